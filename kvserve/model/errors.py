"""Errors a broken or partial checkpoint raises: one line naming the file and what is wrong with it."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A checkpoint file that cannot be used; the CLI prints it as one line and exits with status 2."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)


def describe(exc: BaseException) -> str:
    """An exception as one short line: its type and first line of message."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:300] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
