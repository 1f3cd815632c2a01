"""Launch settings shared by the paged-attention Triton kernels.

Owns the facts every launch derives from its inputs: padded power-of-two sizes, the dtype
and precision of the ``tl.dot`` operands, and whether the kernels run on a GPU or in
Triton's CPU interpreter (``TRITON_INTERPRET=1``, read by Triton when a kernel is
decorated, i.e. when these modules are first imported). It does not own the kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# tl.dot needs every dimension to be at least 16 on NVIDIA GPUs.
MIN_DOT_DIM = 16

_TORCH_TO_TRITON_DTYPE = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def padded_dim(size: int) -> int:
    """The power of two (at least MIN_DOT_DIM) a tile dimension of ``size`` is padded to."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(size))


def is_interpreted(kernel: object) -> bool:
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: object, tensor: torch.Tensor) -> None:
    """Fails clearly where a launch would otherwise fail obscurely.

    A compiled kernel cannot take CPU tensors; an interpreted kernel cannot call Triton's
    own jit library (tl.zeros, tl.max, ...) if triton itself was imported before
    TRITON_INTERPRET=1 was set.
    """
    if is_interpreted(kernel):
        if not is_interpreted(tl.zeros):
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported; set it before any "
                "import of triton (transformers and torch extensions import it too)"
            )
    elif tensor.device.type != "cuda":
        raise RuntimeError(
            "Triton attention kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
            "triton is first imported"
        )


def check_dtype(tensor: torch.Tensor) -> None:
    if tensor.dtype not in _TORCH_TO_TRITON_DTYPE:
        raise TypeError(f"unsupported attention dtype {tensor.dtype}; use fp32, fp16 or bf16")


def widen_dot_operands(kernel: object, dtype: torch.dtype) -> bool:
    """Whether the kernel must widen its dot operands to fp32 after rounding them.

    The interpreter stores bf16 as raw uint16 and only converts it; any arithmetic on it,
    tl.dot included, is wrong. Widening bf16 values to fp32 keeps them exact, so the
    interpreter computes what the GPU's bf16 dot (fp32 accumulation) computes.
    """
    return is_interpreted(kernel) and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently run as tf32 (10-bit mantissa) by default.
    return "ieee" if dtype == torch.float32 else "tf32"
