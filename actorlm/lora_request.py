"""``LoRARequest``: which adapter a request runs with, in vLLM's shape.

``LoRARequest(lora_name, lora_int_id, lora_path)``: the name a client selects it by (the
``model`` of an OpenAI request), a positive integer that identifies it inside the engine (its
slot, its prefix-cache key) and the directory of a PEFT adapter (``adapter_config.json`` and
``adapter_model.safetensors``).
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be a positive "
                             f"integer, got {self.lora_int_id!r}")
