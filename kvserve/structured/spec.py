"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of a few
strings, or an EBNF grammar. Validated and bounded on construction, hashable (compiled grammars are
cached by it)."""

from __future__ import annotations

import copy
import json
import re
import reprlib
from dataclasses import dataclass

# a schema, regex or grammar longer than this is refused before it is compiled; so are more choices
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # nesting of the schema's JSON itself


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


# where a schema keyword holds subschemas: one schema, a list of them, or a name -> schema map
_SCHEMA_KEYWORDS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames", "additionalItems")
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")
# assertions xgrammar 0.2.9 compiles to nothing: output would not follow them, so a schema holding one is refused
_NOT_ENFORCED = ("contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas", "dependencies", "not", "if", "then",
                 "else", "$dynamicRef", "$recursiveRef")  # fmt: skip
# JSON Schema's assertion and applicator keywords: beside a $ref, anyOf, oneOf or allOf (which xgrammar
# compiles alone) or an enum/const (generated as listed) one of these would be ignored. Any other
# keyword (title, description, x-..., OpenAPI's nullable, which only widens) is an annotation.
_ASSERTIONS = frozenset(("type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength",
                         "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
                         "maxProperties", "minProperties", "required", "dependentRequired", "properties", "patternProperties",
                         "additionalProperties", "propertyNames", "items", "prefixItems", "additionalItems", "contains",
                         "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
                         "dependentSchemas", "dependencies", "$ref"))  # fmt: skip
_INT64 = 2**63
# a regex escape of a UTF-16 surrogate (U+D800-U+DFFF: not text), or a \u range that spans them
_SURROGATE_ESCAPE = re.compile(r"\\(?:u|U0000|x\{)[dD][89abAB][0-9a-fA-F]{2}")
_U_RANGE = re.compile(r"\\u([0-9a-fA-F]{4})-\\u([0-9a-fA-F]{4})")


def _admits_surrogates(pattern: str) -> bool:
    # text_only_pattern's exclusions ([^\ud800-\udfff...]) keep them out: not an admission
    pattern = re.sub(r"\[\^((?:\\[swd])?)" + re.escape(_NO_SURROGATES), r"[^\1", pattern)
    spans = (int(lo, 16) <= 0xDFFF and int(hi, 16) >= 0xD800 for lo, hi in _U_RANGE.findall(pattern))
    return bool(_SURROGATE_ESCAPE.search(pattern)) or any(spans)


# an escape of NUL, which no tokenizer's text carries (xgrammar drops it silently from literals)
_NUL_AT = re.compile(r"x0+(?![0-9a-fA-F])|x\{0+\}|u\{0+\}|u0000|U00000000|0(?![0-9])")


def holds_nul(text: str) -> bool:
    """NUL outside a character class (where it would be generated, not merely allowed), raw or escaped."""
    in_class, i = False, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            if not in_class and _NUL_AT.match(text, i + 1):
                return True
            i += 2
            continue
        if c == "\x00" and not in_class:
            return True
        in_class = c != "]" if in_class else c == "["
        i += 1
    return False


_LOOKAROUND = re.compile(r"(?<!\\)(?:\\\\)*\(\?<?[=!]")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),), "array": (list,),
               "object": (dict,)}  # fmt: skip


def _is_of(value, name: str) -> bool:
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, object)) and not (isinstance(value, bool) and name in ("integer", "number"))


def _inner_anchor(pattern: str) -> bool:
    """A ^ or $ (outside a class, unescaped) that does not open or close the whole pattern or one of its
    top-level alternatives: xgrammar drops it, so "a$b" would match "ab"."""
    in_class, depth, i = False, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, i = True, i + (2 if pattern[i + 1 : i + 2] == "^" else 1)
            continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "^" and (depth or (i > 0 and pattern[i - 1] != "|")):
            return True
        elif c == "$" and (depth or (i + 1 < len(pattern) and pattern[i + 1] != "|")):
            return True
        i += 1
    return False


# regex escapes xgrammar reads otherwise than JSON Schema's regexes do: anchors and word boundaries it
# takes as letters, and \x with more than two hex digits (it reads them all: "\x41BC" is U+41BC)
_UNSUPPORTED_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\(?:[AZzbBGpP]|x[0-9a-fA-F]{3})")
_INLINE_FLAGS = re.compile(r"\(\?[a-zA-Z]+[:)]")


def _escaped_code(pattern: str, i: int) -> int | None:
    """The code point the escape at pattern[i] (a backslash) stands for, when it stands for one."""
    e = pattern[i + 1 : i + 2]
    simple = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}
    if e in simple:
        return simple[e]
    width = {"x": 2, "u": 4}.get(e)
    digits = pattern[i + 2 : i + 2 + width] if width else ""
    if width and len(digits) == width and all(d in "0123456789abcdefABCDEF" for d in digits):
        return int(digits, 16)
    return ord(e) if e and not e.isalnum() else None


def _needs_json_escape(pattern: str) -> bool:
    """A literal character of the pattern (outside a class: xgrammar keeps classes to what a JSON
    string may hold raw) that a JSON string must escape, a quote, a backslash or a control
    character: xgrammar writes such literals raw, which no JSON reader takes."""
    in_class, i = False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            code = None if in_class else _escaped_code(pattern, i)
            if code is not None and (code < 0x20 or code in (0x22, 0x5C)):
                return True
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 2 if pattern[i + 1 : i + 2] in ("^", "]") else 1
            continue
        elif c == '"' or ord(c) < 0x20:
            return True
        i += 1
    return False


def _pattern_refusal(pattern) -> str | None:
    if not isinstance(pattern, str):
        return f"a pattern is a string, got {reprlib.repr(pattern)}"
    if _admits_surrogates(pattern):
        return "a pattern admits UTF-16 surrogates (U+D800-U+DFFF), which are not text and cannot be generated"
    if holds_nul(pattern):
        return "a pattern holds NUL, which cannot be generated as text"
    if _LOOKAROUND.search(pattern):
        return f"a lookahead or lookbehind in the pattern {reprlib.repr(pattern)} is not enforced by the grammar compiler"
    if _UNSUPPORTED_ESCAPE.search(pattern) or _INLINE_FLAGS.search(pattern):
        return (f"the pattern {reprlib.repr(pattern)} uses \\A, \\Z, \\b, \\p{{...}}, an inline flag or a \\x escape of more than two "
                "hex digits, which the grammar compiler does not read as JSON Schema's regexes do")  # fmt: skip
    if _inner_anchor(pattern):
        return f"a ^ or $ inside the pattern {reprlib.repr(pattern)} is not enforced (only at its ends and its alternatives')"
    if _needs_json_escape(pattern):
        return (f"the pattern {reprlib.repr(pattern)} generates a quote, a backslash or a control character, which the grammar "
                "compiler would write into the JSON string unescaped")  # fmt: skip
    return None


_NO_SURROGATES = "\\ud800-\\udfff"
_NEGATED_ESCAPES = {"S": "\\s", "W": "\\w", "D": "\\d"}


def _kept_off(pattern: str, start: int) -> bool:
    """The negated class opening at start already leaves out the surrogates (text_only_pattern's own)."""
    end = pattern.find("]", start)
    return _NO_SURROGATES in pattern[start : end if end >= 0 else len(pattern)]


def text_only_pattern(pattern: str) -> str:
    """The pattern with every "any character" form (., a negated class, \\S, \\W, \\D) kept off the UTF-16
    surrogates, which xgrammar's regexes admit and no text holds (their UTF-8 bytes decode to U+FFFD)."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            escape = pattern[i + 1]
            out.append(f"[^{_NEGATED_ESCAPES[escape]}{_NO_SURROGATES}]" if escape in _NEGATED_ESCAPES and not in_class else c + escape)
            i += 2
            continue
        if in_class:
            in_class = c != "]"
            out.append(c)
        elif c == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^" and not _kept_off(pattern, i):
                out.append("[^" + _NO_SURROGATES)
                i += 2
                continue
            out.append(c)
        elif c == ".":
            out.append(f"[^{_NO_SURROGATES}]")
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _text_only_patterns(schema: dict) -> None:
    """text_only_pattern on every pattern of the schema (pattern, patternProperties' keys), in place."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("pattern"), str):
            node["pattern"] = text_only_pattern(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {text_only_pattern(k): v for k, v in node["patternProperties"].items()}
        stack.extend(child for child, _ in _subschemas(node, ""))


def _not_text(value: str) -> bool:
    """NUL or a lone UTF-16 surrogate: characters no tokenizer's text can carry back."""
    return any(ch == "\x00" or 0xD800 <= ord(ch) <= 0xDFFF for ch in value)


def _subschemas(node: dict, pointer: str):
    """(subschema, its JSON pointer) for each schema position directly under node; never into
    const, enum, default or examples, which hold data."""
    for key in _SCHEMA_KEYWORDS:
        if isinstance(node.get(key), (dict, list)):
            value = node[key]
            for i, child in enumerate(value) if isinstance(value, list) else [(None, value)]:
                yield child, f"{pointer}/{key}" + ("" if i is None else f"/{i}")
    for key in _SCHEMA_LIST_KEYWORDS:
        if isinstance(node.get(key), list):
            yield from ((child, f"{pointer}/{key}/{i}") for i, child in enumerate(node[key]))
    for key in _SCHEMA_MAP_KEYWORDS:
        if isinstance(node.get(key), dict):
            yield from ((child, f"{pointer}/{key}/{name}") for name, child in node[key].items())


def rebase_refs(schema: dict, base: str) -> dict:
    """A copy of schema whose local $refs ("#", "#/...") point into it where it is embedded at the
    JSON pointer `base` of a larger schema (a tool's parameters inside the calls' schema)."""
    schema = copy.deepcopy(schema)
    stack, seen = [schema], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:  # a subschema shared by two places is rebased once
            continue
        seen.add(id(node))
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
        stack.extend(child for child, _ in _subschemas(node, ""))
    return schema


def _refusal(node: dict) -> str | None:
    """Why this schema object cannot be enforced as written, or None."""
    for key in _NOT_ENFORCED:
        if key in node:
            return f"{key!r} is not enforced by the grammar compiler, so the output would not follow it"
    if node.get("uniqueItems") is True:
        return "'uniqueItems' is not enforced by the grammar compiler, so the output could repeat items"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one schema is not enforced (only the first would be); merge them into one schema"
    if "multipleOf" in node and node.get("type") != "integer":
        return "'multipleOf' is enforced only for type integer"
    if node.get("allOf") == []:
        return "'allOf' is an empty list; JSON Schema asks for at least one schema"
    for key in ("anyOf", "oneOf", "enum", "type"):
        if node.get(key) == []:
            return f"{key!r} is an empty list, which no value satisfies: nothing could be generated"
    ref = node.get("$ref")
    if "$ref" in node and (not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/"))):
        return f"$ref {reprlib.repr(ref)} is not a JSON pointer into this schema ('#' or '#/...'); other documents and anchors are not resolved"
    for key in ("$ref", "anyOf", "oneOf", "allOf"):
        beside = sorted((set(node) & _ASSERTIONS) - {key})
        if key in node and beside:
            where = "into the schema it names" if key == "$ref" else "into each of its schemas"
            return f"{beside[0]!r} beside {key} is not enforced (the compiler takes {key} alone); move it {where}"
    patterns = [node["pattern"]] if "pattern" in node else []
    patterns += list(node["patternProperties"]) if isinstance(node.get("patternProperties"), dict) else []
    for pattern in patterns:
        reason = _pattern_refusal(pattern)
        if reason is not None:
            return reason
    lengths = sorted({"minLength", "maxLength"} & set(node))
    if lengths and "pattern" in node:  # beside a format it is not enforced either, as documented (pydantic's HttpUrl has one)
        return (f"{lengths[0]!r} beside pattern is not enforced by the grammar compiler (it drops the length); fold the length "
                "into the pattern, or leave one of them out")  # fmt: skip
    if "format" in node and not isinstance(node["format"], str):
        return f"format is a string, got {reprlib.repr(node['format'])}"
    if "uniqueItems" in node and not isinstance(node["uniqueItems"], bool):
        return f"uniqueItems is a boolean, got {reprlib.repr(node['uniqueItems'])}"
    values = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
    if values is not None:
        key = "enum" if "enum" in node else "const"
        beside = sorted((set(node) & _ASSERTIONS) - {key, "type"})
        if beside:
            return f"{beside[0]!r} beside {key} is not enforced (the compiler generates the listed values as given); list only values that satisfy it"
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is not None and any(not any(_is_of(v, t) for t in types) for v in values):
            return f"{key} lists a value that is not of type {node['type']!r}, which the compiler would generate as given"
    if node.get("type") == "integer":
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            bound = node.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not -_INT64 <= bound < _INT64:
                return f"{key} {bound} is outside 64-bit integers, the range integer bounds are compiled in"
    required, properties = node.get("required"), node.get("properties", {})
    names_properties = "properties" in node or node.get("type") == "object"
    closed = node.get("additionalProperties", False) in (False, None) and "patternProperties" not in node
    if isinstance(required, list) and isinstance(properties, dict) and names_properties and closed:
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        if missing:
            return (f"required names {missing[0]!r}, which properties does not define; only the properties a schema names are "
                    "generated (set additionalProperties to allow others)")  # fmt: skip
    return None


def _check_schema(schema: dict) -> None:
    """Refuses (GrammarError, with the JSON pointer) a schema whose output the compiled grammar would
    not make follow it: an assertion xgrammar does not compile, an empty choice, an unresolvable
    $ref, a required property no output could have."""
    stack = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict):
            continue
        reason = _refusal(node)
        if reason is not None:
            raise GrammarError(f"the JSON schema at {pointer or '/'}: {reason}")
        stack.extend(_subschemas(node, pointer))


def schema_text(schema: object) -> str:
    """A JSON schema (dict, or its JSON text) as canonical JSON text, refused past the bounds."""
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
    _check_schema(schema)
    schema = copy.deepcopy(schema)
    _text_only_patterns(schema)
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
    json_object (any JSON object), regex, choice (the output is one of these strings) or grammar
    (EBNF in xgrammar's dialect, root rule `root`)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", schema_text(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise GrammarError(f"choice is a list of strings, got {reprlib.repr(self.choice)}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise GrammarError(f"choice takes 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise GrammarError("choice strings must be non-empty strings")
            if any(_not_text(c) for c in self.choice):
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
        if not isinstance(self.json_object, bool):
            raise GrammarError(f"json_object must be a boolean, got {reprlib.repr(self.json_object)}")
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise GrammarError(f"give exactly one of json, json_object, regex, choice or grammar; got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name) not in (None, False))

    @property
    def description(self) -> str:
        """What the constraint is, for messages: "JSON schema", "regex", ..."""
        return {"json": "JSON schema", "json_object": "JSON object constraint", "choice": "choices"}.get(self.kind, self.kind)
