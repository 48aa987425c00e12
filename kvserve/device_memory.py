"""How much memory a device has: what a KV pool may not exceed."""

from __future__ import annotations

import os

import torch


def device_memory_bytes(device: torch.device) -> int | None:
    """The device's total memory in bytes (a CPU's physical RAM, an accelerator's own), or None where unknown."""
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX system that says
            return None
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return None
