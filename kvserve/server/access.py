"""Who may talk to the server, and how much: one ASGI middleware in front of the app.

Before the app sees a byte of a request, it gives the request an id (the client's own X-Request-Id
when that is plain, else a fresh one; log lines name it and the response carries it), then refuses a Host
header outside the allow-list (a page on another origin that resolves its name to 127.0.0.1
would otherwise reach a localhost server: DNS rebinding), a missing or wrong API key on the
routes that need one (compared in constant time), and a body over --max-request-bytes (413),
reading the body itself so that the limit holds for chunked uploads too.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from typing import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.config import ServerConfig
from kvserve.server.json_limits import raw_depth_exceeds, too_deep_message
from kvserve.server.migration import IMPORT_PATH, MIGRATION_KEY_HEADER

# a client's own X-Request-Id is used when it is this plain (it reaches log lines)
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
# an oversized body is read and dropped up to this size before the 413, so that a client still
# sending it reads the answer instead of a reset connection; beyond it the connection is cut
_DRAIN_BYTES = 64 * 2**20
_THREAD_BYTES = 1 << 20  # a larger body's nesting is measured off the event loop
# reject(request_id, method and path, status, message, kind, reason) -> the error response (logged and counted)
# outside /v1 yet behind --api-key: cache control, the tokenizer endpoints (vLLM serves them at the root), and
# FastAPI's API pages (the OpenAPI schema lists every route and field)
_KEYED_PATHS = frozenset({"/flush_cache", "/tokenize", "/detokenize", "/tokenizer_info", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json"})  # fmt: skip
Reject = Callable[[str, str, int, str, str, str], Response]


def needs_api_key(method: str, path: str) -> bool:
    return path.startswith("/v1/") or (method == "POST" and path == "/reset_prefix_cache") or path in _KEYED_PATHS


class AccessGuard:
    def __init__(self, app: ASGIApp, config: ServerConfig, reject: Reject, max_import_bytes: int = 0) -> None:
        self.app = app
        self.config = config
        self.reject = reject
        self._key = config.api_key.encode() if config.api_key else None
        self._migration_key = config.migration_key.encode() if config.migration_key else None
        self.max_import_bytes = max_import_bytes  # the largest migrated request this engine can need (its KV included)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), value)
        given = headers.get(b"x-request-id", b"")
        request_id = given.decode() if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["arrival"] = request_id, time.monotonic()
        where = f"{scope['method']} {scope['path']}"
        id_header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), id_header]}
            await send(message)

        length = headers.get(b"content-length", b"")
        declared = int(length) if length.isdigit() else None

        async def refuse(status: int, message: str, kind: str, reason: str, extra: dict[str, str] | None = None,
                         received: int | None = 0) -> None:  # fmt: skip
            if received is not None and (declared is None or declared <= _DRAIN_BYTES):
                await self._drain(receive, received)
            response = self.reject(request_id, where, status, message, kind, reason)
            response.headers.update(extra or {})
            await response(scope, receive, send_with_id)

        host = headers.get(b"host", b"").decode("latin-1")
        if not self.config.host_allowed(host):
            await refuse(400, f"Host header {host!r} is not one this server answers to (see --allowed-hosts)",
                         "invalid_request_error", "host_not_allowed")  # fmt: skip
            return
        if self._key is not None and needs_api_key(scope["method"], scope["path"]):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                await refuse(401, "missing or incorrect API key: send `Authorization: Bearer <key>`", "invalid_request_error",
                             "invalid_api_key", {"WWW-Authenticate": "Bearer"})  # fmt: skip
                return
        limit = self.config.max_request_bytes
        if scope["path"] == IMPORT_PATH:  # a migrated request, from a server that holds the migration key only
            if self._migration_key is None:
                await refuse(403, "this server takes no migrated request: start it with --migration-key", "permission_error",
                             "migration_disabled")  # fmt: skip
                return
            if not hmac.compare_digest(headers.get(MIGRATION_KEY_HEADER.encode(), b""), self._migration_key):
                await refuse(403, "missing or incorrect migration key (the --migration-key servers of a group share)",
                             "permission_error", "invalid_migration_key")  # fmt: skip
                return
            limit = max(limit, self.max_import_bytes)  # a state carries its KV
        too_large = f"request body is larger than --max-request-bytes {limit}"
        if declared is not None and declared > limit:
            await refuse(413, too_large, "invalid_request_error", "request_too_large")
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await refuse(413, too_large, "invalid_request_error", "request_too_large", received=len(body) if more else None)
                return
        deep = raw_depth_exceeds(body) if len(body) < _THREAD_BYTES else await asyncio.to_thread(raw_depth_exceeds, bytes(body))
        if deep:
            await refuse(400, too_deep_message(), "invalid_request_error", "too_deep", received=None)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_id)

    @staticmethod
    async def _drain(receive: Receive, received: int) -> None:
        """Read and drop the rest of a body, up to _DRAIN_BYTES in all."""
        while received <= _DRAIN_BYTES:
            message = await receive()
            received += len(message.get("body", b""))
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
