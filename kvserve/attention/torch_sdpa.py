"""`torch_sdpa`: gathers whole blocks and runs torch's scaled_dot_product_attention under a mask
(any device). A prefill chunk that opens its sequence sees only its own keys, so it runs causal
SDPA on the fresh K/V; a later chunk gathers the blocks it can see (a sliding window's last ones)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, register
from kvserve.attention.metadata import AttentionMetadata, PrefillSpan


def context_mask(query_slots: torch.Tensor, kv_len: torch.Tensor, max_len: int, window: int | None) -> torch.Tensor:
    """[Q, max_len] bool: slot j is visible to a query at slot s when j <= s, j < kv_len, and within the window."""
    keys = torch.arange(max_len, device=query_slots.device)
    q = query_slots[:, None]
    mask = (keys[None, :] <= q) & (keys[None, :] < kv_len.reshape(-1, 1))
    if window is not None:
        mask &= keys[None, :] > q - window
    return mask


def fresh_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, meta: AttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:  # fmt: skip
    """A prefill chunk that opens its sequence attends to its own fresh K/V only: causal SDPA; where
    a sliding window is shorter than the chunk, in pieces of `window` queries over the keys of their
    band (a banded mask over the whole chunk would compute every score it masks). q [T, H, D];
    k, v [T, KVH, D]."""
    n = span.num_tokens
    queries, keys, values = (x[span.start : span.end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
    if window is None or window >= n:
        attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        return attn[0].transpose(0, 1)
    out = []
    for first_row in range(0, n, window):
        end, first_key = min(n, first_row + window), max(0, first_row - window + 1)
        key = ("fresh-prefill-band", end - first_row, end - first_key, window)
        if key not in meta.cache:  # each query sees its last `window` keys
            slots = torch.arange(first_row - first_key, end - first_key, device=q.device)
            meta.cache[key] = context_mask(slots, slots[-1:] + 1, end - first_key, window)
        attn = F.scaled_dot_product_attention(queries[:, :, first_row:end], keys[:, :, first_key:end], values[:, :, first_key:end],
                                              attn_mask=meta.cache[key], scale=scale, enable_gqa=True)  # fmt: skip
        out.append(attn[0].transpose(0, 1))
    return torch.cat(out)


def cached_prefill_attention(
    backend: AttentionBackend, layer: int, q: torch.Tensor, index: int, span: PrefillSpan, meta: AttentionMetadata, scale: float,
    window: int | None,
) -> torch.Tensor:  # fmt: skip
    """A prefill chunk over the slots cached before it and its own (already stored): SDPA over the
    gathered blocks it can see, under an additive causal (and window) mask. A sliding window shorter
    than the chunk takes it in pieces of `window` queries, each over the blocks its band covers, so
    no piece computes scores its mask throws away. q [T, H, D]; the span's `index` in the step keys
    the masks, which the step's layers of a group share."""
    kv = backend.layers[layer]
    group, n, block = kv.group, span.num_tokens, kv.block_size
    kv_start, table = span.kv_starts[group], span.block_tables[group]
    piece = n if window is None else min(n, window)
    out = []
    for first_row in range(0, n, piece):
        rows, slot = min(piece, n - first_row), kv_start + first_row
        first = 0 if window is None else max(0, slot - window + 1) // block
        keys, values = backend.gather(layer, table[first : -(-(slot + rows) // block)])  # [L, KVH, D]
        key = ("prefill", index, group, window, first_row)
        if key not in meta.cache:
            slots = torch.arange(slot - first * block, slot - first * block + rows, device=q.device)
            visible = context_mask(slots, slots[-1:] + 1, keys.shape[0], window)
            meta.cache[key] = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        queries = q[span.start + first_row : span.start + first_row + rows].transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]
        keys, values = (x.to(q.dtype).transpose(0, 1).unsqueeze(0) for x in (keys, values))
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.cache[key], scale=scale, enable_gqa=True)
        out.append(attn[0].transpose(0, 1))
    return out[0] if len(out) == 1 else torch.cat(out)


@register
class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
    ) -> torch.Tensor:
        q, k, v = self.rotate_in(q, k, v)
        self.store(layer, meta, k, v)
        out = torch.empty_like(q)
        num_decode = meta.num_decode_tokens
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], layer, meta, scale, window)
        for i, span in enumerate(meta.prefills):
            out[span.start : span.end] = self._prefill(q, k, v, i, span, layer, meta, scale, window)
        if meta.window_scores:
            self.score_windows(layer, q, meta, scale, window)
        return self.rotate_out(out)

    def _decode(self, q: torch.Tensor, layer: int, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        num_decode, num_heads, head_dim = q.shape
        group = self.layers[layer].group
        tables = meta.decode_block_tables[group]
        keys, values = self.gather(layer, tables)  # [B, L, KVH, D]
        kv_heads = keys.shape[2]
        keys, values = keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2)
        queries = q.view(num_decode, kv_heads, num_heads // kv_heads, head_dim)
        key = ("decode", group, window)
        if key not in meta.cache:
            lengths = meta.decode_kv_lens[group]
            padded = tables.shape[1] * self.layers[layer].block_size
            meta.cache[key] = context_mask(lengths - 1, lengths, padded, window).view(num_decode, 1, 1, padded)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.cache[key], scale=scale)
        return attn.reshape(num_decode, num_heads, head_dim)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int, span: PrefillSpan, layer: int, meta: AttentionMetadata,
        scale: float, window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        kv = self.layers[layer]
        if span.kv_starts[kv.group] == 0 and kv.reads_back_as_stored:
            return fresh_prefill_attention(q, k, v, span, meta, scale, window)
        return cached_prefill_attention(self, layer, q, index, span, meta, scale, window)
