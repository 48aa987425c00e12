"""Errors a broken or partial checkpoint raises: one line naming the file and what is wrong with it."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A checkpoint file that cannot be used; the CLI prints it as one line and exits with status 2."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)


def describe(exc: BaseException) -> str:
    """An exception as one short line: its type and its message, lines joined."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
