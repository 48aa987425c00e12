"""LoRA adapters served over one base model: PEFT's format loaded and checked against the base
(adapter.py), a request's adapter (request.py), the adapters held by an engine (manager.py) and
their products added beside the base projections for the rows that use them (rows.py)."""

from kvserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
