"""Give the C heap's free pages back to the system once a load is done.

Loading parses tokenizer.json and GGUF metadata into many small objects that are freed again; glibc
keeps the pages they lived on, so the process stays hundreds of MB larger than what it holds (Gemma
3's tokenizer: ~115 MB held, ~435 MB resident until trimmed). `malloc_trim` returns them; on a C
library without it this does nothing.
"""

from __future__ import annotations

from kvserve.libc import libc


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot (not glibc)."""
    c = libc()
    if c is None or not hasattr(c, "malloc_trim"):
        return False
    c.malloc_trim(0)
    return True
