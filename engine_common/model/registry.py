"""Architecture name (``config.json``'s ``architectures[0]``) -> the network class that
runs it, as vLLM's model registry: one short file per network, imported only when chosen.

Owns the mapping only; ``arch_config`` owns which names are accepted (and says why one is
not), the network files own the networks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

import torch

from engine_common.model.arch_config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from engine_common.model.attention.backend import AttentionBackend
from engine_common.model.causal_lm import CausalLM
from engine_common.parallel.group import TensorParallel

# What every network class is called with: (arch, attention backend class, dtype, device,
# the rank's tensor-parallel place).
NetworkClass = Callable[[ModelArchConfig, type[AttentionBackend], torch.dtype, torch.device,
                         TensorParallel], CausalLM]

# Architecture -> (module under engine_common.model, class name).
_NETWORKS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}
assert set(_NETWORKS) == set(SUPPORTED_ARCHITECTURES)


def network_class(architecture: str) -> NetworkClass:
    """The class that runs ``architecture``; KeyError for one ``arch_config`` rejects."""
    module_name, class_name = _NETWORKS[architecture]
    module = importlib.import_module(f"engine_common.model.{module_name}")
    cls = getattr(module, class_name)
    assert issubclass(cls, CausalLM)
    return cast(NetworkClass, cls)
