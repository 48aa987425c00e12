"""`cpu_paged`: the native CPU kernels read K/V in place through each group's block tables.

On a CPU with AMX a bf16 prefill chunk that opens its sequence runs torch's flash SDPA on its fresh
K/V instead (oneDNN's AMX tiles compute it several times faster than the native kernel's
AVX512-BF16 loop); every other chunk and every decode row take the native kernels.
"""

from __future__ import annotations

import torch

from kvserve import kernels
from kvserve.attention.backend import AttentionBackend, register
from kvserve.attention.metadata import AttentionMetadata, PrefillSpan
from kvserve.attention.torch_sdpa import fresh_prefill_attention


@register
class CpuPagedBackend(AttentionBackend):
    name = "cpu_paged"

    def __init__(self, pool) -> None:
        super().__init__(pool)
        self.amx_prefill = kernels.amx_gemm_min_rows() is not None

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
            if self._opens_on_amx(layer, q, span):
                out[span.start : span.end] = fresh_prefill_attention(q, k, v, span, meta, scale, window)
                continue
            kernels.paged_prefill_attention(
                q[span.start : span.end], kv.view, span.block_tables[kv.group], span.kv_starts[kv.group], scale, window, out=out[span.start : span.end]
            )
        if meta.window_scores:
            self.score_windows(layer, q, meta, scale, window)
        return self.rotate_out(out)

    def _opens_on_amx(self, layer: int, q: torch.Tensor, span: PrefillSpan) -> bool:
        """A bf16 chunk that opens its sequence, on AMX, over a cache that reads back the K/V it was given."""
        kv = self.layers[layer]
        return self.amx_prefill and q.dtype == torch.bfloat16 and span.kv_starts[kv.group] == 0 and kv.reads_back_as_stored
