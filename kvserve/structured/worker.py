"""Compiles grammars for the server in child processes, each killed when a compile runs past its time
or memory limit, with a queue that keeps every client's compiles from holding up another's.

A compile is native code that cannot be interrupted, and some bounded-size schemas take seconds (2,000
properties: 15 s); in a thread a hostile request would keep a core busy after its 400 was sent. Each
child holds the tokenizer's token table and answers one compile at a time with the compiled grammar
serialized; the parent stores it in the engine's GrammarCompiler cache, where add_request finds it.

Scheduling, so that no request waits for another client's grammar work:
- waiting costs no thread: a request awaits a future; each child has one thread of its own that
  talks to it, so tokenizing and chat rendering (the event loop's default executor) never queue
  behind a compile;
- clients (the peer address) take turns: the next compile is the oldest of the next client in turn,
  and one client's compiles run on at most all workers but one, so one is always free for another
  client's; a client has at most MAX_PENDING_PER_CLIENT compiles queued or running (then a 429);
- a request whose client left stops waiting, and a compile nobody waits for any more is dropped
  from the queue, or stopped (its child killed) if it has started;
- the same constraint asked for by several requests compiles once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from kvserve.structured.compiler import GrammarCompiler, compile_spec, xgrammar_module
from kvserve.structured.spec import GrammarError, StructuredOutputs

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in the child
MAX_PENDING_PER_CLIENT = 8
# how a compile ended: compiled, refused (the constraint is a 400), timeout, out_of_memory, dropped
# (nobody waited for it any more), rejected (its client's queue was full: a 429)
OUTCOMES = ("compiled", "refused", "timeout", "out_of_memory", "dropped", "rejected")
_POLL_S = 0.05  # how often a worker thread looks whether anyone still waits for its compile


class CompileQueueFull(GrammarError):
    """A client has MAX_PENDING_PER_CLIENT compiles queued or running already."""


def _address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


def _serve(conn: Connection, tokenizer_info_json: str, memory_bytes: int) -> None:
    os.nice(10)  # a compile takes a core the step loop wants: the step loop goes first where both want one
    xgr = xgrammar_module()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1, cache_enabled=False)
    if memory_bytes:
        import resource

        # above what the child holds once started (torch and xgrammar loaded): a compile's own memory
        limit = _address_space_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", None))
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            answer = ("ok", compile_spec(compiler, spec).serialize_json())
        except MemoryError:
            answer = ("memory", "")
        except Exception as exc:  # noqa: BLE001 - a GrammarError, or native code's failure (std::bad_alloc past the limit)
            answer = ("memory" if "bad_alloc" in str(exc) else "error", str(exc) if isinstance(exc, GrammarError) else "")
            if answer == ("error", ""):
                answer = ("error", f"the grammar compiler failed on this {spec.description}: {type(exc).__name__}")
        conn.send(answer)


@dataclass(eq=False)
class _Job:
    spec: StructuredOutputs
    client: str
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)
    running: bool = False


class _Child:
    """One compile process, started on first use and again after it is killed."""

    def __init__(self, tokenizer_info_json: str, memory_bytes: int) -> None:
        self._info = tokenizer_info_json
        self._memory = memory_bytes
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def connection(self) -> Connection:
        if self._process is not None and self._process.is_alive():
            return self._conn
        self.stop()
        # forked from a server process that imported xgrammar (and torch) once: a child killed past
        # its limit is replaced in a fraction of a second, not the seconds that import takes
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["xgrammar", __name__])
        parent, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self._info, self._memory), name="kvserve-grammar", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(WORKER_START_TIMEOUT_S) or parent.recv()[0] != "ready":
            self.stop()
            raise GrammarError("the grammar compiler process did not start")
        return parent

    def stop(self) -> None:
        if self._process is not None and self._process.pid is not None:  # None: its start failed
            self._process.kill()
            self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


class IsolatedGrammarCompiler:
    """Compiles into `grammars`'s cache within `timeout_s` and `memory_bytes` per grammar, on
    `workers` child processes shared fairly between clients, or raises GrammarError."""

    def __init__(self, grammars: GrammarCompiler, timeout_s: float, workers: int = 2, memory_bytes: int = 1 << 30) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.grammars = grammars
        self.timeout_s = timeout_s
        self.workers = workers
        self.memory_bytes = memory_bytes
        self._cond = threading.Condition()
        self._queues: collections.OrderedDict[str, collections.deque[_Job]] = collections.OrderedDict()  # clients in turn order
        self._jobs: dict[StructuredOutputs, _Job] = {}  # queued or running
        self._running: collections.Counter[str] = collections.Counter()  # per client: jobs running
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self._children: list[_Child] = []
        self._closed = False
        self.outcomes: collections.Counter[str] = collections.Counter({o: 0 for o in OUTCOMES})

    async def compile(self, spec: StructuredOutputs, client: str = "") -> None:
        """Off the event loop, holding no thread while it waits: nothing to do when the grammar is cached."""
        if self.grammars.cached(spec) is not None:
            return
        if not self._threads:
            await asyncio.to_thread(self._start_threads)  # the token table is built on first use (a second on a large vocabulary)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self._closed:
                raise GrammarError("the server is shutting down")
            job = self._jobs.get(spec)
            if job is None:
                if len(self._queues.get(client, ())) + self._running[client] >= MAX_PENDING_PER_CLIENT:
                    self.outcomes["rejected"] += 1
                    raise CompileQueueFull(f"this client has {MAX_PENDING_PER_CLIENT} grammars compiling or waiting to; "
                                           "retry when one is done")  # fmt: skip
                job = self._jobs[spec] = _Job(spec, client)
                self._queues.setdefault(client, collections.deque()).append(job)
                self._cond.notify_all()
            job.waiters.append((loop, future))
        try:
            await future
        finally:
            if not future.done() or future.cancelled():
                self._leave(job, future)

    def _leave(self, job: _Job, future: asyncio.Future) -> None:
        """A waiter gone (its client left, or it was cancelled): a queued job nobody waits for is dropped."""
        with self._cond:
            job.waiters = [(lp, f) for lp, f in job.waiters if f is not future]
            if job.waiters or job.running or self._jobs.get(job.spec) is not job:
                return  # a running one is stopped by its thread, which polls for waiters
            self._queues[job.client].remove(job)
            self._finish(job)
            self.outcomes["dropped"] += 1

    def _finish(self, job: _Job) -> None:
        del self._jobs[job.spec]
        if not self._queues.get(job.client, True):
            del self._queues[job.client]

    def _start_threads(self) -> None:
        with self._start_lock:
            if self._threads:
                return
            info = self.grammars.tokenizer_info.serialize_json()
            for i in range(self.workers):
                child = _Child(info, self.memory_bytes)
                thread = threading.Thread(target=self._work, args=(child,), name=f"kvserve-grammar-{i}", daemon=True)
                self._children.append(child)
                thread.start()
                self._threads.append(thread)

    def _next_job(self) -> _Job | None:
        """The oldest queued job of the first client in turn that may run one more; that client goes to the back."""
        per_client = max(1, self.workers - 1)
        for client, queue in self._queues.items():
            if queue and self._running[client] < per_client:
                self._queues.move_to_end(client)
                return queue.popleft()
        return None

    def _work(self, child: _Child) -> None:
        while True:
            with self._cond:
                job = None
                while not self._closed and (job := self._next_job()) is None:
                    self._cond.wait()
                if self._closed:
                    child.stop()
                    return
                job.running = True
                self._running[job.client] += 1
            try:
                outcome = self._run(child, job)
            except GrammarError as exc:
                outcome = exc
            except Exception as exc:  # noqa: BLE001 - a waiter must hear of every failure
                log.exception("grammar compile failed")
                outcome = GrammarError(f"the grammar compiler failed on this {job.spec.description}: {type(exc).__name__}")
            with self._cond:
                self._running[job.client] -= 1
                self._finish(job)
                waiters = job.waiters
                self._cond.notify_all()
            for loop, future in waiters:
                loop.call_soon_threadsafe(_settle, future, outcome)

    def _run(self, child: _Child, job: _Job) -> GrammarError | None:
        """Compiles one job into the cache; the error to answer with, or None."""
        if self.grammars.cached(job.spec) is not None:
            return None
        if self._abandoned(job):  # its clients left while it was being taken from the queue
            return self._drop()
        conn = child.connection()
        if self._abandoned(job):  # its clients left while the child started
            return self._drop()
        conn.send(job.spec)
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                self.outcomes["timeout"] += 1
                child.stop()
                return GrammarError(f"the {job.spec.description} took longer than {self.timeout_s:g} s to compile")
            if self._abandoned(job):
                child.stop()
                return self._drop()
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            child.stop()
            self.outcomes["out_of_memory"] += 1
            return GrammarError(f"the grammar compiler stopped on this {job.spec.description} (it may have needed more than "
                                f"its {self.memory_bytes >> 20} MiB of memory)")  # fmt: skip
        if status == "memory":
            child.stop()  # what a failed allocation leaves behind is not trusted
            self.outcomes["out_of_memory"] += 1
            return GrammarError(f"the {job.spec.description} needs more than the {self.memory_bytes >> 20} MiB of memory a "
                                "grammar may take to compile")  # fmt: skip
        if status == "error":
            self.outcomes["refused"] += 1
            return GrammarError(payload)
        compiled = xgrammar_module().CompiledGrammar.deserialize_json(payload, self.grammars.tokenizer_info)
        self.grammars.store(job.spec, compiled)
        self.outcomes["compiled"] += 1
        return None

    def _abandoned(self, job: _Job) -> bool:
        with self._cond:
            return not job.waiters or self._closed

    def _drop(self) -> GrammarError:
        self.outcomes["dropped"] += 1
        return GrammarError("nobody waits for this grammar any more")

    @property
    def pending(self) -> int:
        """Compiles queued or running."""
        with self._cond:
            return len(self._jobs)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiters = [w for job in self._jobs.values() for w in job.waiters]
            self._cond.notify_all()
        for loop, future in waiters:
            loop.call_soon_threadsafe(_settle, future, GrammarError("the server is shutting down"))
        for thread in self._threads:
            thread.join(timeout=10)
        for child in self._children:
            child.stop()


def _settle(future: asyncio.Future, outcome: GrammarError | None) -> None:
    if future.done():
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)
