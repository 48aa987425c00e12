"""`kvserve pd-proxy`: one OpenAI endpoint in front of a prefill instance and a decode instance.

A completion or chat request goes first to the producer (`--kv-role producer`) with max_tokens=1,
not streamed: it prefills the prompt and answers once the prompt's blocks are in the shared remote
tier. The original request then goes to the consumer (`--kv-role consumer`), which finds the prompt
there (its `cached_tokens` show the hand-over) and decodes; its answer, streamed or not, is relayed
as it comes. A producer that fails, is unreachable or takes longer than --prefill-timeout costs the
hand-over, not the request: the consumer computes the prompt itself, and while the producer is
down (its /health probed every second) requests go straight to the consumer. A producer's 4xx (the
request is invalid) is the answer. A client that leaves aborts the request upstream (the closed
connection does). Everything else (models, tokenization, health) is the consumer's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import sys

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.kv.tiers.remote import masked_url
from kvserve.server.json_limits import MAX_JSON_DEPTH, TooDeep, first_unpaired_surrogate
from kvserve.server.shutdown import bound_socket

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id")


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                                   "code": code}}, status_code=status)  # fmt: skip


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def prefill_body(body: dict) -> dict:
    """The request as the producer gets it: one token, one choice, not streamed."""
    prefill = copy.deepcopy(body)
    for field in ("stream", "stream_options", "n", "best_of", "max_completion_tokens"):
        prefill.pop(field, None)
    prefill["max_tokens"] = 1
    return prefill


PROBE_INTERVAL_S = 1.0  # while the producer is down, its /health is asked this often


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its body already read: nothing else arrives before that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class PDProxy:
    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float, max_request_bytes: int, prefill_timeout_s: float = 30.0) -> None:
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.max_request_bytes = max_request_bytes
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=httpx.Limits(max_connections=256))
        self.prefill_timeout = httpx.Timeout(prefill_timeout_s, connect=5.0)
        # the producer answered (its blocks stored, unless Redis was down) / failed / was skipped while down
        self.counts = {"prefilled": 0, "prefill_failed": 0, "prefill_skipped": 0}
        self._producer_down = False
        self._probe: asyncio.Task | None = None

    @staticmethod
    def _headers(request: Request) -> dict[str, str]:
        return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}

    async def _body(self, request: Request) -> bytes | None:
        """The request's body, or None when it is over --max-request-bytes (read no further than that)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            return None
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                return None
        return bytes(body)

    async def generate(self, request: Request) -> Response:
        raw = await self._body(request)
        if raw is None:
            return _error(413, f"request body over --max-request-bytes {self.max_request_bytes}", "request_too_large")
        try:
            body = json.loads(raw, parse_constant=_refuse_constant)
            first_unpaired_surrogate(body)  # the nesting limit every server applies, before anything is forwarded
        except (RecursionError, TooDeep):
            return _error(400, f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels, the limit of every request", "invalid_json")
        except (ValueError, UnicodeDecodeError) as error:
            return _error(400, f"the body is not valid JSON ({error})", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_json")
        headers = self._headers(request)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            return await self._generate(request, raw, body, headers, gone)
        finally:
            gone.cancel()

    async def _until_gone(self, work, gone: asyncio.Future):
        """work's result, or None when the client left first (work cancelled: its upstream connection closes, which aborts it)."""
        task = asyncio.ensure_future(work)
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def _generate(self, request: Request, raw: bytes, body: dict, headers: dict[str, str], gone: asyncio.Future) -> Response:
        prefilled = await self._until_gone(self._prefill(request.url.path, body, headers), gone)
        if gone.done():
            return _error(499, "the client disconnected", "client_disconnected")
        if prefilled is not None:
            return prefilled
        upstream = self.client.build_request("POST", self.decode_url + request.url.path, content=raw,
                                             headers={**headers, "content-type": "application/json"})  # fmt: skip
        try:  # a request not streamed has its headers only with the whole answer: the client may leave before them
            response = await self._until_gone(self.client.send(upstream, stream=True), gone)
        except httpx.HTTPError as error:
            return _error(502, f"the decode instance {self.decode_url} did not answer ({type(error).__name__})", "decode_unreachable")
        if response is None:
            return _error(499, "the client disconnected", "client_disconnected")
        passed = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "x-request-id", "retry-after")}
        if not body.get("stream"):
            try:
                content = await self._until_gone(response.aread(), gone)
            finally:
                await response.aclose()  # a client gone mid-answer: the consumer sees the connection close and aborts
            if content is None:
                return _error(499, "the client disconnected", "client_disconnected")
            return Response(content, status_code=response.status_code, headers=passed)

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.HTTPError as error:  # the decode instance died mid-answer: the client hears it, as from kvserve itself
                log.warning("the decode instance %s broke off a streamed answer (%s)", self.decode_url, type(error).__name__)
                failure = {"error": {"message": f"the decode instance broke off the answer ({type(error).__name__})",
                                     "type": "server_error", "param": None, "code": "decode_failed"}}  # fmt: skip
                yield f"\n\ndata: {json.dumps(failure)}\n\n".encode()
            finally:
                await response.aclose()

        return StreamingResponse(relay(), status_code=response.status_code, headers=passed)

    async def _prefill(self, path: str, body: dict, headers: dict[str, str]) -> Response | None:
        """Run the prompt on the producer; its 4xx is returned (the request is invalid), any other
        failure only logged (once per outage): the consumer then computes the prompt itself."""
        if self._producer_down:
            self.counts["prefill_skipped"] += 1
            return None
        try:
            response = await self.client.post(self.prefill_url + path, content=json.dumps(prefill_body(body)),
                                              headers={**headers, "content-type": "application/json"},
                                              timeout=self.prefill_timeout)  # fmt: skip
        except httpx.HTTPError as error:
            self._producer_failed(f"{type(error).__name__}: {error}")
            return None
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            return Response(response.content, status_code=response.status_code, headers={"content-type": "application/json"})
        if response.status_code != 200:
            self._producer_failed(f"status {response.status_code}")
            return None
        self.counts["prefilled"] += 1
        return None

    def _producer_failed(self, reason: str) -> None:
        self.counts["prefill_failed"] += 1
        if not self._producer_down:
            log.warning("the prefill instance %s failed (%s); the decode instance computes prompts until it answers", self.prefill_url, reason)
            self._producer_down = True
            self._probe = asyncio.ensure_future(self._probe_producer())

    async def _probe_producer(self) -> None:
        """While the producer is down, ask its /health every second; requests skip it until it answers."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                if (await self.client.get(self.prefill_url + "/health", timeout=2.0)).status_code == 200:
                    break
            except httpx.HTTPError:
                continue
        log.warning("the prefill instance %s answers again", self.prefill_url)
        self._producer_down = False

    async def forward(self, request: Request) -> Response:
        raw = await self._body(request)
        if raw is None:
            return _error(413, f"request body over --max-request-bytes {self.max_request_bytes}", "request_too_large")
        try:
            response = await self.client.request(request.method, self.decode_url + request.url.path, content=raw,
                                                  params=request.query_params, headers=self._headers(request))  # fmt: skip
        except httpx.HTTPError as error:
            return _error(502, f"the decode instance {self.decode_url} did not answer ({type(error).__name__})", "decode_unreachable")
        passed = {k: v for k, v in response.headers.items() if k.lower() in ("content-type",)}
        return Response(response.content, status_code=response.status_code, headers=passed)

    async def health(self) -> Response:
        """200 while the decode instance is healthy (requests succeed: without the prefill instance the
        consumer computes prompts itself); the body says how each instance is."""
        states = {}
        for name, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                states[name] = "ok" if (await self.client.get(url + "/health", timeout=5.0)).status_code == 200 else "unhealthy"
            except httpx.HTTPError:
                states[name] = "unreachable"
        return JSONResponse(states, status_code=200 if states["decode"] == "ok" else 503)


def create_proxy_app(proxy: PDProxy) -> FastAPI:
    app = FastAPI(title="kvserve pd-proxy", docs_url=None, redoc_url=None, openapi_url=None)
    for path in GENERATION_PATHS:
        app.add_api_route(path, proxy.generate, methods=["POST"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/pd/stats", lambda: proxy.counts, methods=["GET"])
    app.add_api_route("/{path:path}", proxy.forward, methods=["GET", "POST"])
    app.router.on_shutdown.append(proxy.client.aclose)
    return app


def add_pd_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True, metavar="URL", help="base URL of a `kvserve serve --kv-role producer` instance")
    parser.add_argument("--decode", required=True, metavar="URL", help="base URL of a `kvserve serve --kv-role consumer` instance")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the decode instance's answer")
    parser.add_argument("--prefill-timeout", type=float, default=30.0,
                        help="seconds to wait for the prefill instance; past them the decode instance computes the prompt itself, "
                             "and requests skip the prefill instance until its /health answers")  # fmt: skip
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20, help="largest request body; larger ones get 413")


def run_pd_proxy(args: argparse.Namespace) -> int:
    for flag, url in (("--prefill", args.prefill), ("--decode", args.decode)):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag} must be an http:// or https:// base URL, got {masked_url(url)!r}")
    for flag, value in (("--timeout", args.timeout), ("--prefill-timeout", args.prefill_timeout)):
        if not 0 < value <= 86400:
            raise ValueError(f"{flag} must be in (0, 86400] seconds, got {value}")
    if args.max_request_bytes <= 0:
        raise ValueError(f"--max-request-bytes must be positive, got {args.max_request_bytes}")
    proxy = PDProxy(args.prefill, args.decode, args.timeout, args.max_request_bytes, args.prefill_timeout)
    sock = bound_socket(args.host, args.port)
    port = sock.getsockname()[1]
    print(f"kvserve: serving pd-proxy on http://{args.host}:{port} (prefill {masked_url(proxy.prefill_url)}, "
          f"decode {masked_url(proxy.decode_url)})", file=sys.stdout, flush=True)  # fmt: skip
    uvicorn.Server(uvicorn.Config(create_proxy_app(proxy), log_level="warning")).run(sockets=[sock])
    return 0
