"""Regex patterns as xgrammar 0.2.9 compiles them, against what JSON Schema's regexes mean: which a
grammar would not follow (refused, with the reason), and the rewrite that keeps their "any character"
forms to text."""

from __future__ import annotations

import re
import reprlib

_NO_SURROGATES = "\\ud800-\\udfff"  # a class's range of the UTF-16 surrogates
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


# a character class that holds only NUL: xgrammar drops it, and "a[\x00]b" generates "ab"
_NUL_CLASS = re.compile(r"\[(?:\\(?:x0+|x\{0+\}|u0000|U00000000|0)|\x00)\]")
_OCTAL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\0[0-7]")  # Python's "\01" is U+0001
# xgrammar's EBNF lookahead assertion: a hint it does not enforce where the rule ends ('root ::= [a-z]+ (="x")' gave "simpletext")
_EBNF_LOOKAHEAD = re.compile(r"\(\s*=")
_EBNF_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def pattern_refusal(pattern) -> str | None:
    """Why xgrammar would not follow this pattern as JSON Schema means it, or None."""
    if not isinstance(pattern, str):
        return f"a pattern is a string, got {reprlib.repr(pattern)}"
    if _admits_surrogates(pattern):  # a guided regex's classes lose them in compiler.grammar_text instead
        return "a pattern admits UTF-16 surrogates (U+D800-U+DFFF), which are not text and cannot be generated"
    reason = regex_refusal(pattern, "pattern")
    if reason is not None:
        return reason
    if _needs_json_escape(pattern):
        return (f"the pattern {reprlib.repr(pattern)} generates a quote, a backslash or a control character, which the grammar "
                "compiler would write into the JSON string unescaped")  # fmt: skip
    return None


def grammar_refusal(ebnf: str) -> str | None:
    """Why xgrammar would not follow this EBNF grammar as written, or None (its string literals are
    compiler.grammar_text's: NUL there is refused where they are read)."""
    rules = _EBNF_STRING.sub('""', ebnf)
    if _EBNF_LOOKAHEAD.search(rules):
        return "a lookahead assertion (= ...) in the grammar is not enforced by the grammar compiler; leave it out"
    if _NUL_CLASS.search(rules):
        return "a character class in the grammar holds only NUL, which cannot be generated as text"
    return None


def regex_refusal(pattern: str, what: str = "regex") -> str | None:
    """Why xgrammar would not follow this regex as Python's re (and JSON Schema) read it, or None:
    the checks a guided_regex and a schema's pattern share."""
    if holds_nul(pattern):
        return "a pattern holds NUL, which cannot be generated as text"
    if _LOOKAROUND.search(pattern):
        return f"a lookahead or lookbehind in the pattern {reprlib.repr(pattern)} is not enforced by the grammar compiler"
    if _UNSUPPORTED_ESCAPE.search(pattern) or _INLINE_FLAGS.search(pattern):
        return (f"the pattern {reprlib.repr(pattern)} uses \\A, \\Z, \\b, \\p{{...}}, an inline flag or a \\x escape of more than two "
                "hex digits, which the grammar compiler does not read as JSON Schema's regexes do")  # fmt: skip
    if _inner_anchor(pattern):
        return f"a ^ or $ inside the pattern {reprlib.repr(pattern)} is not enforced (only at its ends and its alternatives')"
    if _NUL_CLASS.search(pattern):
        return "a character class in the pattern holds only NUL, which cannot be generated as text"
    if _OCTAL_ESCAPE.search(pattern):
        return f"the pattern {reprlib.repr(pattern)} has an octal escape (\\0 followed by digits), which the grammar compiler reads as NUL and a digit"
    return None


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


def not_text(value: str) -> bool:
    """NUL or a lone UTF-16 surrogate: characters no tokenizer's text can carry back."""
    return any(ch == "\x00" or 0xD800 <= ord(ch) <= 0xDFFF for ch in value)
