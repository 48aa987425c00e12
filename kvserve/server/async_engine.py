"""Runs LLMEngine in its own thread and streams outputs to asyncio consumers.

HTTP handlers never wait for a step: they enqueue commands (add, abort) and read per-request
asyncio queues. The engine thread applies commands between steps, so an abort frees its
blocks before the next step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    pass


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    stream: bool
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, out in items:
        sink.put_nowait(out)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting_requests: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        metrics.update_from_stats(engine.stats())

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------------ API for handlers
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending_adds

    async def generate(
        self, token_ids: list[int], params: SamplingParams, cache_salt: str | None = None, stream: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """With ``stream``, yields an output per step holding what is new (the last one finished);
        without, only the finished output."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped")
        self.engine.validate_prompt_tokens(token_ids)
        with self._lock:
            if self.num_waiting() >= self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{self.num_waiting()} requests are already waiting (--max-waiting-requests {self.max_waiting_requests})"
                )
            self._pending_adds += 1
        request_id = f"req-{uuid.uuid4().hex}"
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request_id, token_ids, params, cache_salt, stream, sink, asyncio.get_running_loop()))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their requests' queues: one wake-up per event loop, not per output."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            entry = self._sinks.get(out.request_id)
            if entry is None:
                continue
            sink, loop = entry
            if out.finished:
                del self._sinks[out.request_id]
                self.metrics.observe_finished(out)
            batches.setdefault(loop, []).append((sink, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                with self._lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(cmd.token_ids, cmd.params, request_id=cmd.request_id,
                                            cache_salt=cmd.cache_salt, stream=cmd.stream)
                    self._sinks[cmd.request_id] = (cmd.sink, cmd.loop)
                except Exception as exc:  # noqa: BLE001 - reported to the one request that caused it
                    cmd.loop.call_soon_threadsafe(cmd.sink.put_nowait, exc)
            else:
                self._sinks.pop(cmd.request_id, None)
                if self.engine.abort_request(cmd.request_id) is not None:
                    log.info("aborted %s", cmd.request_id)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.metrics.update_from_stats(self.engine.stats())
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
                self.metrics.update_from_stats(self.engine.stats())
        except BaseException as exc:  # noqa: BLE001 - fail every waiter rather than hang them
            log.exception("engine loop crashed")
            self.error = exc
            for sink, loop in list(self._sinks.values()):
                loop.call_soon_threadsafe(sink.put_nowait, EngineDeadError(f"engine loop crashed: {exc}"))
            self._sinks.clear()

