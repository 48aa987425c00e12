"""Choosing a step's tokens: the sampler over full logits (sampler.cpp, its uniforms from
gumbel.h), and an lm_head's int8 screen (int8_screen.h), which finds the greedy argmax
(screened_argmax.cpp) or a sampled token (screened_sampler.cpp) from a few exactly computed tiles."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kernels import args
from kvserve.kernels.build import load_kernels
from kvserve.kernels.library import _check, _require
from kvserve.kernels.products import AmxWeight, PackedWeight

SAMPLER_ROW_DTYPE = np.dtype(args.SamplerRow)
MAX_LOGPROBS = 20


@dataclass
class SampledRows:
    tokens: torch.Tensor  # [rows] int64
    token_logprobs: torch.Tensor  # [rows] float32: raw logprob of each drawn token (rows that asked)
    top_ids: torch.Tensor  # [rows, 20] int64
    top_logprobs: torch.Tensor  # [rows, 20] float32


def sample(logits: torch.Tensor, rows: np.ndarray, penalty_ids: np.ndarray, penalty_counts: np.ndarray) -> SampledRows:
    """Draw one token per row of float32 logits [R, V] (modified in place: penalties) with the
    per-row parameters ``rows`` (a SAMPLER_ROW_DTYPE array); see sampler.cpp."""
    library = _require()
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
        raise ValueError("sample: logits must be float32 CPU [rows, vocab] with contiguous rows")
    count = logits.shape[0]
    if rows.dtype != SAMPLER_ROW_DTYPE or rows.shape != (count,):
        raise ValueError(f"sample: rows must be a SAMPLER_ROW_DTYPE array of {count} entries")
    rows = np.ascontiguousarray(rows)
    penalty_ids = np.ascontiguousarray(penalty_ids, dtype=np.int64)
    penalty_counts = np.ascontiguousarray(penalty_counts, dtype=np.int32)
    out = SampledRows(
        torch.empty(count, dtype=torch.int64), torch.zeros(count), torch.zeros(count, MAX_LOGPROBS, dtype=torch.int64),
        torch.zeros(count, MAX_LOGPROBS),
    )  # fmt: skip
    call = args.SamplerArgs(
        logits.data_ptr(), logits.stride(0), logits.shape[1], count, rows.ctypes.data,
        penalty_ids.ctypes.data if penalty_ids.size else None, penalty_counts.ctypes.data if penalty_counts.size else None,
        out.tokens.data_ptr(), out.token_logprobs.data_ptr(), out.top_ids.data_ptr(), out.top_logprobs.data_ptr(),
    )  # fmt: skip
    _check(library.kvserve_sample(ctypes.byref(call)), "sample")
    return out


def token_uniforms(seed: int, position: int, n: int) -> np.ndarray:
    """The native kernels' uniform of tokens 0 .. n-1 for (seed, position) (see gumbel.h)."""
    out = np.empty(n, dtype=np.float64)
    _check(_require().kvserve_token_uniforms(seed, position, n, out.ctypes.data), "token_uniforms")
    return out


@dataclass(frozen=True)
class ScreenedWeight:
    """An lm_head kept for exact greedy argmax by int8 screening (see screened_argmax.cpp): the bf16
    packed weight for the exact rescoring plus int8 rows with their scales and error bounds."""

    bf16: PackedWeight | AmxWeight  # what the full logits are computed with (the rescoring matches it bit for bit)
    int8: torch.Tensor  # uint8 (q + 128) [tiles * 16 * k], laid out [tile][k/4][16][4]
    row_scale: torch.Tensor  # [tiles * 16]
    row_error: torch.Tensor  # [tiles * 16]: max |w - s q| over the row
    row_abs_q: torch.Tensor  # [tiles, groups, 16]: s * sum |q| over each group of dims
    tile_abs_q: torch.Tensor  # [tiles, groups]: the max over the tile's rows
    tile_error: torch.Tensor  # [tiles]
    group: int
    max_scale: float
    max_abs: float

    @property
    def bf16_layout(self) -> int:
        """ScreenedArgmaxArgs.bf16_layout: 1 for AMX B tiles, 0 for packed_matmul's layout."""
        return 1 if isinstance(self.bf16, AmxWeight) else 0


def int8_screen_available() -> bool:
    library = load_kernels()
    return library is not None and bool(library.kvserve_has_int8_screen())


def screen_group(k: int) -> int | None:
    """Dims per quantization group of the hidden state: 64 where it divides k (measured best here)."""
    return next((g for g in (64, 32, 16, 8, 4) if k % g == 0), None)


def screen_weight(packed: PackedWeight | AmxWeight, weight: torch.Tensor) -> ScreenedWeight:
    """Quantize a bf16 [n, k] lm_head to int8 for screening (adds n * k bytes). `packed` is what the
    full logits are computed with (packed_matmul's weight, or amx_matmul's with k % 32 == 0): the
    screen's exact rescoring gives its bits."""
    library = _require()
    group = screen_group(packed.k)
    if not int8_screen_available() or group is None or weight.dtype != torch.bfloat16 or tuple(weight.shape) != (packed.n, packed.k):
        raise ValueError("screen_weight: a bf16 [n, k] weight with k % 4 == 0, on a CPU with AVX512-VNNI and BF16")
    if isinstance(packed, AmxWeight) and packed.k % 32:
        raise ValueError("screen_weight: an AMX-packed weight needs k % 32 == 0")
    weight = weight.contiguous()
    n, k = weight.shape
    tiles = -(-n // 16)
    groups = k // group
    int8 = torch.empty(tiles * 16 * k, dtype=torch.uint8)
    row_scale = torch.empty(tiles * 16)
    row_error = torch.empty(tiles * 16)
    row_abs_q = torch.empty(tiles, groups, 16)
    _check(library.kvserve_pack_int8_weight(
        weight.data_ptr(), n, k, group, int8.data_ptr(), row_scale.data_ptr(), row_error.data_ptr(), row_abs_q.data_ptr(),
    ), "screen_weight")  # fmt: skip
    return ScreenedWeight(
        packed, int8, row_scale, row_error, row_abs_q, row_abs_q.amax(2), row_error.view(tiles, 16).amax(1), group,
        float(row_scale.max()), float(weight.detach().abs().max()),
    )  # fmt: skip


def _screen_inputs(x: torch.Tensor, weight: ScreenedWeight) -> tuple[torch.Tensor, ...]:
    """The hidden rows quantized for the int8 screen, with their error terms (screened_argmax.cpp):
    (xq, group_scale, delta, correction, l1, slack, tile_bound)."""
    k = weight.bf16.k
    rows, group = x.shape[0], weight.group
    exact = x.double().view(rows, k // group, group)
    scale = exact.abs().amax(2) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.round(exact / scale[:, :, None]).clamp(-127, 127)
    delta = (exact - scale[:, :, None] * quantized).abs().amax(2).float()
    correction = (128 * (scale * quantized.sum(2)).sum(1)).float()
    l1 = x.float().abs().sum(1)
    # float rounding: of the int8 approximation's group sums, and (twice) of the exact bf16 dot products
    slack = 2.0**-20 * weight.max_scale * scale.sum(1).float() * group * 255 * 127 + 1e-4 * weight.max_abs * l1
    tile_bound = (delta @ weight.tile_abs_q.t() + l1[:, None] * weight.tile_error[None, :]) * 1.0011 + slack[:, None]
    xq = quantized.to(torch.int8).view(rows, k)
    group_scale = scale.float()
    slack, tile_bound = slack.contiguous(), tile_bound.contiguous()
    return xq, group_scale, delta.contiguous(), correction.contiguous(), l1.contiguous(), slack, tile_bound


def screened_sample(
    x: torch.Tensor, weight: ScreenedWeight, rows: np.ndarray, penalty_ids: np.ndarray, penalty_counts: np.ndarray,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens sample() would draw from the logits x @ weight^T, found from the int8 screen
    and a few exactly computed tiles (screened_sampler.cpp); -1 where a row needs the full logits.
    rows: SAMPLER_ROW_DTYPE, temperature > 0 and no logprobs. scratch: float32 [>= R, 2 * ceil(n/16)*16],
    reused across calls. Returns (tokens [R], tiles rescored per row [R])."""
    library = _require()
    k, n = weight.bf16.k, weight.bf16.n
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != k or x.shape[0] == 0:
        raise ValueError(f"screened_sample: x must be bf16 [rows > 0, {k}]")
    count = x.shape[0]
    if rows.dtype != SAMPLER_ROW_DTYPE or rows.shape != (count,):
        raise ValueError(f"screened_sample: rows must be a SAMPLER_ROW_DTYPE array of {count} entries")
    width = -(-n // 16) * 16 * 2  # approximations, then their bounds
    if scratch is None or scratch.shape[0] < count or scratch.shape[1] != width or scratch.dtype != torch.float32:
        scratch = torch.empty(count, width)
    x = x.contiguous()
    xq, group_scale, delta, correction, l1, slack, tile_bound = _screen_inputs(x, weight)
    rows = np.ascontiguousarray(rows)
    penalty_ids = np.ascontiguousarray(penalty_ids, dtype=np.int64)
    penalty_counts = np.ascontiguousarray(penalty_counts, dtype=np.int32)
    tokens = torch.empty(count, dtype=torch.int64)
    rescored = torch.empty(count, dtype=torch.int64)
    screen = args.ScreenedArgmaxArgs(
        weight.int8.data_ptr(), weight.row_scale.data_ptr(), weight.row_error.data_ptr(), weight.row_abs_q.data_ptr(),
        weight.bf16.data.data_ptr(), xq.data_ptr(), group_scale.data_ptr(), delta.data_ptr(), correction.data_ptr(), l1.data_ptr(),
        slack.data_ptr(), tile_bound.data_ptr(), x.data_ptr(), None, rescored.data_ptr(), n, k, k, k, weight.group, count, weight.bf16_layout,
    )  # fmt: skip
    sample_args = args.SamplerArgs(
        scratch.data_ptr(), width, n, count, rows.ctypes.data, penalty_ids.ctypes.data if penalty_ids.size else None,
        penalty_counts.ctypes.data if penalty_counts.size else None, tokens.data_ptr(), None, None, None,
    )  # fmt: skip
    _check(library.kvserve_screened_sample(ctypes.byref(screen), ctypes.byref(sample_args)), "screened_sample")
    return tokens, rescored


def screened_argmax(x: torch.Tensor, weight: ScreenedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise argmax of x @ weight^T, bit-identical to packed_matmul's (amx_matmul's for an AMX-packed
    weight), from an int8 screen and an
    exact bf16 rescoring of the tiles that can still win. Returns (argmax [R], tiles rescored per row [R]).
    x must be finite bf16 [R, k]."""
    library = _require()
    k = weight.bf16.k
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != k or x.shape[0] == 0:
        raise ValueError(f"screened_argmax: x must be bf16 [rows > 0, {k}]")
    x = x.contiguous()
    rows = x.shape[0]
    xq, group_scale, delta, correction, l1, slack, tile_bound = _screen_inputs(x, weight)
    argmax = torch.empty(rows, dtype=torch.int64)
    rescored = torch.empty(rows, dtype=torch.int64)
    call = args.ScreenedArgmaxArgs(
        weight.int8.data_ptr(), weight.row_scale.data_ptr(), weight.row_error.data_ptr(), weight.row_abs_q.data_ptr(),
        weight.bf16.data.data_ptr(), xq.data_ptr(), group_scale.data_ptr(), delta.data_ptr(), correction.data_ptr(), l1.data_ptr(),
        slack.data_ptr(), tile_bound.data_ptr(), x.data_ptr(), argmax.data_ptr(), rescored.data_ptr(), weight.bf16.n, k, k, k,
        weight.group, rows, weight.bf16_layout,
    )  # fmt: skip
    status = library.kvserve_screened_argmax(ctypes.byref(call))
    _check(status, "screened_argmax")
    return argmax, rescored
