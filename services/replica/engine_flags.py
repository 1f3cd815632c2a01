"""The engine flags: one definition for ``tandem serve`` (a replica) and ``tandem up`` (which
gives them to every replica it starts).

Owns the flags that configure a replica's engine and serving limits alike on every replica
of a suite (the model and its names, dtype, context length, KV cache, scheduler, speculative
decoding, the P/D transfer's timeouts and fallback, the model settings), byte sizes such as
``1GiB``, the ``EngineConfig`` parts they fill, and ``engine_argv``: the flags written back
out for another process. Defaults come from the config records, not repeated here. It does
not own a single replica's own flags (role, ports, CPUs, TLS: ``main``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Collection
from dataclasses import replace

from engine_common.config import (
    KV_CACHE_PAGE_POLICIES,
    CacheConfig,
    EngineConfig,
    KvTransferConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_common.kv_tiers.config import KvTiersConfig
from services.frontend.responses.store import DEFAULT_MAX_STORED_RESPONSES, STORE_HELP
from services.model_args import add_model_args
from services.model_settings import add_model_settings_args, model_settings_from_args

# A replica's serving limits (``ReplicaOptions`` takes its defaults from here: importing the
# server would load torch, which ``tandem up`` and ``--help`` must not wait for).
MAX_WAITING = 256  # requests admitted beyond max_num_seqs before RESOURCE_EXHAUSTED
SHUTDOWN_GRACE_S = 30.0
MAX_PINNED_FRACTION = 0.75  # of a prefill replica's KV blocks, per caller
# A prefill replica's chunk of a long prompt when the transfer overlaps its compute
# (docs/kv-transfer.md, "Overlapping the transfer with the prefill", for the measurement).
KV_OVERLAP_CHUNK_TOKENS = 512

_GROUP_TITLE = "engine (the same on every replica; tandem up passes them to each)"
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``1073741824``, ``1GiB``, ``512Mi``, ``2G`` (Kubernetes' convention: ``Gi`` is 2**30,
    ``G`` is 10**9; a trailing ``B`` is optional)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a unit such as 512MiB, 1GiB, 2G")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def ngram_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        ngram_min, ngram_max = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, e.g. 2:4; got {text!r}") from None
    if not 1 <= ngram_min <= ngram_max:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return ngram_min, ngram_max


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The model's flags (``--model``, ``--served-model-name``), the model settings and the
    engine flags, on ``parser``."""
    add_model_args(parser)
    add_model_settings_args(parser)
    group = parser.add_argument_group(_GROUP_TITLE)
    _add_model_run_args(group)
    _add_cache_args(group)
    _add_scheduler_args(group)
    _add_speculative_args(group)
    _add_transfer_args(group)
    _add_tier_args(group)


def _add_model_run_args(p: argparse._ArgumentGroup) -> None:
    engine = EngineConfig(model="")
    p.add_argument("--dtype", default=engine.dtype,
                   choices=("auto", "bfloat16", "float16", "float32"),
                   help="weights and KV-cache dtype (auto: the checkpoint's; a bf16 one runs "
                        "in float32 on a CPU without a bf16 matmul)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when available, else cpu")
    p.add_argument("--attention-backend", default=engine.attention_backend,
                   choices=("auto", "torch", "triton"),
                   help="attention kernels (auto: Triton on CUDA, PyTorch on CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--cuda-graph-max-batch-size", type=int,
                   default=engine.cuda_graph_max_batch_size,
                   help="largest decode batch captured in a CUDA graph")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--tensor-parallel-size", type=positive_int,
                   default=engine.tensor_parallel_size, metavar="N",
                   help="split the model over N processes (tensor parallelism: one per GPU, "
                        "cuda:0 to N-1; on the CPU each on its share of the engine's CPUs)")
    p.add_argument("--seed", type=int, default=engine.seed,
                   help="the random seed the engine starts with (a request may set its own)")


def _add_cache_args(p: argparse._ArgumentGroup) -> None:
    cache = CacheConfig()
    p.add_argument("--block-size", type=int, default=cache.block_size,
                   help="tokens per KV block")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=cache.kv_cache_memory_bytes,
                   help="KV-cache bytes on CPU, e.g. 1GiB")
    p.add_argument("--kv-cache-pages", default=cache.kv_cache_pages,
                   choices=("auto", *KV_CACHE_PAGE_POLICIES),
                   help="the CPU KV cache's pages: huge (transparent huge pages, however long "
                        "the kernel compacts memory for them at start: about 3x cheaper KV "
                        "reads from this cache and 8-13%% faster decode attention), "
                        "huge-if-free (huge while the kernel has them free, then 4 KiB), 4k; "
                        "auto: huge on a prefill replica, huge-if-free elsewhere")
    p.add_argument("--gpu-memory-utilization", type=float, default=cache.gpu_memory_utilization,
                   help="fraction of free GPU memory for the KV cache")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks, overriding the memory budget")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")


def _add_scheduler_args(p: argparse._ArgumentGroup) -> None:
    scheduler = SchedulerConfig()
    p.add_argument("--max-num-batched-tokens", type=int, default=scheduler.max_num_batched_tokens,
                   help="token budget per engine step")
    p.add_argument("--max-num-seqs", type=int, default=scheduler.max_num_seqs,
                   help="requests running at once")
    p.add_argument("--max-waiting", type=int, default=MAX_WAITING,
                   help="requests queued beyond --max-num-seqs before new ones are refused "
                        "with RESOURCE_EXHAUSTED")
    p.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                   help=STORE_HELP)
    p.add_argument("--scheduling-policy", default=scheduler.policy, choices=("fcfs", "priority"),
                   help="fcfs: first come, first served; priority: by the request's priority")
    p.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S,
                   help="seconds in-flight requests get to finish on SIGTERM")


def _add_speculative_args(p: argparse._ArgumentGroup) -> None:
    spec = SpeculativeConfig()
    p.add_argument("--speculative-ngram", type=int, default=spec.num_tokens, metavar="K",
                   help="speculative decoding by n-gram lookup: up to K draft tokens per "
                        "decode step, taken from where the sequence's last tokens occurred "
                        "before (0: off)")
    p.add_argument("--speculative-ngram-range", type=ngram_range,
                   default=f"{spec.ngram_min}:{spec.ngram_max}", metavar="MIN:MAX",
                   help="lengths of the sequence's last tokens looked up, longest first")
    p.add_argument("--speculative-max-batch", type=int, default=spec.max_batch_size,
                   help="speculate only while at most this many requests run")


def _add_transfer_args(p: argparse._ArgumentGroup) -> None:
    kv = KvTransferConfig()
    p.add_argument("--kv-lease-seconds", type=float, default=kv.lease_seconds,
                   help="P/D: pinned blocks nobody pulls are freed after this")
    p.add_argument("--kv-pull-timeout", type=float, default=kv.pull_timeout_seconds,
                   help="P/D: seconds a decode replica waits for a KV pull")
    p.add_argument("--kv-max-pinned-fraction", type=float, default=MAX_PINNED_FRACTION,
                   help="P/D: the share of a prefill replica's KV blocks one caller may keep "
                        "pinned for pulls; more is RESOURCE_EXHAUSTED")
    p.add_argument("--kv-transport", default=kv.transport, choices=("auto", "tcp"),
                   help="P/D, on a decode replica: how KV blocks travel; auto: shared memory "
                        "from a prefill replica on this host, TCP from others; tcp: TCP always")
    p.add_argument("--kv-fallback", default=kv.fallback, choices=("recompute", "fail"),
                   help="P/D: when the prefill replica or the transfer fails, recompute the "
                        "prefill here, or fail the request")
    p.add_argument("--kv-overlap", default="off", choices=("on", "off"),
                   help="P/D: overlap the KV transfer with the prefill's compute: a decode "
                        "replica asks the prefill replica to announce the prompt's blocks as "
                        "they become final and pulls them while it computes the rest, which a "
                        "prefill replica computes in chunks of --kv-overlap-chunk-tokens; off "
                        "(the default: on a CPU the chunking costs more compute than the "
                        "transfer it hides, docs/kv-transfer.md): the pull starts once the "
                        "whole prompt is computed")
    p.add_argument("--kv-overlap-chunk-tokens", type=non_negative_int,
                   default=KV_OVERLAP_CHUNK_TOKENS,
                   help="P/D, on a prefill replica with --kv-overlap on: the most prompt "
                        "tokens of one request per step (0: --max-num-batched-tokens), so "
                        "that a long prompt's first chunks move while the next are computed")


def _add_tier_args(p: argparse._ArgumentGroup) -> None:
    tiers = KvTiersConfig()
    p.add_argument("--kv-offload-memory", type=parse_bytes, default=tiers.memory_bytes,
                   metavar="SIZE",
                   help="KV tiers: host memory for copies of computed KV blocks, e.g. 4GiB; "
                        "a prefix evicted from the KV cache is loaded from there instead of "
                        "recomputed (0: no host-memory tier; docs/kv-tiers.md)")
    p.add_argument("--kv-offload-dir", default=tiers.disk_dir, metavar="DIR",
                   help="KV tiers: a directory for a disk tier (one LMDB store) that a "
                        "restarted replica reads again")
    p.add_argument("--kv-offload-disk-size", type=parse_bytes, default=tiers.disk_bytes,
                   metavar="SIZE", help="KV tiers: the most bytes the disk tier holds")
    p.add_argument("--kv-offload-admit-after", type=int, default=tiers.admit_after,
                   metavar="N", help="KV tiers: store a block once it has been computed or "
                                     "hit N times (2: only blocks seen twice)")
    p.add_argument("--kv-offload-max-pending", type=int, default=tiers.max_pending_stores,
                   metavar="N", help="KV tiers: block stores queued at most; more are "
                                     "dropped and counted (back-pressure)")
    p.add_argument("--kv-store", type=kv_store_url, default=tiers.store_url, metavar="URL",
                   help="KV tiers: a Redis shared by every replica, redis://host:port/db or "
                        "rediss://... (TLS); its password from --kv-store-password-file or "
                        "$TANDEM_KV_STORE_PASSWORD, never on the command line; tandem up "
                        "--kv-store local starts a redis-server on loopback for the suite")
    p.add_argument("--kv-store-password-file", default=None, metavar="FILE",
                   help="KV tiers: a file holding the shared store's password")
    p.add_argument("--kv-store-tls-ca", default=tiers.store_tls_ca, metavar="FILE",
                   help="KV tiers: the CA bundle a rediss:// store's certificate is checked "
                        "against")
    p.add_argument("--kv-store-timeout", type=float, default=tiers.store_timeout_seconds,
                   metavar="SECONDS", help="KV tiers: a shared-store call slower than this "
                                           "is a miss, counted (the prompt is recomputed)")


def kv_store_url(text: str) -> str:
    """A Redis URL, or ``local`` (``tandem up`` starts one and passes its URL on)."""
    if text != "local" and not text.startswith(("redis://", "rediss://")):
        raise argparse.ArgumentTypeError(
            f"expected redis://host:port/db, rediss://... or local, got {text[:80]!r}")
    return text


def kv_tiers_config(args: argparse.Namespace) -> KvTiersConfig:
    """The KV tiers the flags ask for (ValueError for settings that cannot work)."""
    password = None
    if args.kv_store_password_file:
        with open(args.kv_store_password_file, encoding="utf-8") as f:
            password = f.read().strip()
    config = KvTiersConfig(
        memory_bytes=args.kv_offload_memory, disk_dir=args.kv_offload_dir,
        disk_bytes=args.kv_offload_disk_size, store_url=args.kv_store,
        store_password=password, store_tls_ca=args.kv_store_tls_ca,
        store_timeout_seconds=args.kv_store_timeout, admit_after=args.kv_offload_admit_after,
        max_pending_stores=args.kv_offload_max_pending)
    config.check()
    return config


def engine_argv(args: argparse.Namespace, omit: Collection[str] = ()) -> list[str]:
    """The engine group's flags whose values in ``args`` differ from a replica's defaults,
    as arguments for ``tandem serve`` (flags named by their ``dest`` in ``omit`` left out).
    The model's names and settings are written by ``model_name_args`` and
    ``model_settings_args``: the gateway takes those too."""
    reference = argparse.ArgumentParser(add_help=False)
    add_engine_args(reference)
    defaults = vars(reference.parse_args([]))
    group = next(g for g in reference._action_groups if g.title == _GROUP_TITLE)
    argv: list[str] = []
    for action in group._group_actions:
        value = getattr(args, action.dest)
        if action.dest in omit or value == defaults[action.dest]:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        elif isinstance(value, tuple):  # MIN:MAX
            argv += [flag, ":".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def engine_config(args: argparse.Namespace, device: str, engine_id: str,
                  cpus: list[int] | None, kv: KvTransferConfig) -> EngineConfig:
    """The ``EngineConfig`` the engine flags describe, with the replica's own parts."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=device, max_model_len=args.max_model_len,
        seed=args.seed, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_batch_size=args.cuda_graph_max_batch_size, engine_id=engine_id,
        tensor_parallel_size=args.tensor_parallel_size,
        cpus=cpus, model_settings=model_settings_from_args(args),
        cache=replace(
            CacheConfig(), block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory, kv_cache_pages=args.kv_cache_pages,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_kv_blocks,
            enable_prefix_caching=not args.no_prefix_caching),
        scheduler=replace(
            SchedulerConfig(), max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, policy=args.scheduling_policy,
            long_prefill_token_threshold=prefill_chunk_tokens(args, kv)),
        kv_transfer=kv,
        kv_tiers=kv_tiers_config(args),
        speculative=replace(SpeculativeConfig(), num_tokens=args.speculative_ngram,
                            ngram_min=args.speculative_ngram_range[0],
                            ngram_max=args.speculative_ngram_range[1],
                            max_batch_size=args.speculative_max_batch))


def prefill_chunk_tokens(args: argparse.Namespace, kv: KvTransferConfig) -> int:
    """The scheduler's cap on one request's prompt tokens per step: a prefill replica that
    announces KV chunks long prompts (``--kv-overlap-chunk-tokens``); 0 (no cap) otherwise."""
    if kv.role == "producer" and args.kv_overlap == "on":
        return args.kv_overlap_chunk_tokens
    return 0
