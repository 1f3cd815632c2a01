"""``make demo``'s main job, end to end: ``tandem demo`` starts a P/D suite (one prefill and
one decode replica behind the gateway, real processes), streams chats and completions
through it, moves a prompt's KV over UCX and stops the suite cleanly. Run on the tiny Llama
so that it stays quick; ``make demo`` runs the same code on SmolLM2.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.replica_process import REPO_ROOT, free_port, free_ports

pytestmark = pytest.mark.timeout(300)


def test_the_demo_serves_through_a_pd_suite_and_stops_cleanly(tiny_llama_dir: Path,
                                                               tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "demo", "--model", str(tiny_llama_dir),
         "--prefill", "1", "--decode", "1", "--kv-cache-memory", "16MiB",
         "--base-port", str(free_ports(2)), "--gateway-port", str(free_port()),
         "--metrics-base-port", str(free_ports(3)), "--log-dir", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    # Every part of the demo ran: the chats, the eight concurrent completions and their
    # texts, the scored answers, a prompt whose KV went from the prefill replica to the
    # decode replica over UCX.
    assert output.count("assistant: ") == 3
    assert output.count("Write one sentence about the number") == 8
    assert output.count(" log-likelihood ") == 3  # the answers scored in one request
    assert "pulled over UCX" in output, output[-3000:]
    assert "8 concurrent:" in output and "stopping the suite" in output
