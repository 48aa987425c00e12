"""Paged attention over the KV pool, driven by block-table-derived slot ids.

A step's tokens are flattened: decode tokens first (one per sequence), then each prefill chunk.
The runner turns block tables into slot ids once per step; every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.kv.pool import PagedKVPool


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the flattened batch
    end: int
    block_ids: torch.Tensor  # [nb] blocks covering every token up to the chunk's end
    masks: dict[int | None, torch.Tensor]  # window -> [n, nb * block_size] bool, True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, nb] padded block tables
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, 1, nb * block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)


def context_mask(query_positions: torch.Tensor, context_len: torch.Tensor, max_len: int, window: int | None) -> torch.Tensor:
    """[Q, max_len] bool: key j is visible to a query at position p when j <= p, j < context_len, and within the window."""
    keys = torch.arange(max_len, device=query_positions.device)
    q = query_positions[:, None]
    mask = (keys[None, :] <= q) & (keys[None, :] < context_len.reshape(-1, 1))
    if window is not None:
        mask &= keys[None, :] > q - window
    return mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    pool: PagedKVPool,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]. Stores k/v in the pool, returns [T, H, D]."""
    pool.store(layer, meta.slot_mapping, k, v)
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    if num_decode:
        keys, values = pool.load(layer, meta.decode_block_tables)  # [B, L, KVH, D]
        keys, values = keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2)
        queries = q[:num_decode].view(num_decode, kv_heads, group, head_dim)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_masks[window], scale=scale)
        out[:num_decode] = attn.reshape(num_decode, num_heads, head_dim)
    for span in meta.prefills:
        n = span.end - span.start
        keys, values = pool.load(layer, span.block_ids)  # [L, KVH, D]
        keys, values = keys.to(q.dtype).transpose(0, 1), values.to(q.dtype).transpose(0, 1)
        # fold the query-head group into the query axis so each kv head serves its group without a copy
        queries = q[span.start : span.end].view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        queries = queries.reshape(kv_heads, group * n, head_dim)
        mask = span.masks[window].repeat(group, 1)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        attn = attn.view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[span.start : span.end] = attn.reshape(n, num_heads, head_dim)
    return out
