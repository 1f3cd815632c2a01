"""Tandem's processes around the engine: the replica service (``services.replica``)."""
