"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.sequence import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens: all of them, or (a stream) those new since its previous output
    text: str  # likewise
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (the engine step running it failed)
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None  # likewise
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with params.prompt_logprobs: one per prompt token, the first None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    num_output_tokens: int = 0  # generated so far, in all
    delta: bool = False  # token_ids, text and logprobs hold only what is new (streamed requests)
    error: str | None = None  # with finish_reason "error": what failed
