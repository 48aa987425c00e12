"""SnapKV's scores: the attention a sequence's last prompt queries pay each cached key.

Only the window's queries are scored (a [window, keys] matrix per head, never prompt x prompt).
A window can span prefill chunks: each chunk adds the scores of its own window queries, read
against every key cached up to it, so the sum is the same however the prompt was cut.
"""

from __future__ import annotations

import torch


def window_attention(q: torch.Tensor, keys: torch.Tensor, first_slot: int, scale: float, weighted_from: int = 0,
                     weight: float = 1.0) -> torch.Tensor:  # fmt: skip
    """q [w, H, D] at slots first_slot.. ; keys [L, KVH, D] of slots 0..L-1. Each query's softmax over
    the keys it sees (causally), summed over the queries and the query heads of each KV head: [KVH, L];
    the queries from `weighted_from` on count `weight`."""
    w, heads, dim = q.shape
    length, kv_heads, _ = keys.shape
    queries = q.float().view(w, kv_heads, heads // kv_heads, dim)
    logits = torch.einsum("wkgd,lkd->kgwl", queries, keys.float()) * scale
    slots = torch.arange(first_slot, first_slot + w, device=q.device)
    hidden = torch.arange(length, device=q.device)[None, :] > slots[:, None]  # [w, L]
    logits.masked_fill_(hidden, float("-inf"))
    probs = logits.softmax(-1)
    return probs[:, :, :weighted_from].sum(dim=(1, 2)) + probs[:, :, weighted_from:].sum(dim=(1, 2)) * weight
