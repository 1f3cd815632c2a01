"""Tests for the Triton paged-attention kernels and TritonAttentionBackend.

Without CUDA the kernels run in Triton's CPU interpreter. Triton decides interpreted or
compiled when a kernel is decorated, so TRITON_INTERPRET=1 must be in the environment
before triton (and the kernel modules) are first imported: it is set below, ahead of
those imports. If triton was imported earlier in the session without it (tests/conftest.py
imports transformers, which imports triton), the in-process tests skip and one test reruns
this file in a fresh process with TRITON_INTERPRET=1 in its environment.
With CUDA (and no TRITON_INTERPRET=1 given) the same tests run compiled on the GPU.

The reference is independent of the kernels: each sequence's full K/V is generated up
front, attention is computed in float64 with an explicit causal mask, and the cache is
checked separately by gathering each context back through its block table.
"""

import os

import torch

_ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not _ON_GPU:
    # Must happen before `import triton` and before the kernels are imported (decorated).
    os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402

from engine_common.model.attention.backend import AttentionMetadata  # noqa: E402
from engine_common.model.attention.kv_cache_layout import (  # noqa: E402
    kv_cache_shape,
    layer_cache,
)
from engine_common.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine_common.model.attention.triton_kernels.decode_attention import (  # noqa: E402
    MAX_NUM_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    _decode_split_kernel,
    choose_num_splits,
    decode_attention,
)
from engine_common.model.attention.triton_kernels.kernel_config import (  # noqa: E402
    is_interpreted,
)
from engine_common.model.attention.triton_kernels.kv_write import kv_write  # noqa: E402
from engine_common.model.attention.triton_kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
)

# Triton (its own jit library, e.g. tl.zeros) or the kernels were imported earlier in this
# session without the interpreter (tests/conftest.py imports transformers, which imports
# triton): only a fresh process can interpret them.
_STALE_KERNELS = not _ON_GPU and not (
    is_interpreted(tl.zeros) and is_interpreted(_decode_split_kernel)
)
in_process = pytest.mark.skipif(
    _STALE_KERNELS,
    reason="triton imported earlier without TRITON_INTERPRET; test_in_fresh_process runs these",
)

DEVICES = ["cuda"] if _ON_GPU else ["cpu"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) against the float64 reference on the same dtype-rounded inputs.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 1e-2),
    torch.bfloat16: (2.5e-2, 2e-2),
}
_LARGE = {torch.float32: 1e30, torch.float16: 6e4, torch.bfloat16: 1e30}


@dataclass(frozen=True)
class HeadLayout:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    # Kernel tiling forced small so short test sequences still span several tiles.
    block_m: int
    tile_n: int


# GQA ratio 1 with a power-of-two head; ratio 3 with a head padded to 64 and tiles that are
# half a cache block (the other layout has tiles spanning two blocks).
LAYOUTS = {
    "mha-hs32-tile2blocks": HeadLayout(2, 2, 32, block_size=16, block_m=16, tile_n=32),
    "gqa3-hs40-tilehalfblock": HeadLayout(6, 2, 40, block_size=32, block_m=16, tile_n=16),
}

# (query_len, seq_len) per sequence of a mixed step.
MIXED_STEP = [
    (5, 5),  # fresh prompt
    (3, 19),  # prefix hit of one block, new tokens crossing into the next block
    (1, 23),  # decode row inside a mixed batch
    (7, 40),  # chunk in the middle of a prompt
    (20, 20),  # several query blocks in one sequence
    (1, 32),  # whole prompt cached but its last token, which is recomputed
]
# 1: trailing splits empty; 17: one key into a second block; 50: three splits.
DECODE_SEQ_LENS = [1, 17, 50, 33]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@dataclass
class Step:
    metadata: AttentionMetadata
    query: torch.Tensor  # [num_tokens, num_heads, head_size], a strided view
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size], this step's tokens
    value: torch.Tensor
    # A layer's view [num_blocks, 2, kv_heads, block_size, head_size] of a cache of several
    # layers (strided over blocks, as the engine's); poisoned, each cached prefix written.
    kv_cache: torch.Tensor
    full_keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_size]
    full_values: list[torch.Tensor]
    queries: list[torch.Tensor]  # per sequence [query_len, num_heads, head_size]


def make_step(
    layout: HeadLayout,
    query_and_seq_lens: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Step:
    gen = torch.Generator().manual_seed(seed)
    bs, kvh, hs, nh = layout.block_size, layout.num_kv_heads, layout.head_size, layout.num_heads
    blocks_per_seq = [math.ceil(s / bs) for _, s in query_and_seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # Block 0 (also the table padding) and two more are never assigned: poison only.
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table_width = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(query_and_seq_lens), table_width, dtype=torch.int32)

    kv_cache = poisoned_layer_cache(num_blocks, bs, kvh, hs, dtype, torch.device("cpu"))
    num_tokens = sum(q for q, _ in query_and_seq_lens)
    # One fused projection output, split into strided q/k/v views as a model would.
    qkv = torch.full((num_tokens, (nh + 2 * kvh) * hs), float("nan"), dtype=dtype)
    slot_mapping, full_keys, full_values, queries = [], [], [], []
    token = 0
    for i, (query_len, seq_len) in enumerate(query_and_seq_lens):
        blocks = [free.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        keys = torch.randn(seq_len, kvh, hs, generator=gen).to(dtype)
        values = torch.randn(seq_len, kvh, hs, generator=gen).to(dtype)
        q = torch.randn(query_len, nh, hs, generator=gen).to(dtype)
        slots = [blocks[t // bs] * bs + t % bs for t in range(seq_len)]
        cached = seq_len - query_len
        slot = torch.tensor(slots[:cached], dtype=torch.long)
        kv_cache[slot // bs, 0, :, slot % bs] = keys[:cached]
        kv_cache[slot // bs, 1, :, slot % bs] = values[:cached]
        # Slots past the context in the last block hold huge values, not NaN.
        kv_cache[blocks[-1], :, :, seq_len - (len(blocks) - 1) * bs :] = _LARGE[dtype]
        rows = slice(token, token + query_len)
        qkv[rows, : nh * hs] = q.flatten(1)
        qkv[rows, nh * hs : (nh + kvh) * hs] = keys[cached:].flatten(1)
        qkv[rows, (nh + kvh) * hs :] = values[cached:].flatten(1)
        slot_mapping += slots[cached:]
        full_keys.append(keys)
        full_values.append(values)
        queries.append(q)
        token += query_len

    qkv = qkv.to(device)
    query_lens = [q for q, _ in query_and_seq_lens]
    seq_lens = [s for _, s in query_and_seq_lens]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return Step(
        metadata=metadata,
        query=qkv[:, : nh * hs].view(num_tokens, nh, hs),
        key=qkv[:, nh * hs : (nh + kvh) * hs].view(num_tokens, kvh, hs),
        value=qkv[:, (nh + kvh) * hs :].view(num_tokens, kvh, hs),
        kv_cache=on_device(kv_cache, device),
        full_keys=full_keys,
        full_values=full_values,
        queries=queries,
    )


def reference_attention(step: Step, scale: float) -> torch.Tensor:
    """Causal attention per sequence in float64: [num_tokens, num_heads, head_size]."""
    outputs = []
    for q, k, v in zip(step.queries, step.full_keys, step.full_values, strict=True):
        query_len, num_heads, _ = q.shape
        seq_len, num_kv_heads, _ = k.shape
        group = num_heads // num_kv_heads
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        visible = torch.arange(seq_len)[None, :] <= query_pos
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outputs)


def poisoned_layer_cache(num_blocks: int, block_size: int, kvh: int, hs: int,
                         dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Layer 1 of a NaN-filled 3-layer engine cache."""
    shape = kv_cache_shape(3, num_blocks, block_size, kvh, hs)
    return layer_cache(torch.full(shape, float("nan"), dtype=dtype, device=device), 1)


def on_device(layer_kv: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The same layer view of the whole cache moved to ``device`` (keeps its strides)."""
    if layer_kv.device == device:
        return layer_kv
    whole = torch.empty(layer_kv.untyped_storage().nbytes() // layer_kv.element_size(),
                        dtype=layer_kv.dtype)
    whole.set_(layer_kv.untyped_storage(), 0, whole.shape)
    moved = whole.to(device)
    return moved.as_strided(layer_kv.shape, layer_kv.stride(), layer_kv.storage_offset())


def token_major(layer_kv: torch.Tensor) -> torch.Tensor:
    """A copy of a layer's cache as [2, num_blocks * block_size, kv_heads, head_size]:
    flat slot by flat slot."""
    num_blocks, _, kvh, block_size, hs = layer_kv.shape
    return layer_kv.cpu().permute(1, 0, 3, 2, 4).reshape(2, num_blocks * block_size, kvh, hs)


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """A sequence's [seq_len, kv_heads, head_size] K and V, read back via its block table."""
    block_size = kv_cache.shape[3]
    num_blocks = math.ceil(seq_len / block_size)
    blocks = block_table[:num_blocks].long().cpu()
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]
    flat = token_major(kv_cache)
    return flat[0, slots], flat[1, slots]


def assert_matches_reference(out: torch.Tensor, step: Step, scale: float) -> None:
    assert not out.isnan().any(), "output has NaN: an unwritten element or a poisoned read"
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(
        out.cpu().double(), reference_attention(step, scale), atol=atol, rtol=rtol
    )


def assert_cache_holds_contexts(step: Step) -> None:
    for i, seq_len in enumerate(step.metadata.seq_lens_cpu):
        k, v = gather_context(step.kv_cache, step.metadata.block_tables[i], seq_len)
        assert torch.equal(k, step.full_keys[i]) and torch.equal(v, step.full_values[i])


def scale_for(layout: HeadLayout) -> float:
    return layout.head_size**-0.5


@in_process
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_writes_exactly_the_named_slots(dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kvh, hs = 5, 16, 3, 24
    kv_cache = poisoned_layer_cache(num_blocks, block_size, kvh, hs, dtype, device)
    slots = [17, 3, -1, 79, 48, -1, 64]  # -1: padding tokens, skipped
    # Strided views of one buffer, as the model's fused projection hands them over.
    kv = torch.randn(len(slots), 2, kvh, hs, generator=gen).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)

    kv_write(key.to(device), value.to(device), kv_cache, slot_mapping.to(device))

    flat = token_major(kv_cache)
    written = torch.tensor([s for s in slots if s >= 0])
    real = torch.tensor([i for i, s in enumerate(slots) if s >= 0])
    assert torch.equal(flat[0, written], key[real])
    assert torch.equal(flat[1, written], value[real])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert flat[:, untouched].isnan().all(), "kv_write touched a slot it was not given"


@in_process
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_mixed_step_matches_reference(
    dtype: torch.dtype, layout_name: str, device: torch.device
):
    layout = LAYOUTS[layout_name]
    step = make_step(layout, MIXED_STEP, dtype, device)
    out = torch.full_like(step.query, float("nan"))
    md = step.metadata

    kv_write(step.key, step.value, step.kv_cache, md.slot_mapping)
    prefill_attention(
        step.query,
        step.kv_cache,
        out,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        scale_for(layout),
        md.max_query_len,
        block_m=layout.block_m,
        tile_n=layout.tile_n,
    )

    assert_cache_holds_contexts(step)
    assert_matches_reference(out, step, scale_for(layout))


@in_process
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_decode_matches_reference(dtype: torch.dtype, layout_name: str, device: torch.device):
    """Three splits merged; the single-split path is the backend test's (its default here)."""
    layout = LAYOUTS[layout_name]
    step = make_step(layout, [(1, s) for s in DECODE_SEQ_LENS], dtype, device, seed=2)
    out = torch.full_like(step.query, float("nan"))
    md = step.metadata

    kv_write(step.key, step.value, step.kv_cache, md.slot_mapping)
    # With 16-key tiles and 3 splits, a 50-token context uses three splits and the short
    # ones leave trailing splits empty.
    decode_attention(
        step.query,
        step.kv_cache,
        out,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        scale_for(layout),
        md.max_seq_len,
        num_splits=3,
        tile_n=16,
    )

    assert_cache_holds_contexts(step)
    assert_matches_reference(out, step, scale_for(layout))


@in_process
@pytest.mark.parametrize(
    "query_and_seq_lens",
    [MIXED_STEP, [(1, s) for s in DECODE_SEQ_LENS]],
    ids=["mixed", "pure-decode"],
)
def test_backend_with_default_tiling(query_and_seq_lens, device: torch.device):
    layout = LAYOUTS["gqa3-hs40-tilehalfblock"]
    step = make_step(layout, query_and_seq_lens, torch.float16, device, seed=3)
    backend = TritonAttentionBackend(
        layout.num_heads, layout.num_kv_heads, layout.head_size, scale_for(layout)
    )

    out = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata)

    assert backend.name == "triton"
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    assert_cache_holds_contexts(step)
    assert_matches_reference(out, step, scale_for(layout))


@in_process
@pytest.mark.parametrize(
    ("query_and_seq_lens", "dtype"),
    [(MIXED_STEP, torch.bfloat16), ([(1, s) for s in DECODE_SEQ_LENS], torch.float32)],
    ids=["mixed-bf16", "pure-decode-fp32"],
)
def test_agrees_with_torch_backend(query_and_seq_lens, dtype: torch.dtype, device: torch.device):
    from engine_common.model.attention.torch_backend import TorchAttentionBackend

    layout = LAYOUTS["gqa3-hs40-tilehalfblock"]
    args = (layout.num_heads, layout.num_kv_heads, layout.head_size, scale_for(layout))
    step = make_step(layout, query_and_seq_lens, dtype, device, seed=4)
    # The torch backend's decode path reads whole blocks and masks scores, so a NaN in an
    # unused slot would reach it through 0 * NaN: poison with finite garbage instead.
    step.kv_cache.nan_to_num_(nan=7.0)
    torch_cache = step.kv_cache.clone()

    triton_out = TritonAttentionBackend(*args).forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata
    )
    torch_out = TorchAttentionBackend(*args).forward(
        step.query, step.key, step.value, torch_cache, step.metadata
    )

    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(triton_out.double(), torch_out.double(), atol=atol, rtol=rtol)
    written = step.metadata.slot_mapping.cpu()
    assert torch.equal(token_major(step.kv_cache)[:, written], token_major(torch_cache)[:, written])


def test_num_splits_fill_the_gpu_only_when_needed():
    h100_sms = 132
    # One long sequence: split until the SMs are busy, capped.
    one_long = choose_num_splits(1, 8, 32768, h100_sms)
    assert one_long == MAX_NUM_SPLITS
    # Many sequences already fill the GPU: no split.
    assert choose_num_splits(256, 8, 32768, h100_sms) == 1
    # Short contexts are not split however small the batch.
    assert choose_num_splits(1, 8, MIN_TOKENS_PER_SPLIT, h100_sms) == 1
    # In between: a power of two, more splits for fewer programs, each with enough keys.
    mid = choose_num_splits(4, 8, 4096, h100_sms)
    assert 1 < mid < one_long and mid & (mid - 1) == 0
    assert mid * MIN_TOKENS_PER_SPLIT <= 4096
    assert choose_num_splits(2, 8, 4096, h100_sms) > mid


@pytest.mark.skipif(not _STALE_KERNELS, reason="the kernels run in this process")
def test_in_fresh_process():
    """Reruns this file where TRITON_INTERPRET=1 precedes every import of triton."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    repo_root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
