"""Chat templates rendered in child processes: a template cannot stall the server or exhaust its memory.

Each child (kvserve/model/chat_template.py run as a script, no torch) renders one request at a
time under an address-space cap; a render that outlasts the deadline is answered with an error
and its child is killed and replaced on the next use. Calls block: handlers run them in a thread.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import subprocess
import sys
import time

from kvserve.model import chat_template
from kvserve.model.chat_template import ChatTemplateError

log = logging.getLogger(__name__)


class _Child:
    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", chat_template.__file__, str(self.memory_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, encoding="utf-8",
            )  # fmt: skip
        return self.proc

    def render(self, request: dict, timeout: float) -> str:
        proc = self._start()
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            raise ChatTemplateError("chat template renderer is not running; retry") from None
        # the child's own clock starts later; this one covers its start-up as well
        deadline = time.monotonic() + timeout + 1.0
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            self.kill()
            raise ChatTemplateError(f"chat template took too long to render (over {timeout:g} s)")
        line = proc.stdout.readline()
        if not line:
            self.kill()
            raise ChatTemplateError("chat template rendering ran out of memory (the renderer process ended)")
        answer = json.loads(line)
        if "error" in answer:
            raise ChatTemplateError(answer["error"])
        return answer["text"]

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class TemplateRenderer:
    """A pool of render processes: `render` blocks until one is free, then until it answers."""

    def __init__(self, processes: int = 2, timeout: float = chat_template.DEFAULT_TIMEOUT_S, memory_bytes: int = 2**30) -> None:
        self.timeout = timeout
        self._children = [_Child(memory_bytes) for _ in range(processes)]
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        for child in self._children:
            self._idle.put(child)

    def start(self) -> None:
        for child in self._children:
            child._start()

    def render(self, template: str, messages: list[dict], special_tokens: dict[str, str], max_chars: int,
               add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:  # fmt: skip
        request = {"template": template, "messages": messages, "special_tokens": special_tokens, "max_chars": max_chars,
                   "timeout": self.timeout, "add_generation_prompt": add_generation_prompt, "tools": tools}  # fmt: skip
        child = self._idle.get()
        try:
            return child.render(request, self.timeout)
        finally:
            self._idle.put(child)

    def close(self) -> None:
        for child in self._children:
            if child.proc is not None:
                child.proc.stdin.close()
                child.kill()
