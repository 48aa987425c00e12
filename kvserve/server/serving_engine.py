"""The path every endpoint family (server/serving_*.py) shares from a request to the engine and back:
the checks, the prompt's tokens, the sampling parameters, admission, and the response, whole or streamed.

Every check happens before a response starts: the body, the prompts (tokenized and the chat
template rendered off the event loop), every sample's parameters, and admission of all of them
at once. A streamed 200 then ends with `data: [DONE]`, after one error event when the request is
aborted after admission (deadline, shutdown, a failed engine step).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import reprlib
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.beam import BeamSearchParams
from kvserve.engine.beam_search import check_fits
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sequence import TokenLogprobs
from kvserve.model.chat_template import CONTINUE_MARK, DEFAULT_MAX_CHARS, ChatTemplateError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.lora.request import LoRARequest
from kvserve.server.serving_lora import LoRAModules
from kvserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    PromptGroup,
    RequestAborted,
    Submission,
)
from kvserve.server.config import is_loopback, ServerConfig
from kvserve.server.errors import NO_TOKENIZER, APIError, aborted_body, error_response
from kvserve.server.metrics import ServerMetrics
from kvserve.server.migration import Migrator
from kvserve.server.protocol import ChatCompletionRequest, StreamOptions, TokenizeRequest
from kvserve.server.templates import TemplateRenderer
from kvserve.server.truncation import DoesNotFit, Room, fit_conversation
from kvserve.server.tool_calls import MAX_TOOLS_CHARS, Tool, ToolChoice, parse_tool_choice, parse_tools, template_takes_tools
from kvserve.structured.spec import GrammarError, StructuredOutputs, exceeds_chars
from kvserve.structured.worker import CompileQueueFull, IsolatedGrammarCompiler

# one logger for the whole HTTP layer (app.py, serving_*.py), under the name its lines have always carried:
# the server's one request log, whichever endpoint family writes it (bench/soak.py reads its "kvserve.server: rejected" lines)
log = logging.getLogger("kvserve.server")
_MIN_PERSIST_S = 5.0  # the drain's last step may take this long past --shutdown-timeout

_SPLICE = "\x00kvserve-splice\x00"
_SPLICED = json.dumps(_SPLICE)


# a stream's chunk of one choice: (choice index, its output, its new text, its new tokens' logprobs) -> the chunk, or None
ChunkMaker = Callable[[int, RequestOutput, str, list[TokenLogprobs]], dict | None]


def most_likely(top: dict[int, float], n: int) -> dict[int, float]:
    """The n most likely of a token's alternatives."""
    return dict(sorted(top.items(), key=lambda item: -item[1])[:n])


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read by then: what is left to receive is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _render_json(answer: dict) -> bytes:
    """JSONResponse's bytes, the top-level lists' items serialized one at a time: json.dumps holds the
    GIL for a whole call, so tens of MB in one call would stall the event loop's thread all the same."""
    dump = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    def value(v) -> str:
        return "[" + ",".join(dump(item) for item in v) + "]" if isinstance(v, list) else dump(v)

    return ("{" + ",".join(f"{dump(k)}:{value(v)}" for k, v in answer.items()) + "}").encode()


def stop_reason(out: RequestOutput) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the text, "grammar" where the
    request's constraint allowed no token (the output is cut short); None for EOS or a length."""
    return out.stop_reason if out.finished else None


def request_id_of(request: Request) -> str:
    """The id the access guard gave the request (server/access.py), which its log lines name."""
    return request.scope.get("state", {}).get("request_id", "-")


class SubmissionStream(StreamingResponse):
    """A streamed response that, however it ends (finished, aborted, client gone), closes its submission."""

    def __init__(self, content: AsyncIterator[str], sub: Submission, media_type: str = "text/event-stream") -> None:
        super().__init__(content, media_type=media_type)
        self.sub = sub

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.sub.close()


class OpenAIServing:
    """What every endpoint family shares: the engine and its event-loop side (AsyncEngine), the tokenizer,
    the chat template, the server's settings and metrics; and the path of a request through them."""

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
        self.grammar_compiler = None if engine.grammars is None else IsolatedGrammarCompiler(
            engine.grammars, config.grammar_compile_timeout, config.grammar_compile_workers, config.grammar_compile_memory_mb << 20)
        self._unknown_fields: set[str] = set()
        self.lora_modules = LoRAModules(engine, (self.model_name, engine.config.model), self.metrics.forget_lora,
                                        self.async_engine.call, self.metrics.serve_lora)
        if (config.lora_modules or config.allow_runtime_lora_updating) and engine.lora is None:
            raise ValueError(f"--{'lora-modules' if config.lora_modules else 'allow-runtime-lora-updating'} needs --enable-lora")
        if config.allow_runtime_lora_updating and config.api_key is None and not is_loopback(config.host):
            log.warning("--allow-runtime-lora-updating without --api-key on %s: anyone who reaches the port can load adapters "
                        "from this machine's files", config.host)  # fmt: skip
        for name, path in config.lora_modules:
            try:
                self.lora_modules.load(name, path)
            except APIError as exc:
                raise ValueError(f"--lora-modules {name}={path}: {exc.message}") from None
        if config.lora_modules:
            log.info("LoRA adapters served: %s", ", ".join(name for name, _ in config.lora_modules))
        stats = engine.stats()
        log.info("%s: weights held as %s (%s activations), %.1f MiB; KV cache %d blocks, %.1f MiB (%s)", self.model_name,
                 engine.weights_description(), stats["dtype"], stats["weight_bytes"] / 2**20, stats["num_blocks"],
                 stats["kv_cache_bytes"] / 2**20, stats["kv_cache_dtype"])  # fmt: skip

    # ------------------------------------------------------------------ rejections: logged and counted once each
    def reject(self, request_id: str, where: str, status: int, message: str, kind: str, reason: str,
               param: str | None = None) -> JSONResponse:  # fmt: skip
        log.info("rejected %s %s: %d %s: %s", request_id, where, status, reason, message)
        self.metrics.rejected(reason)
        return error_response(status, message, param, kind, reason)

    # ------------------------------------------------------------------ checks before admission
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name not served."""
        if model is None or model in (self.model_name, self.engine.config.model):
            return None
        adapter = self.lora_modules.request_for(model)
        if adapter is None:
            served = ", ".join(repr(n) for n in [self.model_name, *self.lora_modules.names][:8])
            raise APIError(404, f"model {reprlib.repr(model)} does not exist; this server serves {served}", "model", "model_not_found",
                           "model_not_found")  # fmt: skip
        return adapter

    def note_unknown_fields(self, body) -> None:
        """Fields OpenAI does not define (a router's additions, vLLM extensions not implemented) are ignored: each
        name logged once, at debug level (a bounded set: a client cannot grow it without end)."""
        for name in body.model_extra or ():
            if name not in self._unknown_fields and len(self._unknown_fields) < 256:
                self._unknown_fields.add(name)
                log.debug("ignoring request field %s (not implemented; logged once)", reprlib.repr(name))

    def max_tokens(self, requested: int | None, prompt_len: int, param: str = "max_tokens") -> int:
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

    def check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.config.max_waiting_requests:
            limit = f"at most --max-waiting-requests {self.config.max_waiting_requests} can wait at once"
            if n == 1:  # the prompts alone are too many: the field at fault is prompt
                raise APIError(400, f"this request has {num_prompts} prompts; {limit}", "prompt")
            raise APIError(400, f"this request has {num_prompts * n} choices ({num_prompts} prompts x n={n}); {limit}", "n")

    def check_text_length(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{param} has {chars} characters, more than max_model_len={self.engine.max_model_len} tokens can "
                           "hold", param)  # fmt: skip

    def validate_prompt(self, ids: list[int], param: str) -> None:
        try:
            self.engine.validate_prompt_tokens(ids)
        except ValueError as exc:
            raise APIError(400, str(exc), param) from exc

    def _chat_ids(self, template: str, messages: list[dict], add_generation_prompt: bool = True, add_special_tokens: bool = False,
                  tools: list[dict] | None = None, continue_final_message: bool = False) -> list[int]:  # fmt: skip
        """Render and tokenize (blocking: run in a thread)."""
        if continue_final_message:  # the text ends where the last message's does (a mark placed after it), its end of turn cut
            if not messages[-1]["content"].strip():
                raise APIError(400, "continue_final_message continues the last message's text: it is empty", "continue_final_message")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_MARK}]
        text = self.renderer.render(template, messages, self.tokenizer.special_tokens, DEFAULT_MAX_CHARS, add_generation_prompt, tools)
        if continue_final_message:
            if text.count(CONTINUE_MARK) != 1:
                raise APIError(400, "continue_final_message: the last message's text must appear once in the rendered conversation "
                               f"(this chat template {'drops' if CONTINUE_MARK not in text else 'repeats'} it, or it holds U+10FFFD)",
                               "continue_final_message")  # fmt: skip
            text = text[: text.index(CONTINUE_MARK)]
        self.check_text_length(len(text), "messages")
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

    async def render_messages(self, messages: list, requested_template: str | None, add_generation_prompt: bool = True,
                              add_special_tokens: bool = False, tools: list[Tool] | None = None,
                              continue_final_message: bool = False) -> list[int]:  # fmt: skip
        if self.tokenizer is None:
            raise APIError(400, NO_TOKENIZER, "messages")
        template = self._chat_template_for(requested_template)
        if any(m.tool_calls for m in messages) and "tool_calls" not in template:
            raise APIError(400, "messages carry tool_calls, which this model's chat template does not render; refused rather than "
                           "dropped from the conversation", "messages")  # fmt: skip
        rendered = [m.rendered() for m in messages]
        self.check_text_length(sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in rendered), "messages")
        definitions = [t.definition for t in tools] if tools else None
        try:
            return await asyncio.to_thread(self._chat_ids, template, rendered, add_generation_prompt, add_special_tokens, definitions,
                                           continue_final_message)  # fmt: skip
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "chat_template" if requested_template is not None else "messages") from None

    def sampling_params(self, body, max_tokens: int, logprobs: int | None, offset: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
        try:
            params = body.sampling_params(max_tokens, logprobs, offset, prompt_logprobs)
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, message.split(" ", 1)[0] if message else None) from exc
        try:
            self.engine.eviction_policy(params)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), field if field in ("snapkv_query", "kv_compress_from") else "kv_compression") from exc
        if params.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; " + NO_TOKENIZER.split(": ", 1)[0] + " (use stop_token_ids)", "stop")
        vocab = self.engine.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise APIError(400, f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        return params

    def beam_params(self, body, max_tokens: int, prompt_len: int) -> BeamSearchParams | None:
        """The request's beam search (use_beam_search), or None; a 400 naming what it cannot take (a group
        the KV pool cannot hold to its end among them)."""
        try:
            beam = body.beam_search_params(max_tokens)
            if beam is not None and body.kv_compression not in (None, "none"):
                raise APIError(400, "kv_compression is not supported with use_beam_search (beams share their blocks; "
                               "they run uncompressed, the server's --kv-compression aside)", "kv_compression")  # fmt: skip
            if beam is not None:
                beam.check_width(0 if beam.ignore_eos else len(self.engine.eos_token_ids))
                check_fits(self.engine, prompt_len, beam)
        except ValueError as exc:
            raise APIError(400, str(exc), getattr(exc, "param", "best_of" if body.best_of else "n")) from None
        return beam

    def request_tools(self, body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[Tool], ToolChoice]:
        """The request's tools and tool_choice; tools need a chat template that renders them. What
        is cheap to refuse (no template for tools, a list too large) is refused before any is parsed."""
        if body.tools and body.tool_choice != "none":
            if self.tokenizer is None:
                raise APIError(400, NO_TOKENIZER, "tools")
            if not template_takes_tools(self._chat_template_for(body.chat_template)):
                raise APIError(400, f"model {self.model_name!r} does not take tools: its chat template does not render them "
                               "(Qwen2.5 instruct models do; or set --chat-template)", "tools")  # fmt: skip
            if exceeds_chars(body.tools, MAX_TOOLS_CHARS):
                raise APIError(400, f"tools hold more than {MAX_TOOLS_CHARS} characters of JSON; at most that many are taken", "tools")
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

    async def compile_grammar(self, spec: StructuredOutputs | None, field: str | None, request: Request) -> None:
        """Compiles a request's output constraint before it is admitted: in a compile worker, within
        --grammar-compile-timeout and --grammar-compile-memory-mb, the client's turn shared fairly with
        other clients'; a client that leaves stops waiting (and its compile is dropped)."""
        if spec is None:
            return
        if self.grammar_compiler is None:
            raise APIError(400, f"{field} needs the model's tokenizer; " + NO_TOKENIZER.split(": ", 1)[0], field)
        if self.grammar_compiler.grammars.cached(spec) is not None:
            return
        client = request.client.host if request.client is not None else ""
        compiling = asyncio.ensure_future(self.grammar_compiler.compile(spec, client))

        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((compiling, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not compiling.done():
            compiling.cancel()
            raise APIError(499, "the client disconnected", None, "client_disconnected", "client_disconnected")
        try:
            compiling.result()
        except CompileQueueFull as exc:
            raise APIError(429, f"{field}: {exc}", field, "rate_limit_exceeded", "too_many_compiles", {"Retry-After": "1"}) from None
        except GrammarError as exc:
            raise APIError(400, f"{field}: {exc}", field) from None

    def submit(self, request: Request, groups: list[PromptGroup], cache_salt: str | None, stream: bool, imported=None,
               lora_request: LoRARequest | None = None) -> Submission:  # fmt: skip
        arrival = request.scope.get("state", {}).get("arrival", time.monotonic())
        try:
            return self.async_engine.submit(request_id_of(request), groups, cache_salt, stream, self.config.request_timeout,
                                            time.monotonic() - arrival, imported, lora_request)  # fmt: skip
        except EngineOverloadedError as exc:
            # a router (smg) retries a 503 on another replica; a client learns when to come back
            raise APIError(503, f"server overloaded: {exc}; retry later", None, "server_overloaded", "overloaded",
                           {"Retry-After": "1"}) from None  # fmt: skip
        except EngineDrainingError:
            raise APIError(503, "the server is shutting down; retry later", None, "server_unavailable", "shutting_down",
                           {"Retry-After": "1"}) from None  # fmt: skip
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "server_error", "engine_unavailable") from None

    # ------------------------------------------------------------------ responses
    async def collect(self, sub: Submission, request: Request) -> dict[tuple[int, int], RequestOutput]:
        """Every sample's finished output; a client that leaves aborts the request."""

        async def watch() -> None:
            await _disconnected(request)
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

    def stream(self, sub: Submission, n: int, make_chunk: ChunkMaker, envelope: Callable[[list[dict]], dict],
               stream_options: StreamOptions | None, generated: bool = True, splice: bool = True,
               heavy_first: bool = False) -> StreamingResponse:  # fmt: skip
        """Server-sent events of the submission's outputs; `splice` lets a plain chunk be the first one's JSON with new text
        spliced in; `heavy_first`: a choice's first chunk is built off the event loop (it carries the prompt's logprobs)."""
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
                        # a choice's first chunk may carry the prompt's logprobs (hundreds of thousands of entries): off the loop
                        heavy = heavy_first and g * n + i not in sent
                        text = await asyncio.to_thread(event, g * n + i, out) if heavy else event(g * n + i, out)
                        if text:  # a chunk function may have nothing to send yet (tool calls being held)
                            yield text
            except RequestAborted as exc:  # then [DONE], as vLLM ends every stream
                yield f"data: {json.dumps(aborted_body(exc))}\n\n"
                yield "data: [DONE]\n\n"
                return
            if include_usage:
                yield f"data: {json.dumps({**envelope([]), 'usage': self.usage(sub.groups, finals, generated)})}\n\n"
            yield "data: [DONE]\n\n"

        return SubmissionStream(events(), sub)

    @staticmethod
    async def answer(build: Callable[[], dict]) -> JSONResponse:
        """A non-streamed answer, built and serialized off the event loop: with logprobs, echo and
        prompt logprobs over n choices it can hold 500,000 entries (tens of MB, seconds of work),
        which on the loop would hold every other request, /health included."""
        return await asyncio.to_thread(lambda: Response(_render_json(build()), media_type="application/json"))

    def usage(self, groups: list[PromptGroup], outs: dict[tuple[int, int], RequestOutput], generated: bool = True) -> dict:
        """Each prompt counted once, however many samples (n) it has; `generated` false: a prompt scored, nothing generated."""
        prompt_tokens = sum(len(group.token_ids) for group in groups)
        completion = sum(o.num_output_tokens for o in outs.values()) if generated else 0
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(outs[(g, 0)].num_cached_tokens for g in range(len(groups)) if (g, 0) in outs)},
        }

    def token_count(self, text: str) -> int:
        """Tokens of a text alone (blocking: call it off the event loop)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def truncate_prompt(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as leave one to generate)."""
        if keep is None:
            return ids
        limit = self.engine.max_model_len
        if keep == -1:
            keep = limit - 1
        if not 1 <= keep <= limit:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, max_model_len={limit}], got {keep}", "truncate_prompt_tokens")
        return ids[-keep:]

    async def render_truncated(self, messages: list, requested_template: str | None, max_tokens: int | None, tools=None) -> list[int]:
        """Chat's `truncation: "auto"` (kvserve's extension, truncation.py): the conversation's oldest
        items dropped at fixed points until it and max_tokens fit max_model_len."""
        limit = self.engine.max_model_len
        room = Room.of(limit, max_tokens, truncating=True)

        async def render(chosen: list) -> list[int]:
            return await self.render_messages(chosen, requested_template, True, tools=tools)

        try:
            ids, _ = await fit_conversation(render, messages, 0, room.budget, room.quantum, self.token_count)
        except DoesNotFit as exc:
            raise APIError(400, f"{exc} (max_model_len={limit})", "messages") from None
        return ids

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    def prompt_logprobs(self, prompt_ids: list[int], lps: list[TokenLogprobs | None], top: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (the first None), {token id: logprob, rank, decoded_token},
        the prompt's own token first, then the `top` most likely."""
        out: list[dict | None] = []
        for token_id, lp in zip(prompt_ids, lps):
            if lp is None:
                out.append(None)
                continue
            entry = {str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.token_text(token_id)}}
            for rank, (other, value) in enumerate(most_likely(lp.top, top).items(), 1):
                entry.setdefault(str(other), {"logprob": value, "rank": rank, "decoded_token": self.token_text(other)})
            out.append(entry)
        return out

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
        kv = self.engine.kv
        if kv.offloader is not None and engine.is_alive:
            # what only the pool or the host tier holds goes down to disk: a restart starts warm (kv/tiers/offload.py)
            seconds = max(deadline - loop.time(), _MIN_PERSIST_S)
            queued = await engine.call(lambda: kv.persist_to_tiers(seconds))
            if queued:
                log.info("persisted %d KV records to the disk tier for the next start", queued)

