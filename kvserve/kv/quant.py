"""KV cache codecs: one layer's K or V of whole blocks, to and from the pool's byte records.

A record is one block of one layer's K (or V): the values `[block_size][kv_heads][head_dim x
bits / 8]`, then their scales:

- scaled formats (int8, fp8_e4m3, fp8_e5m2): one fp16 scale per token and head, `[block_size]
  [kv_heads]`: int8 is symmetric (amax / 127), fp8 divides by amax / the format's largest value
  (or by a calibrated per-head scale, when one is given);
- kivi formats (int4, int2), after KIVI (Liu et al. 2024): keys per channel over groups of
  `group` tokens, `[block_size / group][kv_heads][head_dim][2]`; values per token over groups of
  `value_group` channels, `[block_size][kv_heads][head_dim / value_group][2]`. Each group's pair
  is an 8-bit log2 scale, s = 2^((e - 160) / 8), and an 8-bit integer zero point z, with
  x = s * (q - z): 2 bytes instead of two fp16, so int4 takes 0.5625 bytes per value. The scale is
  rounded up so that the format's levels span the group (an error of at most half a step). Sub-byte values are packed low bits first.

The native kernels decode the same layout in place (kernels/kv_formats.h).
"""

from __future__ import annotations

import math

import torch

from kvserve.kv.spec import KVCacheSpec

LOG_SCALE_BIAS = 160
LOG_SCALE_STEPS = 8  # per octave
_FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
_TINY = 2.0 ** -24


def log_scale_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 scales an 8-bit log2 scale byte stands for."""
    return torch.exp2((torch.arange(256, dtype=torch.float64, device=device) - LOG_SCALE_BIAS) / LOG_SCALE_STEPS).float()


def _encode_log_scale(needed: torch.Tensor) -> torch.Tensor:
    """The smallest representable scale at least `needed`, as its byte."""
    exponent = torch.ceil(torch.log2(needed.double().clamp_min(_TINY)) * LOG_SCALE_STEPS - 1e-9) + LOG_SCALE_BIAS
    return exponent.clamp(0, 255).to(torch.uint8)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values < 2**bits along the last dim, packed 8 // bits per byte, low bits first."""
    per = 8 // bits
    q = q.to(torch.uint8).view(*q.shape[:-1], q.shape[-1] // per, per)
    out = torch.zeros(q.shape[:-1], dtype=torch.uint8, device=q.device)
    for i in range(per):
        out |= q[..., i] << (bits * i)
    return out


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _kivi_params(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale byte, zero point) of groups spanning [lo, hi]."""
    # levels - 1 steps span the group: the zero point's rounding can push its largest value half a
    # step past the top level, and clamping it there costs at most the half step rounding costs anyway
    needed = torch.maximum((hi - lo) / (levels - 1), lo.abs() / 127)
    code = _encode_log_scale(needed)
    scale = log_scale_table(lo.device)[code.long()]
    zero = torch.round(-lo / scale).clamp(-128, 127)
    return code, zero


def data_bytes(spec: KVCacheSpec) -> int:
    return spec.block_size * spec.num_kv_heads * math.ceil(spec.head_dim * spec.format.bits / 8)


def data_rows(spec: KVCacheSpec, records: torch.Tensor) -> torch.Tensor:
    """The values part of records [n, record_bytes] as [n, block_size, token bytes] (a view)."""
    return records[:, : data_bytes(spec)].unflatten(1, (spec.block_size, -1))


def scale_rows(spec: KVCacheSpec, records: torch.Tensor) -> torch.Tensor:
    """A scaled format's fp16 scales of records [n, record_bytes] as [n, block_size, kv_heads * 2] bytes (a view)."""
    start = data_bytes(spec)
    return records[:, start : start + spec.block_size * spec.num_kv_heads * 2].unflatten(1, (spec.block_size, -1))


def encode_tokens(spec: KVCacheSpec, x: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A scaled format's tokens x [T, kv_heads, head_dim]: (values [T, token bytes], fp16 scales [T, kv_heads * 2] bytes)."""
    record = encode(spec, x[:, None], "key", scales)  # one "block" of one token per row
    spec_one = data_bytes(spec) // spec.block_size
    return record[:, :spec_one], record[:, spec_one : spec_one + spec.num_kv_heads * 2]


def encode(spec: KVCacheSpec, x: torch.Tensor, which: str, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Records [n, record_bytes] for blocks x [n, block_size, kv_heads, head_dim] of K ("key") or
    V ("value"). `scales`, for fp8: calibrated per-head scales [kv_heads] instead of each token's."""
    fmt = spec.format
    n, bs, heads, dim = x.shape
    x = x.float()
    if fmt.kind == "scaled":
        if fmt.name == "int8":
            scale = (x.abs().amax(-1) / 127).clamp_min(_TINY).half().float()
            data = torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        else:
            limit = _FP8_MAX[fmt.name]
            scale = scales.float().expand(n, bs, heads) if scales is not None else (x.abs().amax(-1) / limit).clamp_min(_TINY)
            scale = scale.half().float()
            data = (x / scale[..., None]).clamp(-limit, limit).to(fmt.torch_dtype).view(torch.uint8)
        meta = scale.half().contiguous().view(torch.uint8).reshape(n, -1)
    else:
        levels = 1 << fmt.bits
        if which == "key":
            grouped = x.view(n, bs // spec.group_size, spec.group_size, heads, dim)
            code, zero = _kivi_params(grouped.amin(2), grouped.amax(2), levels)  # [n, groups, heads, dim]
            scale = log_scale_table(x.device)[code.long()]
            q = torch.round(grouped / scale[:, :, None] + zero[:, :, None]).clamp(0, levels - 1).view(n, bs, heads, dim)
        else:
            grouped = x.view(n, bs, heads, dim // spec.value_group, spec.value_group)
            code, zero = _kivi_params(grouped.amin(-1), grouped.amax(-1), levels)  # [n, bs, heads, groups]
            scale = log_scale_table(x.device)[code.long()]
            q = torch.round(grouped / scale[..., None] + zero[..., None]).clamp(0, levels - 1).view(n, bs, heads, dim)
        data = _pack(q, fmt.bits)
        meta = torch.stack([code, zero.to(torch.int8).view(torch.uint8)], dim=-1).reshape(n, -1)
    data = data.reshape(n, -1)
    record = torch.zeros(n, max(spec.record_bytes, data.shape[1] + meta.shape[1]), dtype=torch.uint8, device=x.device)
    record[:, : data.shape[1]] = data
    record[:, data.shape[1] : data.shape[1] + meta.shape[1]] = meta
    return record


def decode(spec: KVCacheSpec, records: torch.Tensor, which: str) -> torch.Tensor:
    """Float blocks [n, block_size, kv_heads, head_dim] from records [n, record_bytes]."""
    fmt = spec.format
    n = records.shape[0]
    bs, heads, dim = spec.block_size, spec.num_kv_heads, spec.head_dim
    size = data_bytes(spec)
    data, meta = records[:, :size], records[:, size:]
    if fmt.kind == "scaled":
        scale = meta[:, : bs * heads * 2].contiguous().view(torch.float16).float().view(n, bs, heads, 1)
        values = data.contiguous().view(torch.int8 if fmt.name == "int8" else fmt.torch_dtype).float().view(n, bs, heads, dim)
        return values * scale
    levels_table = log_scale_table(records.device)
    q = _unpack(data.reshape(n, bs, heads, -1), fmt.bits).float()
    if which == "key":
        groups = bs // spec.group_size
        pairs = meta[:, : groups * heads * dim * 2].reshape(n, groups, heads, dim, 2)
        scale = levels_table[pairs[..., 0].long()]
        zero = pairs[..., 1].contiguous().view(torch.int8).float()
        q = q.view(n, groups, spec.group_size, heads, dim)
        return (scale[:, :, None] * (q - zero[:, :, None])).view(n, bs, heads, dim)
    groups = dim // spec.value_group
    pairs = meta[:, : bs * heads * groups * 2].reshape(n, bs, heads, groups, 2)
    scale = levels_table[pairs[..., 0].long()]
    zero = pairs[..., 1].contiguous().view(torch.int8).float()
    q = q.view(n, bs, heads, groups, spec.value_group)
    return (scale[..., None] * (q - zero[..., None])).view(n, bs, heads, dim)
