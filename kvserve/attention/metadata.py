"""What attention needs to know about one step's flat batch, built once per step by the runner.

Positions (for RoPE) and cached slots are different numbers: a token's position is its index in
its sequence; `decode_kv_lens` counts the slots a sequence holds in the cache. Every KV cache group
has its own block tables, slot mapping and slot counts (KV eviction compacts only full-attention
groups; a sliding-window group's slots stay positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the flat batch
    end: int
    kv_starts: list[int]  # per group: slot of the chunk's first token
    block_tables: list[torch.Tensor]  # per group: [nb] blocks covering every slot up to the chunk's end

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class WindowScoreSpan:
    """Rows of a sequence's SnapKV window in this step: their attention over the keys cached up to
    them is added to `out` [num_layers, kv_heads, >= kv_len] (attention/window_scores.py)."""

    start: int  # first row in the flat batch
    end: int
    first_slot: int  # slot of the first row's query
    block_tables: list[torch.Tensor]  # per group: [nb] blocks covering kv_len slots
    out: torch.Tensor  # full-attention layers' rows are filled; sliding-window layers evict nothing
    context: int | None = None  # a generic question's rows score only the first `context` keys, those it follows
    weight: float = 1.0  # each query's scores count this much (a generic question's under --snapkv-query both)
    weighted_from: int = 0  # rows before this one (a prompt window's, scored with its question in one pass) count 1

    @property
    def kv_len(self) -> int:
        return self.first_slot + self.end - self.start


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] each token's position in its sequence
    slot_mappings: list[torch.Tensor]  # per group: [T] where each token's K/V goes
    num_decode_tokens: int = 0  # decode rows come first, one per sequence
    decode_kv_lens: list[torch.Tensor] = field(default_factory=list)  # per group: [B] cached slots, the new token's included
    decode_block_tables: list[torch.Tensor] = field(default_factory=list)  # per group: [B, nb]
    prefills: list[PrefillSpan] = field(default_factory=list)
    window_scores: list[WindowScoreSpan] = field(default_factory=list)
    cache: dict = field(default_factory=dict)  # a backend's per-step derived data (masks), shared by its layers
