"""KV byte arithmetic: the single source of bytes per token, block sizes, group needs and capacity.

The planner, the engine and the metrics all call these functions so they never disagree.

Layers are grouped by attention type (full attention, or a sliding window of W) into KV cache
groups of equal size, so that a block of any group holds the same bytes: `block_size` tokens of
`layers_per_group` layers. Every group draws its blocks from one pool, and a request has one block
table per group (vLLM's hybrid allocator does the same). A full-attention group holds every block
of a sequence; a sliding-window group only the blocks that a future query can still read.
"""

from __future__ import annotations

import functools
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
class KVCacheGroupSpec:
    """Layers that share block tables: one attention type, `window` None for full attention."""

    layers: tuple[int, ...]
    window: int | None = None

    @property
    def attention(self) -> str:
        return "full" if self.window is None else f"sliding window {self.window}"

    def first_block(self, position: int, block_size: int) -> int:
        """Index of the oldest block that a query at `position` (or any later one) reads."""
        return 0 if self.window is None else max(0, position - self.window + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks held between steps by a sequence with num_tokens computed (its next query at num_tokens)."""
        return blocks_for_tokens(num_tokens, block_size) - self.first_block(num_tokens, block_size)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks held while a sequence grows to num_tokens, at most `chunk` tokens per step:
        a sliding group needs the window before a chunk's first query as well as the chunk."""
        whole = blocks_for_tokens(num_tokens, block_size)
        if self.window is None:
            return whole
        return min(whole, blocks_for_tokens(min(chunk, num_tokens) + self.window - 1, block_size) + 1)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int
    # per-layer sliding window (None = full attention); empty = every layer full
    layer_windows: tuple[int | None, ...] = ()
    # False: one group of every layer holding every block (vLLM's --disable-hybrid-kv-cache-manager)
    hybrid: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", normalize_kv_dtype(self.kv_dtype))
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError("sliding windows must be positive")

    # ------------------------------------------------------------------ groups
    @functools.cached_property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """Layers of one window size, in groups of the greatest common size across window sizes
        (Gemma 3 270M: 15 sliding and 3 full layers make 5 + 1 groups of 3)."""
        windows = self.layer_windows or (None,) * self.num_layers
        if not self.hybrid or all(w is None for w in windows):
            return (KVCacheGroupSpec(tuple(range(self.num_layers))),)
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        size = functools.reduce(math.gcd, (len(layers) for layers in kinds.values()))
        return tuple(
            KVCacheGroupSpec(tuple(layers[i : i + size]), window) for window, layers in kinds.items() for i in range(0, len(layers), size)
        )

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layers)

    @functools.cached_property
    def layer_slots(self) -> tuple[tuple[int, int], ...]:
        """(group, index within the group) of every layer."""
        slots = {layer: (g, i) for g, group in enumerate(self.groups) for i, layer in enumerate(group.layers)}
        return tuple(slots[layer] for layer in range(self.num_layers))

    # ------------------------------------------------------------------ bytes
    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)

    @property
    def bytes_per_token_per_layer(self) -> float:
        return self.bytes_per_token / self.num_layers

    @property
    def bytes_per_block(self) -> int:
        """One block of one group: block_size tokens of layers_per_group layers."""
        return math.ceil(self.bytes_per_token_per_layer * self.layers_per_group * self.block_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.kv_dtype not in _TORCH_DTYPES:
            raise ValueError(f"kv dtype {self.kv_dtype!r} has no storage in the paged pool yet")
        return _TORCH_DTYPES[self.kv_dtype]

    def num_blocks_for_memory(self, memory_bytes: float) -> int:
        return int(memory_bytes // self.bytes_per_block)

    # ------------------------------------------------------------------ one sequence's needs
    def blocks_held(self, num_tokens: int) -> int:
        """Blocks of every group a sequence with num_tokens computed holds between steps."""
        return sum(g.blocks_held(num_tokens, self.block_size) for g in self.groups)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Blocks of every group a sequence needs at most on its way to num_tokens, `chunk` tokens per step at most."""
        return sum(g.peak_blocks(num_tokens, self.block_size, chunk) for g in self.groups)

    def max_tokens(self, num_blocks: int, chunk: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose peak need fits num_blocks; 0 if none does."""
        if self.peak_blocks(1, chunk) > num_blocks:
            return 0
        low, high = 1, limit
        while low < high:
            mid = (low + high + 1) // 2
            if self.peak_blocks(mid, chunk) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def shared_prefix_bytes(self, num_tokens: int) -> int:
        """Bytes of the whole blocks of a num_tokens prefix that full-attention groups hold for the
        sequence's life: what each further sharer of the prefix saves."""
        full = sum(1 for g in self.groups if g.window is None)
        return full * (num_tokens // self.block_size) * self.bytes_per_block

    def logical_bytes(self, num_tokens: int) -> int:
        """Bytes of K/V a sequence of num_tokens needs, with no page rounding (a sliding layer holds its window)."""
        windows = self.layer_windows or (None,) * self.num_layers
        held = sum(num_tokens if w is None else min(num_tokens, w) for w in windows)
        return math.ceil(held * self.bytes_per_token_per_layer)

    def physical_bytes(self, num_tokens: int) -> int:
        """Bytes of the blocks a sequence of num_tokens holds between steps."""
        return self.blocks_held(num_tokens) * self.bytes_per_block
