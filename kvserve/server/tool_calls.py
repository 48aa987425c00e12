"""Tool calls in chat: the request's tools, validated and handed to the model's chat template; a
grammar when tool_choice asks for a call; the model's `<tool_call>` blocks (the Hermes format Qwen2.5
and others are trained on) parsed into message.tool_calls, and streamed as delta.tool_calls."""

from __future__ import annotations

import copy
import json
import re
import reprlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.server.json_limits import TooDeep, loads_bounded
from kvserve.structured.compiler import CALL_CLOSE, CALL_OPEN
from kvserve.structured.schema_rules import rebase_refs
from kvserve.structured.spec import GrammarError, StructuredOutputs, schema_text

MAX_TOOLS = 128
MAX_TOOLS_CHARS = 512 * 1024  # the tools list as JSON: what the chat template renders and the calls' schema is built from
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NAMES_TOOLS = re.compile(r"\btools\b")


def template_takes_tools(template: str) -> bool:
    return bool(_NAMES_TOOLS.search(template))


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema for the arguments object
    definition: dict  # what the chat template sees: {"type": "function", "function": {...}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required
    name: str | None = None  # a named function: required, that one


def _inline_root_ref(schema: dict) -> dict:
    """A schema that is only a $ref into its own $defs (pydantic's form for a recursive model) as the
    schema it names, its $defs kept, so that it states its type at the top."""
    ref = schema.get("$ref")
    for key in ("$defs", "definitions"):
        prefix = f"#/{key}/"
        if isinstance(ref, str) and ref.startswith(prefix) and isinstance(schema.get(key), dict):
            target = schema[key].get(ref[len(prefix) :])
            if isinstance(target, dict) and "$ref" not in target:
                return {**{k: v for k, v in schema.items() if k != "$ref"}, **copy.deepcopy(target)}
    return schema


def parse_tools(tools: list) -> list[Tool]:
    if len(tools) > MAX_TOOLS:
        raise GrammarError(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    parsed, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise GrammarError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise GrammarError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {reprlib.repr(name)}", "tools")
        if name in names:
            raise GrammarError(f"tools[{i}]: two tools are named {name!r}", "tools")
        names.add(name)
        parameters = function.get("parameters")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        try:
            parameters = json.loads(schema_text(parameters))
        except GrammarError as exc:
            raise GrammarError(f"tools[{i}].function.parameters: {exc}", "tools") from None
        if parameters == {}:
            parameters = {"type": "object", "properties": {}}
        parameters = _inline_root_ref(parameters)
        if parameters.get("type") != "object":
            raise GrammarError(f"tools[{i}].function.parameters must be a JSON schema of type object (a call's arguments are an object), "
                               f"got type {reprlib.repr(parameters.get('type'))}", "tools")  # fmt: skip
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise GrammarError(f"tools[{i}].function.description must be a string", "tools")
        definition = {"type": "function", "function": {k: v for k, v in (("name", name), ("description", description),
                                                                           ("parameters", parameters)) if v is not None}}  # fmt: skip
        parsed.append(Tool(name, parameters, definition))
    return parsed


def parse_tool_choice(value, tools: list[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value == "auto" and not tools:  # nothing to call: plain text, as none
        return ToolChoice("none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise GrammarError(f"tool_choice {value!r} needs tools", "tool_choice")
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(function, dict):
        raise GrammarError('tool_choice is none, auto, required or {"type": "function", "function": {"name": ...}}', "tool_choice")
    name = function.get("name")
    if name not in {t.name for t in tools}:
        raise GrammarError(f"tool_choice names {reprlib.repr(name)}, which is not among the tools", "tool_choice")
    return ToolChoice("required", name)


def call_grammar(tools: list[Tool], choice: ToolChoice, parallel: bool) -> StructuredOutputs:
    """Output that is one tool call (or, with parallel calls, several), each a `<tool_call>` block whose JSON
    names one of the tools (or the named one) and carries arguments that follow its parameters."""
    allowed = [t for t in tools if choice.name is None or t.name == choice.name]
    # each tool's parameters sit at `where` in the calls' schema: their own $refs are rebased to it
    where = ["#/properties/arguments"] if len(allowed) == 1 else [f"#/anyOf/{i}/properties/arguments" for i in range(len(allowed))]
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": rebase_refs(t.parameters, at)},
              "required": ["name", "arguments"], "additionalProperties": False} for t, at in zip(allowed, where)]  # fmt: skip
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return StructuredOutputs(tool_calls=schema, parallel_tool_calls=parallel and choice.name is None)


def _call(body: str | dict, names: frozenset[str] | None = None) -> dict | None:
    """A `<tool_call>` block's JSON (or a parsed object) as an OpenAI tool call; None when it is not one
    (or, given `names`, not a call of one of them)."""
    try:
        value = loads_bounded(body) if isinstance(body, str) else body
    except (json.JSONDecodeError, TooDeep):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or (names is not None and value["name"] not in names):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = loads_bounded(arguments)
        except (json.JSONDecodeError, TooDeep):
            return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}  # fmt: skip


_FENCE = re.compile(r"\s*```(?:json)?\s*\n(.*)\n\s*```\s*", re.DOTALL)


def _bare_calls(text: str, names: frozenset[str]) -> list[dict] | None:
    """Text that is nothing but JSON calls of these tools, one after another without their tags, perhaps
    in one Markdown code fence (small models answer so): the calls; None otherwise."""
    fenced = _FENCE.fullmatch(text)
    if fenced is not None:
        text = fenced.group(1)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call(value, names)
        if call is None:
            return None
        calls.append(call)


class ToolCallParser:
    """Splits one choice's text, piece by piece as it streams, into content and complete tool calls.
    Text that may start a `<tool_call>` is held until it is known; trailing whitespace is held until more
    content follows (dropped at the end when the choice made calls); an answer that opens with `{` (or a JSON
    code fence) is held to the end, where it is either bare JSON calls of the tools or content. So a
    stream reassembles into the same message as the whole text parsed at once."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self._buffer = ""
        self._in_call = False
        self._space = ""
        self._bare: str | None = None  # an answer that opened with "{" or a code fence: held whole
        self._emitted = False
        self.num_calls = 0

    @staticmethod
    def _opening(text: str) -> str:
        """How an answer opens: "bare" (like JSON calls, or a JSON code fence: held to the end), "maybe"
        (too short to say: held) or "text"."""
        start = text.lstrip()
        if start.startswith(("{", "```json", "```\n{")):
            return "bare"
        return "maybe" if any(opening.startswith(start) for opening in ("```json", "```\n{")) else "text"

    def _content(self, text: str, out: list[str]) -> None:
        pending = self._space + text
        kept = pending.rstrip()
        if kept:
            out.append(kept)
            self._emitted = True
        self._space = pending[len(kept) :]  # trailing whitespace waits for what follows

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self._bare is not None:
            self._bare += text
            return "", []
        if not self._emitted and not self.num_calls and not self._in_call:
            opening = self._opening(self._space + self._buffer + text)
            if opening == "bare":
                self._bare, self._buffer = self._space + self._buffer + text, ""
                self._space = ""
                return "", []
            if opening == "maybe":
                self._buffer += text
                return "", []
        self._buffer += text
        content: list[str] = []
        calls: list[dict] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(CALL_OPEN)
                if at < 0:
                    keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self._buffer)), 0, -1)
                                 if CALL_OPEN.startswith(self._buffer[-k:])), 0)  # fmt: skip
                    self._content(self._buffer[: len(self._buffer) - keep], content)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                self._content(self._buffer[:at], content)
                self._buffer, self._in_call = self._buffer[at + len(CALL_OPEN) :], True
            else:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    break
                body, self._buffer, self._in_call = self._buffer[:end], self._buffer[end + len(CALL_CLOSE) :], False
                call = _call(body.strip())
                if call is None:
                    self._content(CALL_OPEN + body + CALL_CLOSE, content)
                else:
                    calls.append(call)
                    self.num_calls += 1
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """The content and calls still held at the end (an unfinished block is content)."""
        if self._bare is not None:
            text, self._bare = self._bare, None
            calls = _bare_calls(text, self.names)
            if calls is not None:
                self.num_calls += len(calls)
                return "", calls
            return text, []
        content: list[str] = []
        self._content((CALL_OPEN if self._in_call else "") + self._buffer, content)
        self._buffer, self._in_call = "", False
        if self._space and not self.num_calls:
            content.append(self._space)
        self._space = ""
        return "".join(content), []

    def parse(self, text: str, last: bool) -> tuple[str, list[dict]]:
        """feed, and with `last` finish too."""
        content, calls = self.feed(text)
        if last:
            rest, more = self.finish()
            content, calls = content + rest, calls + more
        return content, calls


def message_with_calls(text: str, names: Iterable[str]) -> tuple[str | None, list[dict]]:
    """The whole text of a choice as (content or None, tool calls)."""
    content, calls = ToolCallParser(names).parse(text, last=True)
    return content or None, calls
