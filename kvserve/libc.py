"""The C library through ctypes, loaded once (malloc_trim, madvise, prctl); None where it cannot be."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library with errno kept (ctypes.get_errno), or None where none loads."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
