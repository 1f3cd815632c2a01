"""Vendored third-party protos (a minimal, wire-compatible subset of Envoy's ext_proc API) and
their generated Python; regenerate with ``python -m protos.third_party.generate``."""
