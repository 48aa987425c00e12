"""`cpu_paged`: the native CPU kernels read K/V in place through each group's block tables.

Decode rows and prefill chunks run the same per-row code (paged_attention.cpp's attend_rows), so a
token's attention output has the same bits decoded, prefilled in any chunk, after a prefix hit or
recomputed after a preemption.
"""

from __future__ import annotations

import torch

from kvserve import kernels
from kvserve.attention.backend import AttentionBackend, register
from kvserve.attention.metadata import AttentionMetadata


@register
class CpuPagedBackend(AttentionBackend):
    name = "cpu_paged"

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
    ) -> torch.Tensor:
        q, k, v = self.rotate_in(q, k, v)
        self.store(layer, meta, k, v)
        kv = self.layers[layer]
        out = torch.empty_like(q)
        num_decode = meta.num_decode_tokens
        if num_decode:
            kernels.paged_decode_attention(
                q[:num_decode], kv.view, meta.decode_block_tables[kv.group], meta.decode_kv_lens[kv.group], scale, window, out=out[:num_decode]
            )
        for span in meta.prefills:
            kernels.paged_prefill_attention(
                q[span.start : span.end], kv.view, span.block_tables[kv.group], span.kv_starts[kv.group], scale, window, out=out[span.start : span.end]
            )
        if meta.window_scores:
            self.score_windows(layer, q, meta, scale, window)
        return self.rotate_out(out)
