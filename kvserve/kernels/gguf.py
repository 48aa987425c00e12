"""Weights kept in their GGUF blocks (gguf_matmul.cpp): the tile-interleaved layout, products and
dequantization on the blocks, a fused projection's parts in one call, and a Q8_0 lm_head's
int8-screened greedy argmax (gguf_screen.h).

A weight's `activations` says how its products treat the rows: "exact" multiplies them (float32, or
bf16 dot products on the blocks' codes) by the exact dequantized values; "int8" quantizes each row
per block of 32 values and takes integer dot products (gguf_int8.h, AVX512-VNNI): about half the
instructions per weight, the rows' quantization the only loss; "bf16" multiplies bf16 rows on AMX
tiles by the dequantized values rounded to bf16 (gguf_amx.h): a bf16 copy of the weight's products
(amx_matmul) bit for bit, at the file's size. Either way a row's result does not depend on the other
rows."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvserve.kernels import args
from kvserve.kernels.build import load_kernels
from kvserve.kernels.library import _DTYPE_CODES, _check, _require
from kvserve.kernels.products import FLOAT_PACK_DTYPES, amx_ready, check_rows

# ggml's type codes the GGUF kernel reads, with (values, bytes) per block
GGUF_ACTIVATIONS = ("exact", "int8", "bf16")
GGUF_BLOCKS = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
               "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}  # fmt: skip


@dataclass(frozen=True)
class GgufWeight:
    """A weight [n, k] kept in its GGUF blocks (kvserve_gguf_matmul dequantizes them inside the
    product): `data` holds the file's bytes interleaved by tiles of 16 rows, [ceil(n/16)][blocks
    per row][block bytes][16] (gguf_matmul.cpp), the same size as the file's tensor."""

    data: torch.Tensor  # uint8 [tiles, blocks per row, block bytes, 16]
    type_name: str
    n: int
    k: int
    activations: str = "exact"  # GGUF_ACTIVATIONS

    def __post_init__(self) -> None:
        if self.activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"GgufWeight: activations must be one of {GGUF_ACTIVATIONS}, got {self.activations!r}")
        if self.activations == "int8" and not gguf_int8_available():
            raise ValueError("GgufWeight: int8 activations need a CPU with AVX512-VNNI, AVX512-BW and AVX512-VBMI")
        if self.activations == "bf16" and not gguf_tiles_available():
            raise ValueError("GgufWeight: bf16 activations need a CPU whose AMX tiles run (products.amx_ready)")

    @property
    def activations_code(self) -> int:
        return GGUF_ACTIVATIONS.index(self.activations)

    def with_activations(self, activations: str) -> GgufWeight:
        """The same blocks (shared, not copied), their products taking rows as `activations` says."""
        return GgufWeight(self.data, self.type_name, self.n, self.k, activations)

    @property
    def type_code(self) -> int:
        return GGUF_BLOCKS[self.type_name][0]

    @staticmethod
    def row_bytes(type_name: str, k: int) -> int:
        _, values, size = GGUF_BLOCKS[type_name]
        if k % values:
            raise ValueError(f"a {type_name} row holds whole blocks of {values} values; {k} is not a multiple")
        return k // values * size

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def gguf_int8_available() -> bool:
    """Whether this CPU's kernels have the int8-rows products (AVX512-VNNI, BW and VBMI)."""
    library = load_kernels()
    return library is not None and bool(library.kvserve_gguf_int8_available())


def gguf_tiles_available() -> bool:
    """Whether bf16 rows can take the blocks on AMX tiles here (products.amx_ready: the CPU has AMX-BF16,
    Linux grants its tiles and the kernel passed its self-check)."""
    return amx_ready()


def gguf_weight(data: torch.Tensor, type_name: str, n: int, k: int, activations: str = "exact") -> GgufWeight:
    """A GGUF tensor's bytes (n rows of blocks, in the file's order; any shape) as a GgufWeight:
    copied once into the kernel's tile-interleaved layout."""
    if type_name not in GGUF_BLOCKS:
        raise ValueError(f"GGUF type {type_name} is not one the kernels read ({', '.join(GGUF_BLOCKS)})")
    _, values, size = GGUF_BLOCKS[type_name]
    row_bytes = GgufWeight.row_bytes(type_name, k)
    if data.dtype != torch.uint8 or data.numel() != n * row_bytes:
        raise ValueError(f"a {type_name} [{n}, {k}] weight is {n * row_bytes} bytes; got {data.numel()} of {data.dtype}")
    tiles = -(-n // 16)
    rows = data.reshape(n, k // values, size)
    if tiles * 16 != n:
        rows = torch.cat([rows, rows.new_zeros(tiles * 16 - n, k // values, size)])
    interleaved = rows.view(tiles, 16, k // values, size).permute(0, 2, 3, 1).contiguous()
    return GgufWeight(interleaved, type_name, n, k, activations)


def gguf_dequantize(weight: GgufWeight, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (int64, any shape; all rows when None) of the weight as float32 [..., k], each value
    exactly gguf-py's dequantized one."""
    library = _require()
    if ids is None:
        flat, shape = None, (weight.n,)
    else:
        flat, shape = ids.reshape(-1).to(torch.int64).contiguous(), tuple(ids.shape)
    count = weight.n if flat is None else flat.numel()
    out = torch.empty(count, weight.k, dtype=torch.float32)
    if count:
        status = library.kvserve_gguf_dequantize(weight.data.data_ptr(), weight.type_code, weight.n, weight.k,
                                                 None if flat is None else flat.data_ptr(), count, out.data_ptr())  # fmt: skip
        if status == 2:
            raise IndexError(f"gguf_dequantize: row ids must lie in [0, {weight.n})")
        _check(status, "gguf_dequantize")
    return out.reshape(*shape, weight.k)


def gguf_matmul(
    x: torch.Tensor, weight: GgufWeight, out_dtype: torch.dtype | None = None, want_output: bool = True, want_argmax: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x [R, k] (float32 or bf16; bf16 for bf16 activations) @ weight^T on the GGUF blocks, the rows
    taken as the weight's `activations` says (exact: one float32 FMA chain per output in k order over
    the exact dequantized values), so a row's result does not depend on the other rows: (output [R, n]
    in out_dtype (x's by default), or None; row-wise argmax [R] or None).
    `out` may be a column slice of a wider contiguous-row matrix (its row stride is kept)."""
    library = _require()
    check_rows(x, weight.k, "gguf_matmul")
    rows = x.shape[0]
    dtype = out_dtype or x.dtype
    _check_tile_dtypes(weight.activations, x.dtype, dtype, "gguf_matmul")
    if out is not None:
        if tuple(out.shape) != (rows, weight.n) or out.dtype != dtype or out.stride(1) != 1 or (rows > 1 and out.stride(0) < weight.n):
            raise ValueError(f"gguf_matmul: out must be {dtype} [{rows}, {weight.n}] with unit inner stride")
        ldo = out.stride(0) if rows > 1 else weight.n
        out_ptr = out.data_ptr()
    elif want_output:
        out = torch.empty(rows, weight.n, dtype=dtype)
        ldo, out_ptr = weight.n, out.data_ptr()
    else:
        ldo, out_ptr = weight.n, None
    argmax = torch.empty(rows, dtype=torch.int64) if want_argmax else None
    ldx = x.stride(0) if rows > 1 else weight.k
    call = args.GgufMatmulArgs(
        weight.data.data_ptr(), x.data_ptr(), out_ptr, argmax.data_ptr() if argmax is not None else None, weight.n, ldx, ldo, weight.k,
        rows, weight.type_code, _DTYPE_CODES[x.dtype], _DTYPE_CODES[dtype], weight.activations_code,
    )  # fmt: skip
    _check(library.kvserve_gguf_matmul(ctypes.byref(call)), "gguf_matmul")
    return out, argmax


def _check_tile_dtypes(activations: str, x_dtype: torch.dtype, out_dtype: torch.dtype, name: str) -> None:
    if activations == "bf16" and (x_dtype != torch.bfloat16 or out_dtype not in FLOAT_PACK_DTYPES):
        raise ValueError(f"{name}: bf16 activations take bf16 rows into float32 or bf16 outputs; got {x_dtype} into {out_dtype}")


@dataclass(frozen=True)
class GgufScreen:
    """A Q8_0 weight's bounds for its int8-screened greedy argmax (gguf_screen.h): per tile of 16
    rows and block of 32 codes the largest |d| * sum |q|, and per tile the largest row L1 norm
    (4 bytes per 512 weights beside the blocks)."""

    weight: GgufWeight
    block_bound: torch.Tensor  # float32 [tiles, k / 32]
    tile_l1: torch.Tensor  # float32 [tiles]


def gguf_screen_available() -> bool:
    library = load_kernels()
    return library is not None and bool(library.kvserve_gguf_screen_available())


def gguf_screen(weight: GgufWeight) -> GgufScreen:
    if weight.type_name != "Q8_0" or not gguf_screen_available():
        raise ValueError("gguf_screen: a Q8_0 weight, on a CPU with AVX512-BF16, VNNI and VBMI")
    tiles = -(-weight.n // 16)
    block_bound = torch.empty(tiles, weight.k // 32)
    tile_l1 = torch.empty(tiles)
    _check(_require().kvserve_gguf_screen_bounds(weight.data.data_ptr(), weight.n, weight.k, block_bound.data_ptr(), tile_l1.data_ptr()), "gguf_screen")
    return GgufScreen(weight, block_bound, tile_l1)


def gguf_screened_argmax(x: torch.Tensor, screen: GgufScreen) -> tuple[torch.Tensor | None, int]:
    """gguf_matmul(x, screen.weight, want_argmax=True)'s argmax [R] of bf16 rows x [R, k], bit for
    bit, screened with int8 dot products on the Q8_0 codes; and how many tiles were recomputed
    exactly. None (nothing computed) for a row outside the screen's range (not finite, |x| > 2^64,
    or a nonzero |x| < 2^-100): take the full product."""
    weight = screen.weight
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != weight.k or x.stride(1) != 1 or x.shape[0] == 0 or not x.is_cpu:
        raise ValueError(f"gguf_screened_argmax: x must be bf16 [rows > 0, {weight.k}] on the CPU with unit inner stride")
    rows = x.shape[0]
    argmax = torch.empty(rows, dtype=torch.int64)
    rescored = ctypes.c_int64(0)
    call = args.GgufMatmulArgs(
        weight.data.data_ptr(), x.data_ptr(), None, argmax.data_ptr(), weight.n, x.stride(0) if rows > 1 else weight.k, weight.n, weight.k,
        rows, weight.type_code, _DTYPE_CODES[x.dtype], 0, 0,
    )  # fmt: skip
    status = _require().kvserve_gguf_screened_argmax(ctypes.byref(call), screen.block_bound.data_ptr(), screen.tile_l1.data_ptr(), ctypes.byref(rescored))
    if status == 3:
        return None, 0
    _check(status, "gguf_screened_argmax")
    return argmax, rescored.value


class GgufProduct:
    """x @ W^T for W a fused projection's parts in GGUF blocks (stacked on the output axis), in one
    kernel call: each part's outputs are gguf_matmul's bits, side by side. The parts' descriptors
    are built once; a call builds only the rows' arguments."""

    def __init__(self, parts: tuple[GgufWeight, ...]) -> None:
        if not parts or any(part.k != parts[0].k or part.activations != parts[0].activations for part in parts):
            raise ValueError("GgufProduct: one or more parts sharing k and activations")
        self._library = _require()
        self.parts = parts
        self.k = parts[0].k
        self.n = sum(part.n for part in parts)
        self._parts = (args.GgufPart * len(parts))(*(args.GgufPart(part.data.data_ptr(), part.n, part.type_code, 0) for part in parts))

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, k] (float32 or bf16, unit inner stride, on the CPU) into `out` ([R, n] in out_dtype,
        x's by default, unit inner stride: it may be a column slice) or a new tensor."""
        k, n = self.k, self.n
        if x.dim() != 2 or x.dtype not in FLOAT_PACK_DTYPES or x.shape[1] != k or x.stride(1) != 1 or x.shape[0] == 0 or not x.is_cpu:
            raise ValueError(f"GgufProduct: x must be float32 or bf16 [rows > 0, {k}] on the CPU with unit inner stride")
        rows = x.shape[0]
        dtype = out_dtype or x.dtype
        _check_tile_dtypes(self.parts[0].activations, x.dtype, dtype, "GgufProduct")
        if out is None:
            out = torch.empty(rows, n, dtype=dtype)
        elif tuple(out.shape) != (rows, n) or out.dtype != dtype or out.stride(1) != 1 or (rows > 1 and out.stride(0) < n):
            raise ValueError(f"GgufProduct: out must be {dtype} [{rows}, {n}] with unit inner stride")
        call = args.GgufMatmulArgs(
            None, x.data_ptr(), out.data_ptr(), None, n, x.stride(0) if rows > 1 else k, out.stride(0) if rows > 1 else n, k, rows, 0,
            _DTYPE_CODES[x.dtype], _DTYPE_CODES[dtype], self.parts[0].activations_code,
        )  # fmt: skip
        _check(self._library.kvserve_gguf_matmul_parts(ctypes.byref(call), self._parts, len(self.parts)), "gguf product")
        return out
