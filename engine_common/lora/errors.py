"""The errors of loading and unloading LoRA adapters while an engine serves (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter), by kind, so a service can answer each
with its own status.

Owns only the exception types. An adapter that cannot be served at all (a bad directory,
configuration or shapes) is a plain ``ValueError`` from ``adapter_config`` /
``adapter_weights``; these are the two refusals that depend on what the engine serves now.
"""

from __future__ import annotations


class LoraAdapterExists(ValueError):
    """The name is served already, or its adapter is still being unloaded (requests that
    were running with it have not finished)."""


class LoraAdapterNotFound(LookupError):
    """No adapter is served under the name."""
