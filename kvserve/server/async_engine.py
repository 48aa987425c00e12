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
    request_ids: list[str]  # one per sample of the prompt (n > 1 computes the prompt once)
    token_ids: list[int]
    params: list[SamplingParams]
    cache_salt: str | None
    stream: bool
    sink: asyncio.Queue  # every sample's outputs
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Reset:
    result: list[int]
    done: threading.Event


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
        async for _, out in self.generate_group(token_ids, [params], cache_salt, stream):
            yield out

    async def generate_group(
        self, token_ids: list[int], params: list[SamplingParams], cache_salt: str | None = None, stream: bool = False
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """n samples of one prompt, computed once: yields (sample index, output) as outputs arrive,
        until every sample has finished; leaving early aborts the unfinished ones. Admission is all
        or nothing: either every sample is queued or none is."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped")
        self.engine.validate_prompt_tokens(token_ids)
        with self._lock:
            if self.num_waiting() + len(params) > self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{self.num_waiting()} requests are already waiting (--max-waiting-requests {self.max_waiting_requests})"
                )
            self._pending_adds += len(params)
        ids = [f"req-{uuid.uuid4().hex}" for _ in params]
        index = {rid: i for i, rid in enumerate(ids)}
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(ids, token_ids, list(params), cache_salt, stream, sink, asyncio.get_running_loop()))
        self._wake.set()
        unfinished = set(ids)
        try:
            while unfinished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield index[item.request_id], item
        finally:
            for rid in unfinished:
                self.abort(rid)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, between two engine steps; returns the blocks forgotten."""
        done = threading.Event()
        result: list[int] = []
        self._commands.put(_Reset(result, done))
        self._wake.set()
        if not done.wait(timeout=60):
            raise EngineDeadError("the engine loop did not answer")
        return result[0]

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
                    self._pending_adds -= len(cmd.request_ids)
                try:
                    self.engine.add_request_group(cmd.token_ids, cmd.params, cmd.request_ids, cmd.cache_salt, cmd.stream)
                    for rid in cmd.request_ids:
                        self._sinks[rid] = (cmd.sink, cmd.loop)
                except Exception as exc:  # noqa: BLE001 - reported to the one request that caused it
                    cmd.loop.call_soon_threadsafe(cmd.sink.put_nowait, exc)
            elif isinstance(cmd, _Reset):
                cmd.result.append(self.engine.reset_prefix_cache())
                cmd.done.set()
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

