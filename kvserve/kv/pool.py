"""The paged KV pool: the one place that owns the bytes of K/V and their layout.

The pool is one tensor [layers_per_group, 2 (K, V), num_blocks * block_size, kv_heads, head_dim].
A block id names the same slots in each of the layers_per_group slices; the block belongs to one
KV cache group at a time, whose i-th layer uses slice i. So every group draws from one pool, and
a layer's K (or V) is a contiguous [slots, kv_heads, head_dim] array in which a token's slot is
block_id * block_size + offset. The pool hands each layer a `LayerKV`: those arrays and the
kernels' `KVView` of them (addresses, strides, block size, element format, scale slots); nothing
else computes an offset into the pool.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass

import torch

from kvserve import kernels
from kvserve.kernels.args import KVView
from kvserve.kv.spec import KVCacheSpec

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a large, not yet touched CPU tensor with 2 MiB pages (THP in madvise mode).

    Decode attention reads blocks scattered through the pool; with 4 KiB pages nearly every block
    costs TLB misses, and 2 MiB pages measured ~25% faster attention on a pool larger than the caches.
    Best effort: returns False where the kernel or platform does not take the advice.
    """
    if not sys.platform.startswith("linux"):
        return False
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0


@dataclass(frozen=True)
class LayerKV:
    """One layer's K and V: [slots, kv_heads, head_dim] each, slot = block_id * block_size + offset."""

    key: torch.Tensor
    value: torch.Tensor
    view: KVView  # the same, described for the native kernels
    group: int  # the KV cache group whose block tables address it
    block_size: int


class PagedKVPool:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        shape = (spec.layers_per_group, 2, num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = torch.empty(shape, dtype=spec.torch_dtype, device=device)
        if device.type == "cpu":
            advise_huge_pages(self.kv)
        # zeroed, not left empty: padded gathers read arbitrary slots, and 0 * NaN would poison attention
        self.kv.zero_()
        self.layers = tuple(self._layer(group, index) for group, index in spec.layer_slots)

    def _layer(self, group: int, index: int) -> LayerKV:
        key, value = self.kv[index, 0], self.kv[index, 1]
        view = kernels.kv_view(key, value, self.block_size) if kernels.supports(key.device, key.dtype) else KVView()
        return LayerKV(key, value, view, group, self.block_size)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def copy_slots(self, source: int, target: int, slots: int) -> None:
        """Copy the first `slots` tokens of block `source` into block `target`, every layer (a partial prefix hit)."""
        bs = self.block_size
        self.kv[:, :, target * bs : target * bs + slots].copy_(self.kv[:, :, source * bs : source * bs + slots])

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block, every layer of its group: [layers_per_group, 2, block_size, kv_heads, head_dim] (a contiguous copy)."""
        start = block_id * self.block_size
        return self.kv[:, :, start : start + self.block_size].contiguous()

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        start = block_id * self.block_size
        self.kv[:, :, start : start + self.block_size].copy_(data)
