"""bench/gpu_benchmark.py (`make bench-gpu`) runs end to end on a CPU.

The script's GPU parts need a GPU; its `--device cpu --smoke` mode runs the engine against
Hugging Face generate on a tiny synthetic model, as a GPU session will on real shapes. Run
as a subprocess, exactly as a user would, into a temporary results file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "bench" / "gpu_benchmark.py"


def test_cpu_smoke_run_writes_a_complete_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_benchmark.json"
    proc = subprocess.run(
        # -X importtime lists every module the run imports, on stderr.
        [sys.executable, "-X", "importtime", str(SCRIPT), "--device", "cpu", "--smoke",
         "--synthetic-shape", "tiny",
         "--synthetic-dir", str(tmp_path / "models"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0]
                for line in proc.stderr.splitlines() if line.startswith("import time:")}
    # The GPU machine has none of the serving stack (gRPC, protos, UCX) nor the GGUF reader.
    assert "torch" in imported and "engine_common" in imported
    assert not imported & {"ucxx", "ucp", "gguf", "grpc", "protos", "pytest"}
    report = json.loads(out.read_text())

    assert report["passed"] is True and report["failures"] == []
    assert report["settings"]["device"] == "cpu" and report["settings"]["smoke"] is True
    env = report["environment"]
    assert env["torch"] and env["transformers"] and env["date_utc"]
    assert "GPU" in report["kernels"]["skipped"]

    (entry,) = report["end_to_end"]
    model = entry["model"]
    assert model["source"] == "synthetic" and model["num_hidden_layers"] == 2
    assert model["hidden_size"] == 64 and Path(model["path"]).is_relative_to(tmp_path)
    workload = entry["workload"]
    assert workload["num_prompts"] == 4 and workload["greedy"] and workload["ignore_eos"]
    assert "skipped" in entry["engine_cuda_graphs"]
    engine, hf = entry["engine_eager"], entry["hf_generate"]
    assert engine["output_tokens_per_s"] > 0 and hf["output_tokens_per_s"] > 0
    assert engine["settings"]["resolved_attention_backend"] == "torch"
    assert engine["settings"]["enforce_eager"] is True
    assert hf["batch"] == 4
    ratio = entry["ratios"]["engine_eager_over_hf"]
    assert abs(ratio - engine["output_tokens_per_s"] / hf["output_tokens_per_s"]) < 1e-9
    assert entry["speedup_goal"]["engine"] == "engine_eager"
    assert entry["speedup_goal"]["met"] == (ratio >= 3.0)
    agree = entry["greedy_agreement"]["engine_eager_vs_hf"]
    assert 0.0 <= agree["mean_common_prefix_fraction"] <= 1.0

    exact = entry["fp32_exactness"]
    assert exact["passed"] is True and exact["sequences_identical"] == 1.0
    assert exact["num_prompts"] == 2 and exact["output_len"] == 8
    assert any("fp32 exactness" in line and "PASSED" in line for line in report["summary"])


def test_checks_its_own_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--synthetic-shape", "nonexistent"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "unknown --synthetic-shape" in proc.stderr
