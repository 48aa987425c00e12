"""Native CPU kernels (compiled on first use) with a torch-only fallback decided once per process."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kernels import args
from kvserve.kernels.build import cpu_flags, load_kernels

logger = logging.getLogger(__name__)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def cpu_kernels_available() -> bool:
    return load_kernels() is not None


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in _DTYPE_CODES and cpu_kernels_available()


KV_FORMAT_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3, "fp8_e4m3": 4, "fp8_e5m2": 5, "int4": 6, "int2": 7}
NO_RESIDUAL = 1 << 62


def kv_view(
    spec, key: torch.Tensor | None, value: torch.Tensor | None, key_records: torch.Tensor | None = None,
    value_records: torch.Tensor | None = None, first_residual: int = NO_RESIDUAL,
) -> args.KVView:  # fmt: skip
    """The kernels' view of one layer's K and V (kv/pool.py's layout for `spec`, a KVCacheSpec):
    float blocks key/value [slots, kv_heads, head_dim] (contiguous), and for a quantized format its
    byte records [num_blocks, record_bytes], with a KIVI cache's full-precision blocks key/value
    [blocks, block_size, kv_heads, head_dim] (rows contiguous, any block stride) from block id
    first_residual on. The caller keeps the tensors alive as long as the view."""
    heads, dim, bs = spec.num_kv_heads, spec.head_dim, spec.block_size
    blocked = key_records is not None and key is not None
    for tensor in (key_records, value_records) + (() if blocked else (key, value)):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError("kv_view: the pool's tensors must be contiguous")
    if blocked and any(t is None or t.dim() != 4 or t.stride()[1:] != (heads * dim, dim, 1) or t.stride(0) != key.stride(0) for t in (key, value)):
        raise ValueError("kv_view: full-precision blocks [blocks, block_size, kv_heads, head_dim] with contiguous rows")
    float_stride = (key.stride(0), heads * dim) if blocked else (bs * heads * dim, heads * dim)
    if key_records is None:
        return args.KVView(
            key.data_ptr(), value.data_ptr(), None, None, *float_stride, 0, 0, NO_RESIDUAL, _DTYPE_CODES[key.dtype],
            _DTYPE_CODES[key.dtype], bs, heads, dim, spec.group_size, spec.value_group,
        )  # fmt: skip
    token_bytes = heads * dim * spec.format.bits // 8
    residual = key is not None
    return args.KVView(
        key_records.data_ptr(), value_records.data_ptr(), key.data_ptr() if residual else None,
        value.data_ptr() if residual else None, key_records.shape[1], token_bytes, *(float_stride if residual else (0, 0)),
        first_residual if residual else NO_RESIDUAL, KV_FORMAT_CODES[spec.kv_dtype], _DTYPE_CODES[key.dtype] if residual else 0,
        bs, heads, dim, spec.group_size, spec.value_group,
    )  # fmt: skip


SCALED_KV_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")


def kv_store(
    spec, records: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, head_scales: torch.Tensor | None = None,
    center: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write tokens' K or V x [T, kv_heads, head_dim] (fp32/bf16/fp16) into a scaled format's byte
    records [num_blocks, record_bytes] (kv/pool.py's layout for `spec`, a KVCacheSpec) at slots [T],
    bit for bit what kv/quant.py's encode writes for x.float() - center. head_scales: fp8's
    calibrated per-head scales; center: float32 [kv_heads, head_dim] (a centered cache's keys)."""
    library = _require()
    heads, dim = spec.num_kv_heads, spec.head_dim
    if spec.kv_dtype not in SCALED_KV_FORMATS or x.dim() != 3 or tuple(x.shape[1:]) != (heads, dim) or x.dtype not in _DTYPE_CODES:
        raise ValueError(f"kv_store: tokens [T, {heads}, {dim}] in fp32/bf16/fp16 for an int8 or fp8 cache")
    if x.stride(2) != 1 or x.stride(1) != dim:
        x = x.contiguous()
    slots = slots.to(torch.int64).contiguous()
    if records.dtype != torch.uint8 or not records.is_contiguous() or slots.shape[0] != x.shape[0]:
        raise ValueError("kv_store: contiguous uint8 records and one slot per token")
    scales = head_scales.float().contiguous() if head_scales is not None else None
    if center is not None and (center.dtype != torch.float32 or tuple(center.shape) != (heads, dim) or not center.is_contiguous()):
        raise ValueError(f"kv_store: the center must be a contiguous float32 [{heads}, {dim}] tensor")
    call = args.KVStoreArgs(
        x.data_ptr(), slots.data_ptr(), records.data_ptr(), scales.data_ptr() if scales is not None else None,
        center.data_ptr() if center is not None else None, x.shape[0], x.stride(0),
        records.shape[0], records.shape[1], heads * dim, _DTYPE_CODES[x.dtype], KV_FORMAT_CODES[spec.kv_dtype], spec.block_size, heads, dim, 0,
    )  # fmt: skip
    _check(library.kvserve_kv_store(ctypes.byref(call)), "kv_store")


def paged_decode_attention(
    query: torch.Tensor, kv: args.KVView, block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float, window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, H, D]; kv the layer's view; block_tables [B, nb] int64; kv_lens [B] int64 (cached
    slots, the query's own included). Returns [B, H, D] in the query's dtype (written into
    ``out`` when given, which must be contiguous): each query attends to slots
    max(0, len - window) .. len - 1 of its sequence."""
    library = _require()
    query = query.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    kv_lens = kv_lens.to(torch.int64).contiguous()
    num_seqs, num_heads, head_dim = query.shape
    if head_dim != kv.head_dim or block_tables.shape[0] != num_seqs or kv_lens.shape[0] != num_seqs:
        raise ValueError("paged_decode_attention: query, block tables and lengths disagree with the KV view")
    out = _output_for(query, out)
    call = args.DecodeAttentionArgs(
        out.data_ptr(), query.data_ptr(), ctypes.addressof(kv), block_tables.data_ptr(), kv_lens.data_ptr(), num_seqs,
        block_tables.shape[1], _DTYPE_CODES[query.dtype], num_heads, window or 0, scale,
    )  # fmt: skip
    status = library.kvserve_paged_decode_attention(ctypes.byref(call))
    if status:
        raise ValueError(f"paged_decode_attention: bad arguments (status {status}): a context is empty or longer than its block table")
    return out


def paged_prefill_attention(
    query: torch.Tensor, kv: args.KVView, block_table: torch.Tensor, kv_start: int, scale: float, window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's prefill chunk. query [n, H, D] holds slots kv_start .. kv_start + n - 1,
    whose K/V are already in the pool; block_table [nb] covers every slot up to the chunk's end.
    Causal, with an optional sliding window. Returns [n, H, D] in the query's dtype."""
    library = _require()
    query = query.contiguous()
    block_table = block_table.to(torch.int64).contiguous()
    num_tokens, num_heads, head_dim = query.shape
    if head_dim != kv.head_dim:
        raise ValueError("paged_prefill_attention: the query's head_dim differs from the KV view's")
    out = _output_for(query, out)
    call = args.PrefillAttentionArgs(
        out.data_ptr(), query.data_ptr(), ctypes.addressof(kv), block_table.data_ptr(), block_table.numel(), kv_start, num_tokens,
        _DTYPE_CODES[query.dtype], num_heads, window or 0, scale,
    )  # fmt: skip
    status = library.kvserve_paged_prefill_attention(ctypes.byref(call))
    if status == 2:
        raise ValueError("paged_prefill_attention: the block table does not cover the chunk")
    _check(status, "paged_prefill_attention")
    return out


FLOAT_PACK_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class FloatPackedWeight:
    """A float32 or bf16 weight [n, k] re-laid for kvserve_float_matmul: tiles of 16 rows, k-major
    inside a tile ([n/16][k][16]), in the weight's own dtype."""

    data: torch.Tensor
    n: int
    k: int
    dtype: torch.dtype


def can_pack_float(weight: torch.Tensor) -> bool:
    if weight.dim() != 2 or weight.dtype not in FLOAT_PACK_DTYPES or weight.device.type != "cpu" or weight.numel() == 0:
        return False
    return cpu_kernels_available()


def pack_float_weight(weight: torch.Tensor) -> FloatPackedWeight:
    """Pack a float32 or bf16 [n, k] weight once (the same bytes again, padded to 16 rows)."""
    library = _require()
    if not can_pack_float(weight):
        raise ValueError("pack_float_weight: a non-empty 2-D float32 or bf16 CPU weight")
    weight = weight.detach().contiguous()
    n, k = weight.shape
    data = torch.empty(-(-n // 16) * 16 * k, dtype=weight.dtype)
    status = library.kvserve_pack_float_weight(weight.data_ptr(), _DTYPE_CODES[weight.dtype], n, k, data.data_ptr())
    _check(status, "pack_float_weight")
    return FloatPackedWeight(data, n, k, weight.dtype)


def unpack_float_weight(weight: FloatPackedWeight) -> torch.Tensor:
    """The [n, k] weight back from its packed layout (for a torch fallback)."""
    tiles = weight.data.numel() // (16 * weight.k)
    return weight.data.view(tiles, weight.k, 16).transpose(1, 2).reshape(tiles * 16, weight.k)[: weight.n]


def float_matmul(
    x: torch.Tensor, weight: FloatPackedWeight, out_dtype: torch.dtype | None = None, want_output: bool = True, want_argmax: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, k] (float32 or bf16) @ weight^T with one float32 FMA chain per output, in k order, so a
    row's result does not depend on the other rows: (output [R, n] in out_dtype (x's by default),
    written into `out` when given, or None; row-wise argmax [R] or None)."""
    library = _require()
    if x.dim() != 2 or x.dtype not in FLOAT_PACK_DTYPES or x.shape[1] != weight.k or x.stride(1) != 1 or x.shape[0] == 0:
        raise ValueError(f"float_matmul: x must be float32 or bf16 [rows > 0, {weight.k}] with unit inner stride")
    if x.device.type != "cpu":
        raise ValueError("float_matmul: x must be on the CPU")
    rows = x.shape[0]
    out, argmax, out_args, out_dtype_code = _product_outputs(rows, weight.n, out_dtype or x.dtype, want_output, want_argmax, out)
    ldx = x.stride(0) if rows > 1 else weight.k  # a single row's stride can be anything
    call = args.FloatMatmulArgs(
        weight.data.data_ptr(), x.data_ptr(), *out_args, weight.n, ldx, weight.k, rows, _DTYPE_CODES[weight.dtype], _DTYPE_CODES[x.dtype],
        out_dtype_code, 0,
    )  # fmt: skip
    _check(library.kvserve_float_matmul(ctypes.byref(call)), "float_matmul")
    return out, argmax


# ggml's type codes the GGUF kernel reads, with (values, bytes) per block
GGUF_BLOCKS = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
               "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}  # fmt: skip


@dataclass(frozen=True)
class GgufWeight:
    """A weight [n, k] kept in its GGUF blocks (kvserve_gguf_matmul dequantizes them inside the
    product): `data` holds the file's bytes interleaved by tiles of 16 rows, [ceil(n/16)][blocks
    per row][block bytes][16] (gguf_matmul.cpp), the same size as the file's tensor."""

    data: torch.Tensor  # uint8 [tiles, blocks per row, block bytes, 16]
    type_name: str
    n: int
    k: int

    @property
    def type_code(self) -> int:
        return GGUF_BLOCKS[self.type_name][0]

    @staticmethod
    def row_bytes(type_name: str, k: int) -> int:
        _, values, size = GGUF_BLOCKS[type_name]
        if k % values:
            raise ValueError(f"a {type_name} row holds whole blocks of {values} values; {k} is not a multiple")
        return k // values * size

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def gguf_weight(data: torch.Tensor, type_name: str, n: int, k: int) -> GgufWeight:
    """A GGUF tensor's bytes (n rows of blocks, in the file's order; any shape) as a GgufWeight:
    copied once into the kernel's tile-interleaved layout."""
    if type_name not in GGUF_BLOCKS:
        raise ValueError(f"GGUF type {type_name} is not one the kernels read ({', '.join(GGUF_BLOCKS)})")
    _, values, size = GGUF_BLOCKS[type_name]
    row_bytes = GgufWeight.row_bytes(type_name, k)
    if data.dtype != torch.uint8 or data.numel() != n * row_bytes:
        raise ValueError(f"a {type_name} [{n}, {k}] weight is {n * row_bytes} bytes; got {data.numel()} of {data.dtype}")
    tiles = -(-n // 16)
    rows = data.reshape(n, k // values, size)
    if tiles * 16 != n:
        rows = torch.cat([rows, rows.new_zeros(tiles * 16 - n, k // values, size)])
    interleaved = rows.view(tiles, 16, k // values, size).permute(0, 2, 3, 1).contiguous()
    return GgufWeight(interleaved, type_name, n, k)


def gguf_dequantize(weight: GgufWeight, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (int64, any shape; all rows when None) of the weight as float32 [..., k], each value
    exactly gguf-py's dequantized one."""
    library = _require()
    if ids is None:
        flat, shape = None, (weight.n,)
    else:
        flat, shape = ids.reshape(-1).to(torch.int64).contiguous(), tuple(ids.shape)
    count = weight.n if flat is None else flat.numel()
    out = torch.empty(count, weight.k, dtype=torch.float32)
    if count:
        status = library.kvserve_gguf_dequantize(weight.data.data_ptr(), weight.type_code, weight.n, weight.k,
                                                 None if flat is None else flat.data_ptr(), count, out.data_ptr())  # fmt: skip
        if status == 2:
            raise IndexError(f"gguf_dequantize: row ids must lie in [0, {weight.n})")
        _check(status, "gguf_dequantize")
    return out.reshape(*shape, weight.k)


def gguf_matmul(
    x: torch.Tensor, weight: GgufWeight, out_dtype: torch.dtype | None = None, want_output: bool = True, want_argmax: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, k] (float32 or bf16) @ weight^T on the GGUF blocks, one float32 FMA chain per output in
    k order over the exact dequantized values (so a row's result does not depend on the other
    rows): (output [R, n] in out_dtype (x's by default), or None; row-wise argmax [R] or None).
    `out` may be a column slice of a wider contiguous-row matrix (its row stride is kept)."""
    library = _require()
    if x.dim() != 2 or x.dtype not in FLOAT_PACK_DTYPES or x.shape[1] != weight.k or x.stride(1) != 1 or x.shape[0] == 0:
        raise ValueError(f"gguf_matmul: x must be float32 or bf16 [rows > 0, {weight.k}] with unit inner stride")
    if x.device.type != "cpu":
        raise ValueError("gguf_matmul: x must be on the CPU")
    rows = x.shape[0]
    dtype = out_dtype or x.dtype
    if out is not None:
        if tuple(out.shape) != (rows, weight.n) or out.dtype != dtype or out.stride(1) != 1 or (rows > 1 and out.stride(0) < weight.n):
            raise ValueError(f"gguf_matmul: out must be {dtype} [{rows}, {weight.n}] with unit inner stride")
        ldo = out.stride(0) if rows > 1 else weight.n
        out_ptr = out.data_ptr()
    elif want_output:
        out = torch.empty(rows, weight.n, dtype=dtype)
        ldo, out_ptr = weight.n, out.data_ptr()
    else:
        ldo, out_ptr = weight.n, None
    argmax = torch.empty(rows, dtype=torch.int64) if want_argmax else None
    ldx = x.stride(0) if rows > 1 else weight.k
    call = args.GgufMatmulArgs(
        weight.data.data_ptr(), x.data_ptr(), out_ptr, argmax.data_ptr() if argmax is not None else None, weight.n, ldx, ldo, weight.k,
        rows, weight.type_code, _DTYPE_CODES[x.dtype], _DTYPE_CODES[dtype], 0,
    )  # fmt: skip
    _check(library.kvserve_gguf_matmul(ctypes.byref(call)), "gguf_matmul")
    return out, argmax


@dataclass(frozen=True)
class GgufScreen:
    """A Q8_0 weight's bounds for its int8-screened greedy argmax (gguf_screen.h): per tile of 16
    rows and block of 32 codes the largest |d| * sum |q|, and per tile the largest row L1 norm
    (4 bytes per 512 weights beside the blocks)."""

    weight: GgufWeight
    block_bound: torch.Tensor  # float32 [tiles, k / 32]
    tile_l1: torch.Tensor  # float32 [tiles]


def gguf_screen_available() -> bool:
    library = load_kernels()
    return library is not None and bool(library.kvserve_gguf_screen_available())


def gguf_screen(weight: GgufWeight) -> GgufScreen:
    if weight.type_name != "Q8_0" or not gguf_screen_available():
        raise ValueError("gguf_screen: a Q8_0 weight, on a CPU with AVX512-BF16, VNNI and VBMI")
    tiles = -(-weight.n // 16)
    block_bound = torch.empty(tiles, weight.k // 32)
    tile_l1 = torch.empty(tiles)
    _check(_require().kvserve_gguf_screen_bounds(weight.data.data_ptr(), weight.n, weight.k, block_bound.data_ptr(), tile_l1.data_ptr()), "gguf_screen")
    return GgufScreen(weight, block_bound, tile_l1)


def gguf_screened_argmax(x: torch.Tensor, screen: GgufScreen) -> tuple[torch.Tensor | None, int]:
    """gguf_matmul(x, screen.weight, want_argmax=True)'s argmax [R] of bf16 rows x [R, k], bit for
    bit, screened with int8 dot products on the Q8_0 codes; and how many tiles were recomputed
    exactly. None (nothing computed) for a row outside the screen's range (not finite, |x| > 2^64,
    or a nonzero |x| < 2^-100): take the full product."""
    weight = screen.weight
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != weight.k or x.stride(1) != 1 or x.shape[0] == 0 or not x.is_cpu:
        raise ValueError(f"gguf_screened_argmax: x must be bf16 [rows > 0, {weight.k}] on the CPU with unit inner stride")
    rows = x.shape[0]
    argmax = torch.empty(rows, dtype=torch.int64)
    rescored = ctypes.c_int64(0)
    call = args.GgufMatmulArgs(
        weight.data.data_ptr(), x.data_ptr(), None, argmax.data_ptr(), weight.n, x.stride(0) if rows > 1 else weight.k, weight.n, weight.k,
        rows, weight.type_code, _DTYPE_CODES[x.dtype], 0, 0,
    )  # fmt: skip
    status = _require().kvserve_gguf_screened_argmax(ctypes.byref(call), screen.block_bound.data_ptr(), screen.tile_l1.data_ptr(), ctypes.byref(rescored))
    if status == 3:
        return None, 0
    _check(status, "gguf_screened_argmax")
    return argmax, rescored.value


class GgufProduct:
    """x @ W^T for W a fused projection's parts in GGUF blocks (stacked on the output axis), in one
    kernel call: each part's outputs are gguf_matmul's bits, side by side. The parts' descriptors
    are built once; a call builds only the rows' arguments."""

    def __init__(self, parts: tuple[GgufWeight, ...]) -> None:
        if not parts or any(part.k != parts[0].k for part in parts):
            raise ValueError("GgufProduct: one or more parts sharing k")
        self._library = _require()
        self.parts = parts
        self.k = parts[0].k
        self.n = sum(part.n for part in parts)
        self._parts = (args.GgufPart * len(parts))(*(args.GgufPart(part.data.data_ptr(), part.n, part.type_code, 0) for part in parts))

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, k] (float32 or bf16, unit inner stride, on the CPU) into `out` ([R, n] in out_dtype,
        x's by default, unit inner stride: it may be a column slice) or a new tensor."""
        k, n = self.k, self.n
        if x.dim() != 2 or x.dtype not in FLOAT_PACK_DTYPES or x.shape[1] != k or x.stride(1) != 1 or x.shape[0] == 0 or not x.is_cpu:
            raise ValueError(f"GgufProduct: x must be float32 or bf16 [rows > 0, {k}] on the CPU with unit inner stride")
        rows = x.shape[0]
        dtype = out_dtype or x.dtype
        if out is None:
            out = torch.empty(rows, n, dtype=dtype)
        elif tuple(out.shape) != (rows, n) or out.dtype != dtype or out.stride(1) != 1 or (rows > 1 and out.stride(0) < n):
            raise ValueError(f"GgufProduct: out must be {dtype} [{rows}, {n}] with unit inner stride")
        call = args.GgufMatmulArgs(
            None, x.data_ptr(), out.data_ptr(), None, n, x.stride(0) if rows > 1 else k, out.stride(0) if rows > 1 else n, k, rows, 0,
            _DTYPE_CODES[x.dtype], _DTYPE_CODES[dtype], 0,
        )  # fmt: skip
        _check(self._library.kvserve_gguf_matmul_parts(ctypes.byref(call), self._parts, len(self.parts)), "gguf product")
        return out


@dataclass(frozen=True)
class PackedWeight:
    """A bf16 weight [n, k] re-laid for kvserve_packed_matmul: tiles of 16 rows with k-pairs interleaved."""

    data: torch.Tensor
    n: int
    k: int


def bf16_dot_available() -> bool:
    """The CPU has AVX512-BF16 dot products (and the kernels were built for it)."""
    library = load_kernels()
    return library is not None and bool(library.kvserve_has_bf16_dot())


def cpu_has_amx_bf16() -> bool:
    """The CPU reports AMX bf16 tiles."""
    return "amx_bf16" in cpu_flags()


def can_pack(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 2 == 0 and bf16_dot_available()


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """Pack a bf16 [n, k] weight once (the same bytes again, padded to 16 rows)."""
    library = _require()
    if not can_pack(weight):
        raise ValueError("pack_weight: a 2-D bf16 CPU weight with an even inner size, on a CPU with AVX512-BF16")
    weight = weight.contiguous()
    n, k = weight.shape
    data = torch.empty(-(-n // 16) * 16 * k, dtype=torch.bfloat16)
    _check(library.kvserve_pack_bf16_weight(weight.data_ptr(), n, k, data.data_ptr()), "pack_weight")
    return PackedWeight(data, n, k)


def unpack_weight(weight: PackedWeight) -> torch.Tensor:
    """The bf16 [n, k] weight back from its packed layout (for a torch fallback)."""
    tiles = weight.data.numel() // (16 * weight.k)
    return weight.data.view(tiles, weight.k // 2, 16, 2).permute(0, 2, 1, 3).reshape(tiles * 16, weight.k)[: weight.n]


def packed_matmul(
    x: torch.Tensor, weight: PackedWeight, out_dtype: torch.dtype | None = None, want_output: bool = True, want_argmax: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, k] (bf16) @ weight^T with bf16 dot products accumulated in float32: (output [R, n] in
    out_dtype (bf16 by default), written into `out` when given, or None; row-wise argmax [R] or None)."""
    library = _require()
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != weight.k or x.stride(1) != 1 or x.shape[0] == 0:
        raise ValueError(f"packed_matmul: x must be bf16 [rows > 0, {weight.k}] with unit inner stride")
    rows = x.shape[0]
    out, argmax, out_args, out_dtype_code = _product_outputs(rows, weight.n, out_dtype or torch.bfloat16, want_output, want_argmax, out)
    call = args.PackedMatmulArgs(weight.data.data_ptr(), x.data_ptr(), *out_args, weight.n, x.stride(0), weight.k, rows, out_dtype_code, 0)
    status = library.kvserve_packed_matmul(ctypes.byref(call))
    _check(status, "packed_matmul")
    return out, argmax


@dataclass(frozen=True)
class AmxWeight:
    """A bf16 weight [n, k] re-laid for kvserve_amx_matmul: AMX B tiles (amx_matmul.cpp),
    [ceil(n/16)][ceil(k/32)][16 k-pairs][16 columns][2], zero-padded."""

    data: torch.Tensor
    n: int
    k: int


def amx_available(library=None) -> bool:
    """The AMX kernel can run: the library was built with it, the CPU has AMX-BF16 and Linux granted
    this process tile data (kvserve_amx_available), and KVSERVE_DISABLE_AMX is not "1". `library`:
    the kernel library to ask (the production one by default; tests pass the emulated build)."""
    if os.environ.get("KVSERVE_DISABLE_AMX") == "1":
        return False
    library = library if library is not None else load_kernels()
    return library is not None and bool(library.kvserve_amx_compiled()) and bool(library.kvserve_amx_available())


@functools.lru_cache(maxsize=None)
def amx_ready() -> bool:
    """amx_available(), and the kernel's product of a small awkward shape matches a float64
    reference here (checked once per process): the engine's projections and bf16 attention then
    run on AMX tiles (the attention kernel is told the outcome). Otherwise they take the
    AVX512-BF16 kernels, with one log line saying why."""
    ready = _amx_self_check()
    library = load_kernels()
    if library is not None:
        library.kvserve_set_attention_amx(int(ready))
    return ready


def _amx_self_check() -> bool:
    if not amx_available():
        if cpu_has_amx_bf16() and os.environ.get("KVSERVE_DISABLE_AMX") != "1":
            logger.warning("this CPU has AMX but its tiles cannot be used here; projections and attention take the AVX512-BF16 kernels")
        return False
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(19, 72, generator=g).bfloat16(), torch.randn(37, 72, generator=g).bfloat16()
    out, argmax = amx_matmul(x, amx_pack_weight(weight), out_dtype=torch.float32, want_argmax=True)
    expected = x.double() @ weight.double().t()
    if (out.double() - expected).abs().max().item() > 1e-3 * expected.abs().max().item() or not torch.equal(argmax, out.argmax(1)):
        logger.warning("the AMX kernel's self-check failed on this CPU; projections and attention take the AVX512-BF16 kernels")
        return False
    return True


def amx_unpack_weight(weight: AmxWeight) -> torch.Tensor:
    """The bf16 [n, k] weight back from its AMX layout (for a torch fallback)."""
    col_tiles, k_tiles = -(-weight.n // 16), -(-weight.k // 32)
    tiles = weight.data.view(col_tiles, k_tiles, 16, 16, 2).permute(0, 3, 1, 2, 4)
    return tiles.reshape(col_tiles * 16, k_tiles * 32)[: weight.n, : weight.k]


def amx_pack_weight(weight: torch.Tensor, library=None) -> AmxWeight:
    """Pack a bf16 [n, k] weight once into AMX B tiles (plain C++: runs on any CPU)."""
    library = library if library is not None else _require()
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or 0 in weight.shape:
        raise ValueError("amx_pack_weight: a non-empty 2-D bf16 CPU weight")
    weight = weight.contiguous()
    n, k = weight.shape
    data = torch.empty(-(-n // 16) * -(-k // 32) * 16 * 32, dtype=torch.bfloat16)
    _check(library.kvserve_amx_pack_weight(weight.data_ptr(), n, k, data.data_ptr()), "amx_pack_weight")
    return AmxWeight(data, n, k)


def amx_matmul(
    x: torch.Tensor, weight: AmxWeight, out_dtype: torch.dtype | None = None, want_output: bool = True, want_argmax: bool = False,
    out: torch.Tensor | None = None, library=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, k] (bf16) @ weight^T on AMX tiles, accumulated in float32: (output [R, n] in out_dtype
    (float32 or bf16, bf16 by default), written into `out` when given, or None; row-wise argmax [R]
    or None). A row's result does not depend on the other rows (amx_matmul.cpp)."""
    library = library if library is not None else _require()
    shape_ok = x.dim() == 2 and x.shape[0] > 0 and x.shape[1] == weight.k and x.stride(1) == 1
    if not shape_ok or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"amx_matmul: x must be bf16 [rows > 0, {weight.k}] with unit inner stride")
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("amx_matmul: the output is float32 or bf16")
    rows = x.shape[0]
    out, argmax, out_args, out_dtype_code = _product_outputs(rows, weight.n, out_dtype, want_output, want_argmax, out)
    ldx = x.stride(0) if rows > 1 else weight.k  # one row's stride can be anything
    call = args.AmxMatmulArgs(weight.data.data_ptr(), x.data_ptr(), *out_args, weight.n, ldx, weight.k, rows, out_dtype_code, 0)
    status = library.kvserve_amx_matmul(ctypes.byref(call))
    if status == 2:
        raise RuntimeError("amx_matmul: AMX tiles are not available here (see amx_available())")
    _check(status, "amx_matmul")
    return out, argmax


@dataclass(frozen=True)
class ScreenedWeight:
    """An lm_head kept for exact greedy argmax by int8 screening (see screened_argmax.cpp): the bf16
    packed weight for the exact rescoring plus int8 rows with their scales and error bounds."""

    bf16: PackedWeight | AmxWeight  # what the full logits are computed with (the rescoring matches it bit for bit)
    int8: torch.Tensor  # uint8 (q + 128) [tiles * 16 * k], laid out [tile][k/4][16][4]
    row_scale: torch.Tensor  # [tiles * 16]
    row_error: torch.Tensor  # [tiles * 16]: max |w - s q| over the row
    row_abs_q: torch.Tensor  # [tiles, groups, 16]: s * sum |q| over each group of dims
    tile_abs_q: torch.Tensor  # [tiles, groups]: the max over the tile's rows
    tile_error: torch.Tensor  # [tiles]
    group: int
    max_scale: float
    max_abs: float

    @property
    def bf16_layout(self) -> int:
        """ScreenedArgmaxArgs.bf16_layout: 1 for AMX B tiles, 0 for packed_matmul's layout."""
        return 1 if isinstance(self.bf16, AmxWeight) else 0


def int8_screen_available() -> bool:
    library = load_kernels()
    return library is not None and bool(library.kvserve_has_int8_screen())


def screen_group(k: int) -> int | None:
    """Dims per quantization group of the hidden state: 64 where it divides k (measured best here)."""
    return next((g for g in (64, 32, 16, 8, 4) if k % g == 0), None)


def screen_weight(packed: PackedWeight | AmxWeight, weight: torch.Tensor) -> ScreenedWeight:
    """Quantize a bf16 [n, k] lm_head to int8 for screening (adds n * k bytes). `packed` is what the
    full logits are computed with (packed_matmul's weight, or amx_matmul's with k % 32 == 0): the
    screen's exact rescoring gives its bits."""
    library = _require()
    group = screen_group(packed.k)
    if not int8_screen_available() or group is None or weight.dtype != torch.bfloat16 or tuple(weight.shape) != (packed.n, packed.k):
        raise ValueError("screen_weight: a bf16 [n, k] weight with k % 4 == 0, on a CPU with AVX512-VNNI and BF16")
    if isinstance(packed, AmxWeight) and packed.k % 32:
        raise ValueError("screen_weight: an AMX-packed weight needs k % 32 == 0")
    weight = weight.contiguous()
    n, k = weight.shape
    tiles = -(-n // 16)
    groups = k // group
    int8 = torch.empty(tiles * 16 * k, dtype=torch.uint8)
    row_scale = torch.empty(tiles * 16)
    row_error = torch.empty(tiles * 16)
    row_abs_q = torch.empty(tiles, groups, 16)
    _check(library.kvserve_pack_int8_weight(
        weight.data_ptr(), n, k, group, int8.data_ptr(), row_scale.data_ptr(), row_error.data_ptr(), row_abs_q.data_ptr(),
    ), "screen_weight")  # fmt: skip
    return ScreenedWeight(
        packed, int8, row_scale, row_error, row_abs_q, row_abs_q.amax(2), row_error.view(tiles, 16).amax(1), group,
        float(row_scale.max()), float(weight.detach().abs().max()),
    )  # fmt: skip


def _screen_inputs(x: torch.Tensor, weight: ScreenedWeight) -> tuple[torch.Tensor, ...]:
    """The hidden rows quantized for the int8 screen, with their error terms (screened_argmax.cpp):
    (xq, group_scale, delta, correction, l1, slack, tile_bound)."""
    k = weight.bf16.k
    rows, group = x.shape[0], weight.group
    exact = x.double().view(rows, k // group, group)
    scale = exact.abs().amax(2) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.round(exact / scale[:, :, None]).clamp(-127, 127)
    delta = (exact - scale[:, :, None] * quantized).abs().amax(2).float()
    correction = (128 * (scale * quantized.sum(2)).sum(1)).float()
    l1 = x.float().abs().sum(1)
    # float rounding: of the int8 approximation's group sums, and (twice) of the exact bf16 dot products
    slack = 2.0**-20 * weight.max_scale * scale.sum(1).float() * group * 255 * 127 + 1e-4 * weight.max_abs * l1
    tile_bound = (delta @ weight.tile_abs_q.t() + l1[:, None] * weight.tile_error[None, :]) * 1.0011 + slack[:, None]
    xq = quantized.to(torch.int8).view(rows, k)
    group_scale = scale.float()
    slack, tile_bound = slack.contiguous(), tile_bound.contiguous()
    return xq, group_scale, delta.contiguous(), correction.contiguous(), l1.contiguous(), slack, tile_bound


def screened_sample(
    x: torch.Tensor, weight: ScreenedWeight, rows: np.ndarray, penalty_ids: np.ndarray, penalty_counts: np.ndarray,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens kernels.sample would draw from the logits x @ weight^T, found from the int8 screen
    and a few exactly computed tiles (screened_sampler.cpp); -1 where a row needs the full logits.
    rows: SAMPLER_ROW_DTYPE, temperature > 0 and no logprobs. scratch: float32 [>= R, 2 * ceil(n/16)*16],
    reused across calls. Returns (tokens [R], tiles rescored per row [R])."""
    library = _require()
    k, n = weight.bf16.k, weight.bf16.n
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != k or x.shape[0] == 0:
        raise ValueError(f"screened_sample: x must be bf16 [rows > 0, {k}]")
    count = x.shape[0]
    if rows.dtype != SAMPLER_ROW_DTYPE or rows.shape != (count,):
        raise ValueError(f"screened_sample: rows must be a SAMPLER_ROW_DTYPE array of {count} entries")
    width = -(-n // 16) * 16 * 2  # approximations, then their bounds
    if scratch is None or scratch.shape[0] < count or scratch.shape[1] != width or scratch.dtype != torch.float32:
        scratch = torch.empty(count, width)
    x = x.contiguous()
    xq, group_scale, delta, correction, l1, slack, tile_bound = _screen_inputs(x, weight)
    rows = np.ascontiguousarray(rows)
    penalty_ids = np.ascontiguousarray(penalty_ids, dtype=np.int64)
    penalty_counts = np.ascontiguousarray(penalty_counts, dtype=np.int32)
    tokens = torch.empty(count, dtype=torch.int64)
    rescored = torch.empty(count, dtype=torch.int64)
    screen = args.ScreenedArgmaxArgs(
        weight.int8.data_ptr(), weight.row_scale.data_ptr(), weight.row_error.data_ptr(), weight.row_abs_q.data_ptr(),
        weight.bf16.data.data_ptr(), xq.data_ptr(), group_scale.data_ptr(), delta.data_ptr(), correction.data_ptr(), l1.data_ptr(),
        slack.data_ptr(), tile_bound.data_ptr(), x.data_ptr(), None, rescored.data_ptr(), n, k, k, k, weight.group, count, weight.bf16_layout,
    )  # fmt: skip
    sample_args = args.SamplerArgs(
        scratch.data_ptr(), width, n, count, rows.ctypes.data, penalty_ids.ctypes.data if penalty_ids.size else None,
        penalty_counts.ctypes.data if penalty_counts.size else None, tokens.data_ptr(), None, None, None,
    )  # fmt: skip
    _check(library.kvserve_screened_sample(ctypes.byref(screen), ctypes.byref(sample_args)), "screened_sample")
    return tokens, rescored


def screened_argmax(x: torch.Tensor, weight: ScreenedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise argmax of x @ weight^T, bit-identical to packed_matmul's (amx_matmul's for an AMX-packed
    weight), from an int8 screen and an
    exact bf16 rescoring of the tiles that can still win. Returns (argmax [R], tiles rescored per row [R]).
    x must be finite bf16 [R, k]."""
    library = _require()
    k = weight.bf16.k
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != k or x.shape[0] == 0:
        raise ValueError(f"screened_argmax: x must be bf16 [rows > 0, {k}]")
    x = x.contiguous()
    rows = x.shape[0]
    xq, group_scale, delta, correction, l1, slack, tile_bound = _screen_inputs(x, weight)
    argmax = torch.empty(rows, dtype=torch.int64)
    rescored = torch.empty(rows, dtype=torch.int64)
    call = args.ScreenedArgmaxArgs(
        weight.int8.data_ptr(), weight.row_scale.data_ptr(), weight.row_error.data_ptr(), weight.row_abs_q.data_ptr(),
        weight.bf16.data.data_ptr(), xq.data_ptr(), group_scale.data_ptr(), delta.data_ptr(), correction.data_ptr(), l1.data_ptr(),
        slack.data_ptr(), tile_bound.data_ptr(), x.data_ptr(), argmax.data_ptr(), rescored.data_ptr(), weight.bf16.n, k, k, k,
        weight.group, rows, weight.bf16_layout,
    )  # fmt: skip
    status = library.kvserve_screened_argmax(ctypes.byref(call))
    _check(status, "screened_argmax")
    return argmax, rescored


def _product_outputs(
    rows: int, n: int, dtype: torch.dtype, want_output: bool, want_argmax: bool, out: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple, int]:
    """The output [rows, n] and row-wise argmax [rows] a product kernel fills (None where not
    wanted), their pointers (out, argmax) and the output's dtype code. `out`: a contiguous
    [rows, n] tensor of `dtype` to write into instead of a new one (a fresh 64 x 262K float32
    output costs ~30 ms of page faults on every decode step)."""
    if out is not None and (tuple(out.shape) != (rows, n) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"the output must be a contiguous {dtype} [{rows}, {n}] tensor")
    if want_output and out is None:
        out = torch.empty(rows, n, dtype=dtype)
    elif not want_output:
        out = None
    argmax = torch.empty(rows, dtype=torch.int64) if want_argmax else None
    pointers = (out.data_ptr() if out is not None else None, argmax.data_ptr() if argmax is not None else None)
    return out, argmax, pointers, _DTYPE_CODES[dtype] if out is not None else 0


def _output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(query)
    if not out.is_contiguous() or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must be a contiguous tensor shaped and typed like the query")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_after_cast: bool) -> torch.Tensor:
    """RMS norm of the rows of x [..., dim] (last dim contiguous, rows evenly strided) with a float32 weight."""
    library = _require()
    dim = x.shape[-1]
    rows2d = x.reshape(-1, dim) if x.dim() != 2 else x
    if rows2d.stride(-1) != 1:
        raise ValueError("rms_norm: the last dimension must be contiguous")
    out = torch.empty(rows2d.shape, dtype=x.dtype, device=x.device)
    call = args.RmsNormArgs(
        out.data_ptr(), rows2d.data_ptr(), _float_weight(weight).data_ptr(), rows2d.stride(0), rows2d.shape[0], _DTYPE_CODES[x.dtype],
        dim, eps, int(scale_after_cast),
    )  # fmt: skip
    _check(library.kvserve_rms_norm(ctypes.byref(call)), "rms_norm")
    return out.view(x.shape)


def add_rms_norm(
    residual: torch.Tensor, addend: torch.Tensor, addend_weight: torch.Tensor | None, weight: torch.Tensor | None, eps: float, scale_after_cast: bool
) -> torch.Tensor | None:
    """In place: residual += (norm(addend) * addend_weight if addend_weight is given else addend);
    returns norm(residual) * weight, or None without a weight. residual, addend: contiguous [rows, dim]."""
    library = _require()
    if not (residual.is_contiguous() and addend.is_contiguous()) or residual.shape != addend.shape or residual.dtype != addend.dtype:
        raise ValueError("add_rms_norm: residual and addend must be contiguous, of one shape and dtype")
    rows, dim = residual.shape
    out = torch.empty_like(residual) if weight is not None else None
    call = args.AddRmsNormArgs(
        out.data_ptr() if out is not None else residual.data_ptr(), residual.data_ptr(), addend.data_ptr(),
        _float_weight(addend_weight).data_ptr() if addend_weight is not None else None,
        _float_weight(weight).data_ptr() if weight is not None else None, rows, _DTYPE_CODES[residual.dtype], dim, eps,
        int(scale_after_cast),
    )  # fmt: skip
    _check(library.kvserve_add_rms_norm(ctypes.byref(call)), "add_rms_norm")
    return out


def qk_norm_rope(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    eps: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the fused QKV output [T, width] (q heads, then k heads, then v): normed (optional) and
    rotated q [T, H, D] and k [T, KVH, D], both contiguous."""
    library = _require()
    tokens = qkv.shape[0]
    if qkv.stride(1) != 1 or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("qk_norm_rope: qkv rows must be contiguous and the rotary tables float32")
    if cos.shape[-1] != head_dim // 2 or sin.shape != cos.shape:
        raise ValueError(f"qk_norm_rope: the rotary tables are [positions, head_dim / 2 = {head_dim // 2}], got {tuple(cos.shape)}")
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype)
    positions = positions.to(torch.int64).contiguous()
    call = args.QkNormRopeArgs(
        q.data_ptr(), k.data_ptr(), qkv.data_ptr(), _float_weight(q_weight).data_ptr() if q_weight is not None else None,
        _float_weight(k_weight).data_ptr() if k_weight is not None else None, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        tokens, qkv.stride(0), _DTYPE_CODES[qkv.dtype], num_heads, num_kv_heads, head_dim, eps, 0,
    )  # fmt: skip
    _check(library.kvserve_qk_norm_rope(ctypes.byref(call)), "qk_norm_rope")
    return q, k


class Hadamard:
    """Each head vector of 1-3 tensors [T, heads, D] times R = diag(signs) H / sqrt(D) (R^T when
    inverse), by the fast Walsh-Hadamard transform in float32 (hadamard.cpp). Called twice per
    layer and step, so the argument struct is built once (one caller at a time: the engine's step)."""

    def __init__(self, signs: torch.Tensor, scale: float) -> None:
        self._library = _require()
        self.signs = signs.float().contiguous()
        self.dim = int(signs.shape[0])
        self.scale = scale
        self._call = args.HadamardArgs()
        self._call.signs, self._call.scale, self._call.dim = self.signs.data_ptr(), scale, self.dim

    def fits(self, xs: tuple[torch.Tensor, ...]) -> bool:
        """1-3 CPU tensors [T, heads, D] of one float dtype and T, each head's dims contiguous and heads packed."""
        if not 0 < len(xs) <= 3:
            return False
        dtype, tokens, dim = xs[0].dtype, xs[0].shape[0], self.dim
        for x in xs:
            shape, stride = x.shape, x.stride()
            if len(shape) != 3 or shape[0] != tokens or shape[2] != dim or stride[2] != 1 or stride[1] != dim:
                return False
            if x.dtype != dtype or not x.is_cpu:
                return False
        return dtype in _DTYPE_CODES

    def __call__(self, xs: tuple[torch.Tensor, ...], inverse: bool, in_place: bool = False) -> tuple[torch.Tensor, ...]:
        """The rotated tensors: new contiguous ones, or xs themselves, overwritten, when in_place."""
        if not self.fits(xs):
            raise ValueError("hadamard: 1-3 CPU tensors [T, heads, D] of one dtype, heads packed")
        return self.run(xs, inverse, in_place)

    def run(self, xs: tuple[torch.Tensor, ...], inverse: bool, in_place: bool = False) -> tuple[torch.Tensor, ...]:
        """__call__ for tensors fits() has already accepted (the per-layer path asks once)."""
        call = self._call
        outs = xs if in_place else tuple(torch.empty(x.shape, dtype=x.dtype) for x in xs)
        for i, x in enumerate(xs):
            out, row = outs[i], x.shape[1] * self.dim
            # a size-1 dim's stride can be anything; one token's rows are packed whatever it says
            call.out[i], call.x[i], call.heads[i] = out.data_ptr(), x.data_ptr(), x.shape[1]
            call.x_stride[i], call.out_stride[i] = (x.stride(0), out.stride(0)) if x.shape[0] > 1 else (row, row)
        call.count, call.tokens, call.dtype, call.inverse = len(xs), xs[0].shape[0], _DTYPE_CODES[xs[0].dtype], int(inverse)
        _check(self._library.kvserve_hadamard(ctypes.byref(call)), "hadamard")
        return outs


ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up [rows, 2 * inter] (contiguous) -> [rows, inter]."""
    library = _require()
    if not gate_up.is_contiguous():
        raise ValueError("gated_activation: gate_up must be contiguous")
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    call = args.GatedActivationArgs(out.data_ptr(), gate_up.data_ptr(), rows, width // 2, _DTYPE_CODES[gate_up.dtype], ACTIVATIONS[activation])
    _check(library.kvserve_gated_activation(ctypes.byref(call)), "gated_activation")
    return out


SAMPLER_ROW_DTYPE = np.dtype(args.SamplerRow)
MAX_LOGPROBS = 20


@dataclass
class SampledRows:
    tokens: torch.Tensor  # [rows] int64
    token_logprobs: torch.Tensor  # [rows] float32: raw logprob of each drawn token (rows that asked)
    top_ids: torch.Tensor  # [rows, 20] int64
    top_logprobs: torch.Tensor  # [rows, 20] float32


def sample(logits: torch.Tensor, rows: np.ndarray, penalty_ids: np.ndarray, penalty_counts: np.ndarray) -> SampledRows:
    """Draw one token per row of float32 logits [R, V] (modified in place: penalties) with the
    per-row parameters ``rows`` (a SAMPLER_ROW_DTYPE array); see sampler.cpp."""
    library = _require()
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
        raise ValueError("sample: logits must be float32 CPU [rows, vocab] with contiguous rows")
    count = logits.shape[0]
    if rows.dtype != SAMPLER_ROW_DTYPE or rows.shape != (count,):
        raise ValueError(f"sample: rows must be a SAMPLER_ROW_DTYPE array of {count} entries")
    rows = np.ascontiguousarray(rows)
    penalty_ids = np.ascontiguousarray(penalty_ids, dtype=np.int64)
    penalty_counts = np.ascontiguousarray(penalty_counts, dtype=np.int32)
    out = SampledRows(
        torch.empty(count, dtype=torch.int64), torch.zeros(count), torch.zeros(count, MAX_LOGPROBS, dtype=torch.int64),
        torch.zeros(count, MAX_LOGPROBS),
    )  # fmt: skip
    call = args.SamplerArgs(
        logits.data_ptr(), logits.stride(0), logits.shape[1], count, rows.ctypes.data,
        penalty_ids.ctypes.data if penalty_ids.size else None, penalty_counts.ctypes.data if penalty_counts.size else None,
        out.tokens.data_ptr(), out.token_logprobs.data_ptr(), out.top_ids.data_ptr(), out.top_logprobs.data_ptr(),
    )  # fmt: skip
    _check(library.kvserve_sample(ctypes.byref(call)), "sample")
    return out


def token_uniforms(seed: int, position: int, n: int) -> np.ndarray:
    """The native kernels' uniform of tokens 0 .. n-1 for (seed, position) (see gumbel.h)."""
    out = np.empty(n, dtype=np.float64)
    _check(_require().kvserve_token_uniforms(seed, position, n, out.ctypes.data), "token_uniforms")
    return out


def _require():
    library = load_kernels()
    if library is None:
        raise RuntimeError("the CPU kernels are not built; use the torch ops")
    return library


def _float_weight(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError("norm weights must be contiguous float32")
    return weight


def _check(status: int, name: str) -> None:
    if status:
        raise ValueError(f"{name}: bad arguments (status {status})")
