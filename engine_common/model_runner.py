"""The model runner: turns a scheduled step into tensors, runs the model, samples.

Owns the device, the loaded model, the paged KV cache tensor and the per-request sampling
generators. It sizes the KV cache from the memory budget, and on CUDA replays decode steps
from CUDA graphs (``DecodeGraphRunner``). Rows with a grammar (structured outputs) get their
allowed-token mask applied to the logits before anything samples them. It scores prompt
positions for requests that ask for prompt logprobs, and checks speculative drafts against
the tokens the model samples after them. It loads the LoRA adapters the engine serves at
start (the engine core adds and removes others between steps) and tells the model each step
which tokens run which adapter (a ``LoraBatch``); a step with adapter tokens runs eagerly,
as the CUDA graphs were captured without LoRA. Under tensor parallelism this is rank 0's
runner: it starts the other ranks (``engine_common.parallel``), holds its own part of the
model and of the cache (``kv_heads_per_rank`` heads), and hands each step to the workers
before running it; a worker runs the same ``execute`` on its part. It does not decide what runs
(``Scheduler``) or which blocks a request holds (``KVCacheManager``): it receives block ids;
nor does it advance grammars (the scheduler accepts the sampled tokens).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine_common.config import EngineConfig
from engine_common.decode_graphs import DecodeGraphRunner, DecodeInputs
from engine_common.kv_cache_groups import kv_cache_groups
from engine_common.lora.loaded_adapters import LoadedLoraAdapters
from engine_common.model.arch_config import ModelArchConfig
from engine_common.model.attention.backend import AttentionMetadata
from engine_common.model.attention.kv_cache_layout import kv_cache_shape
from engine_common.model.cpu_allocator import keep_large_temporaries_in_heap
from engine_common.model.kv_cache_memory import CacheMemory, allocate_host_cache, page_policy
from engine_common.model.loader import load_model, resolve_dtype
from engine_common.outputs import ModelRunnerOutput
from engine_common.parallel.group import (
    TensorParallel,
    join_as_master,
    master_store,
    wait_for_workers,
)
from engine_common.parallel.sharding import check_divisible
from engine_common.parallel.step_message import WorkerSetup, step_message
from engine_common.parallel.workers import TensorParallelWorkers
from engine_common.request import Request
from engine_common.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    TokenLogprobs,
    greedy_argmax,
    is_greedy,
    takes_argmax,
    token_logprobs,
)
from engine_common.sampling_params import SamplingParams
from engine_common.scheduler import ScheduledRequest, SchedulerOutput
from engine_common.structured_output.grammar import GrammarBitmask, RequestGrammar

logger = logging.getLogger(__name__)

# Prompt positions scored at once: bounds the [rows, vocab] float32 logits of a long prompt.
_PROMPT_LOGPROB_ROWS = 256


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                             num_layers: int | None = None) -> int:
    """Of one rank's cache: ``arch`` is the rank's (its KV heads). ``num_layers``: the
    cache's layer axis (``KVCacheGroups.layers_per_block``); default every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = arch.num_layers if num_layers is None else num_layers
    return layers * 2 * block_size * arch.num_kv_heads * arch.head_size * itemsize


def rank_cpus(cpus: list[int], rank: int, size: int) -> list[int] | None:
    """Rank ``rank``'s contiguous share of ``cpus`` (None: fewer CPUs than ranks)."""
    if len(cpus) < size:
        return None
    per_rank, extra = divmod(len(cpus), size)
    first = rank * per_rank + min(rank, extra)
    return cpus[first:first + per_rank + (rank < extra)]


def _block_table(block_ids: list[list[int]]) -> np.ndarray:
    """[len(block_ids), longest] int32: each row a sequence's block ids, padded with 0."""
    num_seqs = len(block_ids)
    num_blocks = np.fromiter((len(ids) for ids in block_ids), np.int64, num_seqs)
    max_blocks = int(num_blocks.max())
    table = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    # One vectorised fill, row by row: a numpy assignment per row costs more than the
    # rest of the step's input preparation at large batches.
    table[np.arange(max_blocks) < num_blocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_ids), np.int32, int(num_blocks.sum()))
    return table


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArchConfig, eos_token_ids: frozenset[int],
                 max_model_len: int, parallel: TensorParallel | None = None,
                 on_worker_death: Callable[[str], object] | None = None):
        """``parallel``: a worker's place in its group; None for rank 0 (or the only rank),
        which starts the workers ``config.tensor_parallel_size`` asks for and calls
        ``on_worker_death`` with the reason if one exits."""
        self.config = config
        self.arch = arch
        self.workers: TensorParallelWorkers | None = None
        self.store: Any = None  # rank 0 of several: the group's TCP store
        self._released: list[str] = []  # finished since the last step: the workers' news
        self.device = torch.device(config.device)
        if parallel is None:
            parallel = self._start_workers(config, arch, eos_token_ids, max_model_len,
                                           on_worker_death)
        self.parallel = parallel
        if parallel.is_parallel and self.device.type == "cuda":
            self.device = torch.device("cuda", parallel.rank)
        self.dtype = resolve_dtype(config.dtype, arch, self.device)
        self.block_size = config.cache.block_size
        self.eos_token_ids = eos_token_ids
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            keep_large_temporaries_in_heap()
        # "auto" gives float32 for a bf16 checkpoint only on a CPU without a bf16 matmul:
        # float32 stands in for bf16 there, and its weights may be packed too.
        stands_in_for_bf16 = (config.dtype == "auto" and arch.dtype == "bfloat16"
                              and self.dtype == torch.float32)
        self.model = load_model(config.model, self.dtype, self.device, config.attention_backend,
                                pack_float32=stands_in_for_bf16, parallel=parallel)
        # Before the KV cache is sized: on a GPU the adapters take memory the cache would.
        settings = config.model_settings
        self.lora_adapters = LoadedLoraAdapters.load(settings.lora_modules, self.model,
                                                     settings.max_lora_rank)
        self.kv_groups = kv_cache_groups(arch, config)
        # Per layer, (group, slot): read by every step when the cache has several groups.
        self._layer_slots = self.kv_groups.layer_slots()
        # Every rank's pool has the same block ids: the smallest count any rank can hold.
        self.num_blocks = parallel.min_int(self._num_kv_blocks(), self.device)
        self.kv_heads_per_rank = self.model.arch.num_kv_heads
        shape = kv_cache_shape(self.kv_groups.layers_per_block, self.num_blocks, self.block_size,
                               self.kv_heads_per_rank, arch.head_size)
        self.kv_cache_memory: CacheMemory | None = None  # a CPU cache's pages, once made
        self.kv_cache = self._allocate_kv_cache(shape)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self._grammar_bitmask: GrammarBitmask | None = None  # made by the first grammar
        self.decode_graphs: DecodeGraphRunner | None = None
        if self.device.type == "cuda":
            self.warm_up()
        # NOTE: no CUDA graphs across ranks yet: capturing the NCCL all-reduces is unverified.
        if self.device.type == "cuda" and not config.enforce_eager and not parallel.is_parallel:
            if self.model.supports_cuda_graphs and self.kv_groups.is_single:
                try:
                    self.decode_graphs = self.static_decode_runner(max_model_len, capture=True)
                except RuntimeError:
                    # Serving eagerly beats not serving; the log says why graphs are off.
                    logger.exception("CUDA graph capture failed: decode runs eagerly")
                    torch.cuda.synchronize(self.device)
            else:
                logger.info("CUDA graphs off: the %s attention backend or this model's "
                            "layers (MoE, sinks, sliding windows) cannot be captured",
                            self.model.attention_backend.name)

    def _allocate_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Zeros of ``shape``; on the CPU on transparent huge pages per
        ``--kv-cache-pages``. NOTE: measured (docs/kv-transfer.md, "The KV cache on huge
        pages"): 8-13% faster decode attention (a layer's blocks lie a block apart, a TLB
        miss each on 4 KiB pages) and shared-memory KV reads about 3x cheaper in CPU from
        the producer's cache; but where the kernel must compact memory for them a GiB of
        them cost 2.3 s of CPU (5 s wall at load 6-9) against 0.64 s (1.4 s) for
        torch.zeros. Hence huge on a prefill replica, huge while free elsewhere."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        policy = page_policy(self.config.cache.kv_cache_pages, self.config.kv_transfer.role)
        cache, self.kv_cache_memory = allocate_host_cache(shape, self.dtype, policy)
        memory = self.kv_cache_memory
        logger.info("KV cache on %s pages (asked: %s) in %.2f s, %.2f s of CPU%s",
                    memory.pages, policy, memory.seconds, memory.cpu_seconds,
                    f": {memory.reason}" if memory.reason else "")
        return cache

    def _start_workers(self, config: EngineConfig, arch: ModelArchConfig,
                       eos_token_ids: frozenset[int], max_model_len: int,
                       on_death: Callable[[str], object] | None) -> TensorParallel:
        """Rank 0: start ranks 1 to N-1 and join their group (SINGLE when N is 1). On the
        CPU each rank gets its share of ``config.cpus`` (rank 0 pins itself only when the
        replica gave it CPUs), else of this process's CPUs."""
        size = config.tensor_parallel_size
        if size == 1:
            return TensorParallel()
        check_divisible(arch, size)
        cpus = config.cpus or sorted(os.sched_getaffinity(0))
        store, port = master_store(size)
        # Serves the workers' rendezvous, kept for the group's life; per-rank KV pulls'
        # reports come back through it too (``parallel.kv_ranks``).
        self.store = store
        self.workers = TensorParallelWorkers(
            [WorkerSetup(config, eos_token_ids, max_model_len, rank, port,
                         rank_cpus(cpus, rank, size) if self.device.type == "cpu" else None)
             for rank in range(1, size)], on_death)
        own = rank_cpus(cpus, 0, size)
        if config.cpus is not None and own is not None and self.device.type == "cpu":
            os.sched_setaffinity(0, own)
            torch.set_num_threads(len(own))
        logger.info("tensor parallel: rank 0 of %d, workers %s", size, self.workers.pids)
        workers = self.workers
        try:
            wait_for_workers(store, size, lambda: workers.dead_reason)
        except RuntimeError:
            workers.close(timeout=2.0)  # the others wait for a group that will not form
            self.workers = None
            raise
        return join_as_master(store, size, torch.device(config.device))

    def worker_death(self, timeout: float) -> str | None:
        """Why a tensor-parallel worker died (after a failed step: waits up to ``timeout``
        for the exit to be seen); None when none did, or there are none."""
        return self.workers.wait_death(timeout) if self.workers is not None else None

    def close(self) -> None:
        """Stop the workers (rank 0 of several; nothing otherwise)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def warm_up(self) -> None:
        """Runs the steps whose kernels a first request would otherwise wait for (Triton
        compiles on first use, cuBLAS creates its handles): one prefill step with long
        queries and one with short ones (the prefill kernel's two tilings), each sampling.
        Writes the first blocks of the cache, and zeroes it afterwards."""
        long_prompt = max(1, min(64, self.config.scheduler.max_num_batched_tokens - 1))
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        for prompt_lens in ((long_prompt, 1), (2, 1)):
            scheduled, next_block = [], 0
            for i, n in enumerate(prompt_lens):
                num_blocks = -(-n // self.block_size)
                if next_block + num_blocks > self.num_blocks:
                    return
                request = Request(f"warm-up-{i}", [0] * n, greedy, block_size=self.block_size)
                scheduled.append(ScheduledRequest(
                    request, n, list(range(next_block, next_block + num_blocks))))
                next_block += num_blocks
            # Every rank warms up by itself: not sent to the workers.
            self.execute(SchedulerOutput(scheduled=scheduled), to_workers=False)
        self.kv_cache.zero_()

    def static_decode_runner(self, max_model_len: int, capture: bool) -> DecodeGraphRunner:
        """Decode steps through static, padded inputs; captured as CUDA graphs if ``capture``."""
        max_batch_size = min(self.config.cuda_graph_max_batch_size,
                             self.config.scheduler.max_num_seqs)
        return DecodeGraphRunner(self.model, self.kv_cache, max_batch_size, max_model_len,
                                 self.block_size, capture)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = kv_cache_bytes_per_block(self.model.arch, self.block_size, self.dtype,
                                             self.kv_groups.layers_per_block)
        if self.device.type == "cuda":
            # Memory the caching allocator holds but no tensor uses (loading's temporaries)
            # is free for the cache too.
            torch.cuda.empty_cache()
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.gpu_memory_utilization)
            knob = "raise --gpu-memory-utilization or free GPU memory"
        else:
            budget = cache.kv_cache_memory_bytes
            knob = "raise --kv-cache-memory"
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; {knob}"
            )
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**20)
        return num_blocks

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)
        if self.workers is not None:
            self._released.extend(request_ids)

    def _generator_for(self, request: Request) -> torch.Generator | None:
        """The request's seeded generator, created on its first sample.

        The sampler draws one Exp(1) variate per vocabulary entry for every token it samples
        with a generator. Tokens sampled on another replica (a P/D first token, a resumed
        stream) consumed draws of the same seed there, so a new generator skips as many,
        and the output equals what one replica would have sampled.
        """
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            if not is_greedy(request.sampling_params):
                self._skip_draws(gen, request.num_sampled_elsewhere)
            self._generators[request.request_id] = gen
        return gen

    def _skip_draws(self, generator: torch.Generator, num_tokens: int) -> None:
        """Advance ``generator`` past the draws of ``num_tokens`` sampled tokens."""
        skipped = torch.empty(self.arch.vocab_size, device=self.device)
        for _ in range(num_tokens):
            skipped.exponential_(generator=generator)

    def execute(self, scheduler_output: SchedulerOutput,
                to_workers: bool = True) -> ModelRunnerOutput:
        """Run one step; return the sampled token (and logprobs) of every request whose
        scheduled tokens reach its last known token, and the prompt logprobs of the
        positions computed for requests that asked for them. Rank 0 hands the step to its
        workers first (WorkerDiedError when one is gone), unless ``to_workers`` is False (a
        step every rank runs by itself: the warm-up)."""
        if self.workers is not None and to_workers:
            self.workers.send(step_message(scheduler_output, self._released))
            self._released = []
        return self._run(scheduler_output)

    @torch.inference_mode()
    def _run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = scheduler_output.scheduled
        bs = self.block_size
        query_lens = [s.num_new_tokens for s in scheduled]
        starts = [s.request.num_computed_tokens for s in scheduled]
        seq_lens = [st + q for st, q in zip(starts, query_lens, strict=True)]
        num_seqs = len(scheduled)

        input_ids: list[int] = []
        for s, st, end in zip(scheduled, starts, seq_lens, strict=True):
            input_ids.extend(s.request.all_token_ids[st:end])
            input_ids.extend(s.draft_token_ids)  # past the known tokens
        block_tables = _block_table([s.block_ids for s in scheduled])
        max_blocks = block_tables.shape[1]

        query_lens_np = np.asarray(query_lens, dtype=np.int64)
        seq_index = np.repeat(np.arange(num_seqs), query_lens_np)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens_np, out=query_start_loc[1:])
        positions = (
            np.arange(len(input_ids), dtype=np.int64)
            - np.repeat(query_start_loc[:-1].astype(np.int64), query_lens_np)
            + np.repeat(np.asarray(starts, dtype=np.int64), query_lens_np)
        )
        slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        dev = self.device
        # Drafts are in query_lens: a request's draft positions run its adapter too.
        lora = (self.lora_adapters.step_batch([s.request.lora_name for s in scheduled],
                                              query_lens_np, dev, self.dtype)
                if self.lora_adapters.has_weights else None)
        graphs = self.decode_graphs
        if graphs is not None and lora is None and len(input_ids) == num_seqs \
                and graphs.can_run(num_seqs, max_blocks):
            hidden = graphs.run(DecodeInputs(
                np.asarray(input_ids, dtype=np.int64), positions, slot_mapping, seq_lens,
                block_tables))
        else:
            metadata = AttentionMetadata(
                slot_mapping=torch.from_numpy(slot_mapping).to(dev),
                query_start_loc=torch.from_numpy(query_start_loc).to(dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                block_tables=torch.from_numpy(block_tables).to(dev),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                query_lens_cpu=query_lens,
                seq_lens_cpu=seq_lens,
            )
            if not self.kv_groups.is_single:
                self._add_group_views(metadata, scheduled, seq_index, positions)
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.from_numpy(positions).to(dev),
                self.kv_cache,
                metadata,
                lora,
            )

        output = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(
            scheduled, starts, query_start_loc, hidden))
        speculated = [i for i, s in enumerate(scheduled) if s.draft_token_ids]
        if speculated:
            self._check_drafts(scheduled, speculated, query_start_loc, hidden, output)
        sample_items = [i for i, s in enumerate(scheduled)
                        if s.completes_sequence and not s.draft_token_ids]
        if not sample_items:
            return output
        if len(sample_items) < len(input_ids):
            logits_indices = torch.tensor(
                [int(query_start_loc[i + 1]) - 1 for i in sample_items], dtype=torch.int64,
                device=dev)
            hidden = hidden[logits_indices]
        logits = self.model.compute_logits(hidden)
        grammars = [(row, grammar) for row, i in enumerate(sample_items)
                    if (grammar := scheduled[i].request.grammar) is not None and grammar.masks]
        bitmask = None
        if grammars:
            bitmask = self._apply_grammars(logits, grammars)
        if all(takes_argmax(scheduled[i].request.sampling_params,
                            scheduled[i].request.num_output_tokens) for i in sample_items):
            tokens: list[int] = greedy_argmax(logits).tolist()
            output.sampled.update({scheduled[i].request.request_id: (token, None)
                                   for i, token in zip(sample_items, tokens, strict=True)})
            return output
        masked_rows = {row for row, _ in grammars}
        rows = [self._sampling_row(scheduled[i].request, scheduled[i].request.output_token_ids,
                                   bitmask if row in masked_rows else None, row)
                for row, i in enumerate(sample_items)]
        batch = SamplingBatch.build(rows, self.arch.vocab_size, dev)
        result = self.sampler(logits, batch)
        output.sampled.update({
            scheduled[i].request.request_id: (token, lp)
            for i, token, lp in zip(sample_items, result.sampled_token_ids, result.logprobs, strict=True)
        })
        return output

    def _add_group_views(self, metadata: AttentionMetadata, scheduled: list[ScheduledRequest],
                         seq_index: np.ndarray, positions: np.ndarray) -> None:
        """KV cache groups: the later groups' block tables and slots, and every layer's
        view (``AttentionMetadata.layer_views``). A request without tables of its own
        for them (the warm-up's) uses its first table's blocks for every group."""
        bs, dev = self.block_size, self.device
        views = [metadata]
        for g in range(1, len(self.kv_groups.groups)):
            tables = _block_table([s.extra_block_ids[g - 1] if s.extra_block_ids
                                   else s.block_ids for s in scheduled])
            slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
            views.append(dataclasses.replace(
                metadata, block_tables=torch.from_numpy(tables).to(dev),
                slot_mapping=torch.from_numpy(slots).to(dev), step=metadata))
        metadata.layer_views = tuple((slot, views[group]) for group, slot in self._layer_slots)

    def _check_drafts(self, scheduled: list[ScheduledRequest], speculated: list[int],
                      query_start_loc: np.ndarray, hidden: torch.Tensor,
                      output: ModelRunnerOutput) -> None:
        """Speculative decoding: a token is sampled at the last known position and after
        each draft, as one token per step would sample it (penalties and ``min_tokens``
        count the drafts before it as output). The leading drafts equal to the token
        sampled before them are accepted, and the token sampled after the last accepted one
        is the step's token. For a sampled request this is the rejection sampler of a
        one-hot draft: a draft is kept with the probability the model gives it, and a
        rejected position's token comes from the rest of the distribution. A seeded
        request's generator is rewound to have drawn once per token kept, so its output
        is the same as without drafts. Logprobs, where asked for, are each position's own,
        and a grammar masks each position with its state after the drafts before it."""
        positions: list[int] = []
        grammars: list[tuple[int, RequestGrammar]] = []  # each position's grammar state
        for i in speculated:
            end = int(query_start_loc[i + 1])
            item = scheduled[i]
            if item.request.grammar is not None:
                states = [item.request.grammar, *item.draft_grammars]
                grammars.extend((len(positions) + j, state) for j, state in enumerate(states)
                                if state.masks)
            positions.extend(range(end - 1 - len(item.draft_token_ids), end))
        logits = self.model.compute_logits(hidden[positions])
        bitmask = self._apply_grammars(logits, grammars) if grammars else None
        rewinds: dict[str, tuple[torch.Generator, torch.Tensor]] = {}
        if all(takes_argmax(scheduled[i].request.sampling_params,
                            scheduled[i].request.num_output_tokens) for i in speculated):
            predicted: list[int] = greedy_argmax(logits).tolist()
            logprobs: list[TokenLogprobs | None] = [None] * len(predicted)
        else:
            masked_rows = {row for row, _ in grammars}
            rows: list[SamplingRow] = []
            for i in speculated:
                request, drafts = scheduled[i].request, scheduled[i].draft_token_ids
                first = len(rows)
                rows.extend(self._sampling_row(
                    request, request.output_token_ids + drafts[:j],
                    bitmask if first + j in masked_rows else None, first + j)
                    for j in range(len(drafts) + 1))
                generator = rows[-1].generator
                if generator is not None and not is_greedy(request.sampling_params):
                    rewinds[request.request_id] = (generator, generator.get_state())
            result = self.sampler(
                logits, SamplingBatch.build(rows, self.arch.vocab_size, self.device))
            predicted, logprobs = result.sampled_token_ids, result.logprobs
        offset = 0
        for i in speculated:
            drafts = scheduled[i].draft_token_ids
            mine = predicted[offset:offset + len(drafts) + 1]
            my_logprobs = logprobs[offset:offset + len(drafts) + 1]
            offset += len(drafts) + 1
            accepted = 0
            while accepted < len(drafts) and mine[accepted] == drafts[accepted]:
                accepted += 1
            request_id = scheduled[i].request.request_id
            output.accepted_drafts[request_id] = drafts[:accepted]
            if scheduled[i].request.sampling_params.logprobs is not None:
                output.accepted_draft_logprobs[request_id] = my_logprobs[:accepted]
            output.sampled[request_id] = (mine[accepted], my_logprobs[accepted])
            if request_id in rewinds:
                generator, state = rewinds[request_id]
                generator.set_state(state)
                self._skip_draws(generator, accepted + 1)

    def _sampling_row(self, request: Request, output_token_ids: list[int],
                      bitmask: GrammarBitmask | None, row: int) -> SamplingRow:
        """What the sampler needs for one position of ``request`` with ``output_token_ids``
        before it; ``bitmask``: the step's masks, if a grammar masked this ``row``."""
        params = request.sampling_params
        suppress: frozenset[int] = frozenset()
        if len(output_token_ids) < params.min_tokens:
            eos = frozenset() if params.ignore_eos else self.eos_token_ids
            suppress = eos | frozenset(params.stop_token_ids)
            if bitmask is not None and not bitmask.allows_other_than(row, suppress):
                # The grammar can only end here: it wins over min_tokens, or no token
                # would be left to sample.
                suppress = frozenset()
        return SamplingRow(params=params, prompt_token_ids=request.prompt_token_ids,
                           output_token_ids=output_token_ids,
                           generator=self._generator_for(request), suppress_token_ids=suppress)

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], starts: list[int],
                         query_start_loc: np.ndarray, hidden: torch.Tensor,
                         ) -> dict[str, list[TokenLogprobs]]:
        """The raw logprobs of the prompt tokens this step's positions predict, for the
        requests that still owe them. The logits at position p score token p + 1; positions
        already scored (before a preemption made the prompt recompute) are skipped."""
        result: dict[str, list[TokenLogprobs]] = {}
        for i, (item, start) in enumerate(zip(scheduled, starts, strict=True)):
            request = item.request
            if not request.needs_prompt_logprobs:
                continue
            first = max(start + 1, request.next_prompt_logprob_position)
            last = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
            if first > last:
                continue
            targets = request.all_token_ids[first:last + 1]
            row = int(query_start_loc[i]) + first - 1 - start
            num_top = request.sampling_params.prompt_logprobs or 0
            entries: list[TokenLogprobs] = []
            for offset in range(0, len(targets), _PROMPT_LOGPROB_ROWS):
                ids = targets[offset:offset + _PROMPT_LOGPROB_ROWS]
                logits = self.model.compute_logits(hidden[row + offset:row + offset + len(ids)])
                entries.extend(token_logprobs(
                    logits, torch.tensor(ids, device=self.device), [num_top] * len(ids)))
            result[request.request_id] = entries
        return result

    def _apply_grammars(self, logits: torch.Tensor,
                        grammars: list[tuple[int, RequestGrammar]]) -> GrammarBitmask:
        """Masks ``logits`` in place (they are this step's own), before anything samples:
        a greedy constrained row may then take the argmax like any other."""
        if self._grammar_bitmask is None:
            self._grammar_bitmask = GrammarBitmask(
                self.config.scheduler.max_num_seqs, self.arch.vocab_size, self.device)
        self._grammar_bitmask.apply(logits, grammars)
        return self._grammar_bitmask
