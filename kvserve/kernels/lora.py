"""LoRA products of one fused projection over a step's rows, every adapter in one native call (lora.cpp)."""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels import args
from kvserve.kernels.library import _DTYPE_CODES, _check, _require, cpu_kernels_available

LORA_DTYPES = (torch.float32, torch.bfloat16)


def lora_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in LORA_DTYPES and cpu_kernels_available()


class LoraCall:
    """The fixed part of one projection's call for a step: each adapter's A [rank, k], its parts'
    B^T blocks one after the other (flat) and their layout (int32: count, then rank, first column
    and width per part), and the rows' adapter slots (int32, -1: none). The tensors must outlive
    the call object."""

    def __init__(self, slots: torch.Tensor, n: int, a: list[torch.Tensor], bt: list[torch.Tensor], parts: list[torch.Tensor]) -> None:
        self._library = _require()
        self.slots = slots
        self.k, self.n = a[0].shape[1], n
        self.dtype = a[0].dtype
        self._a = (ctypes.c_void_p * len(a))(*[t.data_ptr() for t in a])
        self._bt = (ctypes.c_void_p * len(bt))(*[t.data_ptr() for t in bt])
        self._parts = (ctypes.c_void_p * len(parts))(*[t.data_ptr() for t in parts])
        call = self._call = args.LoraArgs()
        call.slots, call.a, call.bt = slots.data_ptr(), ctypes.addressof(self._a), ctypes.addressof(self._bt)
        call.parts, call.adapters, call.k, call.n = ctypes.addressof(self._parts), len(a), self.k, self.n
        call.dtype = _DTYPE_CODES[self.dtype]

    def set_on(self, call: args.LoraArgs) -> None:
        """Point a decode program's LoRA op (its buffers already set) at these adapters and slots."""
        call.slots, call.a, call.bt, call.parts, call.adapters = self._call.slots, self._call.a, self._call.bt, self._call.parts, self._call.adapters

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += each row's adapter product of x, in place: x [rows, k] and out [rows, n] of the
        adapters' dtype, unit inner stride."""
        if x.dtype != self.dtype or out.dtype != self.dtype or x.shape != (self.slots.shape[0], self.k) or out.shape != (x.shape[0], self.n):
            raise ValueError(f"lora: x [{self.slots.shape[0]}, {self.k}] and out [.., {self.n}] in {self.dtype}, got {tuple(x.shape)} "
                             f"{x.dtype} and {tuple(out.shape)} {out.dtype}")  # fmt: skip
        if x.stride(1) != 1 or out.stride(1) != 1:
            raise ValueError("lora: rows with unit inner stride")
        call = self._call
        call.out, call.x, call.out_stride, call.x_stride, call.rows = out.data_ptr(), x.data_ptr(), out.stride(0), x.stride(0), x.shape[0]
        _check(self._library.kvserve_lora(ctypes.byref(call)), "lora")
        return out
