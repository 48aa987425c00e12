"""The OpenAI-compatible HTTP API (FastAPI)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sequence import TokenLogprobs
from kvserve.model.tokenizer import NoChatTemplateError, read_chat_template
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


_SPLICE = "\x00kvserve-splice\x00"
_SPLICED = json.dumps(_SPLICE)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('msg')}", None
        param = param or (loc[0] if loc else None)
        parts.append(f"{field}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


class OpenAIServer:
    def __init__(self, engine: LLMEngine, served_model_name: str, chat_template: str | None, max_waiting_requests: int) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.chat_template = chat_template
        self.metrics = ServerMetrics(served_model_name)
        self.async_engine = AsyncEngine(engine, self.metrics, max_waiting_requests)
        self.created = int(time.time())

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.engine.config.model):
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model", "model_not_found")

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        room = self.engine.max_model_len - prompt_len
        if requested is None:
            return max(1, room)
        if requested <= 0:
            raise APIError(400, f"max_tokens must be a positive integer, got {requested}", "max_tokens")
        if requested > room:
            raise APIError(
                400,
                f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds max_model_len={self.engine.max_model_len}",
                "max_tokens",
            )
        return requested

    def _tokenize_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        out = []
        for p in prompts:
            ids = self.engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
            if (isinstance(p, str) and not p) or not ids:
                raise APIError(400, "prompt must not be empty", "prompt")
            self._validate_prompt(ids, "prompt")
            out.append(ids)
        return out

    def _validate_prompt(self, ids: list[int], param: str) -> None:
        try:
            self.engine.validate_prompt_tokens(ids)
        except ValueError as exc:
            raise APIError(400, str(exc), param) from exc

    def _params(self, body, max_tokens: int, logprobs: int | None, offset: int) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, offset)
        except ValueError as exc:
            message = str(exc)
            param = message.split(" ", 1)[0] if message else None
            raise APIError(400, message, param) from exc

    def _usage(self, jobs, outs: dict[int, RequestOutput]) -> dict:
        """Each prompt counted once, however many choices (n) it has; outs by choice index."""
        groups = _groups(jobs)
        prompt_tokens = sum(len(ids) for _, ids, _ in groups)
        completion = sum(o.num_output_tokens for o in outs.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(outs[indices[0]].num_cached_tokens for indices, _, _ in groups)},
        }

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.token_text(token_id)

    def _top_dict(self, top: dict[int, float]) -> dict[str, float]:
        """Completions' {token: logprob}, most likely first; two tokens that read alike keep their own entries."""
        out: dict[str, float] = {}
        for token_id, value in sorted(top.items(), key=lambda item: -item[1]):
            text = self._token_text(token_id)
            out[text if text not in out else f"{text}#{token_id}"] = value
        return out

    def _completion_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        tokens = [self._token_text(lp.token_id) for lp in lps]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [self._top_dict(lp.top) for lp in lps],
            "text_offset": [],
        }

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        tokenizer = self.engine.tokenizer

        def entry(token_id: int, value: float) -> dict:
            return {"token": self._token_text(token_id), "logprob": value, "bytes": list(tokenizer.token_bytes(token_id))}

        content = []
        for lp in lps:
            top = sorted(lp.top.items(), key=lambda item: -item[1])
            content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in top]})
        return {"content": content}

    # ------------------------------------------------------------------ endpoints
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        prompts = self._tokenize_prompts(body.prompt)
        jobs = []  # (choice index, prompt ids, params)
        for p_idx, ids in enumerate(prompts):
            max_tokens = self._max_tokens(body.max_tokens if body.max_tokens is not None else 16, len(ids))
            for i in range(body.n):
                jobs.append((p_idx * body.n + i, ids, self._params(body, max_tokens, body.logprobs, i)))
        request_id = f"cmpl-{uuid.uuid4().hex}"

        def choice(index: int, out: RequestOutput, text: str, lps) -> dict:
            return {
                "index": index,
                "text": text,
                "logprobs": self._completion_logprobs(lps) if body.logprobs is not None else None,
                "finish_reason": out.finish_reason if out.finished else None,
            }

        created = int(time.time())

        def envelope(choices: list[dict]) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name, "choices": choices}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(jobs, body.cache_salt, request, lambda idx, out, delta, lps: envelope([choice(idx, out, delta, lps)]),
                                envelope, include_usage)
        outs = await self._collect(jobs, body.cache_salt, request)
        choices = [choice(idx, out, out.text, out.logprobs or []) for (idx, _, _), out in zip(jobs, outs)]
        return {**envelope(choices), "usage": self._usage(jobs, {idx: out for (idx, _, _), out in zip(jobs, outs)})}

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        template = body.chat_template or self.chat_template
        try:
            ids = self.engine.tokenizer.apply_chat_template(messages, chat_template=template)
        except NoChatTemplateError as exc:
            raise APIError(
                400,
                f"model {self.model_name!r} has no chat template (base models ship none), so chat messages cannot be "
                "formatted; start the server with --chat-template (inline Jinja or a file), "
                "or send a plain prompt to /v1/completions",
            ) from exc
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from exc
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            raise APIError(400, f"chat template failed: {exc}", "messages") from exc
        self._validate_prompt(ids, "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self._max_tokens(requested, len(ids))
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        jobs = [(i, ids, self._params(body, max_tokens, top, i)) for i in range(body.n)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        created = int(time.time())

        def envelope(choices: list[dict], obj: str = "chat.completion.chunk") -> dict:
            return {"id": request_id, "object": obj, "created": created, "model": self.model_name, "choices": choices}

        def chunk(index: int, out: RequestOutput, delta: str, lps) -> dict:
            return envelope([{
                "index": index,
                "delta": {"role": "assistant", "content": delta},
                "logprobs": self._chat_logprobs(lps) if body.logprobs else None,
                "finish_reason": out.finish_reason if out.finished else None,
            }])

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(jobs, body.cache_salt, request, chunk, envelope, include_usage)
        outs = await self._collect(jobs, body.cache_salt, request)
        choices = [
            {
                "index": idx,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": self._chat_logprobs(out.logprobs or []) if body.logprobs else None,
                "finish_reason": out.finish_reason,
            }
            for (idx, _, _), out in zip(jobs, outs)
        ]
        return {**envelope(choices, "chat.completion"), "usage": self._usage(jobs, {idx: out for (idx, _, _), out in zip(jobs, outs)})}

    async def _collect(self, jobs, cache_salt: str | None, request: Request) -> list[RequestOutput]:
        results: dict[int, RequestOutput] = {}

        async def run(indices, ids, params) -> None:
            async for i, out in self.async_engine.generate_group(ids, params, cache_salt):
                if out.finished:
                    results[indices[i]] = out

        tasks = [asyncio.ensure_future(run(*group)) for group in _groups(jobs)]
        try:
            pending = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.5)
                if pending and await request.is_disconnected():
                    raise asyncio.CancelledError("client disconnected")
            for t in tasks:
                t.result()
            return [results[idx] for idx, _, _ in jobs]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()  # the generator's finally aborts the request in the engine

    def _stream(self, jobs, cache_salt, request: Request, make_chunk, envelope, include_usage: bool) -> StreamingResponse:
        # fail fast (before the 200 is sent) when the server is already overloaded
        if self.async_engine.num_waiting() + len(jobs) > self.async_engine.max_waiting_requests:
            raise EngineOverloadedError(f"{self.async_engine.num_waiting()} requests are already waiting")

        templates: dict[int, tuple[str, str]] = {}

        def event(idx: int, out: RequestOutput) -> str:
            lps = out.logprobs or []
            if out.finished or lps:
                return f"data: {json.dumps(make_chunk(idx, out, out.text, lps))}\n\n"
            # the common chunk (new text only) is its JSON with the text spliced in: no dict, one dumps
            if idx not in templates:
                head, tail = json.dumps(make_chunk(idx, out, _SPLICE, [])).split(_SPLICED, 1)
                templates[idx] = (f"data: {head}", f"{tail}\n\n")
            head, tail = templates[idx]
            return head + json.dumps(out.text) + tail

        async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            """(choice index, output) as each choice's outputs arrive."""
            groups = _groups(jobs)
            if len(groups) == 1:
                indices, ids, params = groups[0]
                async for i, out in self.async_engine.generate_group(ids, params, cache_salt, stream=True):
                    yield indices[i], out
                return
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(indices, ids, params):
                try:
                    async for i, out in self.async_engine.generate_group(ids, params, cache_salt, stream=True):
                        await merged.put((indices[i], out))
                except Exception as exc:  # noqa: BLE001 - re-raised by the consumer below
                    await merged.put((None, exc))

            tasks = [asyncio.ensure_future(pump(*group)) for group in groups]
            try:
                finished = 0
                while finished < len(jobs):
                    idx, item = await merged.get()
                    if isinstance(item, Exception):
                        raise item
                    finished += item.finished
                    yield idx, item
            finally:
                for t in tasks:
                    t.cancel()

        async def events() -> AsyncIterator[str]:
            finals: dict[int, RequestOutput] = {}
            try:
                async for idx, out in outputs():
                    if out.finished:
                        finals[idx] = out
                    if out.text or out.finished or out.logprobs:
                        yield event(idx, out)
            except Exception as exc:  # noqa: BLE001 - surfaced as an SSE error event
                yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
                return
            if include_usage:
                usage = self._usage(jobs, finals)
                yield f"data: {json.dumps({**envelope([]), 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _groups(jobs: list[tuple[int, list[int], SamplingParams]]) -> list[tuple[list[int], list[int], list[SamplingParams]]]:
    """Consecutive choices of one prompt, as (choice indices, prompt ids, params): each group is one
    request group in the engine, whose prompt is computed once."""
    groups: list[tuple[list[int], list[int], list[SamplingParams]]] = []
    for idx, ids, params in jobs:
        if groups and groups[-1][1] is ids:
            groups[-1][0].append(idx)
            groups[-1][2].append(params)
        else:
            groups.append(([idx], ids, [params]))
    return groups


def create_app(server: OpenAIServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        server.async_engine.start()
        try:
            yield
        finally:
            server.async_engine.shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None, "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_: Request, exc: EngineOverloadedError):
        return error_response(503, f"server overloaded: {exc}; retry later", None, "server_overloaded")

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError):
        return error_response(500, str(exc), None, "server_error")

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError):
        return error_response(400, str(exc), None)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        forgotten = await asyncio.to_thread(server.async_engine.reset_prefix_cache)
        return {"reset": True, "blocks_forgotten": forgotten}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "kvserve",
            "max_model_len": server.engine.max_model_len,
        }]}

    @app.get("/health")
    async def health():
        if not server.async_engine.is_alive:
            return error_response(503, "engine loop is not running", None, "server_error")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.engine_args import engine_config_from_args

    config = engine_config_from_args(args, max_waiting_requests=args.max_waiting_requests)
    engine = LLMEngine(config)
    server = OpenAIServer(engine, args.served_model_name or config.model, read_chat_template(args.chat_template), args.max_waiting_requests)
    app = create_app(server)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    uv_server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level=args.uvicorn_log_level))
    # a machine-readable line: scripts wait for it, then poll /health
    print(f"kvserve: serving {server.model_name} on http://{args.host}:{port} "
          f"(dtype {config.dtype}, {engine.kv.num_blocks} KV blocks, max_model_len {engine.max_model_len})", flush=True)
    uv_server.run(sockets=[sock])
    return 0
