"""KV byte arithmetic: the single source of bytes per token, block sizes and capacity.

The planner, the engine and the metrics all call these functions so they never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GIB = 1024**3

# bytes per stored element, and per-group scale overhead for quantized formats
KV_DTYPES: dict[str, tuple[float, int]] = {
    # name: (bytes per element, elements per scale group; 0 = no scales)
    "float32": (4, 0),
    "bfloat16": (2, 0),
    "float16": (2, 0),
    "fp8": (1, 0),
    "int8": (1, 0),
    "int4": (0.5, 32),
}
SCALE_BYTES = 2  # one fp16 scale per group (int4's zero point folds into symmetric scaling)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def normalize_kv_dtype(name: str) -> str:
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8_e4m3": "fp8"}
    name = aliases.get(name, name)
    if name not in KV_DTYPES:
        raise ValueError(f"kv dtype {name!r} is unknown; choose one of {', '.join(KV_DTYPES)}")
    return name


def bytes_per_element_with_scales(kv_dtype: str, head_dim: int) -> float:
    elem, group = KV_DTYPES[normalize_kv_dtype(kv_dtype)]
    if not group:
        return float(elem)
    groups = math.ceil(head_dim / group)
    return elem + groups * SCALE_BYTES / head_dim


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element, plus quantization scales."""
    for name, value in (("layers", num_layers), ("kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return math.ceil(2 * num_layers * num_kv_heads * head_dim * bytes_per_element_with_scales(kv_dtype, head_dim))


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int
    # per-layer sliding window (None = full attention); empty = every layer full
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", normalize_kv_dtype(self.kv_dtype))
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError("sliding windows must be positive")

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.kv_dtype not in _TORCH_DTYPES:
            raise ValueError(f"kv dtype {self.kv_dtype!r} has no storage in the paged pool yet")
        return _TORCH_DTYPES[self.kv_dtype]

    def num_blocks_for_memory(self, memory_bytes: float) -> int:
        return int(memory_bytes // self.bytes_per_block)

    @property
    def bytes_per_token_per_layer(self) -> float:
        return self.bytes_per_token / self.num_layers

    def _held(self, num_tokens: int, rounded: bool) -> int:
        """Token slots held across layers; a sliding-window layer holds at most its window."""
        windows = self.layer_windows or (None,) * self.num_layers
        total = 0
        for window in windows:
            held = num_tokens if window is None else min(num_tokens, window)
            total += blocks_for_tokens(held, self.block_size) * self.block_size if rounded else held
        return total

    def logical_bytes(self, num_tokens: int) -> int:
        """Bytes of K/V a sequence of num_tokens needs, with no page rounding."""
        return math.ceil(self._held(num_tokens, rounded=False) * self.bytes_per_token_per_layer)

    def physical_bytes(self, num_tokens: int) -> int:
        """Bytes a sequence of num_tokens occupies once each layer rounds up to whole blocks."""
        return math.ceil(self._held(num_tokens, rounded=True) * self.bytes_per_token_per_layer)
