"""The Triton kernels compile for an H100 (sm_90) without register spills, on any machine.

tests/triton_sm90_compile.py records the launches the engine's launch functions make for
the model shapes and dtypes the project serves and tests, and compiles each with Triton's
CUDA backend to a cubin (ptxas ships with Triton); no GPU is needed. A kernel that only
the interpreter accepts (a dot below 16 rows, a type the GPU lacks, a bad launch option)
fails here, as does one whose registers spill to local memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("triton_sm90_compile.py")
# 8 shapes x (kv_write, decode with 1 split, decode split + merge, 2 prefills).
EXPECTED_LAUNCHES = 8 * 6


def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's current default, without its warning
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(compiled) == EXPECTED_LAUNCHES
    kernels = {c["kernel"] for c in compiled}
    assert kernels == {"_kv_write_kernel", "_decode_split_kernel", "_decode_merge_kernel",
                       "_prefill_kernel"}
    spilled = [c for c in compiled if c["local_bytes"]]
    assert not spilled, f"register spills: {spilled}"
    assert all(0 < c["registers"] <= 255 for c in compiled)
