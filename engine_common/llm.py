"""The offline Python API: ``LLM(model).generate(prompts, params)``.

With LoRA adapters loaded (``ModelSettings.lora_modules``, or ``load_lora_adapter`` between
calls), ``lora_name=`` runs a request with one of them: one name for every prompt of a
``generate``, or one per prompt (None: the base model).

Owns a synchronous loop around an in-process ``EngineCore`` with the same input and output
processing the services use. For serving, ``AsyncLLM`` runs the core in its own process.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from engine_common.config import EngineConfig
from engine_common.engine_core import EngineCore
from engine_common.generation_request import GenerationRequest
from engine_common.input_processor import InputProcessor
from engine_common.metrics import EngineMetrics, served_model_label
from engine_common.output_processor import OutputProcessor, RequestOutput
from engine_common.outputs import EngineCoreOutputs, EngineCoreRequest, TokenLogprobs
from engine_common.sampling_params import SamplingParams
from engine_common.tokenizer import load_tokenizer

Prompt = str | Sequence[int]
LoraNames = str | None | Sequence[str | None]  # one adapter for all prompts, or one each


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # With ``prompt_logprobs``: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = load_tokenizer(config.model, config.model_settings.chat_template)
        self.inputs = InputProcessor(self.tokenizer, self.core.max_model_len, self.core.arch.vocab_size)
        self.metrics = EngineMetrics(served_model_label(config.model, None), config.engine_id,
                                     max_model_len=self.core.max_model_len)
        self.metrics.set_cache_config(config.cache, self.core.info.num_blocks)
        self.outputs = OutputProcessor(self.tokenizer, self.metrics)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel workers, KV tiers' writer)."""
        self.core.close()

    def add_request(self, prompt: Prompt, params: SamplingParams, *, priority: int = 0,
                    cache_salt: str | None = None, request_id: str | None = None,
                    lora_name: str | None = None) -> tuple[str, list[int]]:
        """Queues one request (``lora_name``: a loaded LoRA adapter, or None for the base
        model; an adapter the engine did not load raises ValueError)."""
        token_ids = self.inputs.tokenize(prompt)
        self.inputs.validate_prompt(token_ids, params.max_tokens)
        self.inputs.check_sampling_token_ids(params)
        request_id = request_id or f"offline-{next(self._ids)}"
        arrival = time.monotonic()
        self.core.add_request(EngineCoreRequest(request_id, GenerationRequest(
            token_ids, params, priority, cache_salt, lora_name), arrival))
        self.outputs.add_request(request_id, token_ids, params, arrival)
        return request_id, token_ids

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters served now, sorted."""
        return sorted(self.core.model_runner.lora_adapters.names)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in directory ``path`` as ``name`` (``LoraAdapterExists``
        when the name is taken, ValueError when it cannot be served)."""
        self.core.load_lora_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name``; requests already queued with it still finish with it
        (``LoraAdapterNotFound`` when no adapter is served under the name)."""
        self.core.unload_lora_adapter(name)

    def abort(self, request_ids: list[str]) -> None:
        self._process(EngineCoreOutputs(outputs=self.core.abort_requests(request_ids)))

    def step(self) -> list[RequestOutput]:
        if not self.core.has_runnable_requests():
            # NOTE: wait for a tier load rather than step: an empty step still takes the GIL,
            # and the tiers' worker then waited out Python's switch interval at every copy
            # (a host-tier load of 46 blocks took 0.5 s, as long as recomputing them; the
            # engine core's process waits on its pipe instead, core_process).
            self.core.wait_for_tier_loads(0.05)
        return self._process(self.core.step())

    def _process(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        results, to_abort = self.outputs.process(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return results

    def _submit(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                lora_name: LoraNames = None) -> list[tuple[str, list[int]]]:
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = ([lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str)
                 else list(lora_name))
        if len(loras) != len(prompts):
            raise ValueError("give one lora_name, or one per prompt")
        for lora in set(loras):  # before any request is queued
            self.core.model_runner.lora_adapters.check(lora)
        return [self.add_request(prompt, p, lora_name=lora)
                for prompt, p, lora in zip(prompts, per_prompt, loras, strict=True)]

    def stream(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
               lora_name: LoraNames = None) -> Iterator[RequestOutput]:
        """Submit all prompts, then yield every request's deltas as the engine steps."""
        self._submit(prompts, params, lora_name)
        while self.outputs.num_unfinished:
            yield from self.step()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                 lora_name: LoraNames = None) -> list[GenerationResult]:
        """Generate for every prompt; results come back in the order of the prompts.
        ``lora_name``: the LoRA adapter of every prompt, or a list of one per prompt."""
        results = {request_id: GenerationResult(request_id, token_ids)
                   for request_id, token_ids in self._submit(prompts, params, lora_name)}
        while self.outputs.num_unfinished:
            for out in self.step():
                result = results[out.request_id]
                result.text += out.delta_text
                result.token_ids.extend(out.new_token_ids)
                result.logprobs.extend(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = [None, *out.prompt_logprobs]
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.stop_reason = out.stop_reason
                    result.num_cached_tokens = out.num_cached_tokens
        return list(results.values())
