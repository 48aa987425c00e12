"""uvicorn with a clean drain: the first SIGTERM or SIGINT stops admitting (503), lets running
requests finish for up to --shutdown-timeout seconds, aborts the rest with an error, and exits 0;
a second signal exits at once (status 128 + the signal's number, as a shell reports a kill)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable

import uvicorn

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# after the drain, connections that are still open (a client that stopped reading) get this long
_CONNECTIONS_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own re-raises the signal after shutdown (exit status 143); a drained shutdown exits 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self._draining:
            print(f"kvserve: second {name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        self._draining = True
        log.info("%s: draining; a second signal exits at once", name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


_BACKLOG = 2048  # uvicorn's default


def bound_socket(host: str, port: int, flags: str | None = None) -> socket.socket:
    """A listening socket's address taken, or ValueError naming the flags that chose it (--host/--port
    by default) and why not."""
    flags = flags or f"--host {host} --port {port}"
    if not 0 <= port <= 65535:
        raise ValueError(f"{flags}: the port must be in [0, 65535]")
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # listening before the startup line is printed: a client that connects on that line is queued
        # until the server accepts, never refused
        sock.listen(_BACKLOG)
    except OSError as error:
        raise ValueError(f"cannot listen on {flags}: {error.strerror or error}") from None
    return sock


def serve(server, app, uvicorn_log_level: str) -> int:
    """Bind, print the startup line, serve until a signal has drained the server; returns 0."""
    config = server.config
    sock = bound_socket(config.host, config.port)
    port = sock.getsockname()[1]
    uv_config = uvicorn.Config(app, host=config.host, port=port, log_level=uvicorn_log_level,
                               timeout_graceful_shutdown=_CONNECTIONS_GRACE_S)  # fmt: skip
    uv_server = DrainingServer(uv_config, lambda: server.drain(config.shutdown_timeout))
    # everything loaded so far lives as long as the server: out of the collector's sight, a full
    # collection pauses the event loop for ~0 s instead of ~0.28 s (361K objects with the tiny
    # test model loaded, measured)
    gc.collect()
    gc.freeze()
    engine = server.engine
    # a machine-readable line: scripts wait for it, then poll /health
    print(f"kvserve: serving {server.model_name} on http://{config.host}:{port} "
          f"(dtype {engine.config.dtype}, weights {engine.weights_description()}, KV cache {engine.kv_spec.kv_dtype}{', keys centered' if engine.config.centers_keys else ''}{', Hadamard-rotated' if engine.rotates_kv else ''}, "
          f"{engine.kv.num_blocks} KV blocks, max_model_len {engine.max_model_len}{engine.tiers_description()}{engine.lora_description()})", flush=True)
    uv_server.run(sockets=[sock])
    return 0
