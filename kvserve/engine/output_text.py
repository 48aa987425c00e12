"""A sequence's generated text, grown one token at a time.

Only the new token's text is decoded and searched for stop strings, so the cost of a step does
not grow with the output. Text that could still be the start of a stop string is held back until
it cannot, so every piece handed out (a streamed delta) is part of the final text.
"""

from __future__ import annotations

from kvserve.model.detokenizer import IncrementalDetokenizer


def find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest occurrence of any stop string in text: (index, stop)."""
    best = None
    for stop in stops:
        index = text.find(stop)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that begins some stop string (and is not all of it)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class OutputText:
    def __init__(self, detokenizer: IncrementalDetokenizer, stops: tuple[str, ...] = (), include_stop: bool = False) -> None:
        self._detokenizer = detokenizer
        self._stops = stops
        self._include_stop = include_stop
        self._parts: list[str] = []  # final text
        self._held = ""  # may begin a stop string
        self._taken = 0  # parts already handed out by take_new()
        self.stop_hit: str | None = None

    def add(self, token_id: int) -> str | None:
        """Feed the next generated token; returns the stop string it completed, if any."""
        piece = self._detokenizer.step(token_id)
        if not piece or self.stop_hit is not None:
            return None
        if not self._stops:
            self._parts.append(piece)
            return None
        held = self._held + piece
        hit = find_stop(held, self._stops)
        if hit is not None:
            index, stop = hit
            self._parts.append(held[: index + (len(stop) if self._include_stop else 0)])
            self._held = ""
            self.stop_hit = stop
            return stop
        keep = held_length(held, self._stops)
        self._parts.append(held[: len(held) - keep])
        self._held = held[len(held) - keep :]
        return None

    def finish(self) -> None:
        """No more tokens: release the held tail and any incomplete character."""
        if self.stop_hit is None:
            self._parts.append(self._held + self._detokenizer.flush())
            self._held = ""

    def take_new(self) -> str:
        """Text that became final since the last call."""
        new = "".join(self._parts[self._taken :])
        self._taken = len(self._parts)
        return new

    @property
    def text(self) -> str:
        return "".join(self._parts)
