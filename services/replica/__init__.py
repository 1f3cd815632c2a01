"""The replica: one engine behind gRPC (``tandem.v1.Generation`` and ``tandem.v1.Engine``),
in role ``prefill``, ``decode`` or ``both``.

It serves the front end (``services.frontend``) over its local engine, and the internal
Engine API (``engine_servicer``) to the gateway and to other replicas. Its P/D core:
``local_engine`` (the engine behind admission control, and a decode replica's remote
prefill with fallback to recompute), ``prefill_peers`` (a decode replica's calls to prefill
replicas), ``admission``. Run it with ``tandem serve`` or ``python -m services.replica``
(``main.main`` is the entry point; ``server`` owns the process's life).
"""
