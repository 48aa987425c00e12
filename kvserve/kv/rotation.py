"""Hadamard rotation of K and V for the quantized caches (incoherence processing, as in QuaRot).

Every head's query, key and value are multiplied by one orthonormal matrix R = diag(signs) H / sqrt(D)
(H a Hadamard matrix, the signs a fixed pseudo-random draw) before attention, and the output by R^T
after it. Attention does not change: (qR) . (kR) = q . k, and the weighted sum of rotated values,
turned back, is the weighted sum of the values. The quantization does change: a per-token scale
(int8, fp8) or a per-group one (int4) spends its levels on the largest channel of a vector, and
real keys and values have a few large channels; R spreads each vector's energy evenly over its
channels, so the scale follows the vector's norm rather than its worst channel. It lowers int8's
cost on every model measured (the default there, EngineConfig.rotates_kv); fp8 and int4 gain on
SmolLM2-135M (fp8_e4m3 +1.34% -> +0.34% perplexity) but lose on Gemma 3 and Qwen2.5, whose leftover
key constants it spreads over every channel (docs/kv-quantization.md).
"""

from __future__ import annotations

import torch

from kvserve.kernels import hadamard, library

ROTATION_SEED = 0x4B56  # part of the cache identity through the flag: change it and stored K/V change meaning


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_rotation(head_dim: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """The orthonormal float32 [head_dim, head_dim] matrix diag(signs) H / sqrt(head_dim)."""
    if not is_power_of_two(head_dim):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {head_dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return rotation_signs(head_dim, seed)[:, None] * h / head_dim**0.5


def rotation_signs(head_dim: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """The fixed pseudo-random ±1 (float32 [head_dim]) of R's diagonal."""
    return torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1


class Rotation:
    """x R and x R^T per head by the fast Walsh-Hadamard transform (D log2 D adds, not a D x D
    product): in float32, rounded once to the activations' dtype. On CPU one native call turns a
    layer's q, k and v (kernels/hadamard.cpp); elsewhere torch runs the same butterflies in the
    same order, so both give the same bits."""

    def __init__(self, head_dim: int, device: torch.device) -> None:
        self.matrix = hadamard_rotation(head_dim).to(device)  # the R the transform computes
        self.head_dim = head_dim
        self.signs = rotation_signs(head_dim).to(device)
        self.scale = torch.tensor(head_dim**-0.5, dtype=torch.float32)
        native = device.type == "cpu" and library.cpu_kernels_available()
        self.native = hadamard.Hadamard(self.signs, float(self.scale)) if native else None

    def forward(self, *xs: torch.Tensor, in_place: bool = False) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """Each x [..., heads, head_dim] @ R (one tensor in, one out). in_place: the native kernel may
        overwrite xs (the attention backends' q, k and v, which nothing reads after)."""
        return self._apply(xs, False, in_place)

    def inverse(self, *xs: torch.Tensor, in_place: bool = False) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """Each x [..., heads, head_dim] @ R^T."""
        return self._apply(xs, True, in_place)

    def _apply(self, xs: tuple[torch.Tensor, ...], inverse: bool, in_place: bool) -> tuple[torch.Tensor, ...] | torch.Tensor:
        if self.native is not None and self.native.fits(xs):
            out = self.native.run(xs, inverse, in_place)
        else:
            out = tuple(self._butterflies(x, inverse) for x in xs)
        return out[0] if len(out) == 1 else out

    def _butterflies(self, x: torch.Tensor, inverse: bool) -> torch.Tensor:
        d = self.head_dim
        y = x.float() if inverse else x.float() * self.signs
        h = 1
        while h < d:
            y = y.reshape(-1, d // (2 * h), 2, h)
            a, b = y[:, :, 0], y[:, :, 1]
            y = torch.stack((a + b, a - b), dim=2)
            h *= 2
        y = y.reshape(x.shape) * self.scale.to(y.device)
        return (y * self.signs if inverse else y).to(x.dtype)
