"""Where a process's OpenTelemetry spans go: off, or an OTLP/gRPC collector.

Owns installing the tracer provider of a service process (``--otlp-traces-endpoint``, as
vLLM's flag; no flag, no traces and no cost beyond a check per call), its resource
(``service.name``: tandem-replica, tandem-gateway, ...), batching the spans and flushing them
at exit, and ``tracing_enabled``, which the interceptors ask before doing any work. The
provider is OpenTelemetry's process-wide one, set by the entry point at start, never on
import. It does not own which spans are made (``trace_interceptors``, ``phase_spans``).
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry import trace

TRACER_NAME = "tandem"


def configure_tracing(service_name: str, endpoint: str | None) -> Callable[[], None] | None:
    """Export this process's spans to the OTLP/gRPC collector at ``endpoint`` (host:port,
    or an http:// or https:// URL; plaintext unless https). Returns what flushes and stops
    the exporter at exit; None (and nothing installed) without an endpoint."""
    if not endpoint:
        return None
    # Imported here: a process without traces never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider.shutdown


def tracing_enabled() -> bool:
    """Whether this process exports spans (a provider was installed)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)
