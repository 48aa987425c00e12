"""Where kvserve keeps converted tokenizers, dequantized weights and assembled GGUF files."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash


def cache_root() -> Path:
    root = Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes: the key of everything derived from it."""
    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
