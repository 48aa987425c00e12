"""Whether the server is up, and how it is doing: GET/HEAD /health (what load balancers and routers
poll), GET /version, and GET /metrics (Prometheus: server/metrics.py)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvserve
from kvserve.server.errors import error_response
from kvserve.server.serving_engine import OpenAIServing


def register_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not serving.async_engine.is_alive:
            return error_response(503, "engine loop is not running", None, "server_error", "engine_unavailable")
        if not serving.async_engine.accepting:
            return error_response(503, "the server is shutting down", None, "server_unavailable", "shutting_down")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def metrics():
        compiler = serving.grammar_compiler
        if compiler is not None:
            serving.metrics.update_grammar_compiles(compiler.pending, dict(compiler.outcomes))
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)
