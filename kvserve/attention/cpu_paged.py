"""`cpu_paged`: the native CPU kernels read K/V in place through each group's block tables.

Decode rows and prefill chunks run the same per-row code (paged_attention.cpp's attend_rows), so a
token's attention output has the same bits decoded, prefilled in any chunk, after a prefix hit or
recomputed after a preemption. A KIVI cache's rows read the blocks their position reads quantized
(attention/kivi_reads.py), each row through its own table where that differs from the pool's.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend, register
from kvserve.attention.kivi_reads import PREFILL_ROWS, KiviReads
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.attention import paged_decode_attention, paged_prefill_attention


@register
class CpuPagedBackend(AttentionBackend):
    name = "cpu_paged"

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
    ) -> torch.Tensor:
        q, k, v = self.rotate_in(q, k, v)
        self.store(layer, meta, k, v)
        kv = self.layers[layer]
        reads = self._kivi_reads(meta)
        group_reads = reads.prepare(kv) if reads is not None else None
        out = torch.empty_like(q)
        num_decode = meta.num_decode_tokens
        if num_decode:
            rows = group_reads.decode if group_reads is not None else None
            tables = rows.tables if rows is not None else meta.decode_block_tables[kv.group]
            lens = rows.kv_lens if rows is not None else meta.decode_kv_lens[kv.group]
            paged_decode_attention(q[:num_decode], kv.view, tables, lens, scale, window, out=out[:num_decode])
        for i, span in enumerate(meta.prefills):
            rows = group_reads.spans[i] if group_reads is not None else None
            if rows is None:
                paged_prefill_attention(
                    q[span.start : span.end], kv.view, span.block_tables[kv.group], span.kv_starts[kv.group], scale, window,
                    out=out[span.start : span.end],
                )  # fmt: skip
                continue
            for first in range(0, span.num_tokens, PREFILL_ROWS):  # the same per-row code, each row its own table
                end = min(span.num_tokens, first + PREFILL_ROWS)
                paged_decode_attention(q[span.start + first : span.start + end], kv.view, rows.tables[first:end],
                                               rows.kv_lens[first:end], scale, window, out=out[span.start + first : span.start + end])  # fmt: skip
        if meta.window_scores:
            self.score_windows(layer, q, meta, scale, window)
        return self.rotate_out(out)

    def _kivi_reads(self, meta: AttentionMetadata) -> KiviReads | None:
        """The step's KIVI reads, planned at its first layer (None for other caches)."""
        pool = self.pool
        if pool.spec.format.kind != "kivi" or not pool.num_residual_blocks:
            return None
        if "kivi_reads" not in meta.cache:
            meta.cache["kivi_reads"] = KiviReads(meta, pool.spec, pool.first_residual, len(meta.slot_mappings))
        return meta.cache["kivi_reads"]
