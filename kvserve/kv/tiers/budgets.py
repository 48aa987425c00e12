"""A tier's budget against what this machine has: a host tier larger than its memory or a disk
tier larger than its file system can never fill, and would fail (killed for memory, writes
refused) long before it did. Such budgets are refused at start; one larger than what is free
now is started with a warning."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from kvserve.device_memory import device_memory_bytes

logger = logging.getLogger(__name__)

GIB = 1 << 30


def _available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _existing_parent(directory: str | os.PathLike) -> Path:
    """The directory itself, or its nearest ancestor that exists (the tier creates the rest)."""
    path = Path(directory).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_host_budget(gib: float) -> None:
    """Refuse a host tier larger than this process's memory (RAM, ulimit -v, cgroup); warn above what is free."""
    total = device_memory_bytes(torch.device("cpu"))
    if total is not None and gib * GIB > total:
        raise ValueError(f"--kv-offload-host-gib (kv_offload_host_gib) {gib:g} is more than this machine gives this process "
                         f"({total / GIB:.1f} GiB of memory): the host tier holds its records in RAM")  # fmt: skip
    free = _available_memory_bytes()
    if free is not None and gib * GIB > free:
        logger.warning("the host KV tier may grow to %.1f GiB, more than the %.1f GiB of memory free now", gib, free / GIB)


def check_disk_budget(directory: str | os.PathLike, gib: float) -> None:
    """Refuse a disk tier larger than the file system it is on; warn above its free space."""
    try:
        usage = shutil.disk_usage(_existing_parent(directory))
    except OSError:  # the tier's own start says what is wrong with the directory
        return
    if gib * GIB > usage.total:
        raise ValueError(f"--kv-offload-disk-gib (kv_offload_disk_gib) {gib:g} is more than the file system under "
                         f"{directory} holds ({usage.total / GIB:.1f} GiB)")  # fmt: skip
    if gib * GIB > usage.free:
        logger.warning("the disk KV tier in %s may grow to %.1f GiB, more than the %.1f GiB free there now", directory, gib, usage.free / GIB)
