"""Tandem's wire contracts: the ``.proto`` files under ``protos/tandem/v1`` and their generated
Python modules (``protos.tandem.v1.generation_pb2`` and friends), committed so that nothing
needs grpcio-tools at run time. ``python -m protos.generate`` regenerates them."""
