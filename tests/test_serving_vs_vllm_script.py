"""bench/serving_vs_vllm.py without vLLM: the client's command line, reading its results, the
replicas' metrics, and the ratios and goals of a run.

The script's client (`vllm bench serve`) and peer come from `.venv-peer`, which CI does not
have; these checks cover what the script itself computes, on a result shaped as
`vllm bench serve --save-result --save-detailed` writes it (vLLM 0.32).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.online_serving import Server
from bench.serving_vs_vllm import (
    FULL_WORKLOADS,
    bench_command,
    compare,
    goals,
    histogram_totals,
    metrics_urls,
    parse_result,
)


def _result(tok_s: float, ttft_ms: tuple[float, float], itl_ms: tuple[float, float]) -> dict:
    return {"duration": 100.0, "completed": 48, "failed": 0, "output_throughput": tok_s,
            "request_throughput": 0.5, "p50_ttft_ms": ttft_ms[0], "p99_ttft_ms": ttft_ms[1],
            "p50_itl_ms": itl_ms[0], "p99_itl_ms": itl_ms[1], "p50_tpot_ms": 300.0,
            "p50_e2el_ms": 40000.0, "ttfts": [1.0], "errors": [""]}


def test_the_client_runs_the_issues_workloads_as_a_vllm_user_would(tmp_path: Path):
    server = Server("tandem_both", "http://127.0.0.1:8080", "SmolLM2-135M-Instruct", [], {}, 1.0)
    a, b, _, d = FULL_WORKLOADS
    argv = bench_command(server, b, Path("/models/smol"), 7, tmp_path, "b.json",
                         client=Path("/peer/bin/vllm"))
    assert argv[:3] == ["/peer/bin/vllm", "bench", "serve"]

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag("--base-url") == server.base_url and flag("--model") == server.model
    assert flag("--dataset-name") == "random" and flag("--tokenizer") == "/models/smol"
    assert (flag("--random-input-len"), flag("--random-output-len")) == ("512", "128")
    assert (flag("--num-prompts"), flag("--request-rate"), flag("--seed")) == ("48", "2", "7")
    assert "--ignore-eos" in argv and "--save-result" in argv
    assert flag("--result-dir") == str(tmp_path) and flag("--result-filename") == "b.json"
    assert (a.num_prompts, a.input_len, a.output_len, a.rate) == (64, 128, 128, "inf")

    # Shared prefixes: vLLM's prefix_repetition dataset, the suffix after the prefix.
    shared = bench_command(server, d, Path("/models/smol"), 7, tmp_path, "d.json",
                           client=Path("/peer/bin/vllm"))
    assert shared[shared.index("--dataset-name") + 1] == "prefix_repetition"
    assert shared[shared.index("--prefix-repetition-prefix-len") + 1] == "256"
    assert shared[shared.index("--prefix-repetition-suffix-len") + 1] == "256"
    assert "--random-input-len" not in shared


def test_a_result_is_read_in_seconds_and_a_missing_number_is_an_error():
    summary = parse_result(_result(60.0, (2000.0, 9000.0), (300.0, 900.0)))
    assert summary["output_tok_s"] == 60.0
    assert summary["ttft_p50_s"] == pytest.approx(2.0) and summary["itl_p99_s"] == pytest.approx(0.9)
    broken = _result(60.0, (1.0, 1.0), (1.0, 1.0))
    del broken["p99_itl_ms"]
    with pytest.raises(ValueError, match="p99_itl_ms"):
        parse_result(broken)


def test_engine_histograms_are_summed_over_labels_and_replicas():
    page = "\n".join([
        "# HELP vllm:request_queue_time_seconds Time a request waited.",
        'vllm:request_queue_time_seconds_sum{model_name="m",engine="a"} 1.5',
        'vllm:request_queue_time_seconds_count{model_name="m",engine="a"} 3.0',
        'vllm:request_queue_time_seconds_bucket{le="1.0"} 2.0',
        'vllm:request_queue_time_seconds_sum{model_name="m",engine="b"} 0.5',
        "vllm:time_to_first_token_seconds_count 4.0",
    ])
    totals = histogram_totals(page)
    assert totals["queue"] == {"sum": 2.0, "count": 3.0}
    assert totals["ttft"] == {"sum": 0.0, "count": 4.0}
    suite = Server("tandem_pd", "http://127.0.0.1:1", "m", [
        ["python", "-m", "services.replica", "--metrics-port", "9100"],
        ["python", "-m", "services.replica", "--metrics-port", "9101"],
        ["python", "-m", "gateway", "--metrics-port", "9102"]], {}, 1.0)
    assert metrics_urls(suite) == ["http://127.0.0.1:9100/metrics",
                                   "http://127.0.0.1:9101/metrics"]


def test_ratios_to_vllm_per_round_and_the_goals():
    def rnd(index: int, server: str, tok_s: float, ttft: tuple[float, float],
            itl: tuple[float, float]) -> dict:
        return {"round": index, "server": server, "workload": "B",
                "summary": parse_result(_result(tok_s, ttft, itl))}

    rounds = [rnd(1, "vllm", 60.0, (2000, 10000), (300, 6000)),
              rnd(1, "tandem_both", 66.0, (1800, 9000), (400, 700)),
              rnd(2, "vllm", 50.0, (2000, 10000), (300, 6000)),
              rnd(2, "tandem_both", 45.0, (2200, 12000), (400, 900))]
    table = compare(rounds, ["B"], ["vllm", "tandem_both"])
    row = table["B"]["tandem_both"]
    assert row["output_tok_s"]["per_round"] == [66.0, 45.0]
    assert row["output_tok_s"]["over_vllm_per_round"] == pytest.approx([1.1, 0.9])
    assert row["output_tok_s"]["over_vllm"] == pytest.approx(55.5 / 55.0)
    assert row["ttft_p99_s"]["over_vllm_per_round"] == pytest.approx([0.9, 1.2])
    assert row["itl_p99_over_own_p50_per_round"] == pytest.approx([1.75, 2.25])
    assert "over_vllm" not in table["B"]["vllm"]["output_tok_s"]
    verdict = goals(table)["B"]["tandem_both"]
    assert verdict["out_tok_s_ge_vllm"] is True
    assert verdict["ttft_p50_le_vllm"] is True and verdict["ttft_p99_le_vllm"] is False
    assert verdict["itl_p99_over_own_p50"] == pytest.approx(2.0)
    assert verdict["itl_p99_le_2x_own_p50"] is True
