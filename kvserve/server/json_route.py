"""Request bodies parsed off the event loop when they are large: FastAPI parses a route's JSON body
with json.loads on the loop, and a client's 8 MB body (a schema of 300,000 properties, a long
prompt of token ids) would hold every other request, /health included, for a third of a second."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 256 * 1024  # below this a parse takes about a millisecond: a thread would cost more


class OffLoopJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(json.loads, body) if len(body) >= OFF_LOOP_BYTES else json.loads(body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    """An APIRoute whose handler reads the body through OffLoopJSONRequest (FastAPI's documented way
    to change how a route reads its request)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return handle
