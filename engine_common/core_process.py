"""The engine core's own OS process, and the frontend's handle on it.

The replica's gRPC frontend (asyncio, tokenization, detokenization, streaming) must never
stall the step loop, so, as vLLM does, the core runs in a separate process and the two talk
over a pair of pipes: requests, aborts and news of a decode-side request's remote prefill
(``RemoteKvUpdate``) go in, one ``EngineCoreOutputs`` per step comes
out, and a ``KvCacheSnapshotReply`` for each ``SnapshotKvCache``, in line with the steps'
outputs (that order is what ties a snapshot to a KV-event seq). LoRA adapters are loaded and
unloaded between steps (``LoadLoraAdapter``, ``UnloadLoraAdapter``), each answered by a
``LoraAdapterReply`` on the same ordered channel, so a request sent after the answer meets
the engine as the answer describes it. ``run_engine_core`` is the
child's main loop; ``EngineCoreClient`` is the parent's side, with a sender thread (so a busy
child never blocks the event loop on a full pipe) and a receiver thread that hands outputs
to callbacks.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal

from engine_common.block_hash import BlockHash
from engine_common.config import EngineConfig
from engine_common.lora.errors import LoraAdapterExists, LoraAdapterNotFound
from engine_common.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    RemoteKvUpdate,
)

if TYPE_CHECKING:  # the child imports the engine (torch, the model); the frontend never does
    from engine_common.engine_core import EngineCore

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""


@dataclass
class AddRequest:
    request: EngineCoreRequest


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class ReleaseKv:
    request_ids: list[str]


@dataclass
class SnapshotKvCache:
    """Ask for every block hash in the prefix cache (a KV-event watcher must resync)."""


@dataclass
class LoadLoraAdapter:
    """Serve the PEFT adapter in directory ``path`` (on the core's machine) as ``name``."""

    name: str
    path: str


@dataclass
class UnloadLoraAdapter:
    name: str


@dataclass
class Shutdown:
    pass


# ``LoraAdapterReply.error_kind``: the exception the frontend raises again.
LORA_EXISTS = "exists"  # LoraAdapterExists
LORA_NOT_FOUND = "not_found"  # LoraAdapterNotFound
LORA_INVALID = "invalid"  # ValueError: the adapter cannot be served
LORA_FAILED = "error"  # anything else (out of memory, say): RuntimeError


@dataclass
class LoraAdapterReply:
    """The child's answer to ``LoadLoraAdapter`` / ``UnloadLoraAdapter``, one per message, in
    their order."""

    error_kind: str | None  # None: done; else one of the LORA_* kinds
    message: str
    served: list[str]  # the adapters served after it, sorted


@dataclass
class KvCacheSnapshotReply:
    """The child's answer to ``SnapshotKvCache``: the prefix cache as it stands after every
    ``EngineCoreOutputs`` sent before this message, and before any sent after it."""

    block_hashes: list[BlockHash]


@dataclass
class CoreFailed:
    """Sent by the child instead of ``EngineInfo`` when start-up fails, and as its last
    message when it must stop serving (a tensor-parallel worker died)."""

    message: str


CoreMessage = (AddRequest | AbortRequests | ReleaseKv | RemoteKvUpdate | SnapshotKvCache
               | LoadLoraAdapter | UnloadLoraAdapter | Shutdown)


def _update_lora_adapters(core: EngineCore,
                          message: LoadLoraAdapter | UnloadLoraAdapter) -> LoraAdapterReply:
    """Apply a load or unload between steps; what went wrong goes back to the frontend
    rather than ending the core: the adapter and its name come from a caller."""
    error_kind: str | None = None
    try:
        if isinstance(message, LoadLoraAdapter):
            core.load_lora_adapter(message.name, message.path)
            text = f"LoRA adapter {message.name!r} loaded from {message.path!r}"
        else:
            core.unload_lora_adapter(message.name)
            text = f"LoRA adapter {message.name!r} unloaded"
    except LoraAdapterExists as exc:  # before ValueError: it is one
        error_kind, text = LORA_EXISTS, str(exc)
    except LoraAdapterNotFound as exc:
        error_kind, text = LORA_NOT_FOUND, str(exc)
    except ValueError as exc:
        error_kind, text = LORA_INVALID, str(exc)
    except Exception as exc:  # noqa: BLE001 - the engine keeps serving without the adapter
        logger.exception("%s of %r failed", type(message).__name__, message.name)
        error_kind, text = LORA_FAILED, f"{type(exc).__name__}: {exc}"
    if error_kind is None:
        logger.info("%s", text)
    return LoraAdapterReply(error_kind, text, sorted(core.model_runner.lora_adapters.names))


class _OutboxWriter:
    """The child's sending side: pickles and writes its messages on a thread of its own, in
    the order given, so that a step's outputs travel while the next step runs (torch
    releases the GIL inside its kernels, and a GPU step runs asynchronously), as vLLM's
    engine core does with its output thread. What is handed over is built afresh for each
    message and never changed afterwards, so the thread reads it safely."""

    def __init__(self, outbox: Connection):
        self._outbox = outbox
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._broken = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="core-outbox")
        self._thread.start()

    def send(self, message: object) -> None:
        if self._broken:
            raise BrokenPipeError("the frontend closed the pipe")
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(_CLOSE)
        self._thread.join()

    def _run(self) -> None:
        while (message := self._queue.get()) is not _CLOSE:
            try:
                self._outbox.send(message)
            except (BrokenPipeError, OSError):
                self._broken = True
                return


_CLOSE = object()


def run_engine_core(config: EngineConfig, inbox: Connection, outbox: Connection,
                    parent_ends: tuple[Connection, ...] = ()) -> None:
    """Child-process entry point: build the core, then step while there is work.

    ``parent_ends``: the frontend's ends of the pipes, which a forked child inherits; closed
    at once, or the frontend's death would never close the pipe (the core would outlive it).
    """
    for connection in parent_ends:
        connection.close()
    # The core stops when its frontend says so or when the pipe closes because the frontend
    # died, never on a terminal's Ctrl-C or a SIGTERM to the process group: the frontend may
    # still be draining streams that need this core.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    from engine_common.engine_core import EngineCore

    # force: a forked core replaces the frontend's handlers it inherited.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(message)s",
                        force=True)
    if config.cpus is not None:
        os.sched_setaffinity(0, config.cpus)
        torch.set_num_threads(len(config.cpus))
    logging.info("on CPUs %s (%d torch threads)", sorted(os.sched_getaffinity(0)),
                 torch.get_num_threads())
    writers: list[_OutboxWriter] = []  # the writer, once there is one
    dying = threading.Lock()

    def on_worker_death(reason: str) -> None:
        # From the workers' watcher thread, or the step loop after a failed collective
        # (whichever is first; the other waits here for the exit): the replica's model is
        # gone. The frontend hears why, then the process ends non-zero; the replica reports
        # NOT_SERVING and its supervisor restarts it.
        dying.acquire()
        if writers:
            writers[0].send(CoreFailed(reason))
            writers[0].close()
        os._exit(1)

    try:
        core = EngineCore(config, on_worker_death=on_worker_death)
    except Exception as exc:  # noqa: BLE001 - report any start-up failure to the parent
        outbox.send(CoreFailed(f"{type(exc).__name__}: {exc}"))
        return
    outbox.send(core.info)
    writer = _OutboxWriter(outbox)
    writers.append(writer)
    opened_with = core.take_kv_events()
    if opened_with:  # a disk tier's blocks: routers hear of them before the first request
        writer.send(EngineCoreOutputs(kv_events=opened_with, timestamp=time.time()))

    def handle(message: CoreMessage) -> bool:
        if isinstance(message, AddRequest):
            try:
                core.add_request(message.request)
            except ValueError as exc:
                # The frontend validated it already, so this is rare; the stream must still
                # end, or its client would wait forever. A duplicate id is left to its owner.
                request_id = message.request.request_id
                logger.warning("rejected request %s: %s", request_id, exc)
                if request_id not in core.scheduler.requests:
                    writer.send(EngineCoreOutputs(outputs=[EngineCoreOutput(
                        request_id, [], finish_reason="abort", stop_reason=f"rejected: {exc}")]))
        elif isinstance(message, AbortRequests):
            aborted = core.abort_requests(message.request_ids)
            if aborted:
                writer.send(EngineCoreOutputs(outputs=aborted))
        elif isinstance(message, ReleaseKv):
            core.release_kv(message.request_ids)
        elif isinstance(message, RemoteKvUpdate):
            updated = core.update_remote_kv(message)
            if updated:
                writer.send(EngineCoreOutputs(outputs=updated))
        elif isinstance(message, SnapshotKvCache):
            pending_events, block_hashes = core.snapshot_kv_cache()
            if pending_events:
                writer.send(EngineCoreOutputs(kv_events=pending_events, timestamp=time.time()))
            writer.send(KvCacheSnapshotReply(block_hashes))
        elif isinstance(message, LoadLoraAdapter | UnloadLoraAdapter):
            # Answered at once, idle or not: this runs between two steps either way.
            writer.send(_update_lora_adapters(core, message))
        elif isinstance(message, Shutdown):
            return False
        return True

    try:
        while True:
            if not core.has_unfinished_requests() and not core.has_pinned_kv():
                if not handle(inbox.recv()):  # idle: block until there is work
                    return
            while inbox.poll():
                if not handle(inbox.recv()):
                    return
            if not core.has_runnable_requests():
                # Only KV transfers are pending (pulls in flight, requests waiting for a
                # prefill replica's announcements, or blocks pinned for a consumer): wait for
                # a message rather than spin, so the transport thread (and, on a shared host,
                # the prefill replica's compute) gets the CPU, then do the transfer
                # housekeeping. Only a pull's end comes without a message: 2 ms then.
                if inbox.poll(0.002 if core.has_pulls_running() else 0.05):
                    continue
            try:
                outputs = core.step()
            except Exception:
                # A tensor-parallel worker's death fails the step's collective: say why.
                reason = core.model_runner.worker_death(timeout=5.0)
                if reason is not None:
                    on_worker_death(reason)
                raise
            writer.send(outputs)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # the parent is gone
    finally:
        core.close()
        writer.close()


def fork_is_safe() -> bool:
    """Whether this process may fork its engine core rather than spawn it.

    A forked core inherits the frontend's imports (torch, transformers, xgrammar) instead of
    importing them again, as vLLM forks its engine core: a replica on a tiny model serves
    after 3.8 s instead of 6.5 s on a 2-core CPU (4.7 CPU-seconds instead of 7.8). It is
    safe only from a process that has run nothing but imports: one Python thread (no lock
    another thread could hold), no CUDA context (a forked child cannot use it), no OpenMP or
    tokenizer thread pool started by earlier work (imports start none). A replica's frontend
    is such a process when it starts its engine; a caller that cannot vouch for that spawns.
    """
    if not hasattr(os, "fork") or threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


class EngineCoreClient:
    """Starts the core process and moves messages to and from it.

    ``EngineCoreClient(config)`` starts the process and returns at once; ``connect`` waits
    (seconds: the model loads) for the core to report its ``EngineInfo`` and then starts the
    threads that move messages, so the frontend can load its tokenizer meanwhile.
    """

    def __init__(self, config: EngineConfig, start_method: Literal["spawn", "fork"] = "spawn"):
        ctx = mp.get_context("fork") if start_method == "fork" else mp.get_context("spawn")
        child_inbox, self._inbox = ctx.Pipe(duplex=False)
        self._outbox, child_outbox = ctx.Pipe(duplex=False)
        # A spawned child gets only what it is passed; a forked one inherits every end.
        parent_ends = (self._inbox, self._outbox) if start_method == "fork" else ()
        self.process = ctx.Process(
            target=run_engine_core, args=(config, child_inbox, child_outbox, parent_ends),
            name=f"engine-core-{config.engine_id}", daemon=True)
        if start_method == "fork":  # or the child flushes the parent's buffered output too
            sys.stdout.flush()
            sys.stderr.flush()
        self.process.start()
        child_inbox.close()
        child_outbox.close()
        self._send_queue: queue.Queue[CoreMessage | None] = queue.Queue()
        self._closed = False
        self._sender: threading.Thread | None = None
        self.info: EngineInfo | None = None  # once the core has started (wait_started)

    def wait_started(self) -> EngineInfo:
        """Wait until the core has started (seconds: the model loads) and return its
        ``EngineInfo``; raise RuntimeError (the process ended) if it could not. Messages the
        core sends after it wait in the pipe until ``connect``."""
        if self.info is not None:
            return self.info
        first: Any
        try:
            first = self._outbox.recv()
        except EOFError:
            first = None
        if isinstance(first, CoreFailed) or first is None:
            self.process.join(timeout=5)
            self._closed = True
            raise RuntimeError(f"engine core failed to start: {getattr(first, 'message', 'died')}")
        self.info = first
        return first

    def connect(self, on_outputs: Callable[[EngineCoreOutputs], object],
                on_dead: Callable[[str], object],
                on_kv_snapshot: Callable[[KvCacheSnapshotReply], object] | None = None,
                on_lora_reply: Callable[[LoraAdapterReply], object] | None = None
                ) -> EngineInfo:
        """``wait_started``, then start the threads that move messages: ``on_outputs``,
        ``on_kv_snapshot`` and ``on_lora_reply`` are called from one receiver thread, in the
        order the core sent the messages (the first may come at once: the KV events a
        restarted replica's disk tier opened with)."""
        self.wait_started()
        assert self.info is not None
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._on_kv_snapshot = on_kv_snapshot
        self._on_lora_reply = on_lora_reply
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="core-sender")
        receiver = threading.Thread(target=self._recv_loop, daemon=True, name="core-receiver")
        self._sender.start()
        receiver.start()
        return self.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_queue.put(AddRequest(request))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send_queue.put(AbortRequests(request_ids))

    def release_kv(self, request_ids: list[str]) -> None:
        self._send_queue.put(ReleaseKv(request_ids))

    def update_remote_kv(self, update: RemoteKvUpdate) -> None:
        """News of a decode-side request's prefill on its prefill replica."""
        self._send_queue.put(update)

    def snapshot_kv_cache(self) -> None:
        """Ask for a ``KvCacheSnapshotReply``; it comes to ``on_kv_snapshot``, between the
        outputs of two steps."""
        self._send_queue.put(SnapshotKvCache())

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Ask the core to serve an adapter; its ``LoraAdapterReply`` comes to
        ``on_lora_reply``."""
        self._send_queue.put(LoadLoraAdapter(name, path))

    def unload_lora_adapter(self, name: str) -> None:
        """Ask the core to stop serving an adapter; its ``LoraAdapterReply`` comes to
        ``on_lora_reply``."""
        self._send_queue.put(UnloadLoraAdapter(name))

    def _send_loop(self) -> None:
        while (message := self._send_queue.get()) is not None:
            try:
                self._inbox.send(message)
            except (BrokenPipeError, OSError):
                return

    def _recv_loop(self) -> None:
        try:
            while True:
                message = self._outbox.recv()
                if isinstance(message, KvCacheSnapshotReply):
                    if self._on_kv_snapshot is not None:
                        self._on_kv_snapshot(message)
                elif isinstance(message, LoraAdapterReply):
                    if self._on_lora_reply is not None:
                        self._on_lora_reply(message)
                elif isinstance(message, CoreFailed):
                    self._closed = True  # what follows (the pipe closing) says nothing more
                    self._on_dead(f"engine core stopped: {message.message}")
                    return
                else:
                    self._on_outputs(message)
        except (EOFError, OSError):
            if not self._closed:
                self._on_dead(f"engine core process exited (code {self.process.exitcode})")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core: asked to when connected, killed after ``timeout``; a core still
        starting is killed at once (nothing reads its pipe yet)."""
        if self._closed:
            self.process.join(timeout)
            return
        self._closed = True
        if self._sender is None:
            self.process.kill()
        self._send_queue.put(Shutdown())
        self._send_queue.put(None)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
