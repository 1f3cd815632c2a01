"""When a replica sends its load to a watcher (``Engine.WatchLoad``): on change, paced, with a
heartbeat.

Owns the pacing: a report goes out when it differs from the last one sent (its timestamp
aside), no sooner than ``min_interval_s`` after that one, and at least every ``heartbeat_s``
even when nothing changed, so the watcher knows its copy is current (the gateway's picker
stops trusting a report older than ``PickerConfig.max_load_age_s``). An idle replica thus
sends two small messages a second instead of answering twenty GetLoad calls, each of which
cost the caller and the replica ~1.5 ms of CPU (measured: a gateway polling one idle replica
every 50 ms used ~34 ms of CPU a second, ~5 with a 1 s interval). The check itself is
in-process: build the report, compare bytes. It does not own what a report holds (the
servicer builds it) or the watcher's side (``gateway.load``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from protos.tandem.v1 import engine_pb2 as epb
from services.frontend.errors import InvalidArgument

DEFAULT_MIN_INTERVAL_S = 0.05
DEFAULT_HEARTBEAT_S = 0.5
MAX_PACING_S = 60.0


@dataclass(frozen=True)
class LoadPacing:
    min_interval_s: float = DEFAULT_MIN_INTERVAL_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S

    @classmethod
    def of(cls, request: epb.WatchLoadRequest) -> LoadPacing:
        """The request's pacing, its zeros replaced by the defaults; InvalidArgument if the
        numbers make no sense."""
        for name in ("min_interval_s", "heartbeat_s"):
            value = getattr(request, name)
            if not math.isfinite(value) or not 0 <= value <= MAX_PACING_S:
                raise InvalidArgument(f"{name} must be between 0 (the default) and "
                                      f"{MAX_PACING_S:g} seconds, got {value:g}")
        pacing = cls(request.min_interval_s or DEFAULT_MIN_INTERVAL_S,
                     request.heartbeat_s or max(DEFAULT_HEARTBEAT_S,
                                                request.min_interval_s))
        if pacing.heartbeat_s < pacing.min_interval_s:
            raise InvalidArgument(f"heartbeat_s ({pacing.heartbeat_s:g}) must not be shorter "
                                  f"than min_interval_s ({pacing.min_interval_s:g})")
        return pacing


def _content(report: epb.LoadReport) -> bytes:
    """What a report says, without when it was taken."""
    timeless = epb.LoadReport()
    timeless.CopyFrom(report)
    timeless.ClearField("timestamp")
    return timeless.SerializeToString(deterministic=True)


async def paced_reports(take_report: Callable[[], epb.LoadReport],
                        pacing: LoadPacing) -> AsyncGenerator[epb.LoadReport, None]:
    """The reports to send, forever (the caller stops iterating when the watcher leaves);
    the first at once."""
    last_content: bytes | None = None
    last_sent = -math.inf
    while True:
        report = take_report()
        content = _content(report)
        now = time.monotonic()
        if content != last_content or now - last_sent >= pacing.heartbeat_s:
            yield report
            last_content, last_sent = content, now
        await asyncio.sleep(pacing.min_interval_s)
