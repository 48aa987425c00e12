"""Where kvserve keeps converted tokenizers, dequantized weights and assembled GGUF files."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import xxhash


def tree_digest(paths: list[Path]) -> str:
    """One digest over several files' names and contents (an HF checkpoint directory)."""
    digest = xxhash.xxh3_128()
    for path in sorted(paths):
        digest.update(path.name.encode() + b"\0" + file_digest(path).encode())
    return digest.hexdigest()


def cache_root() -> Path:
    root = Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def replaced_atomically(target: Path) -> Iterator[Path]:
    """A fresh temporary path beside `target` to write; it becomes `target` in one rename when the block
    ends without error (and is removed otherwise). Processes filling the cache at once (the replicas
    of `kvserve cluster` on a fresh machine) each write their own file, and readers never see half of one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    os.close(fd)
    partial = Path(name)
    try:
        yield partial
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes: the key of everything derived from it (computed once per file version)."""
    stat = path.stat()
    return _digest(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
