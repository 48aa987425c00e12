"""A request's LoRA adapter, in vLLM's shape: LoRARequest(lora_name, lora_int_id, lora_path)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_NAME_CHARS = 256


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: a name unique per engine, a positive integer id (vLLM's
    lora_int_id) and the directory of its PEFT files (adapter_config.json and adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not 1 <= len(self.lora_name) <= MAX_LORA_NAME_CHARS:
            raise ValueError(f"lora_name must be a string of 1 to {MAX_LORA_NAME_CHARS} characters")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty str, the directory of the adapter's PEFT files (got {type(self.lora_path).__name__})")
