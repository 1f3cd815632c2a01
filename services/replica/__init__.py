"""The replica: one engine behind gRPC (``tandem.v1.Generation`` and ``tandem.v1.Engine``).

Run it with ``python -m services.replica --model DIR``; ``services.replica.main.main`` is the
entry point ``tandem serve`` calls.
"""

import os

# OpenMP threads that spin while waiting steal the cores from the other processes of a
# replica (frontend, engine core) and from neighbouring replicas. Measured on the 2-core
# development machine (bench/pd_mixed_workload.py, 2 replicas + gateway): with the default
# spinning policy steady inter-token latency p50 was 77 ms to 1.7 s and long-prompt TTFT
# 8-16 s; with PASSIVE 75-80 ms and about 2 s. Set before torch loads OpenMP (this package
# is imported before any module that imports torch); an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
