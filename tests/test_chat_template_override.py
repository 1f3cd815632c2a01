"""``--chat-template``: serving a chat template instead of the model's own (vLLM's flag).

Given a template file (or the template's text), the replica and the gateway, which renders
chats itself, both serve a model without a template (a base model) chats that say what the
offline engine says with that template; a gateway not given it refuses chats with a message
that names the flag.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from engine_common.config import CacheConfig, EngineConfig, ModelSettings
from engine_common.llm import LLM
from engine_common.sampling_params import SamplingParams
from engine_common.tokenizer import load_tokenizer, read_chat_template
from tandem.client import Client
from tandem.errors import InvalidRequestError
from tests.replica_process import (
    gateway_started,
    is_serving,
    launch_replicas,
    wait_serving,
    wait_until,
)

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "user", "content": "tell me about the sea"}]


def test_a_template_is_a_file_or_the_text_itself(tiny_llama_dir, tmp_path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE == read_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    assert load_tokenizer(tiny_llama_dir, str(path)).chat_template == TEMPLATE


def test_a_model_without_a_template_is_served_with_the_given_one(tiny_llama_dir,
                                                                 tmp_path) -> None:
    model = tmp_path / "base-model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    offline = LLM(EngineConfig(model=str(model), dtype="float32",
                               model_settings=ModelSettings(chat_template=str(template)),
                               cache=CacheConfig(num_gpu_blocks_override=256)))
    prompt = offline.inputs.tokenize_chat(MESSAGES)
    assert offline.tokenizer.decode(prompt).startswith("<|user|>tell me")
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                     ignore_eos=True))[0].text
    flags = ["--dtype", "float32", "--kv-cache-memory", "16MiB"]
    logs = tmp_path / "logs"
    logs.mkdir()
    # Both gateways start with the replica (they retry it until it answers).
    [replica] = launch_replicas(model, logs, {"a": [
        "--served-model-name", "tiny", *flags, "--chat-template", str(template)]}).values()
    try:
        with gateway_started(model, logs, [replica.target],
                             ["--chat-template", str(template)]) as gateway, \
                gateway_started(model, logs, [replica.target],
                                name="gateway-without-template") as plain:
            wait_serving({"a": replica})
            for started in (gateway, plain):
                wait_until(lambda g=started: is_serving(g), time.monotonic() + 60, started, logs)
            for target in (gateway, replica.target):
                with Client(target, timeout=60) as client:
                    answer = client.chat(MESSAGES, max_tokens=12, temperature=0,
                                         ignore_eos=True)
                    assert answer.content == want
                    assert answer.usage.prompt_tokens == len(prompt)
            # A gateway given no template renders no chat for this model, and says how to.
            with Client(plain, timeout=60) as client, \
                    pytest.raises(InvalidRequestError, match="no chat template.*--chat-template"):
                client.chat(MESSAGES, max_tokens=4)
    finally:
        replica.kill()
