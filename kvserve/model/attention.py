"""Paged attention over the KV pool, driven by block-table-derived slot ids.

A step's tokens are flattened: decode tokens first (one per sequence), then each prefill chunk.
The runner turns block tables into slot ids once per step; every layer reuses them.

With the `cpu_paged` backend, native kernels read the pool in place through block tables for
decode tokens and prefill chunks alike. The `torch_sdpa` backend (any device) gathers whole
blocks and runs SDPA under a mask; a prefill chunk that opens its sequence sees only its own
keys, so there it runs causal SDPA on the fresh K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.kv.pool import PagedKVPool


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the flattened batch
    end: int
    context_start: int  # position of the chunk's first token in its sequence
    block_ids: torch.Tensor  # [nb] blocks covering every token up to the chunk's end
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def sees_only_itself(self, window: int | None) -> bool:
        """True when the chunk opens its sequence, so causal attention over its own K/V is exact."""
        return self.context_start == 0 and (window is None or window >= self.num_tokens)

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """[n, nb * block_size] bool, True = attend."""
        if window not in self._masks:
            device = self.block_ids.device
            positions = torch.arange(self.context_start, self.context_start + self.num_tokens, device=device)
            context_end = torch.tensor(self.context_start + self.num_tokens, device=device)
            self._masks[window] = context_mask(positions, context_end, self.block_ids.numel() * block_size, window)
        return self._masks[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, nb] padded block tables
    decode_context_lens: torch.Tensor | None = None  # [B] tokens in context, the query included
    attention_backend: str = "torch_sdpa"
    prefills: list[PrefillSpan] = field(default_factory=list)
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """[B, 1, 1, nb * block_size] bool for the gathered, padded decode context."""
        if window not in self._decode_masks:
            lengths = self.decode_context_lens
            padded = self.decode_block_tables.shape[1] * block_size
            mask = context_mask(lengths - 1, lengths, padded, window)
            self._decode_masks[window] = mask.view(lengths.numel(), 1, 1, padded)
        return self._decode_masks[window]


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
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    native = meta.attention_backend == "cpu_paged"
    if native:
        key_cache, value_cache = pool.layer_caches(layer)
    if num_decode:
        if native:
            kernels.paged_decode_attention(
                q[:num_decode], key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens,
                pool.block_size, scale, window, out=out[:num_decode],
            )
        else:
            out[:num_decode] = _decode_sdpa(q[:num_decode], layer, pool, meta, scale, window)
    for span in meta.prefills:
        if native:
            kernels.paged_prefill_attention(
                q[span.start : span.end], key_cache, value_cache, span.block_ids, span.context_start,
                pool.block_size, scale, window, out=out[span.start : span.end],
            )
        else:
            out[span.start : span.end] = _prefill_sdpa(q, k, v, span, layer, pool, scale, window)
    return out


def _decode_sdpa(q: torch.Tensor, layer: int, pool: PagedKVPool, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    num_decode, num_heads, head_dim = q.shape
    keys, values = pool.load(layer, meta.decode_block_tables)  # [B, L, KVH, D]
    kv_heads = keys.shape[2]
    keys, values = keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2)
    queries = q.view(num_decode, kv_heads, num_heads // kv_heads, head_dim)
    attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask(window, pool.block_size), scale=scale)
    return attn.reshape(num_decode, num_heads, head_dim)


def _prefill_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, layer: int, pool: PagedKVPool, scale: float, window: int | None
) -> torch.Tensor:
    n, num_heads, head_dim = span.num_tokens, q.shape[1], q.shape[2]
    if span.sees_only_itself(window):
        queries = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        keys = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
        values = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
        attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        return attn[0].transpose(0, 1)
    keys, values = pool.load(layer, span.block_ids)  # [L, KVH, D]
    kv_heads = keys.shape[1]
    keys, values = keys.to(q.dtype).transpose(0, 1), values.to(q.dtype).transpose(0, 1)
    # fold the query-head group into the query axis so each kv head serves its group without a copy
    group = num_heads // kv_heads
    folded = q[span.start : span.end].view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, head_dim)
    attn = F.scaled_dot_product_attention(folded, keys, values, attn_mask=span.mask(window, pool.block_size).repeat(group, 1), scale=scale)
    return attn.view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
