"""One decoder-only transformer covering Llama, Qwen2, Qwen3 and Gemma 3.

Family differences are data in ModelConfig: QKV bias (Qwen2), per-head QK norm (Qwen3, Gemma 3),
Gemma's sandwich norms, scaled embeddings, GELU, and sliding-window layers with their own RoPE.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import nn

from kvserve.kernels import gguf, products, sampling
from kvserve.kernels.fused import qk_norm_rope
from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.fused_decode import FusedDecode
from kvserve.model.layers import (
    GatedMLP, Linear, PackedEmbedding, RMSNorm, RotaryEmbedding, fits_float_matmul, packs_as_float, residual_add_norm,
)


LOGITS_CHUNK = 16384
GREEDY_CHUNK = 4096
GGUF_SCREEN_MIN_ROWS = 9  # greedy batches of 9 rows or more take a Q8_0 lm_head's int8 screen (up to 8 stream the blocks faster)


class Attention(nn.Module):
    native = False  # CausalLM.enable_native_kernels() sets it per instance

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, scale_in_float=config.is_gemma)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, scale_in_float=config.is_gemma)
        self.rotary = rotary
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)
        self.eps = config.rms_norm_eps

    def forward(
        self, x: torch.Tensor, attention: AttentionBackend, meta: AttentionMetadata, rows: torch.Tensor | None = None, lora=None
    ) -> torch.Tensor:
        """Stores every token's K/V; returns the output of ``rows`` only when given (else of all).
        lora: the step's LoRARows (kvserve/lora/rows.py) for x's rows, when any row uses an adapter."""
        tokens = x.shape[0]
        positions = meta.positions
        qkv = self.qkv_proj.forward(x)
        if lora is not None:
            qkv = lora.add(self.layer, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.native:
            q, k = qk_norm_rope(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.eps, positions, self.rotary.cos, self.rotary.sin,
            )  # fmt: skip
        else:
            q = q.view(tokens, self.num_heads, self.head_dim)
            k = k.view(tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        out = attention.forward(self.layer, q, k, v, meta, self.scale, self.window).view(tokens, self.q_size)
        if rows is not None:
            out = out.index_select(0, rows)
            if out.shape[0] == 0:  # a step in which no sequence samples still stores its K/V
                return x.new_empty(0, x.shape[1])
            lora = lora.select(rows) if lora is not None else None
        projected = self.o_proj.forward(out)
        return projected if lora is None else lora.add(self.layer, "o", out, projected)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        gemma = config.is_gemma
        self.self_attn = Attention(config, layer, rotary)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, "gelu_tanh" if gemma else "silu")
        self.mlp.layer = layer
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.sandwich = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)

    def forward(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        attention: AttentionBackend,
        meta: AttentionMetadata,
        next_norm: RMSNorm | None,
        rows: torch.Tensor | None = None,
        lora=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the residual stream; normed: input_layernorm(x). Returns the new residual stream and
        next_norm of it (the next layer's input norm, fused with this layer's last residual add).
        With ``rows``, everything after the attention runs for those rows only (the last layer of a
        prefill: no later layer reads the other rows, and their K/V are already stored)."""
        attn = self.self_attn.forward(normed, attention, meta, rows, lora)
        if rows is not None:
            x = x.index_select(0, rows)
            if x.shape[0] == 0:
                return x, None
            lora = lora.select(rows) if lora is not None else None
        if self.sandwich:
            x, normed = residual_add_norm(x, attn, self.post_attention_layernorm, self.pre_feedforward_layernorm)
            return residual_add_norm(x, self.mlp.forward(normed, lora), self.post_feedforward_layernorm, next_norm)
        x, normed = residual_add_norm(x, attn, None, self.post_attention_layernorm)
        return residual_add_norm(x, self.mlp.forward(normed, lora), None, next_norm)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        ropes: dict[object, RotaryEmbedding] = {}
        layers = []
        for i in range(config.num_layers):
            rope = config.layer_rope(i)
            if rope not in ropes:
                ropes[rope] = RotaryEmbedding(rope, config.head_dim, max_positions)
            layers.append(DecoderLayer(config, i, ropes[rope]))
        self.rotaries = nn.ModuleList(ropes.values())
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.is_gemma)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.embed_scale = config.hidden_size**0.5 if config.is_gemma else None
        self.packed_lm_head: products.PackedWeight | None = None
        self.amx_lm_head: products.AmxWeight | None = None  # instead of packed_lm_head where AMX tiles run
        self.float_lm_head: products.FloatPackedWeight | None = None  # float32 (or bf16 without AVX512-BF16)
        self.screened_lm_head: sampling.ScreenedWeight | None = None
        self.gguf_lm_head: gguf.GgufWeight | None = None  # the lm_head (or tied embedding) in its GGUF blocks
        self.gguf_screen: gguf.GgufScreen | None = None  # a Q8_0 lm_head's int8 screen for greedy rows (its bounds only)
        self._logits_key: tuple | None = None
        self._slice_buffer = self._logits_buffer = None
        self._native_logits: torch.Tensor | None = None  # see _native_logits_buffer
        self._screen_scratch: torch.Tensor | None = None  # screened_sample's approximations, reused
        self.fused_decode = True  # decode steps' layers run as one kernel program where they can (model/fused_decode.py)
        self.lora_enabled = False  # LoRA rows may come (engine enable_lora): the decode program carries their ops
        self._fused: FusedDecode | None = None
        self._fused_backend: weakref.ref | None = None  # the program's backend: a new one (another pool) builds another
        self._fused_dtype: torch.dtype | None = None
        self._fused_supported = False

    def hold_gguf_lm_head(self, weight: gguf.GgufWeight) -> None:
        """Compute the logits on these GGUF blocks (the tied embedding's, or the file's output tensor)."""
        if (weight.n, weight.k) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"lm_head is [{weight.n}, {weight.k}], expected [{self.config.vocab_size}, {self.config.hidden_size}]")
        self.gguf_lm_head = weight
        self.lm_head.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        if weight.type_name == "Q8_0" and gguf.gguf_screen_available():
            self.gguf_screen = gguf.gguf_screen(weight)

    def enable_native_kernels(self) -> None:
        """Route the products (projections and lm_head) to the native CPU kernels. The lm_head is then
        held once, in its packed copy: a tied embedding looks its rows up there (PackedEmbedding) and
        the torch fallbacks unpack it (_row_major_lm_head)."""
        if self.gguf_lm_head is not None:
            pass
        elif products.can_pack(self.lm_head.weight):
            # one bf16 copy: AMX tiles for every row count where they run (the screen's exact
            # rescoring takes the same tiles, so screened and full logits agree bit for bit)
            if products.amx_ready() and self.config.hidden_size % 32 == 0:
                self.amx_lm_head = products.amx_pack_weight(self.lm_head.weight)
            else:
                self.packed_lm_head = products.pack_weight(self.lm_head.weight)
            if sampling.int8_screen_available() and sampling.screen_group(self.config.hidden_size):
                self.screened_lm_head = sampling.screen_weight(self.amx_lm_head or self.packed_lm_head, self.lm_head.weight)
        elif packs_as_float(self.lm_head.weight):
            self.float_lm_head = products.pack_float_weight(self.lm_head.weight)
        packed = self._packed_lm_head
        if packed is not None:
            if isinstance(self.embed_tokens, nn.Embedding) and self.embed_tokens.weight is self.lm_head.weight:
                self.embed_tokens = PackedEmbedding(packed)
            self.lm_head.weight = nn.Parameter(torch.empty(0, dtype=self.lm_head.weight.dtype), requires_grad=False)
        for module in self.modules():
            if isinstance(module, Linear):
                module.enable_native()
            elif isinstance(module, (RMSNorm, GatedMLP, Attention)):
                module.native = True

    def forward(
        self, input_ids: torch.Tensor, attention: AttentionBackend, meta: AttentionMetadata, output_rows: torch.Tensor | None = None,
        lora=None,
    ) -> torch.Tensor:
        """Returns the last layer's hidden states [T, hidden], or only those of ``output_rows`` (the
        rows that sample, in that order); norm and logits run only where sampled. lora: the step's
        LoRARows (kvserve/lora/rows.py) when any row uses an adapter (the decode program does not
        take them: such steps run layer by layer)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        layers = list(self.layers)  # modules' forward called directly: nn.Module's call machinery is ~1 us each, 100+ a step
        normed = layers[0].input_layernorm.forward(x)
        lora_native = lora is None or lora.native
        if output_rows is None and lora_native and self.fused_decode and FusedDecode.applies(meta, x.shape[0]):
            fused = self._fused_decode_for(attention, x.shape[0], x.dtype)
            if fused is not None and (lora is None or fused.lora_ops):
                return fused.run(x, normed, meta, lora)
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i < last else None
            x, normed = layer.forward(x, normed, attention, meta, next_norm, output_rows if i == last else None, lora)
        return x

    def _fused_decode_for(self, attention: AttentionBackend, rows: int, dtype: torch.dtype) -> FusedDecode | None:
        """The decode program for this backend, rebuilt with twice the rows when a step outgrows it;
        None where the layers do not all run on its kernels (asked once per backend and dtype)."""
        if self._fused_backend is None or self._fused_backend() is not attention or self._fused_dtype != dtype:
            self._fused, self._fused_backend, self._fused_dtype = None, weakref.ref(attention), dtype
            self._fused_supported = FusedDecode.supports(self, attention, dtype)
        if not self._fused_supported:
            return None
        if self._fused is None or self._fused.capacity < rows:
            capacity = max(rows, 2 * self._fused.capacity if self._fused is not None else 8)
            self._fused = FusedDecode(self, attention, capacity, dtype)
        return self._fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab] in float32 for the sampled rows only.

        On CPU a [S, 262K] GEMM runs ~1.7x faster as W_slice @ h^T over cache-sized slices of the
        lm_head; each slice is transposed back while still in cache. Both buffers are reused, so
        the result is only valid until the next call.
        """
        normed = self.norm(hidden)
        if self.gguf_lm_head is not None:
            out = self._native_logits_buffer(normed.shape[0])
            return self._softcap(gguf.gguf_matmul(self._gguf_rows(normed), self.gguf_lm_head, out_dtype=torch.float32, out=out)[0])
        if self._use_bf16_lm_head(normed):
            out = self._native_logits_buffer(normed.shape[0])
            return self._softcap(self._bf16_lm_head(normed, out_dtype=torch.float32, out=out)[0])
        if self._use_float_lm_head(normed):
            out = self._native_logits_buffer(normed.shape[0])
            return self._softcap(products.float_matmul(normed, self.float_lm_head, out_dtype=torch.float32, out=out)[0])
        hidden_t = normed.t().contiguous()
        weight = self._row_major_lm_head()
        vocab, rows = weight.shape[0], hidden_t.shape[1]
        chunk = min(LOGITS_CHUNK, vocab)
        key = (rows, weight.dtype, weight.device)
        if self._logits_key != key:
            self._slice_buffer = torch.empty(chunk, rows, dtype=weight.dtype, device=weight.device)
            self._logits_buffer = torch.empty(rows, vocab, dtype=weight.dtype, device=weight.device)
            self._logits_key = key
        for start in range(0, vocab, chunk):
            end = min(start + chunk, vocab)
            part = self._slice_buffer[: end - start]
            torch.mm(weight[start:end], hidden_t, out=part)
            self._logits_buffer[:, start:end].copy_(part.t())
        return self._softcap(self._logits_buffer.float())

    @property
    def _packed_lm_head(self) -> products.PackedWeight | products.AmxWeight | products.FloatPackedWeight | None:
        return self.amx_lm_head or self.packed_lm_head or self.float_lm_head

    def _row_major_lm_head(self) -> torch.Tensor:
        """The lm_head as [vocab, hidden] for the torch paths: its parameter, or, where the native
        kernels hold only the packed copy, every row gathered from it."""
        if self.lm_head.weight.numel():
            return self.lm_head.weight
        packed = self._packed_lm_head
        return products.packed_rows(packed, torch.arange(packed.n))

    def _native_logits_buffer(self, rows: int) -> torch.Tensor:
        """float32 [rows, vocab] for the native lm_head products, reused across steps (grown when
        a step has more rows): a fresh output would page-fault all its memory in on every step."""
        vocab = self.config.vocab_size
        if self._native_logits is None or self._native_logits.shape[0] < rows:
            self._native_logits = torch.empty(rows, vocab, dtype=torch.float32)
        return self._native_logits[:rows]

    @staticmethod
    def _gguf_rows(normed: torch.Tensor) -> torch.Tensor:
        """The rows as gguf_matmul takes them: float32 or bf16, unit inner stride."""
        if normed.dtype not in products.FLOAT_PACK_DTYPES:
            normed = normed.float()
        return normed if normed.stride(-1) == 1 else normed.contiguous()

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _use_bf16_lm_head(self, normed: torch.Tensor) -> bool:
        packed = self.amx_lm_head is not None or self.packed_lm_head is not None
        return packed and normed.dtype == torch.bfloat16 and normed.dim() == 2 and normed.stride(1) == 1

    def _bf16_lm_head(self, normed: torch.Tensor, **kwargs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The lm_head product on its packed bf16 copy: AMX tiles, or the packed AVX512-BF16 kernel."""
        if self.amx_lm_head is not None:
            return products.amx_matmul(normed, self.amx_lm_head, **kwargs)
        return products.packed_matmul(normed, self.packed_lm_head, **kwargs)

    def _use_float_lm_head(self, normed: torch.Tensor) -> bool:
        """Every number of rows takes float_matmul, so a row's logits do not depend on its batch."""
        return self.float_lm_head is not None and fits_float_matmul(normed, self.float_lm_head)

    def screened_sample(self, hidden: torch.Tensor, rows: np.ndarray, penalty_ids: np.ndarray, penalty_counts: np.ndarray) -> torch.Tensor | None:
        """The tokens the sampler would draw from these rows' full logits, drawn from the int8-screened
        lm_head instead (sampling.screened_sample; -1 where a row needs the full logits), or None where
        the screen does not apply (no screened lm_head, final-logit softcapping, a non-finite row)."""
        if self.screened_lm_head is None or self.config.final_logit_softcapping:
            return None
        normed = self.norm(hidden)
        if not self._use_bf16_lm_head(normed) or not bool(torch.isfinite(normed).all()):
            return None
        width = 2 * -(-self.screened_lm_head.bf16.n // 16) * 16
        if self._screen_scratch is None or self._screen_scratch.shape[0] < normed.shape[0]:
            self._screen_scratch = torch.empty(normed.shape[0], width)
        return sampling.screened_sample(normed, self.screened_lm_head, rows, penalty_ids, penalty_counts, self._screen_scratch)[0]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of the logits [S] without materializing them: each cache-sized slice of the lm_head
        keeps only its per-row maximum and index. Ties go to the lowest token id, as argmax does.
        Final-logit softcapping is monotonic, so it cannot move the argmax and is skipped."""
        normed = self.norm(hidden)
        if self.gguf_lm_head is not None:
            rows = self._gguf_rows(normed)
            if self.gguf_screen is not None and rows.dtype == torch.bfloat16 and rows.shape[0] >= GGUF_SCREEN_MIN_ROWS:
                screened = gguf.gguf_screened_argmax(rows, self.gguf_screen)[0]
                if screened is not None:
                    return screened
            return gguf.gguf_matmul(rows, self.gguf_lm_head, want_output=False, want_argmax=True)[1]
        if self._use_bf16_lm_head(normed):
            if self.screened_lm_head is not None and bool(torch.isfinite(normed).all()):
                return sampling.screened_argmax(normed, self.screened_lm_head)[0]
            return self._bf16_lm_head(normed, want_output=False, want_argmax=True)[1]
        if self._use_float_lm_head(normed):
            return products.float_matmul(normed, self.float_lm_head, want_output=False, want_argmax=True)[1]
        hidden_t = normed.t().contiguous()
        weight = self._row_major_lm_head()
        vocab, rows = weight.shape[0], hidden_t.shape[1]
        chunk = min(GREEDY_CHUNK, vocab)
        num_chunks = -(-vocab // chunk)
        part = torch.empty(chunk, rows, dtype=weight.dtype, device=weight.device)
        best_values = torch.empty(num_chunks, rows, dtype=weight.dtype, device=weight.device)
        best_ids = torch.empty(num_chunks, rows, dtype=torch.long, device=weight.device)
        for i, start in enumerate(range(0, vocab, chunk)):
            end = min(start + chunk, vocab)
            torch.mm(weight[start:end], hidden_t, out=part[: end - start])
            torch.max(part[: end - start], 0, out=(best_values[i], best_ids[i]))
        winner = best_values.argmax(0)
        return best_ids.gather(0, winner[None])[0] + winner * chunk
