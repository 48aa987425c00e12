"""How much memory a device has: what a KV pool may not exceed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

GIB = 1 << 30


CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"  # a container's limit (cgroup v2)


def _cpu_memory_bytes() -> int | None:
    """The least of physical RAM, this process's address-space limit (ulimit -v) and its cgroup's limit."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    try:
        with open(CGROUP_MEMORY_MAX) as f:
            text = f.read().strip()
        if text.isdigit():
            limits.append(int(text))
    except OSError:
        pass
    return min(limits) if limits else None


def device_memory_bytes(device: torch.device) -> int | None:
    """The memory the device gives this process, in bytes (on a CPU: RAM within ulimit -v and the
    cgroup's limit; an accelerator's own), or None where unknown."""
    if device.type == "cpu":
        return _cpu_memory_bytes()
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return None


def is_allocation_failure(exc: BaseException) -> bool:
    """An allocator's refusal: MemoryError, CUDA's OutOfMemoryError, or the CPU allocator's
    RuntimeError ("can't allocate memory"), which ulimit -v and a cgroup's limit raise."""
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


@contextmanager
def fitting(device: torch.device, asked: str) -> Iterator[None]:
    """Turn an allocation failure inside into one ValueError that names what was asked for and
    what the device gives (the CLI prints it in a line), instead of an allocator's traceback."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if not is_allocation_failure(exc):
            raise
        available = device_memory_bytes(device)
        gives = f" ({available / GIB:.1f} GiB)" if available is not None else ""
        raise ValueError(f"{asked} and the model's weights do not fit in what this {device.type} device gives this process{gives}: "
                         "lower it; `kvserve plan --model ... --memory-gib ...` says what fits beside the weights") from None
