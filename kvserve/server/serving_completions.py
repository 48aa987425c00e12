"""POST /v1/completions: OpenAI's legacy completions, with vLLM's additions (token-id prompts, echo,
prompt_logprobs, stop_reason)."""

from __future__ import annotations

import asyncio
import codecs
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvserve.engine.sequence import TokenLogprobs
from kvserve.outputs import RequestOutput
from kvserve.server.async_engine import PromptGroup
from kvserve.server.errors import NO_TOKENIZER, APIError
from kvserve.server.protocol import CompletionRequest
from kvserve.server.serving_engine import OpenAIServing, most_likely, stop_reason


MAX_PROMPT_LOGPROB_ENTRIES = 500_000  # ~45 MB of JSON; lm-evaluation-harness asks 2 per prompt token, one choice

class TextOffsets:
    """Where each token's text starts in a choice's text, in characters, chunk after chunk: the
    tokens' bytes decoded as the text was, so a character split across tokens counts once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, token_ids: list[int]) -> list[int]:
        out = []
        for token_id in token_ids:
            out.append(self.chars)
            raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else f"token_id:{token_id}".encode()
            self.chars += len(self.decoder.decode(raw))
        return out


def prompt_list(prompt) -> list:
    """A completion's prompt as a list of prompts, each a text or token ids."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]
    return list(prompt)


class ServingCompletions:
    """The completions endpoint: its prompts (texts or token ids, one or many) and its choices' text and logprobs."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: CompletionRequest, request: Request) -> dict | StreamingResponse:
        serving = self.serving
        lora = serving.check_model(body.model)
        model_name = lora.lora_name if lora is not None else serving.model_name  # what responses name
        serving.note_unknown_fields(body)
        num_prompts = len(prompt_list(body.prompt))
        serving.check_choices(num_prompts, body.n)
        if body.echo and serving.tokenizer is None:
            raise APIError(400, "echo needs a tokenizer to write the prompt's text; " + NO_TOKENIZER.split(": ", 1)[0], "echo")
        prompts = await self._tokenize_prompts(body.prompt, body.truncate_prompt_tokens)
        # echo with max_tokens 0 scores the prompt and generates nothing (vLLM's behaviour): one token is drawn and dropped
        score_only = body.echo and body.max_tokens == 0
        max_tokens = 1 if score_only else body.max_tokens if body.max_tokens is not None else 16
        echo_top = body.logprobs if body.echo else None  # echo with logprobs: the prompt tokens' logprobs too
        prompt_top = max((t for t in (echo_top, body.prompt_logprobs) if t is not None), default=None)
        # every choice repeats its prompt's logprobs (echo and prompt_logprobs each), top alternatives included: a 48 KB
        # request could ask for a 249 MB answer; bounded before any work
        per_token = sum(1 + top for top in (echo_top, body.prompt_logprobs) if top is not None)
        entries = per_token * body.n * sum(len(ids) for ids in prompts)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise APIError(400, f"the answer would hold {entries:,} prompt logprob entries (prompt tokens x n x (1 + top "
                                f"alternatives) for echo and prompt_logprobs), more than the {MAX_PROMPT_LOGPROB_ENTRIES:,} a "
                                "request may ask for: score fewer tokens, choices or alternatives", "prompt_logprobs"
                                if body.prompt_logprobs is not None else "echo")  # fmt: skip
        groups = [
            PromptGroup(ids, [serving.sampling_params(body, serving.max_tokens(max_tokens, len(ids)), body.logprobs, i, prompt_top)
                              for i in range(body.n)], serving.beam_params(body, serving.max_tokens(max_tokens, len(ids)), len(ids)))  # fmt: skip
            for ids in prompts
        ]
        if groups[0].beam is not None and body.echo:
            raise APIError(400, "echo is not supported with use_beam_search by this server", "echo")
        await serving.compile_grammar(groups[0].params[0].structured_outputs, body.structured_field, request)
        echoed_texts = await asyncio.to_thread(self._echo_texts, body.prompt, prompts) if body.echo else None
        sub = serving.submit(request, groups, body.cache_salt, body.stream, lora_request=lora)
        request_id = f"cmpl-{sub.request_id}"
        created = int(time.time())
        n = body.n

        text_offsets: dict[int, TextOffsets] = {}  # per choice: its text so far, for text_offset
        started: set[int] = set()  # choices whose first chunk (the one that carries the echoed prompt) went out

        def choice(index: int, out: RequestOutput, text: str, lps) -> dict:
            first = index not in started
            started.add(index)
            if score_only:
                text, lps = "", []
            prompt_ids = groups[index // n].token_ids
            logprobs = None
            if body.logprobs is not None:
                echoed = (prompt_ids, out.prompt_logprobs, body.logprobs) if body.echo and first else None
                offsets = text_offsets.setdefault(index, TextOffsets(serving.tokenizer))
                logprobs = self._completion_logprobs(lps, offsets, echoed)
            c = {
                "index": index,
                "text": echoed_texts[index // n] + text if body.echo and first else text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None,
            }
            c["stop_reason"] = stop_reason(out)  # null until the choice ends, as vLLM sends it
            if body.prompt_logprobs is not None and first:
                c["prompt_logprobs"] = serving.prompt_logprobs(prompt_ids, out.prompt_logprobs, body.prompt_logprobs)
            if serving.tokenizer is None:
                c["token_ids"] = [] if score_only else out.token_ids
            return c

        def envelope(choices: list[dict]) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": choices}

        if body.stream:
            return serving.stream(sub, n, lambda idx, out, delta, lps: envelope([choice(idx, out, delta, lps)]), envelope,
                                  body.stream_options, generated=not score_only,
                                  heavy_first=body.prompt_logprobs is not None or (body.echo and body.logprobs is not None))  # fmt: skip
        outs = await serving.collect(sub, request)

        def answer() -> dict:
            choices = [choice(g * n + i, out, out.text, out.logprobs or []) for (g, i), out in sorted(outs.items())]
            return {**envelope(choices), "usage": serving.usage(groups, outs, generated=not score_only)}

        return await serving.answer(answer)

    async def _tokenize_prompts(self, prompt, keep: int | None = None) -> list[list[int]]:
        prompts = prompt_list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and self.serving.tokenizer is None:
            raise APIError(400, NO_TOKENIZER, "prompt")
        for text in texts:
            self.serving.check_text_length(len(text), "prompt")
        if texts:
            tokenizer = self.serving.tokenizer
            encoded = iter(await asyncio.to_thread(lambda: [tokenizer.encode(t) for t in texts]))
            prompts = [next(encoded) if isinstance(p, str) else p for p in prompts]
        prompts = [self.serving.truncate_prompt(list(ids), keep) for ids in prompts]
        for ids in prompts:
            self.serving.validate_prompt(ids, "prompt")
        return prompts

    def _echo_texts(self, prompt, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text as echo writes it: the text sent, or token ids decoded (blocking: run in a thread)."""
        return [p if isinstance(p, str) else self.serving.tokenizer.decode(ids, skip_special_tokens=False)
                for p, ids in zip(prompt_list(prompt), prompts)]  # fmt: skip

    def _top_dict(self, top: dict[int, float]) -> dict[str, float]:
        """Completions' {token: logprob}, most likely first; two tokens that read alike keep their own entries."""
        out: dict[str, float] = {}
        for token_id, value in sorted(top.items(), key=lambda item: -item[1]):
            text = self.serving.token_text(token_id)
            out[text if text not in out else f"{text}#{token_id}"] = value
        return out

    def _completion_logprobs(self, lps: list[TokenLogprobs], offsets: TextOffsets,
                             echoed: tuple[list[int], list[TokenLogprobs | None], int] | None = None) -> dict:  # fmt: skip
        """OpenAI's legacy logprobs; text_offset: where each token's text starts in the choice's text,
        counted on from the choice's earlier chunks by `offsets`. `echoed`: the prompt's token ids,
        their logprobs (the first None) and how many alternatives to show, listed first (echo)."""
        token_ids = [lp.token_id for lp in lps]
        values: list[float | None] = [lp.logprob for lp in lps]
        tops: list[dict | None] = [self._top_dict(lp.top) for lp in lps]
        if echoed is not None:
            prompt_ids, prompt_lps, top = echoed
            token_ids = prompt_ids + token_ids
            values = [lp.logprob if lp is not None else None for lp in prompt_lps] + values
            tops = [self._top_dict(most_likely(lp.top, top)) if lp is not None else None for lp in prompt_lps] + tops
        tokens = [self.serving.token_text(t) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets.take(token_ids)}


def register_routes(app: FastAPI, serving: OpenAIServing) -> None:
    endpoint = ServingCompletions(serving)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await endpoint.create(body, request)
