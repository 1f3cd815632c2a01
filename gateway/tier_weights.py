"""What a prefix block found in each KV tier is worth to the routing match: the defaults and
the ``--kv-tier-weights`` flag that changes them (the gateway's, the endpoint picker's, and
``tandem up``'s and ``tandem render k8s``'s, which pass it on).

Owns the tier names, the default weights (device > host > disk > shared: a load costs more
the lower the tier; llm-d's indexer scores device 1.0, CPU 0.8), and reading and writing the
flag's text, validated with an error that names the problem. It does not own matching
(``prefix_index``). Loads no gRPC, so the deploy commands can check the flag cheaply.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

DEVICE, SHARED = "device", "shared"
# Against 1 for a block in a replica's KV pool.
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {DEVICE: 1.0, "host": 0.8, "disk": 0.6,
                                             SHARED: 0.5}
TIER_WEIGHTS_HELP = (
    "what a prefix block found in each KV tier is worth to the routing match, against 1 for "
    "one in a replica's KV pool: TIER=WEIGHT pairs, comma-separated, each in [0, 1]; tiers "
    "left out keep their default (" + ",".join(f"{k}={v:g}" for k, v in
                                                 DEFAULT_TIER_WEIGHTS.items()) + ")")


def parse_tier_weights(text: str) -> dict[str, float]:
    """``device=1.0,host=0.8,...`` as a mapping; ValueError naming what is wrong (an unknown
    tier, a repeated one, a weight that is not a number in [0, 1])."""
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"expected TIER=WEIGHT, got {item.strip()[:40]!r}")
        if name not in DEFAULT_TIER_WEIGHTS:
            raise ValueError(f"unknown KV tier {name[:20]!r}; the tiers are "
                             f"{', '.join(DEFAULT_TIER_WEIGHTS)}")
        if name in weights:
            raise ValueError(f"KV tier {name!r} is given twice")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"the weight of {name!r} must be a number, got "
                             f"{value.strip()[:20]!r}") from None
        if not 0.0 <= weight <= 1.0:  # NaN fails too
            raise ValueError(f"the weight of {name!r} must be in [0, 1], got {weight:g}")
        weights[name] = weight
    return weights


def tier_weights_argument(text: str) -> dict[str, float]:
    """``parse_tier_weights`` as an argparse ``type``: its message, not "invalid value"."""
    try:
        return parse_tier_weights(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def format_tier_weights(weights: Mapping[str, float]) -> str:
    """The flag's text for ``weights`` (as ``parse_tier_weights`` reads it)."""
    return ",".join(f"{name}={weight:g}" for name, weight in weights.items())


def add_placement_args(p: argparse.ArgumentParser) -> None:
    """``--prefill-placement`` and ``--kv-tier-weights``: the gateway's and the endpoint
    picker's, defined once."""
    p.add_argument("--prefill-placement", choices=("estimate", "score"), default="estimate",
                   help="where a prompt is computed: estimate: where its first token is "
                        "estimated soonest from the replicas' queued prompt tokens and measured "
                        "rates (a prefill replica, or the decode replica itself); score: the "
                        "best-scoring prefill replica, always (default: %(default)s)")
    p.add_argument("--kv-tier-weights", type=tier_weights_argument, default=None,
                   metavar="TIER=W,...", help=TIER_WEIGHTS_HELP)
