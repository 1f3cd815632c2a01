"""The engine-core process answers every request it is handed: one it refuses ends with an
"abort" output that says why (the client must not wait forever), and the core goes on
serving the others. A real core process on a tiny Llama.
"""

from __future__ import annotations

import queue
import time

import pytest

from engine_common.config import CacheConfig, EngineConfig
from engine_common.core_process import EngineCoreClient
from engine_common.generation_request import GenerationRequest
from engine_common.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from engine_common.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _finished(outputs: queue.Queue[EngineCoreOutputs], request_id: str) -> EngineCoreOutput:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = outputs.get(timeout=deadline - time.monotonic())
        for output in batch.outputs:
            if output.request_id == request_id and output.finished:
                return output
    raise AssertionError(f"{request_id} never finished")


def test_a_refused_request_ends_with_the_reason_and_the_core_serves_on(tiny_llama_dir) -> None:
    outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
    client = EngineCoreClient(
        EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(num_gpu_blocks_override=32)))
    try:
        client.connect(on_outputs=outputs.put,
                       on_dead=lambda reason: outputs.put(EngineCoreOutputs(outputs=[])))
        params = SamplingParams(max_tokens=3, temperature=0.0)
        # hold_kv asks for a KV producer (a prefill replica); this core is not one.
        client.add_request(EngineCoreRequest("refused", GenerationRequest([1, 2, 3], params),
                                             time.monotonic(), hold_kv=True))
        refused = _finished(outputs, "refused")
        assert refused.finish_reason == "abort" and refused.new_token_ids == []
        assert "not a KV producer" in str(refused.stop_reason)

        client.add_request(EngineCoreRequest("served", GenerationRequest([1, 2, 3], params),
                                             time.monotonic()))
        assert _finished(outputs, "served").finish_reason == "length"
    finally:
        client.shutdown()
