"""Building blocks shared by every model family."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import fused, products
from kvserve.kernels.gguf import GgufProduct, GgufWeight, gguf_dequantize
from kvserve.model.config import RopeConfig


def packs_as_float(weight: torch.Tensor) -> bool:
    """The native kernels run this weight through float_matmul: float32, or bf16 where the CPU has no
    AVX512-BF16 dot products (those take the packed bf16 kernel instead)."""
    if weight.dtype == torch.bfloat16 and products.bf16_dot_available():
        return False
    return products.can_pack_float(weight)


def fits_float_matmul(x: torch.Tensor, weight: products.FloatPackedWeight) -> bool:
    if x.dim() != 2 or x.dtype not in products.FLOAT_PACK_DTYPES:
        return False
    return x.shape[0] > 0 and x.shape[1] == weight.k and x.stride(1) == 1


class Linear(nn.Linear):
    """nn.Linear that runs on the native kernels once enable_native() ran. Every kernel it takes
    computes a row's output in one fixed order whatever rows ride with it (so a token's projections
    have the same bits alone, batched or in any prefill chunk), and the weight is held once: in its
    GGUF blocks (gguf_matmul, set by the loader, one part per fused projection), or packed: a bf16
    weight on AMX tiles where the CPU has them (amx_matmul), else with AVX512-BF16 dot products
    (packed_matmul); a float32 weight, or bf16 without AVX512-BF16, for float_matmul."""

    native = False
    amx: products.AmxWeight | None = None
    packed: products.PackedWeight | None = None
    float_packed: products.FloatPackedWeight | None = None
    gguf: tuple[GgufWeight, ...] | None = None  # the fused projection's parts, stacked on the output axis
    gguf_product: GgufProduct | None = None

    def hold_gguf(self, parts: tuple[GgufWeight, ...]) -> None:
        """Keep the weight as these GGUF tensors (their outputs side by side) instead of a float copy."""
        if sum(p.n for p in parts) != self.out_features or any(p.k != self.in_features for p in parts):
            raise ValueError(f"GGUF parts {[(p.n, p.k) for p in parts]} do not make a [{self.out_features}, {self.in_features}] weight")
        self.gguf = parts
        self.gguf_product = GgufProduct(parts)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device="cpu"), requires_grad=False)

    def enable_native(self) -> None:
        self.native = True
        if self.gguf is not None:
            return
        if products.can_pack(self.weight) and products.amx_ready():
            self.amx = products.amx_pack_weight(self.weight)
        elif products.can_pack(self.weight):
            self.packed = products.pack_weight(self.weight)
        elif packs_as_float(self.weight):
            self.float_packed = products.pack_float_weight(self.weight)
        else:
            return
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._native_product(x)
        if out is not None:
            return out if self.bias is None else out + self.bias
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dense_weight().to(x.dtype), bias)

    def native_weight(self, dtype: torch.dtype) -> GgufProduct | products.AmxWeight | products.PackedWeight | products.FloatPackedWeight | None:
        """What the native product of rows in `dtype` computes on (None: F.linear's fallback)."""
        if self.gguf_product is not None and dtype in products.FLOAT_PACK_DTYPES:
            return self.gguf_product
        if self.amx is not None and dtype == torch.bfloat16:
            return self.amx
        if self.packed is not None and dtype == torch.bfloat16:
            return self.packed
        if self.float_packed is not None and dtype in products.FLOAT_PACK_DTYPES:
            return self.float_packed
        return None

    def _native_product(self, x: torch.Tensor) -> torch.Tensor | None:
        weight = self.native_weight(x.dtype)
        if weight is None or x.dim() != 2 or x.shape[0] == 0 or x.stride(1) != 1 or x.shape[1] != self.in_features:
            return None
        if weight is self.gguf_product:
            return weight(x)
        if weight is self.amx:
            return products.amx_matmul(x, weight)[0]
        if weight is self.packed:
            return products.packed_matmul(x, weight)[0]
        return products.float_matmul(x, weight)[0]

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight, rebuilt from its packed copy where the row-major one was freed."""
        if self.gguf is not None:
            return torch.cat([gguf_dequantize(part) for part in self.gguf])
        if self.amx is not None:
            return products.amx_unpack_weight(self.amx)
        if self.packed is not None:
            return products.unpack_weight(self.packed)
        if self.float_packed is not None:
            return products.unpack_float_weight(self.float_packed)
        return self.weight


class GgufEmbedding(nn.Module):
    """The token embedding read from its GGUF blocks: the looked-up rows are dequantized (exactly
    gguf-py's values) and cast to the activations' dtype. The same blocks may serve as the lm_head."""

    def __init__(self, weight: GgufWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = weight
        self.dtype = dtype

    @property
    def num_embeddings(self) -> int:
        return self.blocks.n

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gguf_dequantize(self.blocks, ids.cpu()).to(device=ids.device, dtype=self.dtype)


class PackedEmbedding(nn.Module):
    """The tied token embedding read from the lm_head's packed copy (packed bf16, AMX tiles or float
    tiles), so the matrix is held once: the looked-up rows are gathered from the packed layout, the
    same values the row-major weight held."""

    def __init__(self, weight: products.PackedWeight | products.AmxWeight | products.FloatPackedWeight) -> None:
        super().__init__()
        self.packed = weight

    @property
    def num_embeddings(self) -> int:
        return self.packed.n

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return products.packed_rows(self.packed, ids.cpu()).to(ids.device).reshape(*ids.shape, self.packed.k)


class RMSNorm(nn.Module):
    """RMS norm computed in float32.

    Gemma scales by ``1 + w`` after the cast back; Llama/Qwen by ``w`` after casting to the input
    dtype. Both store the effective multiplier in ``weight`` (the loader folds Gemma's ``+1`` in).
    """

    def __init__(self, dim: int, eps: float, scale_in_float: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.scale_in_float = scale_in_float

    native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return fused.rms_norm(x, self.weight, self.eps, scale_after_cast=not self.scale_in_float)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.scale_in_float:
            return (normed * self.weight.float()).to(x.dtype)
        return (self.weight * normed.to(x.dtype)).to(x.dtype)


def residual_add_norm(
    residual: torch.Tensor, addend: torch.Tensor, addend_norm: RMSNorm | None, norm: RMSNorm | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """residual + (addend_norm(addend) or addend), and norm() of that sum (None without a norm).

    The native path does both in one pass and updates ``residual`` in place.
    """
    either = norm or addend_norm
    if either is not None and either.native and residual.is_contiguous() and addend.is_contiguous():
        out = fused.add_rms_norm(
            residual, addend, addend_norm.weight if addend_norm is not None else None,
            norm.weight if norm is not None else None, either.eps, scale_after_cast=not either.scale_in_float,
        )  # fmt: skip
        return residual, out
    residual = residual + (addend_norm(addend) if addend_norm is not None else addend)
    return residual, norm(residual) if norm is not None else None


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Half-rotation RoPE with precomputed cos/sin tables [max_positions, head_dim / 2] indexed by
    absolute position (dimensions d and d + D/2 turn by the same angle: HF's tables repeat it)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; rotation computed in the activations' dtype, as HF does."""
        cos = self.cos[positions].repeat(1, 2).to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].repeat(1, 2).to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.intermediate_size = intermediate_size
        self.activation = activation

    native = False
    layer = 0  # the decoder layer's index: where LoRA rows find this layer's adapter products

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """lora: the step's kvserve.lora.rows.LoRARows for x's rows, when any row uses an adapter."""
        gate_up = self.gate_up_proj.forward(x)
        if lora is not None:
            gate_up = lora.add(self.layer, "gate_up", x, gate_up)
        if self.native:
            hidden = fused.gated_activation(gate_up, self.activation)
            return self._down(hidden, lora)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.activation == "gelu_tanh":
            act = F.gelu(gate, approximate="tanh")
        else:
            act = F.silu(gate)
        return self._down(act * up, lora)

    def _down(self, hidden: torch.Tensor, lora) -> torch.Tensor:
        out = self.down_proj.forward(hidden)
        return out if lora is None else lora.add(self.layer, "down", hidden, out)
