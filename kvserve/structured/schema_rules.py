"""What a JSON schema may hold for its compiled grammar to follow it: the keywords xgrammar 0.2.9
compiles to nothing, where subschemas sit, local $refs rebased when a schema is embedded in another."""

from __future__ import annotations

import copy
import reprlib
from decimal import ROUND_CEILING, Decimal

from kvserve.structured.patterns import pattern_refusal, text_only_pattern

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
# xgrammar 0.2.9 writes a bounded number with at most six digits after the point: a range holding
# no such number compiles to a grammar nothing completes
_NUMBER_STEP = Decimal("0.000001")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),), "array": (list,),
               "object": (dict,)}  # fmt: skip


def _is_of(value, name: str) -> bool:
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, object)) and not (isinstance(value, bool) and name in ("integer", "number"))


def subschemas(node: dict, pointer: str):
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


def schema_nodes(schema: dict):
    """(schema object, its JSON pointer) for the schema and every subschema in it, each once (a
    subschema two places share is one object), a parent before its children; the caller may change
    a node before its children are read."""
    stack, seen = [(schema, "")], set()
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node, pointer
        stack.extend(subschemas(node, pointer))


def rebase_refs(schema: dict, base: str) -> dict:
    """A copy of schema whose local $refs ("#", "#/...") point into it where it is embedded at the
    JSON pointer `base` of a larger schema (a tool's parameters inside the calls' schema)."""
    schema = copy.deepcopy(schema)
    for node, _ in schema_nodes(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
    return schema


# xgrammar 0.2.9 compiles an integer's multipleOf up to this, and only unbounded: beside a range it keeps it for ranges
# of a few thousand and drops it past them (its matcher took 201845 as a multiple of 3 in 0..1,000,000)
_MAX_MULTIPLE_OF = 1024
_COUNTS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"), ("minContains", "maxContains"))


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
    if "multipleOf" in node:
        step = node["multipleOf"]
        lower = {"minimum", "exclusiveMinimum"} & set(node)
        upper = {"maximum", "exclusiveMaximum"} & set(node)
        whole = isinstance(step, int) and not isinstance(step, bool) or isinstance(step, float) and step.is_integer()
        if not whole or not 1 <= step <= _MAX_MULTIPLE_OF or lower or upper:
            return (f"'multipleOf' on an integer is enforced only as a whole number in 1..{_MAX_MULTIPLE_OF} without minimum or "
                    "maximum (the compiler drops it otherwise, and the output would not follow it); list a bounded range's "
                    "multiples as an enum")  # fmt: skip
    for low, high in _COUNTS:
        for key in (low, high):
            value = node.get(key)
            if key in node and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                return f"{key} must be a non-negative integer, got {reprlib.repr(value)}"
        if isinstance(node.get(low), int) and isinstance(node.get(high), int) and node[low] > node[high]:
            return f"{low} {node[low]} is larger than {high} {node[high]}: no value satisfies both"
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
        reason = pattern_refusal(pattern)
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
    if node.get("type") == "number" and _holds_no_generated_number(node):
        return ("the range its minimum/maximum bounds leave holds no number of at most six decimal places, the precision the "
                "compiler generates numbers in; widen it")  # fmt: skip
    required, properties = node.get("required"), node.get("properties", {})
    names_properties = "properties" in node or node.get("type") == "object"
    closed = node.get("additionalProperties", False) in (False, None) and "patternProperties" not in node
    if isinstance(required, list) and isinstance(properties, dict) and names_properties and closed:
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        if missing:
            return (f"required names {missing[0]!r}, which properties does not define; only the properties a schema names are "
                    "generated (set additionalProperties to allow others)")  # fmt: skip
    return None


def _bound(node: dict, key: str) -> Decimal | None:
    value = node.get(key)
    return Decimal(repr(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _holds_no_generated_number(node: dict) -> bool:
    """Whether no multiple of 1e-6 meets the number's bounds (the least one above its lower bounds
    breaks an upper bound)."""
    least = None
    for key, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
        bound = _bound(node, key)
        if bound is None or not bound.is_finite():
            continue
        point = (bound / _NUMBER_STEP).to_integral_value(ROUND_CEILING) * _NUMBER_STEP
        if exclusive and point == bound:
            point += _NUMBER_STEP
        least = point if least is None else max(least, point)
    if least is None:
        return False
    high, high_exclusive = _bound(node, "maximum"), _bound(node, "exclusiveMaximum")
    return (high is not None and high.is_finite() and least > high) or (
        high_exclusive is not None and high_exclusive.is_finite() and least >= high_exclusive
    )


def schema_refusal(schema: dict) -> str | None:
    """Why the compiled grammar would not make output follow this schema, with the JSON pointer
    (an assertion xgrammar does not compile, an empty choice, an unresolvable $ref, a required
    property no output could have), or None."""
    steps = 0
    for node, pointer in schema_nodes(schema):
        reason = _refusal(node)
        if reason is not None:
            return f"the JSON schema at {pointer or '/'}: {reason}"
        if "multipleOf" in node:
            steps += int(node["multipleOf"])
            if steps > _MAX_MULTIPLE_OF:  # the grammar grows by about 400 characters per unit of every step
                return (f"the JSON schema's integer multipleOf values add up to more than {_MAX_MULTIPLE_OF} (at {pointer or '/'}): "
                        "each step k writes a grammar of about 400·k characters, so a schema's steps together are bounded")  # fmt: skip
    return None


# xgrammar 0.2.9 writes format ipv4 as octets [0-1]?[0-9]?[0-9], which admits leading zeros ("01.2.3.4")
# that the format (and Python's ipaddress) refuses: the octets are compiled from this pattern instead
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPV4_PATTERN = f"^{_OCTET}(\\.{_OCTET}){{3}}$"


def text_only_patterns(schema: dict) -> None:
    """text_only_pattern on every pattern of the schema (pattern, patternProperties' keys), and format
    ipv4 as its strict pattern, in place."""
    for node, _ in schema_nodes(schema):
        if node.get("format") == "ipv4" and "pattern" not in node:
            del node["format"]
            node["pattern"] = IPV4_PATTERN
        if isinstance(node.get("pattern"), str):
            node["pattern"] = text_only_pattern(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {text_only_pattern(k): v for k, v in node["patternProperties"].items()}
