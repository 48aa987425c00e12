"""The cache's files appear whole or not at all: each writer its own temporary file, one rename."""

from __future__ import annotations

import concurrent.futures

import pytest

from kvserve.cache_dir import replaced_atomically


def test_a_cached_file_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "models" / "m.gguf"
    with pytest.raises(RuntimeError):
        with replaced_atomically(target) as partial:
            partial.write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert not target.exists() and list(target.parent.iterdir()) == []  # no half file, no leftover

    def write(i: int) -> None:
        with replaced_atomically(target) as partial:
            assert partial.parent == target.parent and partial != target
            with partial.open("wb") as out:
                for _ in range(64):
                    out.write(bytes([i]) * 4096)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(8)))
    data = target.read_bytes()
    assert len(data) == 64 * 4096 and len(set(data)) == 1  # one writer's whole file, never a mix
    assert list(target.parent.iterdir()) == [target]
