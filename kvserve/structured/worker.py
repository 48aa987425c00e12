"""Compiles grammars for the server in a child process, killed when a compile runs past its limit.

A compile is native code that cannot be interrupted, and some bounded-size schemas take seconds (2,000
properties: 12 s); in a thread a hostile request would keep a core busy after its 400 was sent. The
child holds the tokenizer's token table and answers one compile at a time with the compiled grammar
serialized; the parent stores it in the engine's GrammarCompiler cache, where add_request finds it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from multiprocessing.connection import Connection

from kvserve.structured.compiler import GrammarCompiler, compile_spec, xgrammar_module
from kvserve.structured.spec import GrammarError, StructuredOutputs

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in the child


def _serve(conn: Connection, tokenizer_info_json: str) -> None:
    xgr = xgrammar_module()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1, cache_enabled=False)
    conn.send(("ready", None))
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compile_spec(compiler, spec).serialize_json()))
        except GrammarError as exc:
            conn.send(("error", str(exc)))


class IsolatedGrammarCompiler:
    """Compiles into `grammars`'s cache within `timeout_s` per grammar, or raises GrammarError."""

    def __init__(self, grammars: GrammarCompiler, timeout_s: float) -> None:
        self.grammars = grammars
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one compile at a time; others wait their turn
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self.num_timeouts = 0

    async def compile(self, spec: StructuredOutputs) -> None:
        """Off the event loop: nothing to do when the grammar is cached."""
        if self.grammars.cached(spec) is None:
            await asyncio.to_thread(self.compile_blocking, spec)

    def compile_blocking(self, spec: StructuredOutputs) -> None:
        with self._lock:
            if self.grammars.cached(spec) is not None:
                return
            conn = self._connection()
            conn.send(spec)
            if not conn.poll(self.timeout_s):
                self.num_timeouts += 1
                self._stop()
                raise GrammarError(f"the {spec.description} took longer than {self.timeout_s:g} s to compile")
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                self._stop()
                raise GrammarError(f"the grammar compiler failed on this {spec.description}") from None
        if status == "error":
            raise GrammarError(payload)
        compiled = xgrammar_module().CompiledGrammar.deserialize_json(payload, self.grammars.tokenizer_info)
        self.grammars.store(spec, compiled)

    def _connection(self) -> Connection:
        if self._process is not None and self._process.is_alive():
            return self._conn
        self._stop()
        info = self.grammars.tokenizer_info.serialize_json()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, info), name="kvserve-grammar", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(WORKER_START_TIMEOUT_S) or parent.recv()[0] != "ready":
            self._stop()
            raise GrammarError("the grammar compiler process did not start")
        return parent

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._stop()
