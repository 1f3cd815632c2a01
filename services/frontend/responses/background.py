"""Responses created with ``background`` true (OpenAI's background mode).

Owns running each as a task of its own, apart from the call that created it (a client that
goes away stops nothing), keeping its stored response current at every step ("queued" at
once, "in_progress", then "completed" or "incomplete"; "failed" with the error; "cancelled"
when ``cancel`` stops it) and keeping its events for readers that come and go (``follow``,
from any sequence number: a client resumes a stream it lost). The events of finished runs
are kept for the latest ``KEPT_FINISHED_RUNS`` of them; their responses stay as long as the
store keeps them. It does not own making the events (``responses_api``), the store
(``response_store``) or the RPCs (``generation_servicer``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from protos.tandem.v1 import generation_pb2 as pb
from services.frontend.errors import FailedPrecondition, status_of
from services.frontend.responses.store import RUNNING_STATUSES, ResponseStore, StoredResponse

KEPT_FINISHED_RUNS = 64

logger = logging.getLogger(__name__)


@dataclass
class _Run:
    events: list[pb.ResponseStreamEvent] = field(default_factory=list)
    finished: bool = False
    # Set and replaced at every new event: the readers waiting for one wake up.
    news: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def publish(self, event: pb.ResponseStreamEvent | None) -> None:
        if event is not None:
            self.events.append(event)
        self.news.set()
        self.news = asyncio.Event()


class BackgroundResponses:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._runs: OrderedDict[str, _Run] = OrderedDict()

    def start(self, queued: StoredResponse,
              events: AsyncGenerator[pb.ResponseStreamEvent, None]) -> None:
        """Stores ``queued`` (its response "queued") and runs ``events`` in the background;
        the stored response follows them."""
        response_id = queued.response.id
        self.store.put(queued)
        run = _Run()
        self._runs[response_id] = run
        run.task = asyncio.create_task(self._run(queued, events, run),
                                       name=f"background-response-{response_id}")

    async def _run(self, stored: StoredResponse,
                   events: AsyncGenerator[pb.ResponseStreamEvent, None], run: _Run) -> None:
        latest = stored.response
        try:
            async with aclosing(events):
                async for event in events:
                    if event.HasField("response"):
                        latest = event.response
                        self._put(stored, latest)
                    run.publish(event)
        except asyncio.CancelledError:  # cancel(), or the server stopping
            self._put(stored, _with_status(latest, "cancelled"))
        except Exception as error:  # noqa: BLE001 - it becomes the response's own status
            code, message = _status(error)
            failed = _with_status(latest, "failed")
            failed.error.CopyFrom(pb.ResponseError(code=code.name.lower(), message=message))
            self._put(stored, failed)
            run.publish(pb.ResponseStreamEvent(type="response.failed", response=failed,
                                               sequence_number=len(run.events)))
        finally:
            run.finished = True
            run.publish(None)
            self._forget_finished()

    def _put(self, stored: StoredResponse, response: pb.Response) -> None:
        self.store.put(dataclasses.replace(stored, response=response))

    def _forget_finished(self) -> None:
        finished = [rid for rid, run in self._runs.items() if run.finished]
        for response_id in finished[:max(0, len(finished) - KEPT_FINISHED_RUNS)]:
            del self._runs[response_id]

    async def cancel(self, response_id: str) -> pb.Response:
        """Stops a queued or running background response; answers it as it stands (a
        finished one as it finished)."""
        stored = self.store.get(response_id)
        if not stored.response.background:
            raise FailedPrecondition(f"response {response_id!r} was not created with "
                                     "background true: only background responses can be "
                                     "cancelled (a foreground one stops when its caller "
                                     "cancels the call)")
        run = self._runs.get(response_id)
        if run is not None and run.task is not None and not run.finished:
            run.task.cancel()
            await asyncio.wait([run.task])  # not its outcome: this call's own cancel counts
            if not run.finished:  # cancelled before it began, it ran none of _run
                run.finished = True
                run.publish(None)
                self._forget_finished()
        stored = self.store.get(response_id)
        if stored.response.status in RUNNING_STATUSES:  # it never began
            self._put(stored, _with_status(stored.response, "cancelled"))
        return self.store.get(response_id).response

    async def follow(self, response_id: str, starting_after: int | None = None,
                     ) -> AsyncGenerator[pb.ResponseStreamEvent, None]:
        """The run's events after the one numbered ``starting_after`` (all without), then
        each as it comes, until the run ends."""
        stored = self.store.get(response_id)
        run = self._runs.get(response_id)
        if run is None:
            if not stored.response.background:
                raise FailedPrecondition(f"response {response_id!r} was not created with "
                                         "background true: only a background response's "
                                         "events can be streamed again")
            raise FailedPrecondition(f"the events of response {response_id!r} are no longer "
                                     f"kept (this server keeps those of the latest "
                                     f"{KEPT_FINISHED_RUNS} finished background responses); "
                                     "GET it without stream for the finished response")
        index = 0 if starting_after is None else _first_after(run.events, starting_after)
        while True:
            news = run.news
            while index < len(run.events):
                yield run.events[index]
                index += 1
            if run.finished:
                return
            await news.wait()


def _first_after(events: list[pb.ResponseStreamEvent], sequence_number: int) -> int:
    return next((i for i, event in enumerate(events)
                 if event.sequence_number > sequence_number), len(events))


def _with_status(response: pb.Response, status: str) -> pb.Response:
    changed = pb.Response()
    changed.CopyFrom(response)
    if changed.status in RUNNING_STATUSES:
        changed.status = status
    return changed


def _status(error: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, grpc.aio.AioRpcError):  # the gateway's replica failed it
        return error.code(), error.details() or ""
    status = status_of(error)
    if status is None:
        logger.exception("a background response failed unexpectedly", exc_info=error)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
    return status
