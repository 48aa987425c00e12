"""Which blocks each query row of a KIVI (int4 / int2) cache reads quantized, and the records it reads.

A token decoding at position p reads its sequence's blocks below spec.blocks_read_quantized(p)
quantized (but the sink): the pool has quantized them between steps. Every other row must read the
same for a token's attention to depend on its position alone: a prefill chunk's later rows (a
block the chunk itself filled may already be old enough for them), a preempted sequence's
recomputed rows, and a forked sequence whose shared block still waits for a free unit (kv/arena.py).
Where a row must read a block quantized that the pool still holds in full precision, it reads a
scratch record quantized from it per layer with the pool's codec, which gives the bits the pool
will write; the kernels take such records at negative ids (kernels/args.h).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kv import quant
from kvserve.kv.pool import LayerKV
from kvserve.kv.spec import KVCacheSpec

PREFILL_ROWS = 256  # rows per kernel call: bounds the per-row tables and the split contexts' buffers


@dataclass
class RowTables:
    """Rows' own block tables [rows, nb] (scratch records at -1 - j) and context lengths [rows]."""

    tables: torch.Tensor
    kv_lens: torch.Tensor


@dataclass
class GroupReads:
    """One KV cache group's reads for a step."""

    residual_rows: torch.Tensor  # [n] full-precision blocks (index into the residual view) quantized into scratch j
    decode: RowTables | None  # the decode rows' tables, where one reads scratch
    spans: list[RowTables | None]  # per prefill span, where one of its rows reads scratch


def _quantized_range(positions: torch.Tensor, spec: KVCacheSpec, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the blocks [first, end) it reads (its window's, in a sliding group) and reads quantized."""
    bs, window = spec.block_size, spec.groups[group].window
    end = (positions - spec.quant_residual).clamp(min=0) // bs  # spec.blocks_read_quantized, per row
    first = torch.full_like(positions, spec.quant_sink_blocks)
    if window is not None:
        first = first.maximum((positions - window + 1).clamp(min=0) // bs)
    return first, end


def _read_quantized(positions: torch.Tensor, num_blocks: int, spec: KVCacheSpec, group: int) -> torch.Tensor:
    """[rows, num_blocks] bool: the blocks a row at each position reads quantized."""
    first, end = _quantized_range(positions, spec, group)
    index = torch.arange(num_blocks, device=positions.device)
    return (index >= first[:, None]) & (index < end[:, None])


def plan_group(meta: AttentionMetadata, group: int, spec: KVCacheSpec, first_residual: int) -> GroupReads | None:
    """The step's reads for `group`; None when every row reads the pool as it is."""
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (tables, kv_lens, entries read from scratch)
    if meta.num_decode_tokens:
        tables, lens = meta.decode_block_tables[group], meta.decode_kv_lens[group]
        parts.append((tables, lens, _read_quantized(lens - 1, tables.shape[-1], spec, group) & (tables >= first_residual)))
    for span in meta.prefills:
        table, start = span.block_tables[group], span.kv_starts[group]
        lens = torch.arange(start + 1, start + span.num_tokens + 1, device=table.device)
        # a chunk's rows read ranges whose both bounds grow with the row: their union runs from the
        # first row's first block to the last row's end (a sliding window's can leave a row's range
        # behind the first row's, but never skip a block between)
        first, end = _quantized_range(lens[[0, -1]] - 1, spec, group)
        index = torch.arange(table.shape[-1], device=table.device)
        parts.append((table, lens, (index >= first[0]) & (index < end[1]) & (table >= first_residual)))
    if not any(bool(scratch.any()) for _, _, scratch in parts):
        return None
    ids = torch.unique(torch.cat([tables[scratch] for tables, _, scratch in parts]))  # sorted
    rows = []
    for tables, lens, scratch in parts:
        if not bool(scratch.any()):
            rows.append(None)
            continue
        scratch_ids = -1 - torch.searchsorted(ids, tables.clamp(min=0))
        if tables.dim() == 1:  # a prefill chunk: each row its own copy of the table
            scratch = _read_quantized(lens - 1, tables.shape[-1], spec, group) & scratch
        rows.append(RowTables(torch.where(scratch, scratch_ids, tables).contiguous(), lens.contiguous()))
    decode = rows.pop(0) if meta.num_decode_tokens else None
    return GroupReads(ids - first_residual, decode, rows)


class KiviReads:
    """A step's reads, per group, and the scratch records of the layer being computed."""

    def __init__(self, meta: AttentionMetadata, spec: KVCacheSpec, first_residual: int, num_groups: int) -> None:
        self.spec = spec
        self.groups = [plan_group(meta, g, spec, first_residual) for g in range(num_groups)]
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # kept alive while the kernels read them

    def prepare(self, kv: LayerKV) -> GroupReads | None:
        """Quantize this layer's blocks its group's rows read from scratch (after the step's K/V are
        stored) and point the layer's view at them."""
        reads = self.groups[kv.group]
        if reads is None:
            return None
        self._scratch = tuple(quant.encode(self.spec, cache.index_select(0, reads.residual_rows), which).contiguous()
                              for cache, which in ((kv.key, "key"), (kv.value, "value")))  # fmt: skip
        kv.view.scratch_key, kv.view.scratch_value = self._scratch[0].data_ptr(), self._scratch[1].data_ptr()
        return reads
