"""The internal ``tandem.v1.Engine`` API as both of its sides speak it.

The replica serves it (``services.replica.engine_servicer``), the gateway and other replicas
call it; ``messages`` converts between its protobuf messages and the engine's records, one
way for each side, so that a round trip is the identity.
"""
