"""The Walsh-Hadamard rotation of head vectors (hadamard.cpp), which an int8 KV cache's layers
apply to q, k and v (kv/rotation.py)."""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels import args
from kvserve.kernels.library import _DTYPE_CODES, _check, _require

class Hadamard:
    """Each head vector of 1-3 tensors [T, heads, D] times R = diag(signs) H / sqrt(D) (R^T when
    inverse), by the fast Walsh-Hadamard transform in float32 (hadamard.cpp). Called twice per
    layer and step, so the argument struct is built once (one caller at a time: the engine's step)."""

    def __init__(self, signs: torch.Tensor, scale: float) -> None:
        self._library = _require()
        self.signs = signs.float().contiguous()
        self.dim = int(signs.shape[0])
        self.scale = scale
        self._call = args.HadamardArgs()
        self._call.signs, self._call.scale, self._call.dim = self.signs.data_ptr(), scale, self.dim

    def fits(self, xs: tuple[torch.Tensor, ...]) -> bool:
        """1-3 CPU tensors [T, heads, D] of one float dtype and T, each head's dims contiguous and heads packed."""
        if not 0 < len(xs) <= 3:
            return False
        dtype, tokens, dim = xs[0].dtype, xs[0].shape[0], self.dim
        for x in xs:
            shape, stride = x.shape, x.stride()
            if len(shape) != 3 or shape[0] != tokens or shape[2] != dim or stride[2] != 1 or stride[1] != dim:
                return False
            if x.dtype != dtype or not x.is_cpu:
                return False
        return dtype in _DTYPE_CODES

    def __call__(self, xs: tuple[torch.Tensor, ...], inverse: bool, in_place: bool = False) -> tuple[torch.Tensor, ...]:
        """The rotated tensors: new contiguous ones, or xs themselves, overwritten, when in_place."""
        if not self.fits(xs):
            raise ValueError("hadamard: 1-3 CPU tensors [T, heads, D] of one dtype, heads packed")
        return self.run(xs, inverse, in_place)

    def run(self, xs: tuple[torch.Tensor, ...], inverse: bool, in_place: bool = False) -> tuple[torch.Tensor, ...]:
        """__call__ for tensors fits() has already accepted (the per-layer path asks once)."""
        call = self._call
        outs = xs if in_place else tuple(torch.empty(x.shape, dtype=x.dtype) for x in xs)
        for i, x in enumerate(xs):
            out, row = outs[i], x.shape[1] * self.dim
            # a size-1 dim's stride can be anything; one token's rows are packed whatever it says
            call.out[i], call.x[i], call.heads[i] = out.data_ptr(), x.data_ptr(), x.shape[1]
            call.x_stride[i], call.out_stride[i] = (x.stride(0), out.stride(0)) if x.shape[0] > 1 else (row, row)
        call.count, call.tokens, call.dtype, call.inverse = len(xs), xs[0].shape[0], _DTYPE_CODES[xs[0].dtype], int(inverse)
        _check(self._library.kvserve_hadamard(ctypes.byref(call)), "hadamard")
        return outs
