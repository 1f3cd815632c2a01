"""Tandem's services around the engine, in two roles kept apart.

- ``services.frontend``: the public, OpenAI-shaped ``tandem.v1.Generation`` API, served
  identically by a replica (over its own engine) and by the gateway (over the replicas).
  Its one contract with an engine is the seam, ``frontend.engine_seam``: a ``GenerateFn``
  that streams ``GenerationDelta``s for one ``engine_common.GenerationRequest`` within a
  ``CallContext`` (deadline, prefill peer, routes), and aborts the request when the stream is
  closed early.
- ``services.replica``: one replica process, its P/D core behind that seam and the internal
  ``tandem.v1.Engine`` API it serves to the gateway and to other replicas.

Shared by both, and by the gateway: ``engine_api`` (the internal API's messages, one
conversion per direction), ``suite_tls`` (mutual TLS between the suite's processes),
``model_settings`` (the flags that shape requests, given alike to every process that resolves
them) and ``entrypoint`` (how a service process runs).

Invariants: the front end never imports the replica; every request crossing into an engine
is a validated ``GenerationRequest``; every RPC answers a client's mistake with a 4xx-class
status and a bounded message (``frontend.errors``, ``frontend.request_guard``).
"""
