"""The float and bf16 products x @ W^T on weights packed once: float32 / bf16 tiles
(float_matmul.cpp), bf16 dot products (packed_matmul.cpp) and AMX tiles (amx_matmul.cpp)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch

from kvserve.kernels import args
from kvserve.kernels.build import cpu_flags, load_kernels
from kvserve.kernels.library import _DTYPE_CODES, _check, _require, cpu_kernels_available

logger = logging.getLogger(__name__)

FLOAT_PACK_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class FloatPackedWeight:
    """A float32 or bf16 weight [n, k] re-laid for kvserve_float_matmul: tiles of 16 rows, k-major
    inside a tile ([n/16][k][16]), in the weight's own dtype."""

    data: torch.Tensor
    n: int
    k: int
    dtype: torch.dtype


def can_pack_float(weight: torch.Tensor) -> bool:
    if weight.dim() != 2 or weight.dtype not in FLOAT_PACK_DTYPES or weight.device.type != "cpu" or weight.numel() == 0:
        return False
    return cpu_kernels_available()


def pack_float_weight(weight: torch.Tensor) -> FloatPackedWeight:
    """Pack a float32 or bf16 [n, k] weight once (the same bytes again, padded to 16 rows)."""
    library = _require()
    if not can_pack_float(weight):
        raise ValueError("pack_float_weight: a non-empty 2-D float32 or bf16 CPU weight")
    weight = weight.detach().contiguous()
    n, k = weight.shape
    data = torch.empty(-(-n // 16) * 16 * k, dtype=weight.dtype)
    status = library.kvserve_pack_float_weight(weight.data_ptr(), _DTYPE_CODES[weight.dtype], n, k, data.data_ptr())
    _check(status, "pack_float_weight")
    return FloatPackedWeight(data, n, k, weight.dtype)


def unpack_float_weight(weight: FloatPackedWeight) -> torch.Tensor:
    """The [n, k] weight back from its packed layout (for a torch fallback)."""
    tiles = weight.data.numel() // (16 * weight.k)
    return weight.data.view(tiles, weight.k, 16).transpose(1, 2).reshape(tiles * 16, weight.k)[: weight.n]


def check_rows(x: torch.Tensor, k: int, name: str) -> None:
    """A product's input rows: float32 or bf16 [rows > 0, k] on the CPU with unit inner stride."""
    if x.dim() != 2 or x.dtype not in FLOAT_PACK_DTYPES or x.shape[1] != k or x.stride(1) != 1 or x.shape[0] == 0:
        raise ValueError(f"{name}: x must be float32 or bf16 [rows > 0, {k}] with unit inner stride")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: x must be on the CPU")
    if x.shape[0] > 1 and x.stride(0) < k:
        raise ValueError(f"{name}: x's rows must not overlap (row stride {x.stride(0)} < {k}): an expanded tensor needs .contiguous()")


def float_matmul(
    x: torch.Tensor, weight: FloatPackedWeight, out_dtype: torch.dtype | None = None, want_output: bool = True, want_argmax: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, k] (float32 or bf16) @ weight^T with one float32 FMA chain per output, in k order, so a
    row's result does not depend on the other rows: (output [R, n] in out_dtype (x's by default),
    written into `out` when given, or None; row-wise argmax [R] or None)."""
    library = _require()
    check_rows(x, weight.k, "float_matmul")
    rows = x.shape[0]
    out, argmax, out_args, out_dtype_code = _product_outputs(rows, weight.n, out_dtype or x.dtype, want_output, want_argmax, out)
    ldx = x.stride(0) if rows > 1 else weight.k  # a single row's stride can be anything
    call = args.FloatMatmulArgs(
        weight.data.data_ptr(), x.data_ptr(), *out_args, weight.n, ldx, weight.k, rows, _DTYPE_CODES[weight.dtype], _DTYPE_CODES[x.dtype],
        out_dtype_code, 0,
    )  # fmt: skip
    _check(library.kvserve_float_matmul(ctypes.byref(call)), "float_matmul")
    return out, argmax


@dataclass(frozen=True)
class PackedWeight:
    """A bf16 weight [n, k] re-laid for kvserve_packed_matmul: tiles of 16 rows with k-pairs interleaved."""

    data: torch.Tensor
    n: int
    k: int


def bf16_dot_available() -> bool:
    """The CPU has AVX512-BF16 dot products (and the kernels were built for it)."""
    library = load_kernels()
    return library is not None and bool(library.kvserve_has_bf16_dot())


def can_pack(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 2 == 0 and bf16_dot_available()


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """Pack a bf16 [n, k] weight once (the same bytes again, padded to 16 rows)."""
    library = _require()
    if not can_pack(weight):
        raise ValueError("pack_weight: a 2-D bf16 CPU weight with an even inner size, on a CPU with AVX512-BF16")
    weight = weight.contiguous()
    n, k = weight.shape
    data = torch.empty(-(-n // 16) * 16 * k, dtype=torch.bfloat16)
    _check(library.kvserve_pack_bf16_weight(weight.data_ptr(), n, k, data.data_ptr()), "pack_weight")
    return PackedWeight(data, n, k)


def unpack_weight(weight: PackedWeight) -> torch.Tensor:
    """The bf16 [n, k] weight back from its packed layout (for a torch fallback)."""
    tiles = weight.data.numel() // (16 * weight.k)
    return weight.data.view(tiles, weight.k // 2, 16, 2).permute(0, 2, 1, 3).reshape(tiles * 16, weight.k)[: weight.n]


def packed_matmul(
    x: torch.Tensor, weight: PackedWeight, out_dtype: torch.dtype | None = None, want_output: bool = True, want_argmax: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, k] (bf16) @ weight^T with bf16 dot products accumulated in float32: (output [R, n] in
    out_dtype (bf16 by default), written into `out` when given, or None; row-wise argmax [R] or None)."""
    library = _require()
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != weight.k or x.stride(1) != 1 or x.shape[0] == 0:
        raise ValueError(f"packed_matmul: x must be bf16 [rows > 0, {weight.k}] with unit inner stride")
    rows = x.shape[0]
    out, argmax, out_args, out_dtype_code = _product_outputs(rows, weight.n, out_dtype or torch.bfloat16, want_output, want_argmax, out)
    call = args.PackedMatmulArgs(weight.data.data_ptr(), x.data_ptr(), *out_args, weight.n, x.stride(0), weight.k, rows, out_dtype_code, 0)
    status = library.kvserve_packed_matmul(ctypes.byref(call))
    _check(status, "packed_matmul")
    return out, argmax


def cpu_has_amx_bf16() -> bool:
    """The CPU reports AMX bf16 tiles."""
    return "amx_bf16" in cpu_flags()


@dataclass(frozen=True)
class AmxWeight:
    """A bf16 weight [n, k] re-laid for kvserve_amx_matmul: AMX B tiles (amx_matmul.cpp),
    [ceil(n/16)][ceil(k/32)][16 k-pairs][16 columns][2], zero-padded."""

    data: torch.Tensor
    n: int
    k: int


def amx_available(library=None) -> bool:
    """The AMX kernel can run: the library was built with it, the CPU has AMX-BF16 and Linux granted
    this process tile data (kvserve_amx_available), and KVSERVE_DISABLE_AMX is not "1". `library`:
    the kernel library to ask (the production one by default; tests pass the emulated build)."""
    if os.environ.get("KVSERVE_DISABLE_AMX") == "1":
        return False
    library = library if library is not None else load_kernels()
    return library is not None and bool(library.kvserve_amx_compiled()) and bool(library.kvserve_amx_available())


@functools.lru_cache(maxsize=None)
def amx_ready() -> bool:
    """amx_available(), and the kernel's product of a small awkward shape matches a float64
    reference here (checked once per process): the engine's projections and bf16 attention then
    run on AMX tiles (the attention kernel is told the outcome). Otherwise they take the
    AVX512-BF16 kernels, with one log line saying why."""
    ready = _amx_self_check()
    library = load_kernels()
    if library is not None:
        library.kvserve_set_attention_amx(int(ready))
    return ready


def _amx_self_check() -> bool:
    if not amx_available():
        if cpu_has_amx_bf16() and os.environ.get("KVSERVE_DISABLE_AMX") != "1":
            logger.warning("this CPU has AMX but its tiles cannot be used here; projections and attention take the AVX512-BF16 kernels")
        return False
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(19, 72, generator=g).bfloat16(), torch.randn(37, 72, generator=g).bfloat16()
    out, argmax = amx_matmul(x, amx_pack_weight(weight), out_dtype=torch.float32, want_argmax=True)
    expected = x.double() @ weight.double().t()
    if (out.double() - expected).abs().max().item() > 1e-3 * expected.abs().max().item() or not torch.equal(argmax, out.argmax(1)):
        logger.warning("the AMX kernel's self-check failed on this CPU; projections and attention take the AVX512-BF16 kernels")
        return False
    return True


def amx_unpack_weight(weight: AmxWeight) -> torch.Tensor:
    """The bf16 [n, k] weight back from its AMX layout (for a torch fallback)."""
    col_tiles, k_tiles = -(-weight.n // 16), -(-weight.k // 32)
    tiles = weight.data.view(col_tiles, k_tiles, 16, 16, 2).permute(0, 3, 1, 2, 4)
    return tiles.reshape(col_tiles * 16, k_tiles * 32)[: weight.n, : weight.k]


@functools.lru_cache(maxsize=8)
def _unit_offsets(per_row: int) -> torch.Tensor:
    """[1, per_row]: where a row's units lie from its first, 16 apart."""
    return torch.arange(0, per_row * 16, 16)[None, :]


def packed_rows(weight: PackedWeight | AmxWeight | FloatPackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [n, k] weight gathered from its packed layout: the same values as the
    row-major weight's rows (a tied embedding looks its tokens up in the lm_head's packed copy).
    Every layout keeps tiles of 16 rows with a row's units (k-pairs, or values for the float tiles)
    16 apart, so one gather takes them all."""
    ids = ids.reshape(-1).long()
    if isinstance(weight, FloatPackedWeight):  # [n/16][k][16] values
        units, per_row = weight.data, weight.k
    else:  # k-pairs as int32: PackedWeight [n/16][k/2][16]; AmxWeight [n/16][k/32][16 pairs][16][2], zero-padded k
        units, per_row = weight.data.view(torch.int32), weight.k // 2 if isinstance(weight, PackedWeight) else -(-weight.k // 32) * 16
    rows = torch.take(units, (ids // 16 * (per_row * 16) + ids % 16)[:, None] + _unit_offsets(per_row))
    if rows.dtype == torch.int32:
        rows = rows.view(weight.data.dtype).view(len(ids), -1)[:, : weight.k]
    return rows


def amx_pack_weight(weight: torch.Tensor, library=None) -> AmxWeight:
    """Pack a bf16 [n, k] weight once into AMX B tiles (plain C++: runs on any CPU)."""
    library = library if library is not None else _require()
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or 0 in weight.shape:
        raise ValueError("amx_pack_weight: a non-empty 2-D bf16 CPU weight")
    weight = weight.contiguous()
    n, k = weight.shape
    data = torch.empty(-(-n // 16) * -(-k // 32) * 16 * 32, dtype=torch.bfloat16)
    _check(library.kvserve_amx_pack_weight(weight.data_ptr(), n, k, data.data_ptr()), "amx_pack_weight")
    return AmxWeight(data, n, k)


def amx_matmul(
    x: torch.Tensor, weight: AmxWeight, out_dtype: torch.dtype | None = None, want_output: bool = True, want_argmax: bool = False,
    out: torch.Tensor | None = None, library=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, k] (bf16) @ weight^T on AMX tiles, accumulated in float32: (output [R, n] in out_dtype
    (float32 or bf16, bf16 by default), written into `out` when given, or None; row-wise argmax [R]
    or None). A row's result does not depend on the other rows (amx_matmul.cpp)."""
    library = library if library is not None else _require()
    shape_ok = x.dim() == 2 and x.shape[0] > 0 and x.shape[1] == weight.k and x.stride(1) == 1
    if not shape_ok or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"amx_matmul: x must be bf16 [rows > 0, {weight.k}] with unit inner stride")
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("amx_matmul: the output is float32 or bf16")
    rows = x.shape[0]
    out, argmax, out_args, out_dtype_code = _product_outputs(rows, weight.n, out_dtype, want_output, want_argmax, out)
    ldx = x.stride(0) if rows > 1 else weight.k  # one row's stride can be anything
    call = args.AmxMatmulArgs(weight.data.data_ptr(), x.data_ptr(), *out_args, weight.n, ldx, weight.k, rows, out_dtype_code, 0)
    status = library.kvserve_amx_matmul(ctypes.byref(call))
    if status == 2:
        raise RuntimeError("amx_matmul: AMX tiles are not available here (see amx_available())")
    _check(status, "amx_matmul")
    return out, argmax


def _product_outputs(
    rows: int, n: int, dtype: torch.dtype, want_output: bool, want_argmax: bool, out: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple, int]:
    """The output [rows, n] and row-wise argmax [rows] a product kernel fills (None where not
    wanted), their pointers (out, argmax) and the output's dtype code. `out`: a contiguous
    [rows, n] tensor of `dtype` to write into instead of a new one (a fresh 64 x 262K float32
    output costs ~30 ms of page faults on every decode step)."""
    if out is not None and (tuple(out.shape) != (rows, n) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"the output must be a contiguous {dtype} [{rows}, {n}] tensor")
    if want_output and out is None:
        out = torch.empty(rows, n, dtype=dtype)
    elif not want_output:
        out = None
    argmax = torch.empty(rows, dtype=torch.int64) if want_argmax else None
    pointers = (out.data_ptr() if out is not None else None, argmax.data_ptr() if argmax is not None else None)
    return out, argmax, pointers, _DTYPE_CODES[dtype] if out is not None else 0
