"""Native CPU kernels (compiled on first use) with a torch-only fallback decided once per process."""

from __future__ import annotations

import torch

from kvserve.kernels.build import load_kernels

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def cpu_kernels_available() -> bool:
    return load_kernels() is not None


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in _DTYPE_CODES and cpu_kernels_available()


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, H, D]; key/value cache [slots, KVH, D]; block_tables [B, nb] int64; context_lens [B] int64.

    Returns [B, H, D] in the query's dtype (written into ``out`` when given, which must be contiguous): each query (the last token of its sequence) attends to
    positions max(0, len - window) .. len - 1 of its context.
    """
    library = load_kernels()
    if library is None:
        raise RuntimeError("the CPU kernels are not built; use the torch attention path")
    query = query.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int64).contiguous()
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key and value caches must be contiguous")
    if key_cache.dtype != value_cache.dtype or key_cache.shape[-1] != head_dim:
        raise ValueError("key/value cache dtype or head_dim does not match the query")
    if out is None:
        out = torch.empty_like(query)
    elif not out.is_contiguous() or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must be a contiguous tensor shaped and typed like the query")
    status = library.kvserve_paged_decode_attention(
        out.data_ptr(), query.data_ptr(), _DTYPE_CODES[query.dtype],
        key_cache.data_ptr(), value_cache.data_ptr(), _DTYPE_CODES[key_cache.dtype],
        block_tables.data_ptr(), context_lens.data_ptr(),
        num_seqs, block_tables.shape[1], num_heads, num_kv_heads, head_dim, block_size,
        window or 0, scale,
    )  # fmt: skip
    if status:
        raise ValueError(f"paged_decode_attention: bad arguments (status {status}): a context is empty or longer than its block table")
    return out
