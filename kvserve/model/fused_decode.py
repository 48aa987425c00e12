"""A decode step's decoder layers as one kernel program (kernels/program.py).

Built per attention backend and row capacity from the model's native modules: for each layer the
QKV product (and its bias), per-head norm and RoPE, the Hadamard rotation, the K/V store, paged
decode attention, the output product, the residual add with its norms, the gated MLP's two products
and its activation. The ops are the kernels the per-module path calls, in the same order on the
same inputs, so a step's bits do not change; only the Python around them goes. Anything the program
does not cover (a torch fallback, KIVI KV, another attention backend) keeps the per-module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels import args, kv_formats, products
from kvserve.kernels.program import DecodeProgram

if TYPE_CHECKING:
    from kvserve.model.transformer import CausalLM, DecoderLayer


class FusedDecode:
    """The layers of `model` for decode steps of up to `capacity` rows over `attention`'s pool."""

    def __init__(self, model: CausalLM, attention: AttentionBackend, capacity: int, dtype: torch.dtype) -> None:
        config = model.config
        self.capacity = capacity
        self.program = DecodeProgram(capacity)
        self.steps = 0
        # with LoRA enabled, an op after each projection adds the step's adapter products (none: a no-op)
        self.lora_ops: dict[tuple[int, str], args.LoraArgs] = {}

        def buffer(width: int) -> torch.Tensor:
            return torch.empty(capacity, width, dtype=dtype)

        first = model.layers[0].self_attn
        q_size, kv_size = first.q_size, first.kv_size
        self.residual, self.normed = buffer(config.hidden_size), buffer(config.hidden_size)
        qkv, q, k = buffer(q_size + 2 * kv_size), buffer(q_size), buffer(kv_size)
        attended, projected = buffer(q_size), buffer(config.hidden_size)
        gate_up, activated = buffer(2 * config.intermediate_size), buffer(config.intermediate_size)
        v = qkv[:, q_size + kv_size :]
        layers: list[DecoderLayer] = list(model.layers)
        program = self.program
        rotation = attention.pool.rotation.native if attention.pool.rotation is not None else None
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            kv = attention.layers[attn.layer]
            program.product(attn.qkv_proj.native_weight(dtype), self.normed, qkv)
            if attn.qkv_proj.bias is not None:  # Qwen2
                program.bias_add(qkv, attn.qkv_proj.bias)
            self._lora(model, attn.layer, "qkv", self.normed, qkv)
            norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
            program.qk_norm_rope(qkv, q, k, attn.num_heads, attn.num_kv_heads, attn.head_dim, *norms, attn.eps, attn.rotary.cos, attn.rotary.sin)
            if rotation is not None:
                program.hadamard(rotation, (q, k, v), inverse=False)
            if kv.key_records is None:
                program.kv_copy(kv.group, kv.key, kv.value, k, v)
            else:
                for w, (records, rows) in enumerate(((kv.key_records, k), (kv.value_records, v))):
                    scales = kv.scales[w] if kv.scales is not None else None
                    program.kv_store(kv.group, kv.spec, records, rows, scales, kv.key_center if w == 0 else None)
            program.decode_attention(kv.group, kv.view, q, attended, attn.num_heads, attn.window, attn.scale)
            if rotation is not None:
                program.hadamard(rotation, (attended,), inverse=True)
            program.product(attn.o_proj.native_weight(dtype), attended, projected)
            self._lora(model, attn.layer, "o", attended, projected)
            # DecoderLayer.forward's residual adds: Gemma's sandwich norms, or none around the sublayers
            sandwich = layer.sandwich
            self._add_norm(layer.post_attention_layernorm if sandwich else None,
                           layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm, projected)  # fmt: skip
            program.product(mlp.gate_up_proj.native_weight(dtype), self.normed, gate_up)
            self._lora(model, attn.layer, "gate_up", self.normed, gate_up)
            program.gated_activation(gate_up, activated, mlp.activation)
            program.product(mlp.down_proj.native_weight(dtype), activated, projected)
            self._lora(model, attn.layer, "down", activated, projected)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            self._add_norm(layer.post_feedforward_layernorm if sandwich else None, next_norm, projected)

    def _lora(self, model: CausalLM, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if model.lora_enabled:
            self.lora_ops[(layer, fused)] = self.program.lora(x, out)

    def _add_norm(self, addend_norm, norm, addend: torch.Tensor) -> None:
        """layers.residual_add_norm into the program's buffers. Without either norm (a Llama model's last
        layer) the kernel's plain add rounds the float sum to the dtype once, as torch's add does."""
        either = norm or addend_norm
        eps, scale_after_cast = (either.eps, not either.scale_in_float) if either is not None else (0.0, True)
        self.program.add_rms_norm(
            self.residual, addend, self.normed if norm is not None else None, addend_norm.weight if addend_norm is not None else None,
            norm.weight if norm is not None else None, eps, scale_after_cast,
        )  # fmt: skip

    @staticmethod
    def supports(model: CausalLM, attention: AttentionBackend, dtype: torch.dtype) -> bool:
        """Every layer runs on kernels the program has: native modules, a bias on QKV only, a cpu_paged
        backend over a pool of float K/V in the activations' dtype or int8/fp8 records (rotated or not)."""
        rotation = attention.pool.rotation
        if type(attention) is not CpuPagedBackend or dtype not in products.FLOAT_PACK_DTYPES:
            return False
        if rotation is not None and (rotation.native is None or model.config.head_dim > 1024):
            return False
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (attn.native and mlp.native and layer.input_layernorm.native):
                return False
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(linear.native_weight(dtype) is None for linear in linears) or any(linear.bias is not None for linear in linears[1:]):
                return False
            bias = attn.qkv_proj.bias
            if bias is not None and (bias.dtype != dtype or not bias.is_cpu):
                return False
            kv = attention.layers[attn.layer]
            if kv.key_records is None:
                if kv.key.dtype != dtype or not kv.key.is_cpu:
                    return False
            elif kv.spec.kv_dtype not in kv_formats.SCALED_KV_FORMATS or kv.key is not None or not kv.key_records.is_cpu:
                return False
            if kv.group >= args.DECODE_GROUPS:
                return False
        return True

    @staticmethod
    def applies(meta: AttentionMetadata, tokens: int) -> bool:
        """A step of decode rows only, with no SnapKV window scored."""
        return meta.num_decode_tokens == tokens and not meta.prefills and not meta.window_scores

    def run(self, x: torch.Tensor, normed: torch.Tensor, meta: AttentionMetadata, lora=None) -> torch.Tensor:
        """The last layer's residual stream [rows, hidden] (a new tensor) from the embedded rows x and
        their first input norm; lora: the step's LoRARows (kvserve/lora/rows.py), if any row has an adapter."""
        for key, call in self.lora_ops.items():
            native = lora.native_call(*key) if lora is not None else None
            if native is None:
                call.adapters = 0
            else:
                native.set_on(call)
        rows = x.shape[0]
        self.residual[:rows].copy_(x)
        self.normed[:rows].copy_(normed)
        self.program.run(meta.positions, meta.slot_mappings, meta.decode_block_tables, meta.decode_kv_lens)
        self.steps += 1
        return self.residual[:rows].clone()
