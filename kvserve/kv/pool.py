"""The paged KV pool: the one place that owns the bytes of K/V and their layout.

Blocks hold `block_size` tokens of one KV cache group's layers; a block id names the same place
in each of the group's `layers_per_group` slices, and a group's i-th layer uses slice i. So every
group draws from one pool. How a block stores a token depends on the KV format:

- float formats: `kv [layers_per_group, 2 (K, V), num_blocks * block_size, kv_heads, head_dim]`;
  a layer's K (or V) is a contiguous [slots, kv_heads, head_dim] array, slot = block * block_size + offset;
- quantized formats: `records [layers_per_group, 2, num_blocks, record_bytes]`, one byte record
  per block, layer and K/V (kv/quant.py has the layout). int8 and fp8 quantize each token as it is
  stored. int4 and int2 (KIVI) quantize whole blocks: new tokens go to full-precision residual
  blocks, ids from `num_blocks` on, in a float array like the one above, and a block is quantized
  once it is full and older than the residual window.

The pool hands each layer a `LayerKV` with its arrays and the kernels' `KVView` of them; nothing
else computes an offset into the pool.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kernels import attention, kv_formats, library
from kvserve.kernels.args import KVView
from kvserve.kv import quant
from kvserve.kv.rotation import Rotation
from kvserve.kv.spec import KVCacheSpec
from kvserve.libc import libc

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
NO_RESIDUAL = 1 << 62  # first_residual of a cache without residual blocks


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
    c = libc()
    if c is None:
        return False
    c.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return c.madvise(start, end - start, _MADV_HUGEPAGE) == 0


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu":
        advise_huge_pages(tensor)
    # zeroed, not left empty: padded gathers read arbitrary slots, and 0 * NaN would poison attention
    return tensor.zero_()


@dataclass(frozen=True)
class LayerKV:
    """One layer's K and V in the pool."""

    spec: KVCacheSpec
    group: int  # the KV cache group whose block tables address it
    block_size: int
    # float blocks: a float cache's [slots, kv_heads, head_dim]; a KIVI cache's full-precision ones
    # [blocks, block_size, kv_heads, head_dim], laid over its records (PagedKVPool.residual_view)
    key: torch.Tensor | None
    value: torch.Tensor | None
    key_records: torch.Tensor | None  # quantized blocks [num_blocks, record_bytes]
    value_records: torch.Tensor | None
    first_residual: int  # block ids from here on are float blocks: 0 for a float cache
    view: KVView  # the same, described for the native kernels
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # fp8: calibrated (K, V) scales per head
    key_center: torch.Tensor | None = None  # int8 / fp8: float32 [kv_heads, head_dim] subtracted from keys as stored (kv/centering.py)

    @property
    def reads_back_as_stored(self) -> bool:
        """Attention over what was just stored reads the K/V it was given: float blocks, or KIVI's
        full-precision residual (int8 / fp8 read back their codes)."""
        return self.key_records is None or self.spec.format.kind == "kivi"

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens' K/V [T, kv_heads, head_dim] at their slots (block id * block_size + offset);
        a centered cache stores k - key_center."""
        if self.key_records is None:
            self.key.index_copy_(0, slots, k.to(self.key.dtype))
            self.value.index_copy_(0, slots, v.to(self.value.dtype))
            return
        if self.spec.format.kind == "kivi":
            blocks, within = slots // self.block_size - self.first_residual, slots % self.block_size
            self.key[blocks, within] = k.to(self.key.dtype)
            self.value[blocks, within] = v.to(self.value.dtype)
            return
        spec = self.spec
        if self.key_records.device.type == "cpu" and library.cpu_kernels_available():
            for w, (records, x) in enumerate(((self.key_records, k), (self.value_records, v))):
                kv_formats.kv_store(spec, records, slots, x, self.scales[w] if self.scales is not None else None, self.key_center if w == 0 else None)
            return
        if self.key_center is not None:
            k = k.float() - self.key_center
        blocks, within = slots // self.block_size, slots % self.block_size
        for w, (records, x) in enumerate(((self.key_records, k), (self.value_records, v))):
            data, scales = quant.encode_tokens(spec, x, self.scales[w] if self.scales is not None else None)
            quant.data_rows(spec, records)[blocks, within] = data
            quant.scale_rows(spec, records)[blocks, within] = scales

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks' K and V for block tables [..., n], in float: [..., n * block_size, kv_heads, head_dim]."""
        return self._gather(block_ids, ("key", "value"))

    def gather_keys(self, block_ids: torch.Tensor) -> torch.Tensor:
        """gather's K alone (SnapKV's scores read no value)."""
        return self._gather(block_ids, ("key",))[0]

    def _gather(self, block_ids: torch.Tensor, kinds: tuple[str, ...]) -> list[torch.Tensor]:
        spec, bs = self.spec, self.block_size
        heads, dim = spec.num_kv_heads, spec.head_dim
        flat = block_ids.reshape(-1)
        out = []
        sides = {"key": (self.key, self.key_records), "value": (self.value, self.value_records)}
        for which in kinds:
            fp, records = sides[which]
            if records is None:
                blocks = fp.view(-1, bs, heads, dim).index_select(0, flat)
            else:
                main = flat.clamp(max=records.shape[0] - 1)
                blocks = quant.decode(spec, records.index_select(0, main), which)
                if fp is not None:
                    residual = (flat - self.first_residual).clamp(0, fp.shape[0] - 1)
                    in_residual = (flat >= self.first_residual).view(-1, 1, 1, 1)
                    blocks = torch.where(in_residual, fp.index_select(0, residual).float(), blocks)
            out.append(blocks.view(*block_ids.shape[:-1], block_ids.shape[-1] * bs, heads, dim))
        return out


class PagedKVPool:
    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
        scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None, key_centering: bool = False, rotate: bool = False,
    ) -> None:  # fmt: skip
        self.spec = spec
        # K and V stored in a Hadamard basis (kv/rotation.py): the attention backends turn q, k, v and the output
        self.rotation = Rotation(spec.head_dim, device) if rotate else None
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        fmt = spec.format
        groups, bs = spec.layers_per_group, spec.block_size
        # a KIVI cache's full-precision blocks share the records' bytes (kv/arena.py): block num_blocks + c
        # lies over quantized blocks c * residual_units onwards
        self.num_residual_blocks = num_blocks // spec.residual_units if spec.residual_units else 0
        self.records = _zeroed((groups, 2, num_blocks, spec.record_bytes), torch.uint8, device) if fmt.quantized else None
        if not fmt.quantized:
            self.kv = _zeroed((groups, 2, num_blocks * bs, spec.num_kv_heads, spec.head_dim), spec.torch_dtype, device)
            self.first_residual = 0
        elif self.num_residual_blocks:
            self.kv = self.residual_view()
            self.first_residual = num_blocks
        else:
            self.kv, self.first_residual = None, NO_RESIDUAL
        # int8 / fp8 keys are stored minus a per-layer, per-head center (zero until set_key_centers)
        centered = key_centering and fmt.kind == "scaled"
        self.key_centers = torch.zeros(spec.num_layers, spec.num_kv_heads, spec.head_dim, device=device) if centered else None
        self.layers = tuple(self._layer(group, index, scales[layer] if scales else None, self.key_centers[layer] if centered else None)
                            for layer, (group, index) in enumerate(spec.layer_slots))  # fmt: skip

    def set_key_centers(self, centers: list[torch.Tensor]) -> None:
        """Set the keys' centers, [kv_heads, head_dim] per layer, before anything is stored."""
        if self.key_centers is None:
            raise ValueError("this pool does not center keys (only int8 / fp8 caches do)")
        stacked = torch.stack([c.float().to(self.key_centers.device) for c in centers])
        if stacked.shape != self.key_centers.shape or not bool(torch.isfinite(stacked).all()):
            raise ValueError(f"key centers must be finite, {tuple(self.key_centers.shape)} (layers, kv heads, head dim)")
        self.key_centers.copy_(stacked)

    def _layer(self, group: int, index: int, scales: tuple[torch.Tensor, torch.Tensor] | None, key_center: torch.Tensor | None) -> LayerKV:
        key = value = key_records = value_records = None
        if self.kv is not None:
            key, value = self.kv[index, 0], self.kv[index, 1]
        if self.records is not None:
            key_records, value_records = self.records[index, 0], self.records[index, 1]
        view = KVView()
        device = (key if key is not None else key_records).device
        if library.cpu_kernels_available() and device.type == "cpu":
            view = attention.kv_view(self.spec, key, value, key_records, value_records, self.first_residual if key_records is not None else attention.NO_RESIDUAL)
        return LayerKV(self.spec, group, self.block_size, key, value, key_records, value_records, self.first_residual, view, scales, key_center)

    def residual_view(self) -> torch.Tensor:
        """The full-precision blocks of a KIVI cache over its records: [layers_per_group, 2, blocks,
        block_size, kv_heads, head_dim], block c from byte c * residual_units * record_bytes of each
        layer's K (V) records on."""
        spec = self.spec
        element = spec.torch_dtype.itemsize
        if spec.record_bytes % element:
            raise ValueError(f"{spec.kv_dtype} records of {spec.record_bytes} bytes do not align {spec.residual_dtype} blocks")
        groups, units, heads, dim = spec.layers_per_group, self.num_blocks * spec.record_bytes // element, spec.num_kv_heads, spec.head_dim
        shape = (groups, 2, self.num_residual_blocks, self.block_size, heads, dim)
        strides = (2 * units, units, spec.residual_units * spec.record_bytes // element, heads * dim, dim, 1)
        return self.records.view(spec.torch_dtype).as_strided(shape, strides)

    @property
    def nbytes(self) -> int:
        held = self.records if self.records is not None else self.kv  # a KIVI cache's kv is a view of its records
        return held.numel() * held.element_size()

    def _float_block(self, block_id: int) -> torch.Tensor:
        """A block, every layer of its group, in float: [layers_per_group, 2, block_size, kv_heads, head_dim]."""
        if block_id >= self.first_residual:
            return self._block_view(block_id).float()
        layers = [torch.stack([quant.decode(self.spec, self.records[j, w, block_id][None], which)[0]
                               for w, which in enumerate(("key", "value"))]) for j in range(self.spec.layers_per_group)]  # fmt: skip
        return torch.stack(layers)

    def copy_slots(self, source: int, target: int, slots: int) -> None:
        """Copy the first `slots` tokens of block `source` into block `target`, every layer (a partial
        prefix hit, a fork's partly filled block); the target is a float block of a KIVI cache."""
        bs = self.block_size
        if self.records is None:
            self.kv[:, :, target * bs : target * bs + slots].copy_(self._float_block(source)[:, :, :slots])
            return
        if self.spec.format.kind == "kivi":
            self.kv[:, :, target - self.first_residual, :slots].copy_(self._float_block(source)[:, :, :slots])
            return
        data, scales = quant.data_rows, quant.scale_rows
        for j in range(self.spec.layers_per_group):
            for w in range(2):
                records = self.records[j, w]
                data(self.spec, records)[target, :slots] = data(self.spec, records)[source, :slots]
                scales(self.spec, records)[target, :slots] = scales(self.spec, records)[source, :slots]

    def _token_arrays(self, index: int) -> list[torch.Tensor]:
        """Slice `index`'s K and V per token and head as [blocks, block_size, kv_heads, bytes or elements]
        views (a scaled format's values and scales apart)."""
        heads, bs = self.spec.num_kv_heads, self.block_size
        if self.records is None:
            return [self.kv[index, w].view(-1, bs, heads, self.spec.head_dim) for w in range(2)]
        if self.spec.format.kind != "scaled":
            raise ValueError(f"{self.spec.kv_dtype} blocks cannot be compacted per token")
        return [rows(self.spec, self.records[index, w]).unflatten(2, (heads, -1)) for w in range(2) for rows in (quant.data_rows, quant.scale_rows)]

    def compact(self, block_ids: list[int], layer_slices: list[int], keep: torch.Tensor, target_ids: list[int] | None = None) -> None:
        """Move each kept token to the front of a sequence's blocks, per layer and KV head: slot i of
        slice layer_slices[j], head h, takes slot keep[j, h, i] (slots counted through block_ids,
        written through target_ids, by default the same blocks). Every kept token is read before
        any is written."""
        bs, device = self.block_size, (self.kv if self.kv is not None else self.records).device
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        targets = ids if target_ids is None else torch.tensor(target_ids, dtype=torch.int64, device=device)
        keep = keep.to(device)
        heads, kept = keep.shape[1], keep.shape[2]
        head = torch.arange(heads, device=device)[:, None]
        target = torch.arange(kept, device=device).expand(heads, kept)
        target_block, target_within = targets[target // bs], target % bs
        for j, index in enumerate(layer_slices):
            source_block, source_within = ids[keep[j] // bs], keep[j] % bs
            for tokens in self._token_arrays(index):
                tokens[target_block, target_within, head] = tokens[source_block, source_within, head]

    def quantize(self, pairs: list[tuple[int, int]]) -> None:
        """Quantize full residual blocks into quantized ones: (residual block id, quantized block id) pairs."""
        if not pairs:
            return
        source = torch.tensor([s - self.first_residual for s, _ in pairs], device=self.kv.device)
        target = torch.tensor([t for _, t in pairs], device=self.kv.device)
        for j in range(self.spec.layers_per_group):
            for w, which in enumerate(("key", "value")):
                # every source is read before any target is written: a target may lie in a source's bytes
                blocks = self.kv[j, w].index_select(0, source)
                self.records[j, w].index_copy_(0, target, quant.encode(self.spec, blocks, which))

    def _block_view(self, block_id: int) -> torch.Tensor:
        """The pool's memory of one block, every layer of its group (a view): float blocks
        [layers_per_group, 2, block_size, kv_heads, head_dim], quantized ones [layers_per_group, 2, record_bytes]."""
        if block_id < self.first_residual and self.records is not None:
            return self.records[:, :, block_id]
        if self.records is not None:
            return self.kv[:, :, block_id - self.first_residual]
        return self.kv[:, :, block_id * self.block_size : (block_id + 1) * self.block_size]

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block, every layer of its group, as stored (a contiguous copy)."""
        return self._block_view(block_id).contiguous()

    def block_bytes(self, block_id: int) -> bytes:
        """read_block's data as bytes: what a KV tier stores for the block."""
        view = self._block_view(block_id)
        view = (view if view.is_contiguous() else view.contiguous()).view(torch.uint8)
        if view.device.type == "cpu":
            return view.numpy().tobytes()  # one gathering copy, no torch op (no OpenMP team woken for a small copy)
        return view.contiguous().cpu().numpy().tobytes()

    def write_block_bytes(self, block_id: int, payload: bytes) -> None:
        """Put block_bytes' data into a block of the same kind (float or quantized); a payload of
        another size is refused (ValueError) before anything is written."""
        target = self._block_view(block_id)
        expected = target.numel() * target.element_size()
        if len(payload) != expected:
            raise ValueError(f"block {block_id} takes {expected} bytes, got {len(payload)}")
        if target.device.type == "cpu":
            # numpy's copy, not torch's: the tiers' worker thread calls this, and a torch op there
            # would start a second OpenMP team that spins beside the step's (decode measured 2.5x slower after)
            view = target.view(torch.uint8).numpy()
            view[...] = np.frombuffer(payload, dtype=np.uint8).reshape(view.shape)
            return
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(target.dtype).view(target.shape)
        target.copy_(data.to(target.device))

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        self._block_view(block_id).copy_(data)

