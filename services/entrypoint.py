"""How a Tandem service process runs: logging, the event loop, signals and the exit code.

Owns the part every server entry point shares (replica, gateway, endpoint picker): configure
logging and tracing (``services.observability``: ``--log-format``, ``--otlp-traces-endpoint``),
run the server's ``serve`` coroutine, flush the traces and exit promptly, turn a start-up
failure into a logged error and exit code 1, and wait for SIGTERM/SIGINT; and the process-wide settings an entry point
makes before it imports what it runs (``set_engine_process_settings``). It does not own
flags or servers.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from services.observability.log_format import configure_logging
from services.observability.settings import ObservabilitySettings
from services.observability.tracing import configure_tracing


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


def run_service(name: str, settings: ObservabilitySettings, build_options: Callable[[], Any],
                serve: Callable[[Any], Coroutine[Any, Any, None]]) -> int:
    """Build the options (may raise on bad flags), serve until stopped; the exit code."""
    configure_logging(settings.log_level, settings.log_format)
    stop_tracing = configure_tracing(settings.service_name, settings.otlp_traces_endpoint)
    try:
        asyncio.run(serve(build_options()))
    except (OSError, RuntimeError, ValueError) as error:
        logging.getLogger(name).error("%s failed: %s", name, error,
                                      exc_info=settings.log_level == "DEBUG")
        return 1
    finally:
        if stop_tracing is not None:
            stop_tracing()  # exports the spans still batched
        # NOTE: the interpreter's last garbage collection at exit walks every object torch
        # and transformers made (seconds: a replica took ~3.7 s to exit after "stopped");
        # nothing needs collecting now, so the objects are frozen out of its reach.
        gc.freeze()
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
