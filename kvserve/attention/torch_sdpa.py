"""`torch_sdpa`: gathers whole blocks and runs torch's scaled_dot_product_attention under a mask
(any device). A prefill chunk that opens its sequence sees only its own keys, so it runs causal
SDPA on the fresh K/V."""

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
    """A prefill chunk that opens its sequence attends to its own fresh K/V only: causal SDPA, with a
    banded mask where a sliding window is shorter than the chunk. q [T, H, D]; k, v [T, KVH, D]."""
    n = span.num_tokens
    queries, keys, values = (x[span.start : span.end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
    if window is None or window >= n:
        attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        key = ("fresh-prefill-band", n, window)
        if key not in meta.cache:  # causal, and each query sees its last `window` keys
            rows = torch.arange(n, device=q.device)
            meta.cache[key] = context_mask(rows, torch.tensor(n, device=q.device), n, window)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.cache[key], scale=scale, enable_gqa=True)
    return attn[0].transpose(0, 1)


@register
class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(self, pool) -> None:
        super().__init__(pool)
        self._workspace: torch.Tensor | None = None

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

    def _gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks' K/V for block tables [..., n]: [..., n * block_size, kv_heads, head_dim] each.

        The result lives in a workspace reused by the next call (gathering into fresh memory costs
        more in page faults than the copy itself), so consume it before gathering again.
        """
        kv = self.layers[layer]
        if kv.key_records is not None:
            return kv.gather(block_ids)  # a quantized cache: decoded into fresh float blocks
        _, heads, dim = kv.key.shape
        block = kv.block_size * heads * dim
        count = block_ids.numel()
        if self._workspace is None or self._workspace.shape[1] < count * block or self._workspace.dtype != kv.key.dtype:
            self._workspace = torch.empty(2, count * block, dtype=kv.key.dtype, device=kv.key.device)
        shape = (*block_ids.shape[:-1], block_ids.shape[-1] * kv.block_size, heads, dim)
        out = []
        for which, cache in enumerate((kv.key, kv.value)):
            blocks = cache.view(-1, kv.block_size, heads, dim)
            target = self._workspace[which, : count * block].view(count, kv.block_size, heads, dim)
            torch.index_select(blocks, 0, block_ids.reshape(-1), out=target)
            out.append(target.view(shape))
        return out[0], out[1]

    def _decode(self, q: torch.Tensor, layer: int, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        num_decode, num_heads, head_dim = q.shape
        group = self.layers[layer].group
        tables = meta.decode_block_tables[group]
        keys, values = self._gather(layer, tables)  # [B, L, KVH, D]
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
        n, num_heads, head_dim = span.num_tokens, q.shape[1], q.shape[2]
        kv = self.layers[layer]
        group = kv.group
        kv_start = span.kv_starts[group]
        if kv_start == 0 and (window is None or window >= n) and kv.reads_back_as_stored:
            return fresh_prefill_attention(q, k, v, span, meta, scale, window)
        table = span.block_tables[group]
        keys, values = self._gather(layer, table)  # [L, KVH, D]
        kv_heads = keys.shape[1]
        keys, values = keys.to(q.dtype).transpose(0, 1), values.to(q.dtype).transpose(0, 1)
        key = ("prefill", index, group, window)
        if key not in meta.cache:
            slots = torch.arange(kv_start, kv_start + n, device=q.device)
            end = torch.tensor(kv_start + n, device=q.device)
            meta.cache[key] = context_mask(slots, end, table.numel() * self.layers[layer].block_size, window)
        # fold the query-head group into the query axis so each kv head serves its group without a copy
        groups = num_heads // kv_heads
        folded = q[span.start : span.end].view(n, kv_heads, groups, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, groups * n, head_dim)
        attn = F.scaled_dot_product_attention(folded, keys, values, attn_mask=meta.cache[key].repeat(groups, 1), scale=scale)
        return attn.view(kv_heads, groups, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
