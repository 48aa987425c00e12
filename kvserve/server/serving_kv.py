"""The KV cache's own endpoints: the live snapshot and its dashboard page, the prefix cache's reset
(and SGLang's name for it), the load report routers poll, and live migration between servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

import kvserve
from kvserve.engine.migration import RequestState
from kvserve.server.async_engine import PromptGroup, RequestAborted
from kvserve.server.errors import APIError
from kvserve.server.kv_snapshot import kv_snapshot as take_snapshot
from kvserve.server.loads import load_report, parse_include
from kvserve.server.migration import IMPORT_PATH, MIGRATE_PATH, MigrationFailed, error_line, output_line
from kvserve.server.protocol import MigrateRequest
from kvserve.server.serving_engine import OpenAIServing, SubmissionStream, log

DASHBOARD_PAGE = (Path(__file__).parent / "dashboard.html").read_bytes()


class ServingMigration:
    """Live migration (server/migration.py): a running request sent to another server, and one taken from another server."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def migrate(self, body: MigrateRequest) -> dict:
        target = body.target.strip().rstrip("/")
        if not self.serving.config.migration_targets:
            raise APIError(403, "live migration is off on this server: start it with --migration-targets", "target",
                           "permission_error", "migration_disabled")  # fmt: skip
        if target not in self.serving.config.migration_targets:
            raise APIError(403, f"target {target!r} is not in --migration-targets", "target", "permission_error", "target_not_allowed")
        request_id = body.request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
        sub = self.serving.async_engine.find(request_id)
        if sub is None:
            raise APIError(404, f"no running request {body.request_id!r}", "request_id", "not_found_error", "request_not_found")
        if sub.relays:
            raise APIError(409, f"request {body.request_id!r} has already migrated", "request_id", "invalid_request_error", "already_migrated")
        try:
            moved = await self.serving.migrator.migrate(sub, target)
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
            self.serving.engine.check_import(state)
            return state, self.serving.engine.decode_records(state)  # the checksums, off the event loop and the engine thread

        try:
            state, records = await asyncio.to_thread(parse)
        except ValueError as exc:
            raise APIError(400, str(exc), None, "invalid_request_error", "invalid_migration_state") from None
        sub = self.serving.submit(request, [PromptGroup(state.prompt_token_ids, [state.params])], state.cache_salt, state.stream,
                                  (state, records))  # fmt: skip

        async def lines() -> AsyncIterator[str]:
            try:
                async for _, _, out in sub.outputs():
                    yield output_line(out)
            except RequestAborted as exc:
                yield error_line(exc)

        return SubmissionStream(lines(), sub, "application/x-ndjson")


def register_routes(app: FastAPI, serving: OpenAIServing) -> None:
    migration = ServingMigration(serving)

    @app.post(MIGRATE_PATH)
    async def migrate(body: MigrateRequest):
        return await migration.migrate(body)

    @app.post(IMPORT_PATH)
    async def import_request(request: Request):
        return await migration.import_request(request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        forgotten = await asyncio.to_thread(serving.async_engine.reset_prefix_cache)
        return {"reset": True, "blocks_forgotten": forgotten}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """SGLang's name for /reset_prefix_cache, which routers (smg's POST /flush_cache) fan out to every worker."""
        forgotten = await asyncio.to_thread(serving.async_engine.reset_prefix_cache)
        return {"flushed": True, "blocks_forgotten": forgotten}

    @app.get("/v1/loads")
    async def loads(include: str | None = None):
        engine = serving.async_engine
        stats = engine.stats
        return load_report(stats, parse_include(include), kvserve.__version__, engine.num_admitting,
                           engine.generation_rate.rate(stats["generation_tokens_total"]))  # fmt: skip

    @app.get("/v1/kv/snapshot")
    async def kv_snapshot():
        """The KV cache now (server/kv_snapshot.py), taken between two engine steps."""
        show_tokens = serving.config.dashboard_show_tokens
        return await serving.async_engine.call(lambda: take_snapshot(serving.engine, serving.model_name, show_tokens))

    @app.api_route("/dashboard", methods=["GET", "HEAD"])
    async def dashboard():
        """The live KV page: static, no data of its own (it reads /v1/kv/snapshot, which needs the API key)."""
        return Response(DASHBOARD_PAGE, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"})

    @app.get("/favicon.ico")
    async def favicon():  # browsers ask on every page load (/dashboard): no icon, and no 404 counted as a rejection
        return Response(status_code=204)
