"""One nesting limit for every JSON a client sends: request bodies, and JSON text inside them (a tool
call's arguments) or produced for them (a generated tool call).

Python's json parser recurses and raises RecursionError near 1,000 levels, and every recursive walk
after it (validation, templates, schema rules) has less stack left: found by QA as 500s for bodies
nested about 960 deep. The access middleware measures a body's nesting on its raw bytes before
anything parses it (`raw_depth_exceeds`), and refuses it past MAX_JSON_DEPTH levels with a 400 that
names the limit; the models' first validator walks the parsed body again, iteratively, with the
same limit (for bodies that reach them another way).
"""

from __future__ import annotations

import json
import re

import numpy as np

MAX_JSON_DEPTH = 128  # a JSON schema nests two levels per object property: 64 levels of properties


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_A_BRACKET = re.compile(rb"[^\[\]{}]+")


def raw_depth_exceeds(body: bytes) -> bool:
    """Whether JSON text nests deeper than MAX_JSON_DEPTH, read from its bytes without parsing them
    (strings skipped; C-speed passes, and a byte count first that settles almost every body)."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return False
    brackets = _NOT_A_BRACKET.sub(b"", _STRING.sub(b"", body))
    steps = np.where(np.isin(np.frombuffer(brackets, dtype=np.uint8), (ord("["), ord("{"))), 1, -1)
    return bool(steps.size) and int(np.cumsum(steps).max()) > MAX_JSON_DEPTH


def too_deep_message() -> str:
    return f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels, the limit of every request"


class TooDeep(ValueError):
    """JSON nested past MAX_JSON_DEPTH; `path` is where the walk crossed the limit."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} nests JSON deeper than {MAX_JSON_DEPTH} levels, the limit of every request" if path else too_deep_message())
        self.path = path


def _holds_a_fault(value: object) -> bool:
    """Whether a JSON value nests past MAX_JSON_DEPTH or holds a string UTF-8 cannot encode: the
    walk every body takes, a level at a time and without the paths that only a fault needs."""
    if isinstance(value, str):
        return _unencodable(value)
    level, depth = [value], 0
    while level:
        deeper = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
            if isinstance(item, dict) and any(not key.isascii() and _unencodable(key) for key in item if isinstance(key, str)):
                return True  # a key is text too (metadata's keys are stored and sent back)
            for child in children:
                if isinstance(child, str):
                    if not child.isascii() and _unencodable(child):
                        return True
                elif isinstance(child, (dict, list)):
                    deeper.append(child)
        if any(isinstance(item, (dict, list)) for item in level) and depth >= MAX_JSON_DEPTH:
            return True
        level, depth = deeper, depth + 1
    return False


def _unencodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def first_unpaired_surrogate(value: object) -> str | None:
    """The path of the first string in a JSON value that UTF-8 cannot encode (JSON's "\\ud800"), after
    checking, on the same walk, that it nests at most MAX_JSON_DEPTH levels (TooDeep). Iterative."""
    if not _holds_a_fault(value):
        return None
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
            continue
        if isinstance(item, dict):
            children = item.items()
            for key in item:
                if isinstance(key, str) and _unencodable(key):
                    name = key.encode("utf-8", "backslashreplace").decode()
                    return f"{path}.{name}" if path else name
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        if depth >= MAX_JSON_DEPTH:
            raise TooDeep(path)
        # reversed: the walk meets fields in the order they were sent, so the first fault is reported
        stack.extend((child, f"{path}.{key}" if path else str(key), depth + 1) for key, child in reversed(list(children)))
    return None


def loads_bounded(text: str | bytes):
    """json.loads, refusing (TooDeep) JSON nested past MAX_JSON_DEPTH before the parser's recursion
    limit can turn it into a RecursionError; json.JSONDecodeError for text that is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep("") from None
    first_unpaired_surrogate(value)
    return value
