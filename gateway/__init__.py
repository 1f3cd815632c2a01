"""Tandem's gateway: routes each request to replicas by the prefix cache and load they publish.

Owns the live view of the replicas (``registry``: addresses, health, role; ``load``: their
queues and KV usage; ``prefix_index``: the blocks each holds, from their KV events), the
choice (``snapshot`` + ``picker``: a decode replica and, for P/D, a prefill replica) and the
forwarding (``proxy``: retries before the first token, resumption after it). Served two
ways: as a gRPC gateway (``server``: the front end's public API over ``remote_engine``) and as
Envoy's endpoint picker (``endpoint_picker``: the same choice as ext_proc headers).

Contract with its neighbours: it serves ``services.frontend``'s API unchanged and calls the
replicas only through the internal ``tandem.v1.Engine`` API (never importing
``services.replica``). Invariant: a replica counts as holding a prompt's blocks only once its
KV events say so, or for a short while after the gateway sent it that prompt (``expect``);
a pick that failed before computing anything, or a prefill that did not run there, is
retracted.
"""
