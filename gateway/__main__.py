"""``python -m gateway``: the gateway's command line (``main(argv)`` is the entry point).

Owns the flags and their mapping onto ``GatewayOptions``, ``PickerConfig`` and
``RetryPolicy`` (defaults come from those records), and the process's logging and exit code.
``--policy round_robin`` zeroes every scorer weight, which leaves the picker's rotation among
tied candidates: plain round-robin over the healthy replicas, for comparisons. It does not
own serving (``server``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from gateway.picker import PickerConfig
from gateway.proxy import RetryPolicy
from gateway.registry import DnsTarget
from gateway.server import GatewayOptions, serve
from gateway.tier_weights import add_placement_args
from services.entrypoint import run_service
from services.frontend.responses.store import STORE_HELP
from services.help_format import DefaultsHelpFormatter
from services.model_args import add_model_args
from services.model_settings import add_model_settings_args, model_settings_from_args
from services.observability.settings import ObservabilitySettings, add_observability_args
from services.suite_tls import add_tls_args, tls_from_args

logger = logging.getLogger("gateway")

POLICIES = ("score", "round_robin")


def build_parser() -> argparse.ArgumentParser:
    picker, retry = PickerConfig(), RetryPolicy()
    options = GatewayOptions(model="", replicas=["unused:0"])
    p = argparse.ArgumentParser(
        prog="tandem gateway", formatter_class=DefaultsHelpFormatter,
        description="Tandem's gateway: serves tandem.v1.Generation and routes each request to "
                    "replicas by prefix-cache match and load (health, reflection, /metrics).")
    p.add_argument("--replica", action="append", default=[], metavar="HOST:PORT",
                   help="a replica's gRPC address (repeat for each); its role comes from GetInfo")
    p.add_argument("--dns", action="append", default=[], metavar="NAME:PORT",
                   type=DnsTarget.parse,
                   help="a DNS name whose addresses are replicas (a headless Service), "
                        "re-resolved every --dns-interval seconds")
    add_model_args(p)  # --model (the replicas', for the tokenizer), --served-model-name
    p.add_argument("--max-stored-responses", type=int, default=options.max_stored_responses,
                   help=STORE_HELP)
    p.add_argument("--host", default=options.host, help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=options.port,
                   help="gRPC port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=options.metrics_port,
                   help="Prometheus /metrics HTTP port, 0 for none (default: %(default)s)")
    p.add_argument("--policy", choices=POLICIES, default="score",
                   help="score: weighted scorers; round_robin: ignore caches and load "
                        "(default: %(default)s)")
    p.add_argument("--prefix-weight", type=float, default=picker.prefix_weight,
                   help="(default: %(default)s)")
    p.add_argument("--kv-usage-weight", type=float, default=picker.kv_usage_weight,
                   help="(default: %(default)s)")
    p.add_argument("--queue-weight", type=float, default=picker.queue_weight,
                   help="(default: %(default)s)")
    p.add_argument("--queue-scale", type=float, default=picker.queue_scale,
                   help="queue depth at which the queue score halves (default: %(default)s)")
    p.add_argument("--prefill-skip-fraction", type=float, default=picker.prefill_skip_fraction,
                   help="skip the prefill hop when the decode replica caches at least this "
                        "fraction of the prompt (default: %(default)s: only a fully cached one)")
    p.add_argument("--prefill-min-uncached-tokens", type=int,
                   default=picker.prefill_min_uncached_tokens,
                   help="skip the prefill hop for fewer uncached tokens (default: %(default)s)")
    add_placement_args(p)
    p.add_argument("--max-attempts", type=int, default=retry.max_attempts,
                   help="replicas tried before the first token (default: %(default)s)")
    p.add_argument("--max-resumptions", type=int, default=retry.max_resumptions,
                   help="times a broken stream is resumed elsewhere (default: %(default)s)")
    p.add_argument("--load-interval", type=float, default=options.load_interval_s,
                   help="the most often a replica sends its load report, in seconds "
                   "(WatchLoad; an older replica is polled with GetLoad) (default: %(default)s)")
    p.add_argument("--dns-interval", type=float, default=options.dns_interval_s,
                   help="seconds between DNS resolutions (default: %(default)s)")
    add_model_settings_args(p)
    add_tls_args(p)
    add_observability_args(p)  # --log-level, --log-format, --otlp-traces-endpoint
    return p


def options_from_args(args: argparse.Namespace) -> GatewayOptions:
    if args.model is None:
        from engine_common.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    picker = replace(
        PickerConfig(),
        prefix_weight=args.prefix_weight, kv_usage_weight=args.kv_usage_weight,
        queue_weight=args.queue_weight, queue_scale=args.queue_scale,
        prefill_skip_fraction=args.prefill_skip_fraction,
        prefill_min_uncached_tokens=args.prefill_min_uncached_tokens,
        estimate_placement=args.prefill_placement == "estimate")
    if args.policy == "round_robin":
        picker = replace(picker, prefix_weight=0.0, kv_usage_weight=0.0, queue_weight=0.0)
    return GatewayOptions(
        model=args.model, replicas=args.replica, dns=args.dns, host=args.host, port=args.port,
        metrics_port=args.metrics_port, served_model_name=args.served_model_name,
        picker=picker, kv_tier_weights=args.kv_tier_weights,
        retry=RetryPolicy(max_attempts=args.max_attempts, max_resumptions=args.max_resumptions),
        load_interval_s=args.load_interval, dns_interval_s=args.dns_interval,
        model_settings=model_settings_from_args(args),
        max_stored_responses=args.max_stored_responses, tls=tls_from_args(args))


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), serve until stopped; the exit code."""
    args = build_parser().parse_args(argv)
    return run_service("gateway", ObservabilitySettings.from_args("tandem-gateway", args),
                       lambda: options_from_args(args), serve)


if __name__ == "__main__":
    sys.exit(main())
