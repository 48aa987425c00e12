"""The OpenAI-compatible HTTP API (FastAPI).

Every check happens before a response starts: the body, the prompts (tokenized and the chat
template rendered off the event loop), every sample's parameters, and admission of all of them
at once. A streamed 200 then ends with `data: [DONE]`, after one error event when the request is
aborted after admission (deadline, shutdown, a failed engine step).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import json
import logging
import reprlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.engine.engine import LLMEngine
from kvserve.engine.migration import RequestState
from kvserve.engine.sequence import TokenLogprobs
from kvserve.model.chat_template import DEFAULT_MAX_CHARS, ChatTemplateError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.access import AccessGuard
from kvserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    PromptGroup,
    RequestAborted,
    Submission,
)
from kvserve.server.config import ServerConfig
from kvserve.server.errors import NO_TOKENIZER, APIError, aborted_body, error_response, validation_message
from kvserve.server.kv_snapshot import kv_snapshot as take_snapshot
from kvserve.server.loads import load_report, parse_include
from kvserve.server.metrics import ServerMetrics
from kvserve.server.tool_calls import (
    Tool, ToolCallParser, ToolChoice, call_grammar, message_with_calls, parse_tool_choice, parse_tools, template_takes_tools,
)
from kvserve.structured.spec import GrammarError, StructuredOutputs
from kvserve.structured.worker import IsolatedGrammarCompiler
from kvserve.server.migration import IMPORT_PATH, MIGRATE_PATH, MigrationFailed, Migrator, error_line, output_line
from kvserve.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, MigrateRequest, StreamOptions, TokenizeRequest,
)
from kvserve.server.templates import TemplateRenderer

log = logging.getLogger(__name__)


# endpoints of other engines that routers try on every worker (smg: /loads before /v1/loads at every load poll,
# /server_info when it tells SGLang from vLLM): kvserve has none of them
_ROUTER_PROBES = frozenset({"/loads", "/server_info", "/get_server_info", "/get_model_info"})
DASHBOARD_PAGE = (Path(__file__).parent / "dashboard.html").read_bytes()
_SPLICE = "\x00kvserve-splice\x00"
_SPLICED = json.dumps(_SPLICE)


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


def _top(top: dict[int, float], n: int) -> dict[int, float]:
    """The n most likely of a token's alternatives."""
    return dict(sorted(top.items(), key=lambda item: -item[1])[:n])


_CONTINUE_MARK = "\U0010fffd"  # a private-use character: where continue_final_message's message ends in the rendered text


def _stop_reason(out: RequestOutput) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the text, "grammar" where the
    request's constraint allowed no token (the output is cut short); None for EOS or a length."""
    return out.stop_reason if out.finished else None


def _request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "-")


class _SubmissionStream(StreamingResponse):
    """A streamed response that, however it ends (finished, aborted, client gone), closes its submission."""

    def __init__(self, content: AsyncIterator[str], sub: Submission, media_type: str = "text/event-stream") -> None:
        super().__init__(content, media_type=media_type)
        self.sub = sub

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.sub.close()


class OpenAIServer:
    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.model_name = config.served_model_name or engine.config.model
        self.chat_template = config.chat_template or (self.tokenizer.chat_template if self.tokenizer is not None else None)
        self.metrics = ServerMetrics(self.model_name)
        self.async_engine = AsyncEngine(engine, self.metrics, config.max_waiting_requests)
        self.renderer = TemplateRenderer()
        self.created = int(time.time())
        # a text longer than this is more than max_model_len tokens, whatever the tokenizer makes of it
        self.max_prompt_chars = engine.max_model_len * (self.tokenizer.max_token_chars if self.tokenizer is not None else 1)
        self.migrator = Migrator(self, config.migration_targets)
        self.grammar_compiler = IsolatedGrammarCompiler(engine.grammars, config.grammar_compile_timeout) if engine.grammars else None
        self._unknown_fields: set[str] = set()

    # ------------------------------------------------------------------ rejections: logged and counted once each
    def reject(self, request_id: str, where: str, status: int, message: str, kind: str, reason: str,
               param: str | None = None) -> JSONResponse:  # fmt: skip
        log.info("rejected %s %s: %d %s: %s", request_id, where, status, reason, message)
        self.metrics.rejected(reason)
        return error_response(status, message, param, kind, reason)

    # ------------------------------------------------------------------ checks before admission
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.engine.config.model):
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model", "model_not_found",
                           "model_not_found")  # fmt: skip

    def _note_unknown_fields(self, body) -> None:
        """Fields OpenAI does not define (a router's additions, vLLM extensions not implemented) are ignored: each
        name logged once, at debug level (a bounded set: a client cannot grow it without end)."""
        for name in body.model_extra or ():
            if name not in self._unknown_fields and len(self._unknown_fields) < 256:
                self._unknown_fields.add(name)
                log.debug("ignoring request field %s (not implemented; logged once)", reprlib.repr(name))

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        room = self.engine.max_model_len - prompt_len
        if requested is None:
            return max(1, room)
        if requested <= 0:
            raise APIError(400, f"{param} must be a positive integer, got {reprlib.repr(requested)}", param)
        if requested > room:
            raise APIError(
                400,
                f"{param}={requested} plus the prompt's {prompt_len} tokens exceeds max_model_len={self.engine.max_model_len}",
                param,
            )
        return requested

    def _check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.config.max_waiting_requests:
            limit = f"at most --max-waiting-requests {self.config.max_waiting_requests} can wait at once"
            if n == 1:  # the prompts alone are too many: the field at fault is prompt
                raise APIError(400, f"this request has {num_prompts} prompts; {limit}", "prompt")
            raise APIError(400, f"this request has {num_prompts * n} choices ({num_prompts} prompts x n={n}); {limit}", "n")

    def _check_text_length(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{param} has {chars} characters, more than max_model_len={self.engine.max_model_len} tokens can "
                           "hold", param)  # fmt: skip

    def _validate_prompt(self, ids: list[int], param: str) -> None:
        try:
            self.engine.validate_prompt_tokens(ids)
        except ValueError as exc:
            raise APIError(400, str(exc), param) from exc

    @staticmethod
    def _prompt_list(prompt) -> list:
        """A completion's prompt as a list of prompts, each a text or token ids."""
        if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
            return [prompt]
        return list(prompt)

    async def _tokenize_prompts(self, prompt) -> list[list[int]]:
        prompts = self._prompt_list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and self.tokenizer is None:
            raise APIError(400, NO_TOKENIZER, "prompt")
        for text in texts:
            self._check_text_length(len(text), "prompt")
        if texts:
            tokenizer = self.tokenizer
            encoded = iter(await asyncio.to_thread(lambda: [tokenizer.encode(t) for t in texts]))
            prompts = [next(encoded) if isinstance(p, str) else p for p in prompts]
        for ids in prompts:
            self._validate_prompt(ids, "prompt")
        return [list(ids) for ids in prompts]

    def _chat_ids(self, template: str, messages: list[dict], add_generation_prompt: bool = True, add_special_tokens: bool = False,
                  tools: list[dict] | None = None, continue_final_message: bool = False) -> list[int]:  # fmt: skip
        """Render and tokenize (blocking: run in a thread)."""
        if continue_final_message:  # the text ends where the last message's does (a mark placed after it), its end of turn cut
            if not messages[-1]["content"].strip():
                raise APIError(400, "continue_final_message continues the last message's text: it is empty", "continue_final_message")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_MARK}]
        text = self.renderer.render(template, messages, self.tokenizer.special_tokens, DEFAULT_MAX_CHARS, add_generation_prompt, tools)
        if continue_final_message:
            if text.count(_CONTINUE_MARK) != 1:
                raise APIError(400, "continue_final_message: the last message's text must appear once in the rendered conversation "
                               f"(this chat template {'drops' if _CONTINUE_MARK not in text else 'repeats'} it, or it holds U+10FFFD)",
                               "continue_final_message")  # fmt: skip
            text = text[: text.index(_CONTINUE_MARK)]
        self._check_text_length(len(text), "messages")
        # the template already carries BOS where the model wants it
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _chat_template_for(self, requested: str | None) -> str:
        """The template that renders a request's messages: the request's own (when the server trusts
        request templates) or the server's."""
        if requested is not None and not self.config.trust_request_chat_template:
            raise APIError(400, "chat_template in a request is refused: a template is code the server runs; start the server "
                           "with --trust-request-chat-template to accept it, or set --chat-template", "chat_template")  # fmt: skip
        template = requested or self.chat_template
        if template is None:
            raise APIError(
                400,
                f"model {self.model_name!r} has no chat template (base models ship none), so chat messages cannot be "
                "formatted; start the server with --chat-template (inline Jinja or a file), "
                "or send a plain prompt to /v1/completions",
                "messages",
            )
        return template

    async def _render_messages(self, messages: list, requested_template: str | None, add_generation_prompt: bool = True,
                               add_special_tokens: bool = False, tools: list[Tool] | None = None,
                               continue_final_message: bool = False) -> list[int]:  # fmt: skip
        if self.tokenizer is None:
            raise APIError(400, NO_TOKENIZER, "messages")
        template = self._chat_template_for(requested_template)
        if any(m.tool_calls for m in messages) and "tool_calls" not in template:
            raise APIError(400, "messages carry tool_calls, which this model's chat template does not render; refused rather than "
                           "dropped from the conversation", "messages")  # fmt: skip
        rendered = [m.rendered() for m in messages]
        self._check_text_length(sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in rendered), "messages")
        definitions = [t.definition for t in tools] if tools else None
        try:
            return await asyncio.to_thread(self._chat_ids, template, rendered, add_generation_prompt, add_special_tokens, definitions,
                                           continue_final_message)  # fmt: skip
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "chat_template" if requested_template is not None else "messages") from None

    def _params(self, body, max_tokens: int, logprobs: int | None, offset: int, prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            params = body.sampling_params(max_tokens, logprobs, offset, prompt_logprobs)
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, message.split(" ", 1)[0] if message else None) from exc
        try:
            self.engine.eviction_policy(params)
        except ValueError as exc:
            raise APIError(400, str(exc), "snapkv_query" if str(exc).startswith("snapkv_query") else "kv_compression") from exc
        if params.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; " + NO_TOKENIZER.split(": ", 1)[0] + " (use stop_token_ids)", "stop")
        vocab = self.engine.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise APIError(400, f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        return params

    def _tools(self, body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[Tool], ToolChoice]:
        """The request's tools and tool_choice; tools need a chat template that renders them."""
        try:
            tools = parse_tools(body.tools or [])
            choice = parse_tool_choice(body.tool_choice, tools)
        except GrammarError as exc:
            raise APIError(400, str(exc), exc.param) from None
        if choice.mode != "none":
            if self.tokenizer is None:
                raise APIError(400, NO_TOKENIZER, "tools")
            if not template_takes_tools(self._chat_template_for(body.chat_template)):
                raise APIError(400, f"model {self.model_name!r} does not take tools: its chat template does not render them "
                               "(Qwen2.5 instruct models do; or set --chat-template)", "tools")  # fmt: skip
            if isinstance(body, TokenizeRequest):
                return tools, choice
            if choice.mode == "required" and body.structured_field is not None:
                raise APIError(400, f"tool_choice {body.tool_choice!r} constrains the output; {body.structured_field} cannot as well",
                               body.structured_field)  # fmt: skip
        return tools, choice

    async def _compile_grammar(self, spec: StructuredOutputs | None, field: str | None) -> None:
        """Compiles a request's output constraint (off the event loop, within --grammar-compile-timeout) before it is admitted."""
        if spec is None:
            return
        if self.grammar_compiler is None:
            raise APIError(400, f"{field} needs the model's tokenizer; " + NO_TOKENIZER.split(": ", 1)[0], field)
        try:
            await self.grammar_compiler.compile(spec)
        except GrammarError as exc:
            raise APIError(400, f"{field}: {exc}", field) from None

    def _submit(self, request: Request, groups: list[PromptGroup], cache_salt: str | None, stream: bool, imported=None) -> Submission:
        arrival = request.scope.get("state", {}).get("arrival", time.monotonic())
        try:
            return self.async_engine.submit(_request_id(request), groups, cache_salt, stream, self.config.request_timeout,
                                            time.monotonic() - arrival, imported)  # fmt: skip
        except EngineOverloadedError as exc:
            # a router (smg) retries a 503 on another replica; a client learns when to come back
            raise APIError(503, f"server overloaded: {exc}; retry later", None, "server_overloaded", "overloaded",
                           {"Retry-After": "1"}) from None  # fmt: skip
        except EngineDrainingError:
            raise APIError(503, "the server is shutting down; retry later", None, "server_unavailable", "shutting_down",
                           {"Retry-After": "1"}) from None  # fmt: skip
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "server_error", "engine_unavailable") from None

    # ------------------------------------------------------------------ output helpers
    def _usage(self, groups: list[PromptGroup], outs: dict[tuple[int, int], RequestOutput], generated: bool = True) -> dict:
        """Each prompt counted once, however many samples (n) it has; `generated` false: a prompt scored, nothing generated."""
        prompt_tokens = sum(len(group.token_ids) for group in groups)
        completion = sum(o.num_output_tokens for o in outs.values()) if generated else 0
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(outs[(g, 0)].num_cached_tokens for g in range(len(groups)) if (g, 0) in outs)},
        }

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    def _top_dict(self, top: dict[int, float]) -> dict[str, float]:
        """Completions' {token: logprob}, most likely first; two tokens that read alike keep their own entries."""
        out: dict[str, float] = {}
        for token_id, value in sorted(top.items(), key=lambda item: -item[1]):
            text = self._token_text(token_id)
            out[text if text not in out else f"{text}#{token_id}"] = value
        return out

    def _completion_logprobs(self, lps: list[TokenLogprobs], offsets: "TextOffsets",
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
            tops = [self._top_dict(_top(lp.top, top)) if lp is not None else None for lp in prompt_lps] + tops
        tokens = [self._token_text(t) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets.take(token_ids)}

    def _prompt_logprobs(self, prompt_ids: list[int], lps: list[TokenLogprobs | None], top: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (the first None), {token id: logprob, rank, decoded_token},
        the prompt's own token first, then the `top` most likely."""
        out: list[dict | None] = []
        for token_id, lp in zip(prompt_ids, lps):
            if lp is None:
                out.append(None)
                continue
            entry = {str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._token_text(token_id)}}
            for rank, (other, value) in enumerate(_top(lp.top, top).items(), 1):
                entry.setdefault(str(other), {"logprob": value, "rank": rank, "decoded_token": self._token_text(other)})
            out.append(entry)
        return out

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        tokenizer = self.tokenizer

        def entry(token_id: int, value: float) -> dict:
            raw = tokenizer.token_bytes(token_id) if tokenizer is not None else str(token_id).encode()
            return {"token": self._token_text(token_id), "logprob": value, "bytes": list(raw)}

        content = []
        for lp in lps:
            top = sorted(lp.top.items(), key=lambda item: -item[1])
            content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in top]})
        return {"content": content}

    # ------------------------------------------------------------------ endpoints
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        self._note_unknown_fields(body)
        num_prompts = len(self._prompt_list(body.prompt))
        self._check_choices(num_prompts, body.n)
        if body.echo and self.tokenizer is None:
            raise APIError(400, "echo needs a tokenizer to write the prompt's text; " + NO_TOKENIZER.split(": ", 1)[0], "echo")
        prompts = await self._tokenize_prompts(body.prompt)
        # echo with max_tokens 0 scores the prompt and generates nothing (vLLM's behaviour): one token is drawn and dropped
        score_only = body.echo and body.max_tokens == 0
        max_tokens = 1 if score_only else body.max_tokens if body.max_tokens is not None else 16
        echo_top = body.logprobs if body.echo else None  # echo with logprobs: the prompt tokens' logprobs too
        prompt_top = max((t for t in (echo_top, body.prompt_logprobs) if t is not None), default=None)
        groups = [
            PromptGroup(ids, [self._params(body, self._max_tokens(max_tokens, len(ids)), body.logprobs, i, prompt_top)
                              for i in range(body.n)])  # fmt: skip
            for ids in prompts
        ]
        await self._compile_grammar(groups[0].params[0].structured_outputs, body.structured_field)
        echoed_texts = await asyncio.to_thread(self._echo_texts, body.prompt, prompts) if body.echo else None
        sub = self._submit(request, groups, body.cache_salt, body.stream)
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
                offsets = text_offsets.setdefault(index, TextOffsets(self.tokenizer))
                logprobs = self._completion_logprobs(lps, offsets, echoed)
            c = {
                "index": index,
                "text": echoed_texts[index // n] + text if body.echo and first else text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None,
            }
            c["stop_reason"] = _stop_reason(out)  # null until the choice ends, as vLLM sends it
            if body.prompt_logprobs is not None and first:
                c["prompt_logprobs"] = self._prompt_logprobs(prompt_ids, out.prompt_logprobs, body.prompt_logprobs)
            if self.tokenizer is None:
                c["token_ids"] = [] if score_only else out.token_ids
            return c

        def envelope(choices: list[dict]) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name, "choices": choices}

        if body.stream:
            return self._stream(sub, n, lambda idx, out, delta, lps: envelope([choice(idx, out, delta, lps)]), envelope, body.stream_options,
                                generated=not score_only)
        outs = await self._collect(sub, request)
        choices = [choice(g * n + i, out, out.text, out.logprobs or []) for (g, i), out in sorted(outs.items())]
        return {**envelope(choices), "usage": self._usage(groups, outs, generated=not score_only)}

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        self._note_unknown_fields(body)
        self._check_choices(1, body.n)
        tools, tool_choice = self._tools(body)
        calling = tool_choice.mode != "none"
        ids = await self._render_messages(body.messages, body.chat_template, body.add_generation_prompt, tools=tools if calling else None,
                                          continue_final_message=body.continue_final_message)  # fmt: skip
        self._validate_prompt(ids, "messages")
        # vLLM's echo: the last message's text before the new text when it is the assistant's (the one continued)
        echoed = body.messages[-1].text() if body.echo and body.messages[-1].role == "assistant" else ""
        if echoed and calling:
            raise APIError(400, "echo with tools is not supported by this server (the echoed text would be read as a call)", "echo")
        if body.max_completion_tokens is not None:
            max_tokens = self._max_tokens(body.max_completion_tokens, len(ids), "max_completion_tokens")
        else:
            max_tokens = self._max_tokens(body.max_tokens, len(ids))
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        if top is not None and not 0 <= top <= 20:
            raise APIError(400, f"top_logprobs must be an integer in [0, 20], got {reprlib.repr(top)}", "top_logprobs")
        params = [self._params(body, max_tokens, top, i, body.prompt_logprobs) for i in range(body.n)]
        if calling:  # the calls' grammar is compiled under auto too: a tool whose parameters are no schema is a 400 either way
            try:
                spec = call_grammar(tools, tool_choice, body.parallel_tool_calls is not False)
            except GrammarError as exc:
                raise APIError(400, f"tools: {exc}", "tools") from None
            await self._compile_grammar(spec, "tools")
            if tool_choice.mode == "required":
                params = [dataclasses.replace(p, structured_outputs=spec) for p in params]
        if tool_choice.mode != "required":
            await self._compile_grammar(params[0].structured_outputs, body.structured_field)
        groups = [PromptGroup(ids, params)]
        sub = self._submit(request, groups, body.cache_salt, body.stream)
        request_id = f"chatcmpl-{sub.request_id}"
        created = int(time.time())

        def envelope(choices: list[dict], obj: str = "chat.completion.chunk") -> dict:
            return {"id": request_id, "object": obj, "created": created, "model": self.model_name, "choices": choices}

        started: set[int] = set()  # choices whose first chunk (the one that names the role, as OpenAI's) went out
        parsers: dict[int, ToolCallParser] = {}  # with tools: each choice's text split into content and tool calls

        def chunk(index: int, out: RequestOutput, delta: str, lps) -> dict | None:
            first = index not in started
            started.add(index)
            message: dict = {"content": delta}
            finish = out.finish_reason if out.finished else None
            if calling:
                parser = parsers.setdefault(index, ToolCallParser(t.name for t in tools))
                made = parser.num_calls
                content, calls = parser.parse(delta, last=out.finished)
                message = {"content": content or (None if calls else "")}
                if calls:
                    message["tool_calls"] = [{"index": made + k, **call} for k, call in enumerate(calls)]
                elif not content and not first and finish is None and not (body.logprobs and lps):
                    return None  # the text is held (it may be a call): nothing to send yet
                if finish == "stop" and parser.num_calls:
                    finish = "tool_calls"
            if first and echoed:
                message["content"] = echoed + message["content"]
            c = envelope([{
                "index": index,
                "delta": {"role": "assistant", **message} if first else message,
                "logprobs": self._chat_logprobs(lps) if body.logprobs else None,
                "finish_reason": finish,
                "stop_reason": _stop_reason(out),
            }])
            if body.prompt_logprobs is not None and first:
                c["prompt_logprobs"] = self._prompt_logprobs(ids, out.prompt_logprobs, body.prompt_logprobs)
            return c

        if body.stream:
            return self._stream(sub, body.n, chunk, envelope, body.stream_options, splice=not calling)
        outs = await self._collect(sub, request)

        def message(out: RequestOutput) -> tuple[dict, str | None]:
            if not calling:
                return {"role": "assistant", "content": echoed + out.text}, out.finish_reason
            content, calls = message_with_calls(out.text, (t.name for t in tools))
            if not calls:
                return {"role": "assistant", "content": content or ""}, out.finish_reason
            finish = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
            return {"role": "assistant", "content": content, "tool_calls": calls}, finish

        choices = []
        for (_, i), out in sorted(outs.items()):
            msg, finish = message(out)
            choices.append({"index": i, "message": msg, "logprobs": self._chat_logprobs(out.logprobs or []) if body.logprobs else None,
                            "finish_reason": finish, "stop_reason": _stop_reason(out)})  # fmt: skip
        response = {**envelope(choices, "chat.completion"), "usage": self._usage(groups, outs)}
        if body.prompt_logprobs is not None:  # vLLM's place for them: the response's, the prompt being one for every choice
            response["prompt_logprobs"] = self._prompt_logprobs(ids, outs[(0, 0)].prompt_logprobs, body.prompt_logprobs)
        return response

    async def _collect(self, sub: Submission, request: Request) -> dict[tuple[int, int], RequestOutput]:
        """Every sample's finished output; a client that leaves aborts the request."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            sub.fail(RequestAborted("client_disconnected", "the client disconnected", 499))

        watcher = asyncio.ensure_future(watch())
        results: dict[tuple[int, int], RequestOutput] = {}
        try:
            async for g, i, out in sub.outputs():
                if out.finished:
                    results[(g, i)] = out
            return results
        finally:
            watcher.cancel()
            sub.close()

    def _stream(self, sub: Submission, n: int, make_chunk, envelope, stream_options: StreamOptions | None, generated: bool = True,
                splice: bool = True) -> StreamingResponse:  # fmt: skip
        """Server-sent events of the submission's outputs; `splice` lets a plain chunk be the first one's JSON with new text spliced in."""
        include_usage = bool(stream_options and stream_options.include_usage)
        continuous = include_usage and stream_options.continuous_usage_stats  # vLLM's: every chunk carries its choice's usage so far
        templates: dict[int, tuple[str, str]] = {}
        sent: set[int] = set()

        def event(idx: int, out: RequestOutput) -> str:
            lps = out.logprobs or []
            if continuous or not splice or out.finished or lps or self.tokenizer is None or idx not in sent:  # a choice's first chunk differs (chat: the role)
                sent.add(idx)
                chunk = make_chunk(idx, out, out.text, lps)
                if chunk is not None and continuous:
                    prompt = len(sub.groups[idx // n].token_ids)
                    done = out.num_output_tokens if generated else 0
                    chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
                return "" if chunk is None else f"data: {json.dumps(chunk)}\n\n"
            # the common chunk (new text only) is its JSON with the text spliced in: no dict, one dumps
            if idx not in templates:
                head, tail = json.dumps(make_chunk(idx, out, _SPLICE, [])).split(_SPLICED, 1)
                templates[idx] = (f"data: {head}", f"{tail}\n\n")
            head, tail = templates[idx]
            return head + json.dumps(out.text) + tail

        async def events() -> AsyncIterator[str]:
            finals: dict[tuple[int, int], RequestOutput] = {}
            try:
                async for g, i, out in sub.outputs():
                    if out.finished:
                        finals[(g, i)] = out
                    if out.text or out.finished or out.logprobs or (out.token_ids and self.tokenizer is None):
                        text = event(g * n + i, out)
                        if text:  # a chunk function may have nothing to send yet (tool calls being held)
                            yield text
            except RequestAborted as exc:  # then [DONE], as vLLM ends every stream
                yield f"data: {json.dumps(aborted_body(exc))}\n\n"
                yield "data: [DONE]\n\n"
                return
            if include_usage:
                yield f"data: {json.dumps({**envelope([]), 'usage': self._usage(sub.groups, finals, generated)})}\n\n"
            yield "data: [DONE]\n\n"

        return _SubmissionStream(events(), sub)

    def _echo_texts(self, prompt, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text as echo writes it: the text sent, or token ids decoded (blocking: run in a thread)."""
        return [p if isinstance(p, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
                for p, ids in zip(self._prompt_list(prompt), prompts)]  # fmt: skip

    # ------------------------------------------------------------------ tokenizer endpoints (vLLM's)
    def _need_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise APIError(400, NO_TOKENIZER.split(": ", 1)[0], param)
        return self.tokenizer

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self._check_model(body.model)
        if body.prompt is not None:
            tokenizer = self._need_tokenizer("prompt")
            self._check_text_length(len(body.prompt), "prompt")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add)
        else:
            tools, choice = self._tools(body)
            tools = tools if choice.mode != "none" else None  # as chat renders them
            ids = await self._render_messages(body.messages, body.chat_template, body.add_generation_prompt, bool(body.add_special_tokens),
                                              tools, body.continue_final_message)  # fmt: skip
        strs = await asyncio.to_thread(self.tokenizer.token_strings, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check_model(body.model)
        tokenizer = self._need_tokenizer("tokens")
        vocab = self.engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {reprlib.repr(bad)}", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}

    def tokenizer_info(self) -> dict:
        tokenizer = self._need_tokenizer("tokenizer")
        special = tokenizer.special_tokens
        return {
            "tokenizer_class": tokenizer.class_name,
            **{name: special.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
            "model_max_length": self.engine.max_model_len,
            "vocab_size": tokenizer.vocab_size,
            "chat_template": self.chat_template,
        }

    # ------------------------------------------------------------------ live migration (server/migration.py)
    async def migrate(self, body: MigrateRequest) -> dict:
        target = body.target.strip().rstrip("/")
        if not self.config.migration_targets:
            raise APIError(403, "live migration is off on this server: start it with --migration-targets", "target",
                           "permission_error", "migration_disabled")  # fmt: skip
        if target not in self.config.migration_targets:
            raise APIError(403, f"target {target!r} is not in --migration-targets", "target", "permission_error", "target_not_allowed")
        request_id = body.request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
        sub = self.async_engine.find(request_id)
        if sub is None:
            raise APIError(404, f"no running request {body.request_id!r}", "request_id", "not_found_error", "request_not_found")
        if sub.relays:
            raise APIError(409, f"request {body.request_id!r} has already migrated", "request_id", "invalid_request_error", "already_migrated")
        try:
            moved = await self.migrator.migrate(sub, target)
        except MigrationFailed as exc:
            raise APIError(502, f"{exc}; the request goes on here", "target", "server_error", "migration_failed") from None
        except (ValueError, KeyError) as exc:
            raise APIError(409, f"request {body.request_id!r} cannot migrate: {exc}", "request_id", "invalid_request_error",
                           "not_migratable") from None  # fmt: skip
        log.info("migrated %s (%d samples) to %s", sub.request_id, moved, target)
        return {"request_id": body.request_id, "target": target, "migrated_samples": moved}

    async def import_request(self, request: Request) -> StreamingResponse:
        """Continue a request another server exported; its outputs as JSON lines (server/migration.py)."""
        raw = await request.body()

        def parse() -> tuple[RequestState, list]:
            state = RequestState.from_bytes(raw)
            self.engine.check_import(state)
            return state, self.engine.decode_records(state)  # the checksums, off the event loop and the engine thread

        try:
            state, records = await asyncio.to_thread(parse)
        except ValueError as exc:
            raise APIError(400, str(exc), None, "invalid_request_error", "invalid_migration_state") from None
        sub = self._submit(request, [PromptGroup(state.prompt_token_ids, [state.params])], state.cache_salt, state.stream,
                           (state, records))  # fmt: skip

        async def lines() -> AsyncIterator[str]:
            try:
                async for _, _, out in sub.outputs():
                    yield output_line(out)
            except RequestAborted as exc:
                yield error_line(exc)

        return _SubmissionStream(lines(), sub, "application/x-ndjson")

    # ------------------------------------------------------------------ shutdown
    async def drain(self, timeout: float) -> None:
        """Stop admitting, let running requests finish for up to `timeout` seconds, abort the rest."""
        engine = self.async_engine
        engine.stop_admitting()
        log.info("shutting down: %d requests running, waiting up to %g s (--shutdown-timeout)", engine.num_active, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while engine.num_active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_active:
            log.info("shutdown timeout: aborting %d requests", engine.num_active)
            engine.abort_all(RequestAborted("shutdown", "the server shut down before this request finished", 503))
            deadline = loop.time() + 5.0  # their responses send the error event, then end
            while engine.num_active and loop.time() < deadline:
                await asyncio.sleep(0.05)


def create_app(server: OpenAIServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        server.async_engine.start()
        await asyncio.to_thread(server.renderer.start)
        try:
            yield
        finally:
            server.async_engine.shutdown()
            server.renderer.close()
            if server.grammar_compiler is not None:
                server.grammar_compiler.close()
            await server.migrator.close()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)

    def where(request: Request) -> str:
        return f"{request.method} {request.url.path}"

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        response = server.reject(_request_id(request), where(request), exc.status, exc.message, exc.kind, exc.reason, exc.param)
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        whole_body = [err for err in exc.errors() if tuple(err.get("loc", ())) == ("body",)]
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if whole_body and whole_body[0].get("type") == "missing":
            return server.reject(_request_id(request), where(request), 400, "the request body is empty: send a JSON object",
                                 "invalid_request_error", "invalid_request")  # fmt: skip
        if whole_body and media != "application/json" and not media.endswith("+json"):
            given = f"Content-Type: {reprlib.repr(media)}" if media else "no Content-Type"
            return server.reject(_request_id(request), where(request), 415, f"the body must be JSON (Content-Type: application/json), "
                                 f"got {given}", "invalid_request_error", "unsupported_media_type")  # fmt: skip
        message, param = validation_message(exc)
        return server.reject(_request_id(request), where(request), 400, message, "invalid_request_error", "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        reason = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code == 404 and request.url.path in _ROUTER_PROBES:  # asked again at every poll: neither logged nor counted
            log.debug("%s %s: 404 (a router's probe for another engine's endpoint)", _request_id(request), where(request))
            return error_response(404, str(exc.detail), None, kind, reason)
        response = server.reject(_request_id(request), where(request), exc.status_code, str(exc.detail), kind, reason)
        response.headers.update(exc.headers or {})  # a 405's Allow: the methods the path takes
        return response

    @app.exception_handler(RequestAborted)
    async def _aborted(_: Request, exc: RequestAborted):
        return JSONResponse(aborted_body(exc), status_code=exc.status)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return server.reject(_request_id(request), where(request), 503, str(exc), "server_error", "engine_unavailable")

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return server.reject(_request_id(request), where(request), 400, str(exc), "invalid_request_error", "invalid_request")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # a bug of ours, not the client's: uvicorn logs its traceback after this line
        log.error("internal error on %s %s: %s", _request_id(request), where(request), type(exc).__name__)
        return error_response(500, f"internal server error ({type(exc).__name__})", None, "server_error", "internal_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await server.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return server.tokenizer_info()

    @app.post(MIGRATE_PATH)
    async def migrate(body: MigrateRequest):
        return await server.migrate(body)

    @app.post(IMPORT_PATH)
    async def import_request(request: Request):
        return await server.import_request(request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        forgotten = await asyncio.to_thread(server.async_engine.reset_prefix_cache)
        return {"reset": True, "blocks_forgotten": forgotten}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """SGLang's name for /reset_prefix_cache, which routers (smg's POST /flush_cache) fan out to every worker."""
        forgotten = await asyncio.to_thread(server.async_engine.reset_prefix_cache)
        return {"flushed": True, "blocks_forgotten": forgotten}

    @app.get("/v1/loads")
    async def loads(include: str | None = None):
        engine = server.async_engine
        stats = engine.stats
        return load_report(stats, parse_include(include), kvserve.__version__, engine.num_admitting,
                           engine.generation_rate.rate(stats["generation_tokens_total"]))  # fmt: skip

    @app.get("/v1/kv/snapshot")
    async def kv_snapshot():
        """The KV cache now (server/kv_snapshot.py), taken between two engine steps."""
        show_tokens = server.config.dashboard_show_tokens
        return await server.async_engine.call(lambda: take_snapshot(server.engine, server.model_name, show_tokens))

    @app.api_route("/dashboard", methods=["GET", "HEAD"])
    async def dashboard():
        """The live KV page: static, no data of its own (it reads /v1/kv/snapshot, which needs the API key)."""
        return Response(DASHBOARD_PAGE, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "kvserve",
            "max_model_len": server.engine.max_model_len,
        }]}

    @app.get("/favicon.ico")
    async def favicon():  # browsers ask on every page load (/dashboard): no icon, and no 404 counted as a rejection
        return Response(status_code=204)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not server.async_engine.is_alive:
            return error_response(503, "engine loop is not running", None, "server_error", "engine_unavailable")
        if not server.async_engine.accepting:
            return error_response(503, "the server is shutting down", None, "server_unavailable", "shutting_down")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def build_asgi(server: OpenAIServer) -> AccessGuard:
    """The app behind its access guard: what uvicorn serves."""

    def reject(request_id: str, where: str, status: int, message: str, kind: str, reason: str) -> Response:
        return server.reject(request_id, where, status, message, kind, reason)

    return AccessGuard(create_app(server), server.config, reject, server.engine.max_migration_bytes())


def run_server(args) -> int:
    from kvserve.engine_args import engine_config_from_args
    from kvserve.server.shutdown import serve

    server_config = ServerConfig.from_args(args)
    config = engine_config_from_args(args, max_waiting_requests=server_config.max_waiting_requests)
    engine = LLMEngine(config)
    server = OpenAIServer(engine, server_config)
    return serve(server, build_asgi(server), args.uvicorn_log_level)
