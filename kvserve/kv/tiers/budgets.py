"""The tiers' budgets against what this machine has. A host tier larger than the memory this
process may use, a disk tier larger than its file system, or the two together larger than the
memory where the disk tier is on tmpfs can never fill, and would fail (killed for memory, writes
refused) long before they did: refused before anything is loaded or created. Once the weights and
the KV pool are in place, budgets that would not fit beside them, or above what is free now, start
with a warning: the tiers fill only as blocks leave the pool."""

from __future__ import annotations

import logging
import os
import resource
import shutil
from pathlib import Path

import torch

from kvserve.device_memory import GIB, device_memory_bytes

logger = logging.getLogger(__name__)

IN_MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def _existing_parent(directory: str | os.PathLike) -> Path:
    """The directory itself, or its nearest ancestor that exists (the tier creates the rest)."""
    path = Path(directory).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _file_system_type(path: Path) -> str | None:
    """The type of the file system mounted deepest above path (/proc/mounts), or None."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    resolved = str(path.resolve())
    found = [(point, kind) for point, kind in mounts if resolved == point or resolved.startswith(point.rstrip("/") + "/")]
    return max(found, key=lambda m: len(m[0]))[1] if found else None


def _disk_usage(directory: str | os.PathLike):
    """shutil.disk_usage of the tier's directory (or the ancestor it will be created under); None
    where it cannot be read or the file system reports no size (/proc, /sys: the tier's own start
    says what is wrong there)."""
    try:
        usage = shutil.disk_usage(_existing_parent(directory))
    except OSError:
        return None
    return usage if usage.total > 0 else None


def _in_memory(directory: str | os.PathLike) -> bool:
    return _file_system_type(_existing_parent(directory)) in IN_MEMORY_FILE_SYSTEMS


def _free_memory_bytes() -> int | None:
    """What this process could still take: MemAvailable (Linux), and under ulimit -v the limit less
    the address space the process already maps; None where neither is known."""
    free = []
    try:
        with open("/proc/meminfo") as f:
            free += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status") as f:
                mapped = [int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")]
            free += [soft - mapped[0]] if mapped else []
        except (OSError, ValueError, IndexError):
            pass
    return min(free) if free else None


def check_tier_budgets(host_gib: float, disk_dir: str | None, disk_gib: float | None) -> None:
    """Refuse budgets the machine cannot hold (before the model loads and before the disk tier's
    directory is created)."""
    total = device_memory_bytes(torch.device("cpu"))
    if host_gib > 0 and total is not None and host_gib * GIB > total:
        raise ValueError(f"--kv-offload-host-gib (kv_offload_host_gib) {host_gib:g} is more than this machine gives this process "
                         f"({total / GIB:.1f} GiB of memory): the host tier holds its records in RAM")  # fmt: skip
    if disk_dir is None or disk_gib is None:
        return
    usage = _disk_usage(disk_dir)
    if usage is not None and disk_gib * GIB > usage.total:
        raise ValueError(f"--kv-offload-disk-gib (kv_offload_disk_gib) {disk_gib:g} is more than the file system under "
                         f"{disk_dir} holds ({usage.total / GIB:.1f} GiB)")  # fmt: skip
    if total is not None and _in_memory(disk_dir) and (host_gib + disk_gib) * GIB > total:
        raise ValueError(f"--kv-offload-host-gib {host_gib:g} and --kv-offload-disk-gib {disk_gib:g} on {disk_dir} (tmpfs: memory too) "
                         f"are more than this machine gives this process ({total / GIB:.1f} GiB of memory)")  # fmt: skip


def warn_tier_budgets(host_gib: float, disk_dir: str | None, disk_gib: float | None, beside_bytes: int) -> None:
    """Warn where the tiers may outgrow what is left: the memory beside `beside_bytes` (the weights
    and, on a CPU device, the KV pool) or what is free now; the disk's free space."""
    in_memory_disk = disk_dir is not None and disk_gib is not None and _in_memory(disk_dir)
    memory_tiers = host_gib + (disk_gib if in_memory_disk else 0.0)
    what = "the host KV tier" if host_gib > 0 else "the disk KV tier on tmpfs"
    if host_gib > 0 and in_memory_disk:
        what += " and the disk tier on tmpfs"
    if memory_tiers > 0:
        total, free = device_memory_bytes(torch.device("cpu")), _free_memory_bytes()
        if total is not None and memory_tiers * GIB + beside_bytes > total:
            logger.warning("%s may grow to %.2f GiB, and the weights and KV pool take %.2f GiB: together more than the %.2f GiB "
                           "this process may use", what, memory_tiers, beside_bytes / GIB, total / GIB)  # fmt: skip
        elif free is not None and memory_tiers * GIB > free:
            logger.warning("%s may grow to %.2f GiB, more than the %.2f GiB of memory free now", what, memory_tiers, free / GIB)
    if disk_dir is not None and disk_gib is not None and not in_memory_disk:
        usage = _disk_usage(disk_dir)
        if usage is not None and disk_gib * GIB > usage.free:
            logger.warning("the disk KV tier in %s may grow to %.2f GiB, more than the %.2f GiB free there now", disk_dir, disk_gib, usage.free / GIB)
