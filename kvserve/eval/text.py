"""The evaluation text and what is cut from it: perplexity windows, greedy prompts, needle haystacks."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

NEEDLE = "\nThe secret passkey is {key}. Remember it, the passkey is {key}.\n"
QUESTION = "\nWhat is the secret passkey? The secret passkey is"


def default_text_path() -> Path:
    """A real text on every machine that runs Python: argparse's source (prose docstrings and code)."""
    return Path(argparse.__file__)


def read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ValueError(f"cannot read --text {path}: {exc.strerror or exc}") from None
    if not text.strip():
        raise ValueError(f"--text {path} is empty")
    if "\0" in text:
        raise ValueError(f"--text {path} is not a text file (it holds NUL bytes)")
    return text


@dataclass(frozen=True)
class EvalText:
    """A text tokenized once; `prefix` is what the tokenizer puts before any text (BOS or nothing)."""

    token_ids: list[int]
    prefix: list[int]

    @classmethod
    def from_text(cls, tokenizer, text: str) -> "EvalText":
        prefix = list(tokenizer.encode("", add_special_tokens=True))
        return cls(list(tokenizer.encode(text, add_special_tokens=False)), prefix)

    def windows(self, context: int, max_windows: int) -> list[list[int]]:
        """Consecutive, non-overlapping windows of `context` tokens (the prefix included), at most max_windows."""
        body = context - len(self.prefix)
        if body < 2:
            raise ValueError(f"--context {context} leaves no tokens to score")
        count = min(max_windows, len(self.token_ids) // body)
        if count == 0:
            raise ValueError(f"the text has {len(self.token_ids)} tokens, fewer than one --context window of {context}")
        return [self.prefix + self.token_ids[i * body : (i + 1) * body] for i in range(count)]

    def prompts(self, count: int, length: int) -> list[list[int]]:
        """`count` prompts of `length` tokens from evenly spaced places in the text."""
        body = length - len(self.prefix)
        room = len(self.token_ids) - body
        if body < 1 or room < 0:
            raise ValueError(f"the text has {len(self.token_ids)} tokens, fewer than one prompt of {length}")
        step = room // max(count - 1, 1)
        return [self.prefix + self.token_ids[i * step : i * step + body] for i in range(count)]

    def filler(self, length: int) -> list[int]:
        """`length` tokens of the text, repeated when it is shorter."""
        repeats = -(-length // len(self.token_ids))
        return (self.token_ids * repeats)[:length]


@dataclass(frozen=True)
class NeedleCase:
    length: int
    depth: float
    key: str
    token_ids: list[int]
    question_at: int  # where the question starts: everything before it is the haystack


def needle_cases(tokenizer, text: EvalText, lengths: list[int], depths: list[float], seed: int) -> list[NeedleCase]:
    """A random passkey said once at `depth` of a haystack of real text, asked for at the end; each
    case is exactly `length` tokens long."""
    rng = random.Random(seed)
    question = list(tokenizer.encode(QUESTION, add_special_tokens=False))
    cases = []
    for length in lengths:
        for depth in depths:
            key = str(rng.randrange(10_000, 100_000))
            needle = list(tokenizer.encode(NEEDLE.format(key=key), add_special_tokens=False))
            room = length - len(text.prefix) - len(needle) - len(question)
            if room < 1:
                raise ValueError(f"needle length {length} is too short for the needle and the question")
            haystack = text.filler(room)
            at = round(room * depth)
            ids = text.prefix + haystack[:at] + needle + haystack[at:] + question
            cases.append(NeedleCase(length, depth, key, ids, len(ids) - len(question)))
    return cases


def retrieved(key: str, generated: str) -> bool:
    """Exact retrieval: the first number the model writes is the key."""
    digits = "".join(ch if ch.isdigit() else " " for ch in generated).split()
    return bool(digits) and digits[0] == key
