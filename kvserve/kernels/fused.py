"""The fused elementwise ops of a decoder layer (fused_ops.cpp): RMS norm, residual add + norm,
q/k norm + rotary embedding, and the gated activation."""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels import args
from kvserve.kernels.library import _DTYPE_CODES, _check, _require

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_after_cast: bool) -> torch.Tensor:
    """RMS norm of the rows of x [..., dim] (last dim contiguous, rows evenly strided) with a float32 weight."""
    library = _require()
    dim = x.shape[-1]
    rows2d = x.reshape(-1, dim) if x.dim() != 2 else x
    if rows2d.stride(-1) != 1:
        raise ValueError("rms_norm: the last dimension must be contiguous")
    out = torch.empty(rows2d.shape, dtype=x.dtype, device=x.device)
    call = args.RmsNormArgs(
        out.data_ptr(), rows2d.data_ptr(), _float_weight(weight).data_ptr(), rows2d.stride(0), rows2d.shape[0], _DTYPE_CODES[x.dtype],
        dim, eps, int(scale_after_cast),
    )  # fmt: skip
    _check(library.kvserve_rms_norm(ctypes.byref(call)), "rms_norm")
    return out.view(x.shape)


def add_rms_norm(
    residual: torch.Tensor, addend: torch.Tensor, addend_weight: torch.Tensor | None, weight: torch.Tensor | None, eps: float, scale_after_cast: bool
) -> torch.Tensor | None:
    """In place: residual += (norm(addend) * addend_weight if addend_weight is given else addend);
    returns norm(residual) * weight, or None without a weight. residual, addend: contiguous [rows, dim]."""
    library = _require()
    if not (residual.is_contiguous() and addend.is_contiguous()) or residual.shape != addend.shape or residual.dtype != addend.dtype:
        raise ValueError("add_rms_norm: residual and addend must be contiguous, of one shape and dtype")
    rows, dim = residual.shape
    out = torch.empty_like(residual) if weight is not None else None
    call = args.AddRmsNormArgs(
        out.data_ptr() if out is not None else residual.data_ptr(), residual.data_ptr(), addend.data_ptr(),
        _float_weight(addend_weight).data_ptr() if addend_weight is not None else None,
        _float_weight(weight).data_ptr() if weight is not None else None, rows, _DTYPE_CODES[residual.dtype], dim, eps,
        int(scale_after_cast),
    )  # fmt: skip
    _check(library.kvserve_add_rms_norm(ctypes.byref(call)), "add_rms_norm")
    return out


def qk_norm_rope(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    eps: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the fused QKV output [T, width] (q heads, then k heads, then v): normed (optional) and
    rotated q [T, H, D] and k [T, KVH, D], both contiguous."""
    library = _require()
    tokens = qkv.shape[0]
    if qkv.stride(1) != 1 or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("qk_norm_rope: qkv rows must be contiguous and the rotary tables float32")
    if cos.shape[-1] != head_dim // 2 or sin.shape != cos.shape:
        raise ValueError(f"qk_norm_rope: the rotary tables are [positions, head_dim / 2 = {head_dim // 2}], got {tuple(cos.shape)}")
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype)
    positions = positions.to(torch.int64).contiguous()
    call = args.QkNormRopeArgs(
        q.data_ptr(), k.data_ptr(), qkv.data_ptr(), _float_weight(q_weight).data_ptr() if q_weight is not None else None,
        _float_weight(k_weight).data_ptr() if k_weight is not None else None, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        tokens, qkv.stride(0), _DTYPE_CODES[qkv.dtype], num_heads, num_kv_heads, head_dim, eps, 0,
    )  # fmt: skip
    _check(library.kvserve_qk_norm_rope(ctypes.byref(call)), "qk_norm_rope")
    return q, k


ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up [rows, 2 * inter] (contiguous) -> [rows, inter]."""
    library = _require()
    if not gate_up.is_contiguous():
        raise ValueError("gated_activation: gate_up must be contiguous")
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    call = args.GatedActivationArgs(out.data_ptr(), gate_up.data_ptr(), rows, width // 2, _DTYPE_CODES[gate_up.dtype], ACTIVATIONS[activation])
    _check(library.kvserve_gated_activation(ctypes.byref(call)), "gated_activation")
    return out


def _float_weight(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError("norm weights must be contiguous float32")
    return weight
