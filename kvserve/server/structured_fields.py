"""The request fields that constrain an output, as one StructuredOutputs: OpenAI's `response_format`,
vLLM's `structured_outputs` and its older `guided_*` fields. At most one of them per request; each
error names the field at fault."""

from __future__ import annotations

import re
import reprlib

from kvserve.structured.spec import GrammarError, StructuredOutputs

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# vLLM's structured_outputs keys: the constraint, and options this server's compile already follows
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_FIXED_OPTIONS = {"disable_any_whitespace": True, "disable_additional_properties": True}  # what every compile does
_INERT_OPTIONS = ("disable_fallback",)  # there is one backend, no fallback
BACKENDS = ("auto", "xgrammar")
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def _error(field: str, message: str) -> GrammarError:
    return GrammarError(message if message.startswith(field) else f"{field}: {message}", field)


def from_response_format(value: dict) -> StructuredOutputs | None:
    kind = value.get("type")
    if kind is None:
        raise GrammarError("needs a type: text, json_object or json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("type json_schema needs json_schema: {name, schema, strict}")
        name, strict = spec.get("name"), spec.get("strict")
        if name is not None and not (isinstance(name, str) and SCHEMA_NAME.fullmatch(name)):
            raise GrammarError(f"json_schema.name must be 1-64 letters, digits, _ or -, got {reprlib.repr(name)}")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError(f"json_schema.strict must be a boolean, got {reprlib.repr(strict)}")
        if spec.get("schema") is None:
            return StructuredOutputs(json_object=True)
        return StructuredOutputs(json=spec["schema"])
    raise GrammarError(f"type {reprlib.repr(kind)} is not supported (text, json_object or json_schema)")


def from_structured_outputs(value: dict) -> StructuredOutputs:
    unknown = [k for k in value if k not in _CONSTRAINT_KEYS and k not in _FIXED_OPTIONS and k not in _INERT_OPTIONS]
    if unknown:
        raise GrammarError(f"{reprlib.repr(unknown[0])} is not supported by this server (it takes {', '.join(_CONSTRAINT_KEYS)})")
    for option, fixed in _FIXED_OPTIONS.items():
        if option in value and value[option] is not fixed:
            raise GrammarError(f"{option}={reprlib.repr(value[option])} is not supported: this server always compiles with {option}={fixed}")
    return StructuredOutputs(**{k: value[k] for k in _CONSTRAINT_KEYS if k in value and value[k] is not None})


def from_guided(field: str, value) -> StructuredOutputs:
    return StructuredOutputs(**{field.removeprefix("guided_"): value})


def structured_outputs_of(body) -> tuple[StructuredOutputs, str] | None:
    """The request's constraint and the field it came from (None: unconstrained)."""
    found: list[tuple[StructuredOutputs, str]] = []
    candidates = [("response_format", body.response_format, from_response_format),
                  ("structured_outputs", body.structured_outputs, from_structured_outputs)]  # fmt: skip
    candidates += [(name, getattr(body, name), lambda v, name=name: from_guided(name, v)) for name in GUIDED_FIELDS]
    for field, value, parse in candidates:
        if value is None:
            continue
        try:
            spec = parse(value)
        except (GrammarError, TypeError) as exc:
            raise _error(field, str(exc)) from None
        if spec is None:
            continue
        if found:
            raise _error(field, f"give one constraint per request; {found[0][1]} is already given")
        found.append((spec, field))
    if body.guided_decoding_backend is not None and body.guided_decoding_backend not in BACKENDS:
        raise _error("guided_decoding_backend", f"{reprlib.repr(body.guided_decoding_backend)} is not available: this server "
                     "compiles grammars with xgrammar (auto or xgrammar)")  # fmt: skip
    if body.guided_whitespace_pattern is not None:
        raise _error("guided_whitespace_pattern", "guided_whitespace_pattern is not supported: JSON is generated without free whitespace")
    return found[0] if found else None
