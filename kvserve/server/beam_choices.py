"""A beam search's finished output as the choices of its API request: the best n beams, best first."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.engine.sequence import TokenLogprobs
from kvserve.outputs import RequestOutput


def beam_choices(out: RequestOutput, ids: list[str], logprobs: int | None, decode: Callable[[list[int]], str] | None) -> list[RequestOutput]:
    """One finished output per choice id: beam i for choice i (its tokens, text and, with `logprobs`,
    each token's logprob and its top alternatives among those the search read)."""
    prompt_len = len(out.prompt_token_ids)
    sequences = out.beams.sequences if out.beams is not None else []
    choices = []
    for i, request_id in enumerate(ids):
        beam = sequences[i] if i < len(sequences) else None
        tokens = beam.tokens[prompt_len:] if beam is not None else []
        lps = None
        if logprobs is not None and beam is not None:
            lps = [TokenLogprobs(token, top[token], dict(sorted(top.items(), key=lambda kv: -kv[1])[:logprobs]))
                   for token, top in zip(tokens, beam.logprobs)]  # fmt: skip
        choices.append(RequestOutput(
            request_id=request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids, token_ids=tokens,
            text=decode(tokens) if decode is not None else "", finished=True,
            finish_reason=beam.finish_reason if beam is not None else out.finish_reason, logprobs=lps, metrics=out.metrics,
            num_output_tokens=len(tokens), error=out.error, num_cached_tokens=out.num_cached_tokens,
        ))  # fmt: skip
    return choices
