"""`cpu_paged`: the native CPU kernels read K/V in place through each group's block tables.

On a CPU with AMX a bf16 prefill chunk runs torch's flash SDPA instead (oneDNN's AMX tiles compute
it several times faster than the native kernel's AVX512-BF16 loop): on its fresh K/V where it opens
its sequence, over the gathered blocks it can see where it follows cached slots of a float cache.
Every other chunk and every decode row take the native kernels.
"""

from __future__ import annotations

import torch

from kvserve import kernels
from kvserve.attention.backend import AttentionBackend, register
from kvserve.attention.metadata import AttentionMetadata, PrefillSpan
from kvserve.attention.torch_sdpa import cached_prefill_attention, fresh_prefill_attention


# a chunk of fewer rows over a long context reads the cache like a few decode rows, where the native
# kernel streams it in place instead of gathering it
CACHED_PREFILL_MIN_ROWS = 32


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
        for i, span in enumerate(meta.prefills):
            on_amx = self._on_amx(layer, q, span)
            if on_amx == "fresh":
                out[span.start : span.end] = fresh_prefill_attention(q, k, v, span, meta, scale, window)
                continue
            if on_amx == "cached":
                out[span.start : span.end] = cached_prefill_attention(self, layer, q, i, span, meta, scale, window)
                continue
            kernels.paged_prefill_attention(
                q[span.start : span.end], kv.view, span.block_tables[kv.group], span.kv_starts[kv.group], scale, window, out=out[span.start : span.end]
            )
        if meta.window_scores:
            self.score_windows(layer, q, meta, scale, window)
        return self.rotate_out(out)

    def _on_amx(self, layer: int, q: torch.Tensor, span: PrefillSpan) -> str | None:
        """How a bf16 chunk runs on AMX: "fresh" where it opens its sequence over a cache that reads
        back the K/V it was given, "cached" where it follows slots of a float cache; else None."""
        kv = self.layers[layer]
        if not self.amx_prefill or q.dtype != torch.bfloat16:
            return None
        if span.kv_starts[kv.group] == 0:
            return "fresh" if kv.reads_back_as_stored else None
        return "cached" if kv.key_records is None and span.num_tokens >= CACHED_PREFILL_MIN_ROWS else None
