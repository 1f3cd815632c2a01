"""The replica: one engine behind gRPC (``tandem.v1.Generation`` and ``tandem.v1.Engine``).

Run it with ``python -m services.replica --model DIR``; ``services.replica.main.main`` is the
entry point ``tandem serve`` calls.
"""
