"""Chat templates rendered in a sandboxed Jinja environment with limits on output size and time.

The environment is the one transformers gives chat templates (ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loop controls, `{% generation %}`, `tojson`, `raise_exception`,
`strftime_now`, `dict`, an underscore-free `namespace`), so a template renders the same text
here. On top of the sandbox: `*`, `**` and `+` refuse results over the output limit before
computing them and `~` right after, the output is counted as it is produced, and a deadline is
checked in the sandbox's hooks (calls, attribute and item access, operators), at every loop
iteration and at each output piece.

In-process rendering (`LLM`, `kvserve generate --chat`) relies on those checks alone. The server
renders in child processes (`python -I this_file`, JSON lines on stdin/stdout) whose address
space is capped and which it kills at the deadline, so that no template, however written, can
stall or exhaust the server. This file imports nothing of kvserve, so the child starts without
torch.
"""

from __future__ import annotations

import contextvars
import functools
import json
import sys
import time
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_MAX_CHARS = 4 * 2**20
CONTINUE_MARK = "\U0010fffd"  # a private-use character: where continue_final_message's message ends in the rendered text
DEFAULT_TIMEOUT_S = 2.0
_CHECK_EVERY = 64  # hook calls between two clock reads

_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_deadline", default=float("inf"))
_timeout: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_timeout", default=float("inf"))


class ChatTemplateError(ValueError):
    """The template failed, or broke the output or time limit."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping, json.dumps' options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed names (no route to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed names on a namespace ({name!r})")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it): its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


_TICK_ITER = "kvserve_tick_iter"
_CHECKED_CONCAT = "kvserve_checked_concat"


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
        self.max_chars = max_chars
        self._ticks = 0
        self.filters["tojson"] = _tojson
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_Namespace)
        self.globals.update({_TICK_ITER: self._tick_iter, _CHECKED_CONCAT: self._checked_concat})

    def _parse(self, source, name, filename):
        # every loop's iterable is wrapped so that each iteration ticks, and every `~` is size-checked
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Call(jinja2.nodes.Name(_TICK_ITER, "load"), [loop.iter], [], None, None)
        for concat in list(tree.find_all(jinja2.nodes.Concat)):
            inner = jinja2.nodes.Concat(concat.nodes)
            concat.nodes = [jinja2.nodes.Call(jinja2.nodes.Name(_CHECKED_CONCAT, "load"), [inner], [], None, None)]
        return tree

    def _tick_iter(self, iterable):
        for item in iterable:
            self.tick()
            yield item

    def _checked_concat(self, text):
        if len(text) > self.max_chars:
            raise ChatTemplateError(f"chat template builds a value over the {self.max_chars}-character limit")
        return text

    def tick(self) -> None:
        self._ticks += 1
        if self._ticks % _CHECK_EVERY == 0 and time.monotonic() > _deadline.get():
            raise ChatTemplateError(f"chat template took too long to render (over {_timeout.get():g} s)")

    def call_binop(self, context, operator, left, right):
        self.tick()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(count, int) and _size(seq) * count > self.max_chars:
                    raise ChatTemplateError(f"chat template builds a value over the {self.max_chars}-character limit")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and left.bit_length() * right > 4096:
                raise ChatTemplateError("chat template computes a power too large")
        elif operator == "+":
            if _size(left) is not None and _size(right) is not None and _size(left) + _size(right) > self.max_chars:
                raise ChatTemplateError(f"chat template builds a value over the {self.max_chars}-character limit")
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        self.tick()
        return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.tick()
        return super().getitem(obj, argument)


@functools.lru_cache(maxsize=16)
def _compile(template: str, max_chars: int) -> jinja2.Template:
    try:
        return _LimitedSandbox(max_chars).from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from None


def render_chat_template(
    template: str,
    messages: list[dict],
    special_tokens: dict[str, str] | None = None,
    add_generation_prompt: bool = True,
    max_chars: int = DEFAULT_MAX_CHARS,
    timeout: float = DEFAULT_TIMEOUT_S,
    tools: list[dict] | None = None,
) -> str:
    """The template's text for messages (what transformers' apply_chat_template(tokenize=False)
    gives), or ChatTemplateError when it fails or breaks a limit."""
    compiled = _compile(template, max_chars)
    token, timeout_token = _deadline.set(time.monotonic() + timeout), _timeout.set(timeout)
    parts: list[str] = []
    size = 0
    try:
        stream = compiled.generate(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **(special_tokens or {})
        )
        for piece in stream:
            size += len(piece)
            if size > max_chars:
                raise ChatTemplateError(f"chat template output exceeds the {max_chars}-character limit")
            parts.append(piece)
            compiled.environment.tick()
    except ChatTemplateError:
        raise
    except MemoryError:
        raise ChatTemplateError("chat template ran out of memory") from None
    except Exception as exc:  # noqa: BLE001 - whatever a template raises is the template's failure
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        _deadline.reset(token)
        _timeout.reset(timeout_token)
    return "".join(parts)


def _worker_main() -> None:
    """Render requests from stdin, one JSON object per line; answer {"text"} or {"error"} per line."""
    import resource

    memory = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    for line in sys.stdin:
        try:
            req = json.loads(line)
            text = render_chat_template(
                req["template"], req["messages"], req.get("special_tokens"), req.get("add_generation_prompt", True),
                req["max_chars"], req["timeout"], req.get("tools"),
            )  # fmt: skip
            answer = {"text": text}
        except ChatTemplateError as exc:
            answer = {"error": str(exc)}
        except MemoryError:
            answer = {"error": "chat template ran out of memory"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _worker_main()
