"""The observability flags every server entry point takes, and the record they fill.

Owns ``--log-level``, ``--log-format`` and ``--otlp-traces-endpoint`` (vLLM's flag: traces
are off unless it is given) on a parser, and ``ObservabilitySettings``, what
``services.entrypoint.run_service`` configures the process with. It does not own configuring
them (``log_format``, ``tracing``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.observability.log_format import LOG_FORMATS

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class ObservabilitySettings:
    service_name: str  # as traces name the process: "tandem-replica", "tandem-gateway", ...
    log_level: str = "INFO"
    log_format: str = "text"
    # host:port or a URL of an OTLP/gRPC collector; None: no traces.
    otlp_traces_endpoint: str | None = None

    @classmethod
    def from_args(cls, service_name: str, args: argparse.Namespace) -> ObservabilitySettings:
        return cls(service_name, args.log_level, args.log_format, args.otlp_traces_endpoint)


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help="(default: %(default)s)")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text, or json: one JSON object per line with timestamp, level, "
                             "logger, message and each request's fields as keys "
                             "(default: %(default)s)")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="HOST:PORT",
                        help="send OpenTelemetry traces over OTLP/gRPC to this collector, e.g. "
                             "localhost:4317 (default: no traces)")


def observability_args(settings: ObservabilitySettings) -> list[str]:
    """The flags that give another process these settings (``tandem up`` passes them to
    every process it starts)."""
    return ["--log-level", settings.log_level, "--log-format", settings.log_format,
            *(["--otlp-traces-endpoint", settings.otlp_traces_endpoint]
              if settings.otlp_traces_endpoint else [])]
