"""Observability of the suite's processes: logs, per-request records and traces.

Every server entry point (replica, gateway, endpoint picker) configures these through
``services.entrypoint.run_service``: the log format (``--log-format text|json``), one INFO
line per request, a periodic throughput line on replicas, and OpenTelemetry traces when
``--otlp-traces-endpoint`` is given. Prometheus metrics live with what they measure
(``engine_common.metrics``, ``gateway.metrics``). One concept per module; nothing here has
side effects on import.
"""
