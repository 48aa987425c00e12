"""Paged attention over the KV pool, read in place through block tables (paged_attention.cpp):
the layer's KV view, and the decode and prefill kernels."""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels import args
from kvserve.kernels.kv_formats import KV_FORMAT_CODES
from kvserve.kernels.library import _DTYPE_CODES, _check, _require

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


def _output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(query)
    if not out.is_contiguous() or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must be a contiguous tensor shaped and typed like the query")
    return out
