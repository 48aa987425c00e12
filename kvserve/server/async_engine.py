"""Runs LLMEngine in its own thread and streams outputs to asyncio consumers.

HTTP handlers never wait for a step: they submit a request (every prompt's samples at once) and
read its asyncio queue. The engine thread applies commands (add, abort) between steps, so an
abort frees its blocks before the next step runs.

Admission is all or nothing and happens in `submit`, before a response starts: either every
sample of every prompt is queued or none is. After admission a request ends in one of two ways:
every sample finishes, or it is aborted as a whole (`RequestAborted`: deadline, shutdown, a
failed engine step, the engine thread gone, the client gone), its unfinished samples removed
from the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvserve.engine.beam import BeamSearchParams
from kvserve.engine.engine import LLMEngine
from kvserve.libc import libc
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.beam_choices import beam_choices
from kvserve.server.loads import GenerationRate
from kvserve.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    pass


class EngineDeadError(RuntimeError):
    pass


class EngineDrainingError(RuntimeError):
    pass


class RequestAborted(Exception):
    """An admitted request that will not finish: `reason` names why, `status` is its HTTP status."""

    def __init__(self, reason: str, message: str, status: int) -> None:
        super().__init__(message)
        self.reason, self.message, self.status = reason, message, status


@dataclass(frozen=True)
class PromptGroup:
    """One prompt and its samples (n > 1 computes the prompt once)."""

    token_ids: list[int]
    params: list[SamplingParams]
    beam: BeamSearchParams | None = None  # beam search: one engine request, its best len(params) beams the choices
    keep_kv: bool = False  # a stored conversation's turn: its blocks stay pinned for the next turn


@dataclass
class _Add:
    submission: "Submission"


@dataclass
class _Abort:
    submission: "Submission"
    request_ids: list[str]
    report: "RequestAborted | None"  # logged and counted if the engine still had some of it to drop


@dataclass
class _Reset:
    result: list[int]
    done: threading.Event


@dataclass
class _Call:
    """fn() on the engine thread between two steps; its result or exception goes to `future`."""

    fn: Callable[[], object]
    future: concurrent.futures.Future


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, out in items:
        sink.put_nowait(out)


class Submission:
    """One API request in the engine: (prompt, sample) pairs, each an engine request."""

    def __init__(self, engine: "AsyncEngine", request_id: str, groups: list[PromptGroup], cache_salt: str | None, stream: bool,
                 lora_request=None) -> None:  # fmt: skip
        self.engine = engine
        self.lora_request = lora_request  # the adapter every sample runs with (None: the base model)
        self.request_id = request_id
        self.groups = groups
        self.cache_salt = cache_salt
        self.stream = stream
        # engine ids are the server's own: a client's X-Request-Id need not be unique
        serial = uuid.uuid4().hex
        self.ids = [[f"{serial}-{g}-{i}" for i in range(len(group.params))] for g, group in enumerate(groups)]
        self.index = {rid: (g, i) for g, ids in enumerate(self.ids) for i, rid in enumerate(ids)}
        self.unfinished = set(self.index)
        self.sink: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.aborted: RequestAborted | None = None  # why it ended unfinished, once it has
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.imported = None  # (RequestState, its decoded KV records) to continue (live migration) instead of its prompt
        self.relays: set[asyncio.Task] = set()  # samples migrated away: their target's outputs relayed in (server/migration.py)

    @property
    def num_samples(self) -> int:
        return len(self.index)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    @property
    def closed(self) -> bool:
        """Its response has ended, however (finished, aborted, client gone)."""
        return self._closed

    def fail(self, error: RequestAborted) -> None:
        """End the request with `error` (on the event loop's thread)."""
        if self.unfinished:
            self.sink.put_nowait(error)

    def expire_at(self, delay: float, seconds: float) -> None:
        self._timer = self.loop.call_later(
            delay, self.fail, RequestAborted("timeout", f"request exceeded --request-timeout of {seconds:g} s", 504)
        )

    async def outputs(self) -> AsyncIterator[tuple[int, int, RequestOutput]]:
        """(prompt index, sample index, output) as outputs arrive, until every sample has finished.
        Raises RequestAborted when the request is aborted; leaving early aborts what is unfinished."""
        try:
            while self.unfinished:
                item = await self.sink.get()
                if isinstance(item, RequestAborted):
                    self.aborted = item
                    raise item
                if item.finished:
                    self.unfinished.discard(item.request_id)
                    if item.finish_reason == "error":
                        self.aborted = RequestAborted("engine_error", f"the engine step running this request failed ({item.error})", 500)
                        raise self.aborted
                g, i = self.index[item.request_id]
                yield g, i, item
        finally:
            self.close()

    def close(self) -> None:
        """Stop tracking the request, abort what is unfinished in the engine, and report an abort
        once (idempotent). A client that left heard nothing: its request counts as aborted only if
        the engine still had some of it to drop; other aborts count as what the client was told."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for relay in self.relays:
            relay.cancel()
        self.engine._active.discard(self)
        if self.aborted is None and not self.unfinished:
            return
        error = self.aborted or RequestAborted("client_disconnected", "the client disconnected", 499)
        if error.reason != "client_disconnected":
            self.engine.report_abort(self.request_id, error)
        if self.unfinished:
            self.engine.abort(self, sorted(self.unfinished), error if error.reason == "client_disconnected" else None)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting_requests: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, Submission] = {}  # engine thread: request id -> its submission
        self._active: set[Submission] = set()  # event loop: admitted and not yet closed
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._stop = False
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self.generation_rate = GenerationRate()
        self.stats: dict = {}  # the engine's latest stats() snapshot, refreshed after every step (and twice a second when idle)
        self._publish_stats()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_admitting(self) -> None:
        self._accepting = False

    @property
    def num_active(self) -> int:
        return len(self._active)

    def abort_all(self, error: RequestAborted) -> None:
        for sub in list(self._active):
            sub.fail(error)

    # ------------------------------------------------------------------ API for handlers
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending_adds

    @property
    def num_admitting(self) -> int:
        """Requests admitted by the API and not yet handed to the engine (at its next step)."""
        return self._pending_adds

    def submit(
        self, request_id: str, groups: list[PromptGroup], cache_salt: str | None = None, stream: bool = False,
        timeout: float | None = None, elapsed: float = 0.0, imported=None, lora_request=None,
    ) -> Submission:
        """Admit every sample of every prompt, or none (raising). `timeout` counts from the request's
        arrival, `elapsed` seconds ago. `imported`: a migrated request's (RequestState, decoded KV
        records) to continue (groups then name its prompt and its one sample)."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        if not self._accepting:
            raise EngineDrainingError("the server is shutting down")
        sub = Submission(self, request_id, groups, cache_salt, stream, lora_request)
        sub.imported = imported
        with self._lock:
            if self.num_waiting() + sub.num_samples > self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{self.num_waiting()} requests are already waiting (--max-waiting-requests {self.max_waiting_requests})"
                )
            self._pending_adds += sub.num_samples
        self._active.add(sub)
        if timeout is not None:
            sub.expire_at(max(0.0, timeout - elapsed), timeout)
        self._commands.put(_Add(sub))
        self._wake.set()
        return sub

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, between two engine steps; returns the blocks forgotten."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        done = threading.Event()
        result: list[int] = []
        self._commands.put(_Reset(result, done))
        self._wake.set()
        if not done.wait(timeout=60):
            raise EngineDeadError("the engine loop did not answer")
        return result[0]

    def call(self, fn: Callable[[], object]) -> asyncio.Future:
        """Run fn() on the engine thread between two steps (it may touch the engine); await its result."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        self._wake.set()
        return asyncio.wrap_future(future)

    def find(self, request_id: str) -> Submission | None:
        """The admitted, unclosed API request with this id (the newest, if a client reused one)."""
        found = [sub for sub in self._active if sub.request_id == request_id]
        return found[-1] if found else None

    def sink_of(self, request_id: str) -> Submission | None:
        return self._sinks.get(request_id)

    def detach(self, request_id: str) -> None:
        """Engine thread: the request left the engine (migrated); its outputs now come another way."""
        self._sinks.pop(request_id, None)

    def attach(self, request_id: str, sub: Submission) -> None:
        """Engine thread: the request is back in the engine (a migration that failed)."""
        self._sinks[request_id] = sub

    def abort(self, sub: Submission, request_ids: list[str], report: RequestAborted | None) -> None:
        self._commands.put(_Abort(sub, request_ids, report))
        self._wake.set()

    def report_abort(self, request_id: str, error: RequestAborted) -> None:
        """One log line and one count per aborted request (either thread)."""
        log.info("aborted %s: %s: %s", request_id, error.reason, error.message)
        self.metrics.aborted(error.reason)

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their requests' queues: one wake-up per step, not per output."""
        items = []
        for out in outputs:
            sub = self._sinks.get(out.request_id)
            if sub is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
                self.metrics.observe_finished(out, sub.lora_request)
            if out.beams is not None:  # a beam search: its best beams are the group's choices
                g, _ = sub.index[out.request_id]
                group = sub.groups[g]
                decode = self.engine.tokenizer.decode if self.engine.tokenizer is not None else None
                items.extend((sub.sink, choice) for choice in beam_choices(out, sub.ids[g], group.params[0].logprobs, decode))
                continue
            items.append((sub.sink, out))
        if items:
            self._loop.call_soon_threadsafe(_put_all, items)

    def _add(self, sub: Submission) -> None:
        with self._lock:
            self._pending_adds -= sub.num_samples
        added: list[str] = []
        try:
            if sub.imported is not None:
                state, records = sub.imported
                self.engine.import_request(state, sub.ids[0][0], records)
                added.append(sub.ids[0][0])
            for group, ids in zip(sub.groups, sub.ids) if sub.imported is None else ():
                if group.beam is not None:
                    self.engine.add_beam_search(group.token_ids, group.beam, ids[0], sub.cache_salt, sub.lora_request)
                    added.append(ids[0])
                    continue
                self.engine.add_request_group(group.token_ids, group.params, ids, sub.cache_salt, sub.stream, sub.lora_request,
                                              keep_kv=group.keep_kv)
                added.extend(ids)
        except Exception as exc:  # noqa: BLE001 - validated before admission; reported to this request alone
            for rid in added:
                self.engine.abort_request(rid)
            log.error("could not add %s to the engine: %s", sub.request_id, exc)
            error = RequestAborted("engine_error", f"the engine could not add this request ({exc})", 500)
            self._loop.call_soon_threadsafe(sub.fail, error)
            return
        for rid in added:
            self._sinks[rid] = sub

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._add(cmd.submission)
            elif isinstance(cmd, _Reset):
                cmd.result.append(self.engine.reset_prefix_cache())
                cmd.done.set()
            elif isinstance(cmd, _Call):
                try:
                    cmd.future.set_result(cmd.fn())
                except Exception as exc:  # noqa: BLE001 - the caller's to handle
                    cmd.future.set_exception(exc)
            else:
                dropped = False
                for rid in cmd.request_ids:
                    self._sinks.pop(rid, None)
                    out = self.engine.abort_request(rid)
                    if out is not None:  # its latencies count too (vLLM's do): a client that gives up is the slow case
                        self.metrics.observe_finished(out)
                        dropped = True
                if dropped and cmd.report is not None:
                    self.report_abort(cmd.submission.request_id, cmd.report)

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        self.metrics.update_from_stats(stats)
        self.generation_rate.observe(stats["generation_tokens_total"])
        self.stats = stats

    def _fail_all_dead(self, exc: BaseException) -> None:
        self.abort_all(RequestAborted("engine_dead", f"the engine loop stopped ({type(exc).__name__}: {exc})", 500))

    def _run(self) -> None:
        _name_os_thread(self._thread.name)
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._publish_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
                self._publish_stats()
        except BaseException as exc:  # noqa: BLE001 - fail every waiter at once rather than hang them
            log.exception("engine loop crashed")
            self.error = exc
            self._sinks.clear()
            self._loop.call_soon_threadsafe(self._fail_all_dead, exc)


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name in the OS as well (top -H, /proc/PID/task), where Linux allows it."""
    c = libc()
    if c is not None and hasattr(c, "prctl"):
        c.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
