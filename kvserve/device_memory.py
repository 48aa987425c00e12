"""How much memory a device has: what a KV pool may not exceed."""

from __future__ import annotations

import os

import torch


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
