"""Speculative decoding: guess a few tokens per sequence, verify them in one step, keep what holds.

A proposer (n-gram prompt lookup here, or a draft model: engine/draft_model.py) guesses up to k tokens
after a decoding sequence's last one.
The scheduler runs the last token and the guesses as one span of k + 1 rows in the flat batch
(beside decode rows and prefill chunks); every row samples as plain decoding would at its
position, with the request's seed and that position, and the guesses are kept while each equals
the token its row drew. The first row that draws something else gives its own token; if every
guess holds, the last row gives one more. So the output is, token for token and logprob for
logprob, what plain decoding gives: greedy or seeded, alone or batched (a row's bits never depend
on the rows beside it).

For a deterministic proposal x, rejection sampling accepts x with probability p(x) and otherwise
draws from p with x removed: exactly the law of "draw from p, keep x if the draw is x", which is
what this does, so the target distribution is kept.

The KV written for rejected guesses is taken back (KVCacheManager.truncate): the sequence's
length, its last block's fill, and blocks that held only guesses go back to the pool. Everything
that publishes, quantizes or frees by length (the prefix cache, the tiers, KIVI's residual window,
window groups) runs after that, on the accepted length only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvserve.engine.sequence import Sequence

SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# a sequence whose guesses keep failing stops guessing for a while: a verification that keeps none
# pauses it 2, 4, 8 or MAX_BACKOFF_STEPS steps (one that keeps any resets that); and after
# LOW_ACCEPTANCE_WINDOW guessed tokens with fewer than LOW_ACCEPTANCE_RATE of them kept, it pauses
# MAX_BACKOFF_STEPS steps. A verification step of 5 rows costs about 1.4 decode steps (Qwen2.5 0.5B,
# one stream), a sampled one more: guesses that are seldom right cost more than they give.
MAX_BACKOFF_STEPS = 16
LOW_ACCEPTANCE_WINDOW = 32
LOW_ACCEPTANCE_RATE = 0.2


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2, "disable_by_batch_size": N}."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # no sequence guesses in a step where at least this many sequences run (None: always guess)
    disable_by_batch_size: int | None = 8
    model: str | None = None  # draft_model: an alias, GGUF file or HF directory with the target's vocabulary
    draft_kv_cache_memory: float = 0.25  # draft_model: GiB of the draft's own paged KV pool

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", 1, 64),
                                ("prompt_lookup_min", 1, 64)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"speculative_config {name} must be an integer in [{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")  # fmt: skip
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError('speculative_config method "draft_model" needs "model": an alias, a GGUF file or a Hugging Face directory')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config "model" names a draft model: it needs "method": "draft_model"')
        memory = self.draft_kv_cache_memory
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory <= 1024:
            raise ValueError(f"speculative_config draft_kv_cache_memory must be a number of GiB in (0, 1024], got {memory!r}")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer or null, got {size!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | Mapping | str | None") -> "SpeculativeConfig | None":
        """From a dict (LLM(speculative_config=...)), a JSON object (--speculative-config) or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config must be a JSON object: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be an object such as {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
        return cls(**value)


def ngram_proposal(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, for the longest n in [min_n, max_n] that occurs; [] when none does."""
    length = len(token_ids)
    if length <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # occurrences ending before the last token
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            start = int(starts[-1]) + n
            return token_ids[start : start + k]
    return []


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: drafts (sequences that guessed in a step), drafted tokens, accepted
    tokens, and accepted tokens by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts_total": self.num_drafts,
            "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
        }


@dataclass
class SequenceSpeculation:
    """One sequence's recent acceptance, to pause guessing where it does not pay."""

    drafted: int = 0
    accepted: int = 0
    failures: int = 0  # verifications in a row that kept nothing
    paused_until: int = 0


class Speculator:
    """Sets each decoding sequence's guesses before a step and judges them after it."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None) -> None:
        self.config = config
        self.draft = draft  # draft_model: a DraftModel (engine/draft_model.py) that guesses for many sequences at once
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self._sequences: dict[str, SequenceSpeculation] = {}
        self._step = 0

    @staticmethod
    def can_guess(seq: Sequence) -> bool:
        """Sequences whose rows sample with nothing that depends on the tokens before them in the same
        step: no penalties (counts), no grammar (a matcher's state), no compression or scoring."""
        p = seq.params
        return (not p.uses_penalties and seq.grammar is None and seq.beam_group is None and seq.eviction is None and seq.probe is None and seq.captured is None
                and not seq.forks and seq.num_computed_tokens == len(seq.token_ids) - 1 and seq.num_output_tokens > 0)  # fmt: skip

    def propose(self, running: list[Sequence]) -> None:
        """Set draft_token_ids on every running sequence (empty where it does not guess this step)."""
        self._step += 1
        batch_too_large = self.config.disable_by_batch_size is not None and len(running) >= self.config.disable_by_batch_size
        wanted: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_token_ids = []
            if batch_too_large or not self.can_guess(seq):
                continue
            state = self._sequences.setdefault(seq.request_id, SequenceSpeculation())
            if state.paused_until > self._step:
                continue
            room = min(self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - len(seq.token_ids) - 1)  # fmt: skip
            if room > 0:
                wanted.append((seq, room))
        if not wanted:
            return
        guesses = self.draft.propose(wanted) if self.draft is not None else [self.proposer(seq, k) for seq, k in wanted]
        for (seq, room), guess in zip(wanted, guesses):
            seq.draft_token_ids = list(guess)[:room]

    def proposer(self, seq: Sequence, k: int) -> list[int]:
        """At most k guesses after seq's last token (the method's; tests replace it to force outcomes)."""
        c = self.config
        return ngram_proposal(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def judged(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verification's outcome: counted, and a sequence whose guesses keep failing pauses."""
        self.stats.record(drafted, accepted)
        state = self._sequences.setdefault(seq.request_id, SequenceSpeculation())
        state.drafted += drafted
        state.accepted += accepted
        state.failures = 0 if accepted else state.failures + 1
        if state.failures:
            state.paused_until = self._step + min(2**state.failures, MAX_BACKOFF_STEPS)
        if state.drafted >= LOW_ACCEPTANCE_WINDOW:
            if state.accepted < LOW_ACCEPTANCE_RATE * state.drafted:
                state.paused_until = max(state.paused_until, self._step + MAX_BACKOFF_STEPS)
            state.drafted = state.accepted = 0

    def forget(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)


def accepted_length(draft: list[int], drawn: list[int]) -> int:
    """How many guesses hold: the longest prefix of draft equal to the tokens its rows drew."""
    for i, token in enumerate(draft):
        if i >= len(drawn) or drawn[i] != token:
            return i
    return len(draft)
