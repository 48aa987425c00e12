"""Incremental detokenization: each step turns only a sequence's new tokens into text.

The `tokenizers` library's DecodeStream keeps a few tokens of context (so leading spaces and
byte-fallback or multi-byte characters come out as a full decode would give them) and returns
nothing while a character is incomplete, so the cost per step does not grow with the output.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, backend_tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # tokens fed since the last text came out (an incomplete character)

    def step(self, token_id: int) -> str:
        """The text that token_id completes ("" while a character is still incomplete)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if piece is None:
            self._pending.append(token_id)
            return ""
        self._pending.clear()
        return piece

    @property
    def has_pending(self) -> bool:
        """Tokens are held back because they end inside a character."""
        return bool(self._pending)

    def flush(self) -> str:
        """The held-back tokens' text as a full decode renders an incomplete character (U+FFFD)."""
        if not self._pending:
            return ""
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special_tokens)
        self._pending.clear()
        return text
