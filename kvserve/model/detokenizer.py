"""Incremental detokenization: each step turns only a sequence's new tokens into text.

The `tokenizers` library's DecodeStream keeps a few tokens of context (so leading spaces and
byte-fallback or multi-byte characters come out as a full decode would give them) and returns
nothing while a character is incomplete, so the cost per step does not grow with the output.

DecodeStream raises "Invalid prefix encountered" on some byte-fallback sequences (its context's
text changes once a later byte completes a character, seen on Gemma 3 with random tokens). A
sequence that meets it goes on in window mode: the text of (a few context tokens + the new ones)
less the context's own text, the way vLLM's incremental detokenizer works, never an error.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 4  # tokens before the new ones whose text is decoded with them (spaces, merges)


class IncrementalDetokenizer:
    def __init__(self, backend_tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # tokens fed since the last text came out (an incomplete character)
        self._context: list[int] = []  # the last tokens whose text came out
        self._window: list[int] = []  # window mode: context tokens, then the pending ones
        self._read = 0  # window mode: where the pending tokens start in _window

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The text that token_id completes ("" while a character is still incomplete)."""
        if self._stream is not None:
            try:
                piece = self._stream.step(self._tokenizer, token_id)
            except Exception:  # tokenizers raises a bare Exception for an invalid prefix
                self._stream = None
                self._window = self._context + self._pending
                self._read = len(self._context)
            else:
                if piece is None:
                    self._pending.append(token_id)
                    return ""
                self._context = (self._context + self._pending + [token_id])[-_CONTEXT_TOKENS:]
                self._pending.clear()
                return piece
        return self._window_step(token_id)

    def _window_step(self, token_id: int) -> str:
        self._window.append(token_id)
        before = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        if text.endswith("\ufffd") or len(text) <= len(before):
            self._pending = self._window[self._read :]
            return ""
        piece = text[len(before) :]
        self._window = self._window[-_CONTEXT_TOKENS:]
        self._read = len(self._window)
        self._pending = []
        return piece

    @property
    def has_pending(self) -> bool:
        """Tokens are held back because they end inside a character."""
        return bool(self._pending)

    def flush(self) -> str:
        """The held-back tokens' text as a full decode renders an incomplete character (U+FFFD)."""
        if not self._pending:
            return ""
        text = self._decode(self._pending)
        self._pending.clear()
        if self._stream is None:
            self._window = self._window[: self._read]
        return text
