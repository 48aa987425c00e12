"""Compiles StructuredOutputs into xgrammar grammars for one tokenizer, and the per-request matcher.

xgrammar turns a grammar into token masks over the model's vocabulary; a GrammarMatcher follows a
request's output token by token and fills the mask of the tokens allowed next. Compiled grammars
are kept in a bounded LRU keyed by the constraint, so a schema shared by many requests compiles once.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Iterator

from kvserve.structured.patterns import holds_nul
from kvserve.structured.spec import GrammarError, StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

MAX_CACHED_GRAMMARS = 256
# "[11:31:22] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the message alone
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Character classes xgrammar 0.2.9 writes that admit text no JSON or UTF-8 reader takes back: any
# negated class, and regex's `.`, admit the UTF-16 surrogates U+D800-U+DFFF (whose UTF-8 bytes decode
# to U+FFFD); a JSON string with a length bound is written with characters of the class below, which
# also admits the control characters JSON forbids unescaped (json.loads rejects "\x15").
_NO_SURROGATE = r"\uD800-\uDFFF"
_ANY_CHARACTER = r"\0-\U0010ffff"
_BOUNDED_STRING_CHARS = r'^\"\\\r\n'
_JSON_STRING_CHARS = r'^\0-\x1f\"\\'


def xgrammar_module():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - a dependency of the package
        raise GrammarError("structured outputs need the xgrammar package (pip install xgrammar)") from None
    return xgrammar


def error_message(exc: Exception) -> str:
    lines = [_XGRAMMAR_PREFIX.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


def choice_grammar(choices: Iterable[str]) -> str:
    """EBNF whose language is exactly these strings (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def ebnf_segments(ebnf: str) -> Iterator[tuple[str, str]]:
    """The grammar's text as ("literal", '"..."'), ("class", "[...]") and ("code", rule names and operators)."""
    i = 0
    while i < len(ebnf):
        if ebnf[i] in '"[':
            close = '"' if ebnf[i] == '"' else "]"
            end = i + 1
            while ebnf[end] != close:
                end += 2 if ebnf[end] == "\\" else 1
            yield ("literal" if close == '"' else "class"), ebnf[i : end + 1]
            i = end + 1
        else:
            end = min((j for j in (ebnf.find('"', i), ebnf.find("[", i)) if j >= 0), default=len(ebnf))
            yield "code", ebnf[i:end]
            i = end


def rename_rule(ebnf: str, old: str, new: str) -> str:
    """The grammar with rule `old` (its definition and every reference) named `new`."""
    pattern = re.compile(rf"\b{re.escape(old)}\b")
    return "".join(pattern.sub(new, text) if kind == "code" else text for kind, text in ebnf_segments(ebnf))


_CLASS_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "0": 0x00}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
SURROGATES = range(0xD800, 0xE000)


def class_ranges(body: str) -> list[tuple[int, int]]:
    """A positive character class's body (as xgrammar prints it) as inclusive code point ranges."""
    points, i = [], 0
    while i < len(body):
        if body[i] == "\\":
            kind = body[i + 1]
            if kind in _HEX_DIGITS:
                width = _HEX_DIGITS[kind]
                points.append(int(body[i + 2 : i + 2 + width], 16))
                i += 2 + width
                continue
            points.append(_CLASS_ESCAPES.get(kind, ord(kind)))
            i += 2
        elif body[i] == "-" and points and i + 1 < len(body):
            points.append(None)  # a range's dash
            i += 1
        else:
            points.append(ord(body[i]))
            i += 1
    ranges, j = [], 0
    while j < len(points):
        if j + 2 < len(points) and points[j + 1] is None:
            ranges.append((points[j], points[j + 2]))
            j += 3
        else:
            ranges.append((points[j], points[j]) if points[j] is not None else (ord("-"), ord("-")))
            j += 1
    return ranges


def _without_surrogates(body: str) -> str:
    """A positive class's body without U+D800-U+DFFF (unchanged where it holds none of them)."""
    ranges = class_ranges(body)
    if not any(lo <= SURROGATES[-1] and hi >= SURROGATES[0] for lo, hi in ranges):
        return body
    kept = []
    for lo, hi in ranges:
        kept += [(a, b) for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[-1] + 1), hi)) if a <= b]
    if not kept:
        raise GrammarError("a character class holds only UTF-16 surrogates (U+D800-U+DFFF), which are not text: nothing could be generated")
    return "".join(f"\\U{a:08x}" + (f"-\\U{b:08x}" if b > a else "") for a, b in kept)


def _valid_text_class(body: str, json_strings: bool, regex: bool = False) -> str:
    """A character class (without its brackets) kept to valid Unicode text, and for JSON to valid
    string characters; a regex's `.` (which xgrammar writes as every code point) without the newline,
    as Python's re reads it."""
    if json_strings and body == _BOUNDED_STRING_CHARS:
        body = _JSON_STRING_CHARS
    if body == _ANY_CHARACTER:
        body = "^\\n" if regex else "^"
    if not body.startswith("^"):
        return _without_surrogates(body)
    return "^" + _NO_SURROGATE + body[1:] if not body.startswith("^" + _NO_SURROGATE) else body


_SURROGATE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\(u|U0000)[dD][89abAB][0-9a-fA-F]{2}")  # an unescaped backslash's \uD800-\uDFFF


def _valid_text_classes(ebnf: str, json_strings: bool, regex: bool = False) -> str:
    """The grammar with its classes kept to text (above); a literal holding a surrogate is refused."""
    out = []
    for kind, text in ebnf_segments(ebnf):
        if kind == "class":
            text = "[" + _valid_text_class(text[1:-1], json_strings, regex) + "]"
        elif kind == "literal" and _SURROGATE_ESCAPE.search(text):
            raise GrammarError(f"{text[:40]} holds a UTF-16 surrogate (U+D800-U+DFFF), which is not text and cannot be generated")
        out.append(text)
    return "".join(out)


def grammar_text(spec: StructuredOutputs) -> str:
    """The constraint as EBNF. JSON comes out compact (no free whitespace: small models otherwise pad
    with spaces until max_tokens), properties the schema does not name are not generated."""
    grammar = xgrammar_module().Grammar
    if spec.grammar is not None:
        try:
            literals = [text for kind, text in ebnf_segments(spec.grammar) if kind == "literal"]
        except IndexError:  # an unclosed literal or class: xgrammar says where
            literals = []
        if any(holds_nul(text[1:-1]) for text in literals):
            raise GrammarError("cannot compile the grammar: a literal holds NUL, which cannot be generated as text")
    if spec.tool_calls is not None:
        return tool_calls_grammar(spec.tool_calls, spec.parallel_tool_calls)
    try:
        if spec.json is not None:
            text = str(grammar.from_json_schema(spec.json, any_whitespace=False, strict_mode=True))
        elif spec.json_object:
            text = str(grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False))
        elif spec.regex is not None:
            text = str(grammar.from_regex(spec.regex))
        else:
            text = str(grammar.from_ebnf(choice_grammar(spec.choice) if spec.choice is not None else spec.grammar))
    except Exception as exc:  # noqa: BLE001 - xgrammar reports every malformed input as a RuntimeError
        raise GrammarError(f"cannot compile the {spec.description}: {error_message(exc)}") from None
    try:
        return _valid_text_classes(text, json_strings=spec.json is not None or spec.json_object, regex=spec.regex is not None)
    except GrammarError as exc:
        raise GrammarError(f"cannot compile the {spec.description}: {exc}") from None


CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def tool_calls_grammar(call_schema: str, parallel: bool) -> str:
    """EBNF of output that is one `<tool_call>` block holding JSON of the call's schema (with
    parallel calls, one or more blocks, a newline apart)."""
    try:
        body = rename_rule(grammar_text(StructuredOutputs(json=call_schema)), "root", "tool_call_json")
    except GrammarError as exc:
        raise GrammarError(str(exc).replace("the JSON schema", "the tools' parameters")) from None
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'root ::= call{repeat}\ncall ::= "{CALL_OPEN}\\n" tool_call_json "\\n{CALL_CLOSE}"\n{body}'


def compile_spec(compiler: "xgrammar.GrammarCompiler", spec: StructuredOutputs) -> "xgrammar.CompiledGrammar":
    """One compile, uncached."""
    text = grammar_text(spec)
    try:
        return compiler.compile_grammar(text)
    except Exception as exc:  # noqa: BLE001
        raise GrammarError(f"cannot compile the {spec.description}: {error_message(exc)}") from None


class GrammarCompiler:
    """One tokenizer's grammars. Thread-safe; the tokenizer's token table is built on first use."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._cache: OrderedDict[StructuredOutputs, xgrammar.CompiledGrammar] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._info: xgrammar.TokenizerInfo | None = None

    @property
    def tokenizer_info(self) -> "xgrammar.TokenizerInfo":
        with self._lock:
            if self._info is None:
                xgr = xgrammar_module()
                self._info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_token_ids)  # fmt: skip
            return self._info

    def cached(self, spec: StructuredOutputs) -> "xgrammar.CompiledGrammar | None":
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
            return compiled

    def store(self, spec: StructuredOutputs, compiled: "xgrammar.CompiledGrammar") -> None:
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)

    def compile(self, spec: StructuredOutputs) -> "xgrammar.CompiledGrammar":
        compiled = self.cached(spec)
        if compiled is None:
            info = self.tokenizer_info
            with self._lock:
                if self._compiler is None:
                    self._compiler = xgrammar_module().GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compiled = compile_spec(self._compiler, spec)
            self.store(spec, compiled)
        return compiled

    def matcher(self, spec: StructuredOutputs) -> "xgrammar.GrammarMatcher":
        return xgrammar_module().GrammarMatcher(self.compile(spec))
