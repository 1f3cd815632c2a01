"""Multi-LoRA serving: PEFT LoRA adapters applied per token beside the base model.

``adapter_config`` reads and checks a PEFT ``adapter_config.json``; ``adapter_weights``
reads its ``adapter_model.safetensors``; ``linear_delta`` holds one adapter's low-rank
weights for one (possibly fused) projection and adds their delta to a step's rows;
``step_batch`` says which rows of a step run which adapter; ``loaded_adapters`` is what an
engine serves, by name, loaded at start or while it serves; ``errors`` are the refusals of
loads and unloads at runtime. PEFT itself is never imported: the files are read here.
"""
