"""KV eviction policies: which of a sequence's cached tokens it keeps, and how many.

snapkv scores each prompt position by the attention the last `window` prompt queries pay it (from
the first block boundary among them, when at least half the window follows it:
EvictionPolicy.window_start) and keeps, once at the end of prefill, the last `window` positions and
the best others within the budget, per layer and KV head. streaming (StreamingLLM) keeps the first
`sinks` tokens and the most recent ones, evicting as decode proceeds. random keeps the window and random other tokens, the same for
every layer and head (a baseline, not for production). SnapKV's queries are by default the
prompt's own last tokens, the question when the prompt ends with one; with query "generic" they
are a generic question (GENERIC_QUESTION) the engine appends after the tokens it compresses,
computes, and drops again, so a text can be compressed before its questions are known; with
"both" the window's scores and the question's are added, the question's weighing `question_weight`
times the window's (each averaged over its queries). The budget counts every kept token, the
window's and the sinks' included; the window takes at most half of it, so a budget near the
window's size still keeps the positions attention needs most (the first token, a sink, above all).

A request compresses only what is its own: its first `compress_from` tokens (kv_compress_from: a
system prompt, previous turns, which other requests share), rounded down to a block, stay whole and
shared, and the policy (its budget included) applies to the rest. A one-shot compaction (snapkv,
random) writes the kept tokens into blocks of the request's own, taken with the chunk that ends the
prompt, so no block of the prompt is ever written: every one is published whole as computed (the
next turn, or the same document asked another question, reads all of it) and let go once
compacted. streaming, which compacts again as it decodes, writes into the last blocks of the
region, leaving the blocks before them whole (CompressionRegion.whole); so does a one-shot
compaction whose extra blocks could never fit the pool (in_place). A compressed block is never
published. Which tokens a request keeps depends on its prompt alone, never on what was cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KV_COMPRESSIONS = ("none", "snapkv", "streaming", "random")
SNAPKV_QUERIES = ("window", "generic", "both")
GENERIC_QUESTION = "\nList every name, number and key fact above."
MAX_QUESTION_WEIGHT = 1e6  # float32 scores times a larger one could overflow to inf


@dataclass(frozen=True)
class EvictionPolicy:
    method: str = "none"
    keep_ratio: float | None = None  # of the sequence's tokens
    budget: int | None = None  # tokens; exclusive with keep_ratio
    window: int = 32  # snapkv: the last prompt queries that score, all kept
    kernel: int = 7  # snapkv: width of the max-pool that smooths the scores (odd)
    sinks: int = 4  # streaming: first tokens always kept
    query: str = "both"  # snapkv: whose attention scores: the prompt's last `window` tokens, GENERIC_QUESTION's, or both
    question_weight: float = 10.0  # snapkv "both": the question's mean scores per query count this much against the window's

    def __post_init__(self) -> None:
        if self.method not in KV_COMPRESSIONS:
            raise ValueError(f"kv_compression must be one of {', '.join(KV_COMPRESSIONS)}; got {self.method!r}")
        if self.keep_ratio is not None and self.budget is not None:
            raise ValueError("give kv_keep_ratio or kv_budget, not both")
        if self.keep_ratio is not None and (isinstance(self.keep_ratio, bool) or not isinstance(self.keep_ratio, (int, float))
                                            or not 0 < self.keep_ratio <= 1):  # fmt: skip
            raise ValueError(f"kv_keep_ratio must be in (0, 1], got {self.keep_ratio!r}")
        if self.budget is not None and (not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 1):
            raise ValueError(f"kv_budget must be a positive number of tokens, got {self.budget!r}")
        for name, low in (("window", 1), ("kernel", 1), ("sinks", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                flag = {"window": "snapkv_window", "kernel": "snapkv_kernel", "sinks": "sink_tokens"}[name]
                raise ValueError(f"{flag} must be an integer of at least {low}, got {value!r}")
        if self.query not in SNAPKV_QUERIES:
            raise ValueError(f"snapkv_query must be one of {', '.join(SNAPKV_QUERIES)}; got {self.query!r}")
        weight = self.question_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_QUESTION_WEIGHT:
            raise ValueError(f"snapkv_question_weight must be a number in (0, {MAX_QUESTION_WEIGHT:g}], got {weight!r}")
        if self.kernel % 2 == 0:
            raise ValueError(f"snapkv_kernel must be odd (the pooled scores keep their positions), got {self.kernel}")
        if self.method != "none" and self.keep_ratio is None and self.budget is None:
            raise ValueError(f"kv_compression {self.method} needs a budget: kv_keep_ratio or kv_budget")
        if self.method == "streaming" and self.budget is not None and self.sinks >= self.budget:
            raise ValueError(f"sink_tokens must be fewer than kv_budget ({self.budget}), got {self.sinks}: streaming keeps the sinks "
                             "and the most recent tokens within the budget")  # fmt: skip

    @property
    def active(self) -> bool:
        return self.method != "none"

    @property
    def scores_window(self) -> bool:
        """snapkv scored (also) by the prompt's last `window` queries."""
        return self.method == "snapkv" and self.query in ("window", "both")

    @property
    def asks_generic_question(self) -> bool:
        """snapkv scored (also) by GENERIC_QUESTION, appended, computed and dropped again."""
        return self.method == "snapkv" and self.query in ("generic", "both")

    def window_start(self, point: int, block_size: int) -> int:
        """Where SnapKV's scoring queries begin in a prompt compressed at `point`: at the first block
        boundary of its last `window` positions when at least half the window follows it, so that the
        same text asked another question reads every block before the queries from the prefix cache
        and computes none of them again; else `window` positions before `point`."""
        aligned = -(-(point - self.window) // block_size) * block_size
        return max(aligned if 2 * (point - aligned) >= self.window else point - self.window, 0)

    def question_query_weight(self, window_queries: int, question_len: int) -> float:
        """What each of the generic question's queries counts against a window of window_queries
        queries, a window query counting 1 (the window's own scores are plain sums): with "both",
        question_weight times the mean of the window's queries."""
        if self.query != "both":
            return 1.0
        return self.question_weight * window_queries / question_len

    def tokens_kept(self, num_tokens: int) -> int:
        """How many of a num_tokens sequence's tokens the budget keeps."""
        if self.budget is not None:
            return min(num_tokens, self.budget)
        return min(num_tokens, max(1, math.ceil(self.keep_ratio * num_tokens)))


@dataclass(frozen=True)
class CompressionRegion:
    """Where a prompt compressed at `point` is compressed: positions [start, point), `kept` of them
    kept. Positions before `whole` are never written (published as computed); a prefix hit reads at
    most up to `hit_end` (SnapKV's window queries are computed, never read from the cache).
    `in_place`: the kept tokens are written into the region's last blocks, not blocks taken for them."""

    start: int
    whole: int
    kept: int
    hit_end: int
    in_place: bool = False

    @classmethod
    def of(cls, policy: EvictionPolicy, point: int, compress_from: int, block_size: int, in_place: bool = False) -> CompressionRegion:
        start = compress_from // block_size * block_size
        in_place = in_place or policy.method == "streaming"
        if start >= point:  # none of the prompt (streaming: what follows `start` as it decodes)
            return cls(start, point, 0, point, in_place)
        kept = policy.tokens_kept(point - start)
        # SnapKV keeps a region no longer than its window whole: the window would be all of it, and
        # scoring it (and a generic question) costs more than the block or two it could free
        short = policy.method == "snapkv" and point - start <= 2 * policy.window
        if (kept >= point - start or short) and policy.method != "streaming":  # kept whole: nothing is ever written
            return cls(start, point, point - start, point, in_place)
        whole = point
        if in_place:
            untouched = -(-(point - start) // block_size) - -(-kept // block_size)
            whole = start + untouched * block_size
        hit_end = whole
        if policy.scores_window:  # the window's queries are computed, never served from the cache
            hit_end = max(start, min(whole, policy.window_start(point, block_size) // block_size * block_size))
        return cls(start, whole, kept, hit_end, in_place)

    def reserve(self, point: int, block_size: int) -> int:
        """Blocks (per full-attention group) the compaction takes to write the kept tokens into."""
        return 0 if self.in_place or not self.compresses(point) else -(-self.kept // block_size)

    def compresses(self, point: int) -> bool:
        return self.kept < point - self.start


def top_positions(scores: torch.Tensor, kept: int, window: int, kernel: int) -> torch.Tensor:
    """SnapKV's selection from scores [..., n]: the last `window` positions (at most kept // 2) and
    the best others after a max-pool of `kernel`; sorted indices [..., kept]."""
    n = scores.shape[-1]
    window = min(window, kept // 2)
    tail = torch.arange(n - window, n, device=scores.device).expand(*scores.shape[:-1], window)
    if kept == window:
        return tail
    lead = scores[..., : n - window].float()
    pooled = F.max_pool1d(lead.reshape(-1, 1, n - window), kernel, stride=1, padding=kernel // 2).view(lead.shape)
    best = pooled.topk(kept - window, dim=-1).indices
    return torch.cat([best.sort(dim=-1).values, tail], dim=-1)


def sink_and_recent(n: int, kept: int, sinks: int) -> torch.Tensor:
    """StreamingLLM's selection: the first `sinks` slots of n and the most recent (indices [kept])."""
    sinks = min(sinks, kept)
    return torch.cat([torch.arange(sinks), torch.arange(n - (kept - sinks), n)])
