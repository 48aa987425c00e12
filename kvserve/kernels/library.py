"""The kernel library, loaded once per process (kernels/build.py compiles it), and what every
family's bindings share: whether it is here, the dtype codes of the argument structs, and the check
of a kernel's status."""

from __future__ import annotations

import torch

from kvserve.kernels.build import load_kernels

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def cpu_kernels_available() -> bool:
    return load_kernels() is not None


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in _DTYPE_CODES and cpu_kernels_available()


def _require():
    library = load_kernels()
    if library is None:
        raise RuntimeError("the CPU kernels are not built; use the torch ops")
    return library


def _check(status: int, name: str) -> None:
    if status:
        raise ValueError(f"{name}: bad arguments (status {status})")
