"""The engine core's side of P/D KV transfer: pin on the prefill side, pull on the decode side.

Owns this engine's KV connector (a UCX producer on a prefill replica, a UCX consumer on a
decode replica), the pulls in flight, and the hand-off of lease ends from the transport's
thread to the core's loop. It does not free or allocate blocks: the scheduler does, when
this module reports a lease ended (``take_released``) or a pull finished
(``take_finished_pulls``). Everything here is called on the core's loop, except the
producer's release callback, which only queues.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine_common.config import KvTransferConfig
from engine_common.outputs import KvTransferReport
from engine_common.request import Request
from kv_transfer.connector import KvHandle, KvTransferError, TransferResult
from kv_transfer.layout import KvLayout
from kv_transfer.ucx_connector import UcxKvConsumer, UcxKvProducer

logger = logging.getLogger(__name__)


@dataclass
class _PendingPull:
    request: Request
    future: Future[TransferResult]
    num_local_blocks: int
    num_pulled_blocks: int


class RemoteKv:
    def __init__(self, config: KvTransferConfig, kv_cache: torch.Tensor, layout: KvLayout,
                 engine_id: str):
        if config.role not in ("producer", "consumer"):
            raise ValueError(f"KV transfer role must be 'producer' or 'consumer', got {config.role!r}")
        if config.transport not in ("auto", "tcp"):
            raise ValueError(f"KV transport must be 'auto' or 'tcp', got {config.transport!r}")
        if config.fallback not in ("recompute", "fail"):
            raise ValueError(f"KV transfer fallback must be 'recompute' or 'fail', got {config.fallback!r}")
        self.config = config
        self.layout = layout
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._pulls: dict[str, _PendingPull] = {}
        self.producer: UcxKvProducer | None = None
        self.consumer: UcxKvConsumer | None = None
        self.address: tuple[str, int] | None = None
        if config.role == "producer":
            self.producer = UcxKvProducer(
                kv_cache, self.layout, engine_id, host=config.host, port=config.port,
                on_release=lambda request_id, _blocks: self._released.put(request_id))
            self.address = self.producer.start()
        else:
            self.consumer = UcxKvConsumer(kv_cache, self.layout, host=config.host,
                                          transport=config.transport)

    # ------------------------------------------------------------------ producer
    def pin(self, request: Request, block_ids: list[int]) -> KvHandle:
        assert self.producer is not None
        return self.producer.pin(request.request_id, block_ids, request.num_computed_tokens,
                                 self.config.lease_seconds)

    def release(self, request_id: str) -> None:
        if self.producer is not None:
            self.producer.release(request_id)

    def take_released(self) -> list[str]:
        """Request ids whose lease ended (released or expired) since the last call."""
        if self.producer is not None:
            self.producer.expire_leases(time.time())
        released = []
        while not self._released.empty():
            released.append(self._released.get_nowait())
        return released

    @property
    def num_pinned(self) -> int:
        return self.producer.num_leases if self.producer is not None else 0

    # ------------------------------------------------------------------ consumer
    def start_pull(self, request: Request, local_block_ids: list[int], num_local_blocks: int) -> None:
        """Pull the prompt blocks this engine does not have yet (the first
        ``num_local_blocks`` were prefix-cache hits here)."""
        assert self.consumer is not None and request.remote_prefill is not None
        handle = request.remote_prefill.handle
        remote = list(handle.block_ids[num_local_blocks:])
        local = local_block_ids[num_local_blocks : len(handle.block_ids)]
        future: Future[TransferResult]
        if len(remote) != len(local) or handle.num_tokens != request.num_prompt_tokens:
            future = Future()
            future.set_exception(KvTransferError(
                "protocol", f"handle covers {handle.num_tokens} tokens in {len(handle.block_ids)} "
                f"blocks; the request has {request.num_prompt_tokens} prompt tokens"))
        elif not remote:
            future = Future()
            future.set_result(TransferResult(0, 0, 0.0))
        else:
            future = self.consumer.pull(handle, remote, local, self.config.pull_timeout_seconds)
        self._pulls[request.request_id] = _PendingPull(request, future, num_local_blocks, len(remote))

    @property
    def num_pulls_in_flight(self) -> int:
        return len(self._pulls)

    def take_finished_pulls(self) -> list[tuple[Request, KvTransferReport]]:
        finished = []
        for request_id, pull in list(self._pulls.items()):
            if not pull.future.done():
                continue
            del self._pulls[request_id]
            assert pull.request.remote_prefill is not None
            report = KvTransferReport(
                prefill_engine_id=pull.request.remote_prefill.handle.engine_id,
                blocks_local=pull.num_local_blocks)
            try:
                result = pull.future.result()
                report.blocks_pulled = result.num_blocks
                report.num_bytes = result.num_bytes
                report.seconds = result.seconds
                report.transport = result.transport
            except KvTransferError as exc:
                report.fallback_reason = exc.reason
                logger.warning("KV pull for %s failed (%s): %s", request_id, exc.reason, exc)
            except Exception as exc:  # noqa: BLE001 - any transport bug becomes a fallback
                report.fallback_reason = "protocol"
                logger.exception("KV pull for %s failed: %s", request_id, exc)
            finished.append((pull.request, report))
        return finished

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
