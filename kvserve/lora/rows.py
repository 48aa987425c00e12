"""The LoRA products of one step. Each adapter is held per fused projection (qkv, o, gate_up,
down) as A, its parts' lora_A stacked [sum r, in], and each part's (lora_B times scaling)^T
[r, part width] for its own output columns. On the CPU kernels one native
call per projection adds every row's adapter product into the base projection's output
(kernels/lora.cpp: a row's result in one fixed order, so the same bits alone or batched); elsewhere
torch does, once per adapter over the rows that use it. Rows without an adapter take no part."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.kernels.lora import LORA_DTYPES, LoraCall, lora_available
from kvserve.lora.adapter import LoRAAdapter, module_shape
from kvserve.model.config import ModelConfig

# the model's fused projections and the PEFT modules they are made of, in output order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass(frozen=True)
class HeldProduct:
    """One fused projection's adapter product: A [sum r, in], the parts' lora_A stacked; bt, each
    part's (lora_B times scaling)^T [r, width] flattened one after the other; parts, int32: the count,
    then each part's rank, first output column and width; and the projection's output width."""

    a: torch.Tensor
    bt: torch.Tensor
    parts: torch.Tensor
    n: int

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The product for rows x as torch computes it (off the CPU kernels)."""
        h = F.linear(x.to(self.a.dtype), self.a)
        out = h.new_zeros(x.shape[0], self.n)
        layout = self.parts.tolist()
        first = at = 0
        for p in range(layout[0]):
            rank, column, width = layout[1 + 3 * p : 4 + 3 * p]
            block = self.bt[at : at + rank * width].view(rank, width)
            out[:, column : column + width] = h[:, first : first + rank] @ block
            first, at = first + rank, at + rank * width
        return out


class ResidentAdapter:
    """An adapter's products per (layer, fused projection), in the activations' dtype on the model's device."""

    def __init__(self, adapter: LoRAAdapter, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.identity = adapter.identity
        self.nbytes = 0
        self.products: dict[tuple[int, str], HeldProduct] = {}
        for layer in range(config.num_layers):
            for fused, modules in FUSED.items():
                widths = [module_shape(config, m)[0] for m in modules]
                adapted = [(i, adapter.weights[(layer, m)]) for i, m in enumerate(modules) if (layer, m) in adapter.weights]
                if not adapted:
                    continue
                a_stack = torch.cat([a for _, (a, _) in adapted])
                bt = torch.cat([(b * adapter.scaling).t().reshape(-1) for _, (_, b) in adapted])
                layout = [len(adapted)] + [v for i, (a, _) in adapted for v in (a.shape[0], sum(widths[:i]), widths[i])]
                held = HeldProduct(a_stack.to(device=device, dtype=dtype).contiguous(), bt.to(device=device, dtype=dtype).contiguous(),
                                   torch.tensor(layout, dtype=torch.int32), sum(widths))  # fmt: skip
                self.products[(layer, fused)] = held
                self.nbytes += held.a.numel() * held.a.element_size() + held.bt.numel() * held.bt.element_size()


class LoRARows:
    """Which adapter each row of a step uses (slot -1: none) and their products."""

    def __init__(self, slots: torch.Tensor, adapters: list[ResidentAdapter]) -> None:
        self.slots = slots
        self.adapters = adapters
        self.native = lora_available(next(iter(adapters[0].products.values())).a.dtype, slots.device)
        self._calls: dict[tuple[int, str], LoraCall | None] = {}
        self._groups: list[tuple[ResidentAdapter, torch.Tensor]] | None = None

    @classmethod
    def of(cls, row_slots: np.ndarray, adapters: list[ResidentAdapter], device: torch.device) -> LoRARows | None:
        if not adapters or not (row_slots >= 0).any():
            return None
        return cls(torch.from_numpy(row_slots.astype(np.int32)).to(device), adapters)

    def select(self, rows: torch.Tensor) -> LoRARows:
        """The same for a subset of the rows (the last layer's sampled rows), in that order."""
        return LoRARows(self.slots.index_select(0, rows), self.adapters)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base projection of x) plus each row's adapter product, in place."""
        if self.native and x.dtype in LORA_DTYPES and out.dtype == x.dtype and x.stride(1) == 1 and out.stride(1) == 1:
            call = self.native_call(layer, fused)
            return call.add(x, out) if call is not None else out
        for adapter, rows in self._torch_groups():
            held = adapter.products.get((layer, fused))
            if held is not None:
                out.index_add_(0, rows, held.delta(x.index_select(0, rows)).to(out.dtype))
        return out

    def native_call(self, layer: int, fused: str) -> LoraCall | None:
        """The native call of this projection's adapter products (None: no adapter has it), built once a step."""
        key = (layer, fused)
        if key not in self._calls:
            held = [adapter.products.get(key) for adapter in self.adapters]
            present = [i for i, h in enumerate(held) if h is not None]
            if not present:
                self._calls[key] = None
            else:
                slots = self.slots
                if len(present) < len(held):  # adapters without this projection: their rows take none here
                    remap = torch.full((len(held) + 1,), -1, dtype=torch.int32)
                    remap[torch.tensor(present)] = torch.arange(len(present), dtype=torch.int32)
                    slots = remap[slots.long()]  # slot -1 reads remap[-1], which is -1
                chosen = [held[i] for i in present]
                self._calls[key] = LoraCall(slots.contiguous(), chosen[0].n, [h.a for h in chosen], [h.bt for h in chosen], [h.parts for h in chosen])
        return self._calls[key]

    def _torch_groups(self) -> list[tuple[ResidentAdapter, torch.Tensor]]:
        if self._groups is None:
            self._groups = [(self.adapters[s], (self.slots == s).nonzero().flatten()) for s in torch.unique(self.slots).tolist() if s >= 0]
        return self._groups
