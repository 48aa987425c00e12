"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of a few
strings, or an EBNF grammar. Validated and bounded on construction, hashable (compiled grammars are
cached by it)."""

from __future__ import annotations

import copy
import json
import re
import reprlib
from dataclasses import dataclass

from kvserve.structured.patterns import grammar_refusal, holds_nul, not_text, regex_refusal
from kvserve.structured.schema_rules import schema_refusal, text_only_patterns

# a schema, regex or grammar longer than this is refused before it is compiled; so are more choices
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # nesting of the schema's JSON itself
_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")


class GrammarError(ValueError):
    """A constraint that cannot be compiled: malformed, unsupported, too large or too slow; `param`
    names the request field that carried it, where known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion (a hostile schema may nest thousands deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def exceeds_chars(value: object, limit: int) -> bool:
    """Whether parsed JSON's compact text would be longer than `limit` characters, found by a walk
    that stops once it has seen that many: a 500,000-property object is refused in microseconds,
    not walked (or copied, or serialized) first."""
    size, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            size += 1 + 3 * len(node)  # braces and each entry's quotes, colon and comma
            for key, child in node.items():
                size += len(key) if isinstance(key, str) else 8
                stack.append(child)
                if size > limit:
                    return True
        elif isinstance(node, (list, tuple)):
            size += 1 + len(node)
            stack.extend(node)
        elif isinstance(node, str):
            size += 2 + len(node)
        else:
            size += 4 if node is None or isinstance(node, bool) else len(repr(node)) if isinstance(node, (int, float)) else 8
        if size > limit:
            return True
    return False


def schema_text(schema: object) -> str:
    """A JSON schema (dict, or its JSON text) as canonical JSON text, refused past the bounds."""
    if not isinstance(schema, str) and exceeds_chars(schema, MAX_GRAMMAR_CHARS):
        raise GrammarError(f"the JSON schema is over {MAX_GRAMMAR_CHARS} characters; at most {MAX_GRAMMAR_CHARS} are compiled")
    if isinstance(schema, str):
        if len(schema) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the JSON schema is {len(schema)} characters; at most {MAX_GRAMMAR_CHARS} are compiled")
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if schema is False or (isinstance(schema, dict) and schema.keys() == {"not"} and schema["not"] in ({}, True)):
        raise GrammarError("the JSON schema is false, which no value satisfies: nothing could be generated")
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema is an object (or true), got {type(schema).__name__}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    reason = schema_refusal(schema)
    if reason is not None:
        raise GrammarError(reason)
    schema = copy.deepcopy(schema)
    text_only_patterns(schema)
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)  # key order kept: properties generate in it
    except ValueError as exc:
        raise GrammarError(f"the JSON schema holds a value JSON cannot carry: {exc}") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the JSON schema is {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are compiled")
    return text


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: json (a JSON schema as JSON text; a dict is accepted and made canonical),
    json_object (any JSON object), regex, choice (the output is one of these strings), grammar
    (EBNF in xgrammar's dialect, root rule `root`) or tool_calls (the JSON schema of one tool call's
    object, each call written in a `<tool_call>` block; several of them with parallel_tool_calls).
    A tool call's grammar is written from its schema where it is compiled (the compile worker), since
    writing it can take as long as compiling it."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    tool_calls: str | None = None
    parallel_tool_calls: bool = False

    def __post_init__(self) -> None:
        for name in ("json", "tool_calls"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, schema_text(getattr(self, name)))
        if not isinstance(self.parallel_tool_calls, bool) or (self.parallel_tool_calls and self.tool_calls is None):
            raise GrammarError(f"parallel_tool_calls is a boolean that goes with tool_calls, got {reprlib.repr(self.parallel_tool_calls)}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise GrammarError(f"choice is a list of strings, got {reprlib.repr(self.choice)}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise GrammarError(f"choice takes 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise GrammarError("choice strings must be non-empty strings")
            if any(not_text(c) for c in self.choice):
                raise GrammarError("a choice holds NUL or a UTF-16 surrogate, which cannot be generated as text")
            if sum(len(c) for c in self.choice) > MAX_GRAMMAR_CHARS:
                raise GrammarError(f"the choices hold more than {MAX_GRAMMAR_CHARS} characters")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise GrammarError(f"{name} must be a non-empty string, got {reprlib.repr(value)}")
            if name == "regex" and value is not None and holds_nul(value):  # a grammar's literals: compiler.grammar_text
                raise GrammarError("the regex holds NUL, which cannot be generated as text")
            if value is not None and len(value) > MAX_GRAMMAR_CHARS:
                raise GrammarError(f"the {name} is {len(value)} characters; at most {MAX_GRAMMAR_CHARS} are compiled")
            if name == "regex" and value is not None:
                try:  # what Python's re refuses ("[\d-z]", "\Q") xgrammar would read some way of its own
                    re.compile(value)
                except (re.error, RecursionError, OverflowError) as error:
                    raise GrammarError(f"the regex is not one Python's re reads: {error}") from None
            if value is not None:  # one check for a regex and a schema's pattern: forms xgrammar reads otherwise
                reason = regex_refusal(value) if name == "regex" else grammar_refusal(value)
                if reason is not None:
                    raise GrammarError(reason.replace("the pattern", f"the {name}").replace("a pattern", f"a {name}"))
        if not isinstance(self.json_object, bool):
            raise GrammarError(f"json_object must be a boolean, got {reprlib.repr(self.json_object)}")
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise GrammarError(f"give exactly one of json, json_object, regex, choice or grammar; got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    @property
    def description(self) -> str:
        """What the constraint is, for messages: "JSON schema", "regex", ..."""
        return {"json": "JSON schema", "json_object": "JSON object constraint", "choice": "choices",
                "tool_calls": "tools' call grammar"}.get(self.kind, self.kind)  # fmt: skip
