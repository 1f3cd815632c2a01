"""A Responses request without ``max_output_tokens`` gets the chat's default cap, end to end.

The default is the model's ``max_new_tokens`` (here set on a real replica with
``--override-generation-config``, as an operator caps output): a response without a limit
stops there, ``incomplete`` for ``max_output_tokens`` as OpenAI reports a response cut by the
model's cap, exactly where a chat without ``max_tokens`` stops; a request's own limit wins.
Without a default a response runs to the context, as vLLM's chat does (docs/limits.md).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from tests.replica_process import start_replicas

pytestmark = pytest.mark.timeout(300)

CAP = 3


def test_a_response_without_a_limit_gets_the_chats_default(tiny_llama_dir: Path,
                                                           tmp_path: Path) -> None:
    replicas = start_replicas(tiny_llama_dir, tmp_path, {"capped": [
        "--dtype", "float32", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
        "--override-generation-config", f'{{"max_new_tokens": {CAP}, "temperature": 0}}']})
    try:
        with grpc.insecure_channel(replicas["capped"].target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.ResponseRequest(model="tiny")
            request.input.string_value = "Tell me a long story about the sea"
            capped = stub.CreateResponse(request, timeout=60)
            request.max_output_tokens = CAP + 2
            own = stub.CreateResponse(request, timeout=60)
            chat = pb.ChatCompletionRequest(model="tiny")
            chat.messages.add(role="user").content.string_value = request.input.string_value
            chat_answer = stub.ChatComplete(chat, timeout=60)
    finally:
        replicas["capped"].kill()
    assert capped.usage.output_tokens == CAP == chat_answer.usage.completion_tokens
    assert capped.status == "incomplete"
    assert capped.incomplete_details.reason == "max_output_tokens"
    assert not capped.HasField("max_output_tokens")  # as OpenAI: the request set none
    text = "".join(part.text for item in capped.output for part in item.content)
    assert text == chat_answer.choices[0].message.content
    assert own.usage.output_tokens == CAP + 2 and own.max_output_tokens == CAP + 2
