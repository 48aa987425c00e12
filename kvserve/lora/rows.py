"""The LoRA products of one step: each adapter's A and B as projections of the model's own kind
(model/layers.py Linear, so on the CPU kernels whose rows keep their bits whatever rides with
them), run once per adapter over the rows that use it and added into the base projection's output
slice; rows without an adapter take no part. The fused projections (qkv, gate_up) add each part's
product into its slice of the output."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.lora.adapter import LoRAAdapter, module_shape
from kvserve.model.config import ModelConfig
from kvserve.model.layers import Linear

# the model's fused projections and the PEFT modules they are made of, in output order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass
class LoRAPart:
    offset: int  # the part's first output column in the fused projection
    a: Linear  # [r, in]
    b: Linear  # [out, r]
    scaling: float


class ResidentAdapter:
    """An adapter's products in the activations' dtype on the model's device, per (layer, fused projection)."""

    def __init__(self, adapter: LoRAAdapter, config: ModelConfig, dtype: torch.dtype, device: torch.device, native: bool) -> None:
        self.identity = adapter.identity
        self.nbytes = 0
        self.parts: dict[tuple[int, str], list[LoRAPart]] = {}
        for layer in range(config.num_layers):
            for fused, modules in FUSED.items():
                offset, parts = 0, []
                for module in modules:
                    out, inner = module_shape(config, module)
                    if (layer, module) in adapter.weights:
                        a, b = adapter.weights[(layer, module)]
                        parts.append(LoRAPart(offset, self._linear(a, dtype, device, native), self._linear(b, dtype, device, native),
                                              adapter.scaling))  # fmt: skip
                        self.nbytes += (a.numel() + b.numel()) * dtype.itemsize
                    offset += out
                if parts:
                    self.parts[(layer, fused)] = parts

    @staticmethod
    def _linear(weight: torch.Tensor, dtype: torch.dtype, device: torch.device, native: bool) -> Linear:
        out, inner = weight.shape
        with torch.device("meta"):
            linear = Linear(inner, out, bias=False)
        linear.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        if native:
            linear.enable_native()
        return linear


class LoRARows:
    """Which adapter each row of a step uses (slot -1: none) and their products."""

    def __init__(self, slots: torch.Tensor, adapters: list[ResidentAdapter]) -> None:
        self.slots = slots
        self.adapters = adapters
        self.groups = [(adapters[s], (slots == s).nonzero().flatten()) for s in torch.unique(slots).tolist() if s >= 0]

    @classmethod
    def of(cls, row_slots: np.ndarray, adapters: list[ResidentAdapter], device: torch.device) -> LoRARows | None:
        if not adapters or not (row_slots >= 0).any():
            return None
        return cls(torch.from_numpy(row_slots).to(device), adapters)

    def select(self, rows: torch.Tensor) -> LoRARows:
        """The same for a subset of the rows (the last layer's sampled rows), in that order."""
        return LoRARows(self.slots.index_select(0, rows), self.adapters)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base projection of x) plus each row's adapter product, in place."""
        for adapter, rows in self.groups:
            parts = adapter.parts.get((layer, fused))
            if not parts:
                continue
            xs = x.index_select(0, rows)
            for part in parts:
                delta = part.b.forward(part.a.forward(xs)) * part.scaling
                out[:, part.offset : part.offset + delta.shape[1]].index_add_(0, rows, delta.to(out.dtype))
        return out
