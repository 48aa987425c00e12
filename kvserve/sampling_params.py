"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field, replace

from kvserve.kv.eviction import KV_COMPRESSIONS, SNAPKV_QUERIES
from kvserve.structured.spec import StructuredOutputs

GREEDY_TEMPERATURE = 1e-5  # below it a temperature means greedy: 1/T would overflow the scores
MAX_SEED = 2**63
MAX_TOP_K = 2**31 - 1  # the sampler's row holds top_k as int32
# float32 holds it above 0, and any top_p at most 1 / vocab keeps only the most likely token, as this does
MIN_TOP_P = 1e-30
# the sampler's rows hold these as float32: bounds far inside its range, so none becomes 0 or inf there
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# stop strings are matched against each new piece of text: their number and length bound that work
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGPROBS = 20  # top-N alternatives per token, as OpenAI bounds them


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    n: int = 1  # samples of the prompt (the prompt is computed once; sample i draws with seed + i)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # each prompt token's logprob (the first has none) and the top N, from the prefill
    include_stop_str_in_output: bool = False
    kv_compression: str | None = None  # overrides the engine's --kv-compression for this request (None: the engine's)
    kv_keep_ratio: float | None = None  # overrides the engine's budget for this request
    snapkv_query: str | None = None  # overrides the engine's --snapkv-query (window | generic | both) for this request
    kv_compress_from: int | None = None  # compression leaves the prompt's first N tokens whole and shared (a system prompt, previous turns)
    structured_outputs: StructuredOutputs | None = None  # the output follows this grammar (JSON schema, regex, choice, EBNF)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= 64:
            raise ValueError(f"n must be an integer in [1, 64], got {reprlib.repr(self.n)}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {reprlib.repr(self.max_tokens)}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {reprlib.repr(value)}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {reprlib.repr(self.seed)}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "top_p", max(self.top_p, MIN_TOP_P))
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer up to 2^31 - 1, got {reprlib.repr(self.top_k)}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {reprlib.repr(value)}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (integers in [0, 2^31))")

        if self.kv_compression is not None and self.kv_compression not in KV_COMPRESSIONS:
            raise ValueError(f"kv_compression must be one of {', '.join(KV_COMPRESSIONS)}; got {reprlib.repr(self.kv_compression)}")  # a client's string, cut short
        if self.kv_keep_ratio is not None and (isinstance(self.kv_keep_ratio, bool) or not isinstance(self.kv_keep_ratio, (int, float))
                                               or not 0 < self.kv_keep_ratio <= 1):  # fmt: skip
            raise ValueError(f"kv_keep_ratio must be in (0, 1], got {self.kv_keep_ratio!r}")
        if self.snapkv_query is not None and self.snapkv_query not in SNAPKV_QUERIES:
            raise ValueError(f"snapkv_query must be one of {', '.join(SNAPKV_QUERIES)}; got {reprlib.repr(self.snapkv_query)}")
        if self.kv_compress_from is not None and (isinstance(self.kv_compress_from, bool) or not isinstance(self.kv_compress_from, int)
                                                  or not 0 <= self.kv_compress_from <= MAX_TOKEN_ID):  # fmt: skip
            raise ValueError(f"kv_compress_from must be a number of prompt tokens (an integer from 0 to {MAX_TOKEN_ID}), "
                             f"got {reprlib.repr(self.kv_compress_from)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got {type(self.structured_outputs).__name__}")

    def samples(self) -> list["SamplingParams"]:
        """One SamplingParams per sample (n = 1 each), sample i seeded with seed + i."""
        return [
            replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % MAX_SEED) for i in range(self.n)
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
