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

@dataclass(frozen=True)
class KVFormat:
    """How one token's K (or V) of one KV head is stored in a block.

    float: the values themselves. scaled (int8, fp8): the values divided by one scale per token and
    head (an fp16 next to them). kivi (int4, int2): KIVI's asymmetric quantization, keys per
    channel over groups of `group_size` tokens, values per token over groups of `group_size`
    channels, each group's scale and zero point in 2 bytes (an 8-bit log2 scale, an 8-bit
    integer zero point); the most recent tokens stay in full precision (the residual).
    """

    name: str
    bits: int
    kind: str  # float | scaled | kivi
    torch_dtype: torch.dtype | None = None  # float formats: the element type; fp8: its encoding

    @property
    def quantized(self) -> bool:
        return self.kind != "float"

    def data_bytes(self, head_dim: int) -> float:
        return head_dim * self.bits / 8

    def meta_bytes(self, head_dim: int, group_size: int) -> float:
        """Bytes of scales per token and head, for K and for V alike."""
        if self.kind == "scaled":
            return 2.0
        if self.kind == "kivi":
            return 2.0 * head_dim / group_size
        return 0.0


KV_FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("float32", 32, "float", torch.float32),
        KVFormat("bfloat16", 16, "float", torch.bfloat16),
        KVFormat("float16", 16, "float", torch.float16),
        KVFormat("fp8_e4m3", 8, "scaled", torch.float8_e4m3fn),
        KVFormat("fp8_e5m2", 8, "scaled", torch.float8_e5m2),
        KVFormat("int8", 8, "scaled"),
        KVFormat("int4", 4, "kivi"),
        KVFormat("int2", 2, "kivi"),
    )
}
KV_DTYPES = tuple(KV_FORMATS)
DEFAULT_QUANT_GROUP_SIZE = 32
DEFAULT_QUANT_RESIDUAL = 128
MAX_KV_QUANT_RESIDUAL = 65536  # tokens a sequence keeps in full precision at most (--kv-quant-residual)


def normalize_kv_dtype(name: str) -> str:
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
    name = aliases.get(name, name)
    if name not in KV_FORMATS:
        raise ValueError(f"kv dtype {name!r} is unknown; choose one of {', '.join(KV_FORMATS)}")
    return name


def block_size_for(kv_dtype: str, block_size: int | None, group_size: int = DEFAULT_QUANT_GROUP_SIZE) -> int:
    """The block size a format takes: `block_size` (16 when None), rounded up to a multiple of
    the group size for int4 / int2, whose key groups must not span blocks."""
    size = 16 if block_size is None else block_size
    if KV_FORMATS[normalize_kv_dtype(kv_dtype)].kind == "kivi":
        size = -(-size // group_size) * group_size
    return size


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, group_size: int = DEFAULT_QUANT_GROUP_SIZE) -> int:
    """2 (K and V) x layers x kv_heads x (head_dim x bytes per element + the format's scales)."""
    for name, value in (("layers", num_layers), ("kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    fmt = KV_FORMATS[normalize_kv_dtype(kv_dtype)]
    return math.ceil(2 * num_layers * num_kv_heads * (fmt.data_bytes(head_dim) + fmt.meta_bytes(head_dim, group_size)))


def scale_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, group_size: int = DEFAULT_QUANT_GROUP_SIZE) -> int:
    """The scales' share of bytes_per_token."""
    fmt = KV_FORMATS[normalize_kv_dtype(kv_dtype)]
    return math.ceil(2 * num_layers * num_kv_heads * fmt.meta_bytes(head_dim, group_size))


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
    # quantized formats: KIVI's group size (tokens of a key channel, channels of a value) and the
    # recent tokens int4/int2 keep in full precision; the dtype of those full-precision blocks
    group_size: int = DEFAULT_QUANT_GROUP_SIZE
    residual: int = DEFAULT_QUANT_RESIDUAL
    residual_dtype: str = "float32"
    # int4/int2: a sequence's first block stays in full precision (its attention sink)
    sink_block: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", normalize_kv_dtype(self.kv_dtype))
        object.__setattr__(self, "residual_dtype", normalize_kv_dtype(self.residual_dtype))
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)
        if self.format.kind == "kivi":
            if self.group_size <= 0 or self.block_size % self.group_size:
                raise ValueError(f"{self.kv_dtype} needs --block-size ({self.block_size}) to be a multiple of "
                                 f"--kv-quant-group-size ({self.group_size})")  # fmt: skip
            if self.head_dim % self.value_group:
                raise ValueError(f"{self.kv_dtype} needs head_dim ({self.head_dim}) to be a multiple of the group size ({self.group_size})")
        if not 0 <= self.residual <= MAX_KV_QUANT_RESIDUAL:
            raise ValueError(f"kv_quant_residual must be 0 to {MAX_KV_QUANT_RESIDUAL} tokens, got {self.residual}")
        if KV_FORMATS[self.residual_dtype].kind != "float":
            raise ValueError("the residual blocks hold a float format")
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

    # ------------------------------------------------------------------ format
    @property
    def format(self) -> KVFormat:
        return KV_FORMATS[self.kv_dtype]

    @property
    def value_group(self) -> int:
        """Channels per value group (KIVI): the group size, or the whole head when it is smaller."""
        return self.group_size if self.head_dim >= self.group_size else self.head_dim

    @property
    def quant_residual(self) -> int:
        """Recent tokens int4/int2 keep in full precision before quantizing them (int8 and fp8
        quantize each token as it is stored)."""
        return self.residual if self.format.kind == "kivi" else 0

    @property
    def quant_sink_blocks(self) -> int:
        """Leading blocks of a sequence int4/int2 never quantize: the first, where the attention
        sink (the first token, with outlier keys) would set its key group's scales."""
        return int(self.sink_block and self.format.kind == "kivi")

    def blocks_read_quantized(self, position: int) -> int:
        """int4/int2: a token at `position` reads its sequence's blocks below this index quantized
        (but the sink blocks): those wholly older than the residual window. The pool quantizes them
        once that many tokens are computed (kv/manager.py); attention/kivi_reads.py gives every
        row the same, however its sequence was chunked, batched or resumed."""
        return max(0, position - self.quant_residual) // self.block_size

    def meta_bytes_per_token(self, which: str) -> float:
        """Scale bytes one token takes per KV head, for `which` of "key", "value"."""
        fmt = self.format
        if fmt.kind == "kivi":
            return 2.0 * self.head_dim / (self.group_size if which == "key" else self.value_group)
        return fmt.meta_bytes(self.head_dim, self.group_size)

    # ------------------------------------------------------------------ bytes
    @property
    def record_bytes(self) -> int:
        """One layer's K (or V) of one block: its values, then their scales."""
        data = self.block_size * self.num_kv_heads * self.format.data_bytes(self.head_dim)
        meta = max(self.meta_bytes_per_token("key"), self.meta_bytes_per_token("value"))
        return math.ceil(data + self.block_size * self.num_kv_heads * meta)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, scales included."""
        return math.ceil(self.bytes_per_block * self.num_layers / self.layers_per_group / self.block_size)

    @property
    def scale_bytes_per_token(self) -> int:
        meta = self.meta_bytes_per_token("key") + self.meta_bytes_per_token("value")
        return math.ceil(self.num_layers * self.num_kv_heads * meta)

    @property
    def bytes_per_token_per_layer(self) -> float:
        return self.bytes_per_token / self.num_layers

    @property
    def bytes_per_block(self) -> int:
        """One block of one group: block_size tokens of layers_per_group layers, K and V."""
        return 2 * self.layers_per_group * self.record_bytes

    @property
    def residual_block_bytes(self) -> int:
        """One full-precision block of one group (quantized formats keep recent tokens in those)."""
        return 2 * self.layers_per_group * self.block_size * self.num_kv_heads * self.head_dim * KV_FORMATS[self.residual_dtype].bits // 8

    @functools.cached_property
    def residual_units(self) -> int:
        """Quantized blocks' room one full-precision block of a KIVI cache (int4, int2) takes: both
        kinds are carved from the same bytes (kv/arena.py), a full-precision block from that many
        consecutive quantized ones. 0 for other formats."""
        if self.format.kind != "kivi":
            return 0
        return -(-self.residual_block_bytes // self.bytes_per_block)

    def residual_blocks_held(self, num_tokens: int) -> int:
        """Full-precision blocks of every group a KIVI sequence with num_tokens computed holds between
        steps: its sink block, the blocks of its residual window and the partly filled one."""
        if self.format.kind != "kivi":
            return 0
        bs, recent = self.block_size, blocks_for_tokens(self.quant_residual, self.block_size) + 1
        return sum(min(g.blocks_held(num_tokens, bs), recent + self.quant_sink_blocks) for g in self.groups)

    def residual_peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Full-precision blocks of every group a KIVI sequence holds at most during a step on its way
        to num_tokens: a step's new tokens are stored in full precision and quantized after it."""
        if self.format.kind != "kivi":
            return 0
        bs = self.block_size
        recent = blocks_for_tokens(self.quant_residual, bs) + blocks_for_tokens(min(chunk, num_tokens), bs) + 1 + self.quant_sink_blocks
        return sum(min(g.peak_blocks(num_tokens, bs, chunk), recent) for g in self.groups)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type of the float blocks: all of a float cache's, a KIVI cache's residual ones."""
        return KV_FORMATS[self.kv_dtype if not self.format.quantized else self.residual_dtype].torch_dtype

    def num_blocks_for_memory(self, memory_bytes: float) -> int:
        """Blocks memory_bytes holds (a KIVI cache's full-precision blocks are taken from them as needed)."""
        return int(memory_bytes // self.bytes_per_block)

    # ------------------------------------------------------------------ one sequence's needs
    def blocks_held(self, num_tokens: int) -> int:
        """Blocks of every group a sequence with num_tokens computed holds between steps (a KIVI
        cache's full-precision ones counted as the quantized blocks they take)."""
        whole = sum(g.blocks_held(num_tokens, self.block_size) for g in self.groups)
        return whole + max(self.residual_units - 1, 0) * self.residual_blocks_held(num_tokens)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Blocks of every group a sequence needs at most on its way to num_tokens, `chunk` tokens per
        step at most; a KIVI cache counts a full-precision block as the quantized blocks it takes."""
        whole = sum(g.peak_blocks(num_tokens, self.block_size, chunk) for g in self.groups)
        return whole + max(self.residual_units - 1, 0) * self.residual_peak_blocks(num_tokens, chunk)

    def min_blocks(self, num_tokens: int, chunk: int) -> int:
        """The smallest pool that holds one sequence of num_tokens at its peak: its blocks (a KIVI
        cache's full-precision ones at the room they take), and for KIVI enough whole chunks of
        `residual_units` blocks for its full-precision blocks at once."""
        return max(self.peak_blocks(num_tokens, chunk), self.residual_peak_blocks(num_tokens, chunk) * self.residual_units)

    def fits(self, num_tokens: int, num_blocks: int, chunk: int) -> bool:
        return self.min_blocks(num_tokens, chunk) <= num_blocks

    def max_tokens(self, num_blocks: int, chunk: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose peak need fits num_blocks; 0 if none does."""
        if not self.fits(1, num_blocks, chunk):
            return 0
        low, high = 1, limit
        while low < high:
            mid = (low + high + 1) // 2
            if self.fits(mid, num_blocks, chunk):
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
