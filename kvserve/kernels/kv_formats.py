"""The KV cache's formats as the kernels know them (kv_formats.h), and the store kernel of the
scaled ones (kv_store.cpp)."""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels import args
from kvserve.kernels.library import _DTYPE_CODES, _check, _require

KV_FORMAT_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3, "fp8_e4m3": 4, "fp8_e5m2": 5, "int4": 6, "int2": 7}


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
