"""Give the C heap's free pages back to the system once a load is done.

Loading parses tokenizer.json and GGUF metadata into many small objects that are freed again; glibc
keeps the pages they lived on, so the process stays hundreds of MB larger than what it holds (Gemma
3's tokenizer: ~115 MB held, ~435 MB resident until trimmed). `malloc_trim` returns them; on a C
library without it this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot (not glibc)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
