"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.sequence import Sequence, TokenLogprobs


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
    beams: Any = None  # beam search: a BeamSearchOutput, its finished beams best first (the fields above are the best one's)

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM's shape, `out.outputs[0].text`: this sample (its text, token_ids, logprobs, finish_reason
        are vLLM's CompletionOutput's). kvserve returns each of n samples as its own output, in a row."""
        return [self]


def request_output(seq: Sequence) -> RequestOutput:
    """What the engine hands back for seq now: a stream's output holds what is new since its
    previous one (which it marks sent); a finished request's text is flushed first."""
    finished = seq.is_finished
    if finished and seq.text is not None:
        seq.text.finish()
    if seq.stream:
        token_ids = seq.token_ids[seq.prompt_len + seq.num_sent_tokens :]
        logprobs = seq.logprobs[seq.num_sent_tokens :] if seq.params.logprobs is not None else None
        text = seq.text.take_new() if seq.text is not None else ""
        seq.num_sent_tokens = seq.num_output_tokens
    else:
        token_ids = seq.output_token_ids
        logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
        text = seq.text.text if seq.text is not None else ""
    metrics = {"arrival_time": seq.arrival_time}
    for name in ("first_scheduled_time", "first_token_time", "last_token_time", "finished_time"):
        value = getattr(seq, name)
        if value is not None:
            metrics[name] = value
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=token_ids,
        text=text,
        finished=finished,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=logprobs,
        prompt_logprobs=seq.prompt_logprobs,
        num_cached_tokens=seq.num_cached_tokens,
        metrics=metrics,
        num_output_tokens=seq.num_output_tokens,
        delta=seq.stream,
    )
