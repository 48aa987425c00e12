"""A request's state as it moves through the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvserve.engine.output_text import OutputText
from kvserve.kv.eviction import CompressionRegion, EvictionPolicy
from kvserve.kv.hashing import adapter_salt
from kvserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FORKING = "forking"  # a sibling of an n > 1 request: takes its parent's prompt blocks once those are computed
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None  # prompt tokens: 1 + how many tokens the model found more likely


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: OutputText | None = None  # None without a tokenizer (token ids only)
    stream: bool = False  # outputs carry what is new since the previous one, every step
    num_sent_tokens: int = 0  # output tokens already handed out (stream)
    captured: list[torch.Tensor] | None = None  # scoring: the last hidden state of every computed position, chunk by chunk
    max_chunk: int | None = None  # scoring: most prompt tokens computed in one step (None: the step's token budget)
    forks: list["Sequence"] = field(default_factory=list)  # siblings that start from this sequence's prompt
    fork_parent: "Sequence | None" = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with params.prompt_logprobs: one entry per prompt position scored so far (position 0's is None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    seed: int = 0  # of this request's draws (its own, or one the engine derived from its seed)
    penalty_counts: dict[int, int] | None = None  # every token seen -> its count in the output (penalties only)
    num_preemptions: int = 0
    migrated: bool = False  # imported from another engine (live migration): its cached-token count is the source's
    lora: "LoRAHandle | None" = None  # the LoRA adapter it runs with (kvserve/lora/manager.py)
    keep_kv: bool = False  # a stored conversation's turn: its cached blocks are pinned for the next (kv/conversation_pins.py)
    eviction: EvictionPolicy | None = None  # evicts cached tokens: shares no block with the prefix cache or forks
    eviction_started: bool = False  # the prompt's compression is done (streaming: evicting as it decodes)
    compress_at: int | None = None  # compress after this many prompt tokens, before the rest is computed (None: the prompt's end)
    compress_from: int = 0  # the first tokens stay whole and shared (kv_compress_from: a system prompt, previous turns)
    compacts_in_place: bool = False  # its compaction's own blocks could never fit the pool: it writes into the prompt's last ones
    window_scores: torch.Tensor | None = None  # snapkv: [layers, kv_heads, tokens] attention the scoring queries pay
    probe: list[int] | None = None  # snapkv's generic question, computed at positions probe_from on to score, then dropped
    probe_from: int = 0
    question: list[int] | None = None  # the generic question its chunk reaching the compression point takes on, room allowing
    grammar: Any = None  # structured outputs: the xgrammar GrammarMatcher that has accepted the output so far
    beam_group: str | None = None  # beam search: the group this beam belongs to (engine/beam_search.py)
    held: bool = False  # a beam that has drawn this round's token: not scheduled until its group has chosen
    draft_token_ids: list[int] = field(default_factory=list)  # speculative decoding: this step's guesses after the last token
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.uses_penalties and self.penalty_counts is None:
            self.penalty_counts = dict.fromkeys(self.prompt_token_ids, 0)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def prompt_scores_pending(self) -> bool:
        """Prompt positions still to score: their rows must be computed, not taken from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        if self.penalty_counts is not None:
            self.penalty_counts[token] = self.penalty_counts.get(token, 0) + 1

    def penalty_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids seen in the prompt or the output, their counts in the output)."""
        counts = self.penalty_counts or {}
        return np.fromiter(counts.keys(), np.int64, len(counts)), np.fromiter(counts.values(), np.int32, len(counts))

    @property
    def prefix_salt(self) -> str | None:
        """What keys its blocks beside the cache identity: its cache_salt and its adapter's identity."""
        return adapter_salt(self.cache_salt, self.lora.identity if self.lora is not None else None)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens to compute: the sequence's and this step's guesses, or while a generic question scores it, the
        compressed ones' and the question's."""
        return len(self.token_ids) + len(self.draft_token_ids) if self.probe is None else self.probe_from + len(self.probe)

    def input_ids(self, start: int, end: int) -> list[int]:
        """The tokens computed at positions [start, end): the sequence's (then its guesses), or the generic question's from probe_from on."""
        if self.probe is None and end > len(self.token_ids):
            return (self.token_ids + self.draft_token_ids)[start:end]
        if self.probe is None or end <= self.probe_from:
            return self.token_ids[start:end]
        return self.token_ids[start : min(end, self.probe_from)] + self.probe[max(start - self.probe_from, 0) : end - self.probe_from]

    def input_id(self, position: int) -> int:
        """The token computed at `position` (a decode row's)."""
        return self.token_ids[position] if self.probe is None or position < self.probe_from else self.probe[position - self.probe_from]

    def reset_compression(self) -> None:
        """Preempted: recomputed whole, scored and compressed again (and guesses nothing this step)."""
        self.draft_token_ids = []
        self.eviction_started, self.window_scores = False, None
        self.probe, self.probe_from = None, 0
        self.question = None  # its compression point moved on (its output is compressed too): asked after that chunk

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_tokens_to_admit(self) -> int:
        """Tokens its admission finds blocks for: num_tokens, and a generic question it may take on."""
        return self.num_tokens + (len(self.question) if self.question is not None and self.probe is None else 0)

    @property
    def compression_point(self) -> int:
        """The tokens computed when the prompt is compressed: the SnapKV window ends there."""
        return self.compress_at if self.compress_at is not None else len(self.token_ids)

    def compression_region(self, block_size: int) -> CompressionRegion:
        """What its compression writes and what it leaves whole (kv/eviction.py); needs an eviction policy."""
        return CompressionRegion.of(self.eviction, self.compression_point, self.compress_from, block_size, self.compacts_in_place)

    def compaction_reserve(self, block_size: int, end: int) -> int:
        """Blocks (per full-attention group) to take with a chunk computing up to `end` for the prompt's
        compaction to write into (kv/eviction.py): 0 unless that chunk reaches the compression point."""
        if self.eviction is None or self.eviction_started or end < self.compression_point:
            return 0
        return self.compression_region(block_size).reserve(self.compression_point, block_size)

    def next_chunk(self, budget: int) -> int:
        """Tokens to compute next within `budget`: a chunk stops at the compression point, so the
        tokens after it are computed against the compressed cache. The chunk that reaches it takes
        the generic question on when `budget` holds it too (its rows score the prompt in the same
        step, then are dropped); otherwise the question is computed in a step of its own."""
        n = min(self.num_uncomputed_tokens, budget, self.max_chunk or budget)
        if self.eviction is not None and not self.eviction_started and self.probe is None and self.num_computed_tokens < self.compression_point:
            n = min(n, self.compression_point - self.num_computed_tokens)
            question = self.question
            if question is not None and self.num_computed_tokens + n == self.compression_point and n + len(question) <= budget:
                self.probe, self.probe_from = question, self.compression_point
                n += len(question)
        return n
