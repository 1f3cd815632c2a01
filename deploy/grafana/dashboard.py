"""The suite's Grafana dashboard, rendered from Python into ``deploy/grafana/tandem.json``.

Owns the panels and their PromQL: replicas by role and health, the gateway's (or endpoint
picker's) routing decisions, picks per replica, P/D outcomes, retries and fallbacks; the
replicas' latencies (TTFT, inter-token, per-request time per output token, end to end, queue)
as vLLM names them, their queues, KV-cache usage and prefix-cache hit rate, token throughput;
the KV transfers between prefill and decode replicas (bytes and pull latency by transport,
blocks served locally, fallbacks by reason, blocks pinned); the processes' CPU and memory.
Every query reads a metric a replica or the gateway exports (a test scrapes both to check);
``$model`` selects the served model name. Import the JSON into Grafana with a Prometheus data
source that scrapes the replicas' and the gateways' /metrics.

    python -m deploy.grafana.dashboard          # rewrite tandem.json
    python -m deploy.grafana.dashboard --check  # exit 1 if it is stale

It does not own the metrics (``engine_common.metrics``, ``gateway.metrics``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD_PATH = Path(__file__).with_name("tandem.json")
UID = "tandem-suite"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
MODEL = 'model_name=~"$model"'
WINDOW = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    description: str = ""


def quantiles(metric: str, *selectors: str, by: str = "") -> tuple[tuple[str, str], ...]:
    """p50/p90/p99 of a histogram, summed over replicas (``by``: also split by a label)."""
    labels = "{" + ",".join(selectors) + "}" if selectors else ""
    group = f"le{',' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return tuple(
        (f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{labels}[{WINDOW}])))",
         f"p{int(q * 100)}{suffix}")
        for q in (0.5, 0.9, 0.99))


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Suite and routing", (
        Panel("Replicas by role", (
            ('sum by (role) (tandem:gateway_replicas{healthy="true"})', "{{role}} healthy"),
            ('sum by (role) (tandem:gateway_replicas{healthy="false"})', "{{role}} unhealthy")),
            description="As each gateway (or endpoint picker) sees them; take one gateway's "
                        "view, they agree."),
        Panel("Routing decisions", (
            (f"sum by (reason, pd) (rate(tandem:gateway_routing_decisions_total[{WINDOW}]))",
             "{{reason}} / {{pd}}"),), unit="reqps",
            description="Why the decode replica won (prefix, load, ...) and whether a prefill "
                        "replica was added (P/D) or skipped."),
        Panel("Picks per replica", (
            (f"sum by (replica, as_role) (rate(tandem:gateway_picks_total[{WINDOW}]))",
             "{{replica}} as {{as_role}}"),), unit="reqps"),
        Panel("P/D outcomes", (
            (f"sum by (outcome) (rate(tandem:gateway_prefill_outcomes_total[{WINDOW}]))",
             "{{outcome}}"),), unit="reqps",
            description="How decode replicas got a P/D pick's prompt KV: pulled from the "
                        "prefill replica (remote) or recomputed (fallback:<reason>)."),
        Panel("Prefix match of picks", quantiles("tandem:gateway_pick_prefix_match_fraction"),
              unit="percentunit"),
        Panel("Gateway retries, resumptions, refusals", (
            (f"sum by (code) (rate(tandem:gateway_retries_total[{WINDOW}]))", "retry {{code}}"),
            (f"sum by (outcome) (rate(tandem:gateway_resumptions_total[{WINDOW}]))",
             "resumption {{outcome}}"),
            (f"sum(rate(tandem:gateway_no_replica_total[{WINDOW}]))", "no replica")),
            unit="reqps"),
        Panel("Gateway requests by status", (
            (f"sum by (method, code) (rate(tandem:gateway_requests_total[{WINDOW}]))",
             "{{method}} {{code}}"),), unit="reqps"),
        Panel("Gateway routing work", quantiles("tandem:gateway_routing_latency_seconds"),
              unit="s"),
    )),
    ("Latency", (
        Panel("Time to first token (replicas)", quantiles("vllm:time_to_first_token_seconds",
                                                          MODEL), unit="s"),
        Panel("Time to first token (gateway)",
              quantiles("tandem:gateway_time_to_first_token_seconds"), unit="s",
              description="From the gateway's arrival: routing and the prefill hop included."),
        Panel("Inter-token latency", quantiles("vllm:inter_token_latency_seconds", MODEL),
              unit="s"),
        Panel("Time per output token (per request)",
              quantiles("vllm:request_time_per_output_token_seconds", MODEL), unit="s"),
        Panel("End-to-end latency", quantiles("vllm:e2e_request_latency_seconds", MODEL),
              unit="s"),
        Panel("Gateway request latency", quantiles("tandem:gateway_request_latency_seconds",
                                                   by="method"), unit="s"),
    )),
    ("Load", (
        Panel("Queue", (
            (f"sum by (engine) (vllm:num_requests_running{{{MODEL}}})", "{{engine}} running"),
            (f"sum by (engine) (vllm:num_requests_waiting{{{MODEL}}})", "{{engine}} waiting"))),
        Panel("Queue time", quantiles("vllm:request_queue_time_seconds", MODEL), unit="s"),
        Panel("KV-cache usage", (
            (f"vllm:kv_cache_usage_perc{{{MODEL}}}", "{{engine}}"),), unit="percentunit"),
        Panel("Prefix-cache hit rate", (
            (f"sum by (engine) (rate(vllm:prefix_cache_hits_total{{{MODEL}}}[{WINDOW}])) / "
             f"sum by (engine) (rate(vllm:prefix_cache_queries_total{{{MODEL}}}[{WINDOW}]))",
             "{{engine}}"),), unit="percentunit"),
        Panel("Token throughput", (
            (f"sum(rate(vllm:prompt_tokens_total{{{MODEL}}}[{WINDOW}]))", "prompt"),
            (f"sum(rate(vllm:generation_tokens_total{{{MODEL}}}[{WINDOW}]))", "generation")),
            unit="short"),
        Panel("Finished requests", (
            (f"sum by (finished_reason) (rate(vllm:request_success_total{{{MODEL}}}[{WINDOW}]))",
             "{{finished_reason}}"),), unit="reqps"),
        Panel("Preemptions", (
            (f"sum by (engine) (rate(vllm:num_preemptions_total{{{MODEL}}}[{WINDOW}]))",
             "{{engine}}"),), unit="reqps"),
        Panel("Request parameters: n and max_tokens", (
            *quantiles("vllm:request_params_n", MODEL)[:1],
            *quantiles("vllm:request_params_max_tokens", MODEL)[:1])),
    )),
    ("KV transfer (P/D)", (
        Panel("KV bytes pulled", (
            (f"sum by (transport) (rate(tandem:kv_transfer_bytes_total{{{MODEL}}}[{WINDOW}]))",
             "{{transport}}"),), unit="Bps"),
        Panel("KV pull latency", quantiles("tandem:kv_transfer_seconds", MODEL, by="transport"),
              unit="s"),
        Panel("Fallbacks to a local prefill", (
            (f"sum by (reason) (rate(tandem:kv_transfer_failures_total{{{MODEL}}}[{WINDOW}]))",
             "{{reason}}"),
            (f"sum(rate(tandem:kv_transfer_fallbacks_total{{{MODEL}}}[{WINDOW}]))", "all")),
            unit="reqps"),
        Panel("Prompt blocks held locally (not pulled)", (
            (f"sum by (engine) (rate(tandem:kv_transfer_blocks_local_total{{{MODEL}}}"
             f"[{WINDOW}]))", "{{engine}}"),)),
        Panel("Blocks pinned for decode replicas", (
            (f"tandem:kv_pinned_blocks{{{MODEL}}}", "{{engine}}"),)),
    )),
    ("Processes", (
        Panel("CPU", ((f"rate(process_cpu_seconds_total[{WINDOW}])", "{{instance}}"),),
              unit="percentunit"),
        Panel("Resident memory", (("process_resident_memory_bytes", "{{instance}}"),),
              unit="bytes"),
    )),
)


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title,
        "description": panel.description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(panel.queries)],
    }


def render() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        for index, panel in enumerate(row):
            panels.append(_panel_json(panel, len(panels) + 1, 8 * (index % 3),
                                      y + 8 * (index // 3)))
        y += 8 * -(-len(row) // 3)
    return {
        "uid": UID, "title": "Tandem", "tags": ["tandem", "vllm", "llm-serving"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": True,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Data source"},
            {"name": "model", "type": "query", "label": "Model", "datasource": DATASOURCE,
             "query": "label_values(vllm:num_requests_running, model_name)",
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
             "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": panels,
    }


def render_text() -> str:
    return json.dumps(render(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.grafana.dashboard",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if tandem.json is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = not DASHBOARD_PATH.is_file() or DASHBOARD_PATH.read_text() != render_text()
        if stale:
            print(f"stale: {DASHBOARD_PATH}", file=sys.stderr)
        return 1 if stale else 0
    DASHBOARD_PATH.write_text(render_text())
    print(f"wrote {DASHBOARD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
