"""The OpenAI-compatible HTTP API (FastAPI): the app factory, and `kvserve serve`'s entry point.

create_app makes the app: its lifespan, its error handlers (each refusal an OpenAI error body,
logged and counted once) and its routes, which each endpoint family registers from its own module
(server/serving_*.py; the path they share from a request to the engine is server/serving_engine.py).
build_asgi puts the app behind the access guard (server/access.py: API keys, Host allow-list, limits).
"""

from __future__ import annotations

import asyncio
import contextlib
import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.engine.engine import LLMEngine
from kvserve.server import (
    serving_chat, serving_completions, serving_health, serving_kv, serving_lora, serving_models, serving_responses,
)
from kvserve.server.access import AccessGuard
from kvserve.server.async_engine import EngineDeadError, RequestAborted
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, aborted_body, error_response, validation_message
from kvserve.server.serving_engine import OpenAIServing, log, request_id_of

# endpoints of other engines that routers try on every worker (smg: /loads before /v1/loads at every load poll,
# /server_info when it tells SGLang from vLLM): kvserve has none of them
_ROUTER_PROBES = frozenset({"/loads", "/server_info", "/get_server_info", "/get_model_info"})


def _where(request: Request) -> str:
    return f"{request.method} {request.url.path}"


def create_app(serving: OpenAIServing) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        serving.async_engine.start()
        await asyncio.to_thread(serving.renderer.start)
        try:
            yield
        finally:
            serving.async_engine.shutdown()
            serving.renderer.close()
            if serving.grammar_compiler is not None:
                serving.grammar_compiler.close()
            await serving.migrator.close()

    docs = not serving.config.disable_fastapi_docs  # /docs, /redoc, /openapi.json: behind --api-key when one is set (access.py)
    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)  # fmt: skip
    _add_error_handlers(app, serving)
    serving_completions.register_routes(app, serving)
    serving_chat.register_routes(app, serving)
    serving_responses.register_routes(app, serving)
    serving_models.register_routes(app, serving)
    serving_lora.register_routes(app, serving)
    serving_kv.register_routes(app, serving)
    serving_health.register_routes(app, serving)
    return app


def _add_error_handlers(app: FastAPI, serving: OpenAIServing) -> None:
    def reject(request: Request, status: int, message: str, kind: str, reason: str, param: str | None = None) -> JSONResponse:
        return serving.reject(request_id_of(request), _where(request), status, message, kind, reason, param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        response = reject(request, exc.status, exc.message, exc.kind, exc.reason, exc.param)
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        whole_body = [err for err in exc.errors() if tuple(err.get("loc", ())) == ("body",)]
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if whole_body and whole_body[0].get("type") == "missing":
            return reject(request, 400, "the request body is empty: send a JSON object", "invalid_request_error",
                          "invalid_request")  # fmt: skip
        if whole_body and media != "application/json" and not media.endswith("+json"):
            given = f"Content-Type: {reprlib.repr(media)}" if media else "no Content-Type"
            return reject(request, 415, f"the body must be JSON (Content-Type: application/json), got {given}",
                          "invalid_request_error", "unsupported_media_type")  # fmt: skip
        message, param = validation_message(exc)
        return reject(request, 400, message, "invalid_request_error", "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        reason = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code == 404 and request.url.path in _ROUTER_PROBES:  # asked again at every poll: neither logged nor counted
            log.debug("%s %s: 404 (a router's probe for another engine's endpoint)", request_id_of(request), _where(request))
            return error_response(404, str(exc.detail), None, kind, reason)
        response = reject(request, exc.status_code, str(exc.detail), kind, reason)
        response.headers.update(exc.headers or {})  # a 405's Allow: the methods the path takes
        return response

    @app.exception_handler(RequestAborted)
    async def _aborted(_: Request, exc: RequestAborted):
        return JSONResponse(aborted_body(exc), status_code=exc.status)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return reject(request, 503, str(exc), "server_error", "engine_unavailable")

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return reject(request, 400, str(exc), "invalid_request_error", "invalid_request")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # a bug of ours, not the client's: uvicorn logs its traceback after this line
        log.error("internal error on %s %s: %s", request_id_of(request), _where(request), type(exc).__name__)
        return error_response(500, f"internal server error ({type(exc).__name__})", None, "server_error", "internal_error")


def build_asgi(serving: OpenAIServing) -> AccessGuard:
    """The app behind its access guard: what uvicorn serves."""

    def reject(request_id: str, where: str, status: int, message: str, kind: str, reason: str) -> Response:
        return serving.reject(request_id, where, status, message, kind, reason)

    return AccessGuard(create_app(serving), serving.config, reject, serving.engine.max_migration_bytes())


def run_server(args) -> int:
    from kvserve.engine_args import engine_config_from_args
    from kvserve.server.shutdown import serve

    server_config = ServerConfig.from_args(args)
    config = engine_config_from_args(args, max_waiting_requests=server_config.max_waiting_requests)
    engine = LLMEngine(config)
    serving = OpenAIServing(engine, server_config)
    return serve(serving, build_asgi(serving), args.uvicorn_log_level)
