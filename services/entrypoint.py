"""How a Tandem service process runs: logging, the event loop, signals and the exit code.

Owns the part every server entry point shares (replica, gateway, endpoint picker): configure
logging, run the server's ``serve`` coroutine, turn a start-up failure into a logged error
and exit code 1, and wait for SIGTERM/SIGINT; and the process-wide settings an entry point
makes before it imports what it runs (``set_engine_process_settings``). It does not own
flags or servers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def set_engine_process_settings() -> None:
    """What a process that runs an engine sets before anything imports torch.

    OpenMP threads that spin while waiting steal the cores from the other processes of a
    replica (frontend, engine core) and from neighbouring replicas. Measured on the 2-core
    development machine (bench/pd_mixed_workload.py, 2 replicas + gateway): with the default
    spinning policy steady inter-token latency p50 was 77 ms to 1.7 s and long-prompt TTFT
    8-16 s; with PASSIVE 75-80 ms and about 2 s. OpenMP reads it when torch loads it, so the
    entry point calls this first; an explicit setting wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_service(name: str, log_level: str, build_options: Callable[[], Any],
                serve: Callable[[Any], Coroutine[Any, Any, None]]) -> int:
    """Build the options (may raise on bad flags), serve until stopped; the exit code."""
    logging.basicConfig(level=log_level, stream=sys.stderr, format=LOG_FORMAT)
    try:
        asyncio.run(serve(build_options()))
    except (OSError, RuntimeError, ValueError) as error:
        logging.getLogger(name).error("%s failed: %s", name, error,
                                      exc_info=log_level == "DEBUG")
        return 1
    return 0


async def wait_for_stop_signal() -> None:
    """Return at the first SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
