"""The one interface the model calls for attention, and the registry of its implementations.

A backend owns how K/V are stored into and read from the paged pool; the model hands it each
layer's queries, keys and values and gets the attention output back. Adding a backend (a CUDA
one, a quantized-KV path) is one class registered here; no model file changes.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.window_scores import add_window_scores

if TYPE_CHECKING:
    from kvserve.kv.pool import PagedKVPool


class AttentionBackend(abc.ABC):
    name: ClassVar[str]

    def __init__(self, pool: "PagedKVPool") -> None:
        self.pool = pool
        self.layers = pool.layers
        self._workspace: torch.Tensor | None = None

    @abc.abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None
    ) -> torch.Tensor:
        """q [T, H, D]; k, v [T, KVH, D] of the step's tokens. Stores k/v in the layer's slots and
        returns the attention output [T, H, D]; a sliding-window layer sees the last `window` slots."""

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks' K/V for block tables [..., n]: [..., n * block_size, kv_heads, head_dim] each.

        The result lives in a workspace reused by the next call (gathering into fresh memory costs
        more in page faults than the copy itself), so consume it before gathering again.
        """
        kv = self.layers[layer]
        if kv.key_records is not None:
            return kv.gather(block_ids)  # a quantized cache: decoded into fresh float blocks
        _, heads, dim = kv.key.shape
        block = kv.block_size * heads * dim
        count = block_ids.numel()
        if self._workspace is None or self._workspace.shape[1] < count * block or self._workspace.dtype != kv.key.dtype:
            self._workspace = torch.empty(2, count * block, dtype=kv.key.dtype, device=kv.key.device)
        shape = (*block_ids.shape[:-1], block_ids.shape[-1] * kv.block_size, heads, dim)
        out = []
        for which, cache in enumerate((kv.key, kv.value)):
            blocks = cache.view(-1, kv.block_size, heads, dim)
            target = self._workspace[which, : count * block].view(count, kv.block_size, heads, dim)
            torch.index_select(blocks, 0, block_ids.reshape(-1), out=target)
            out.append(target.view(shape))
        return out[0], out[1]

    def score_windows(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None) -> None:
        """Add the SnapKV scores of this layer's window queries (after their K/V are stored); a
        sliding-window layer is not compressed and scores nothing."""
        if window is not None:
            return
        kv = self.layers[layer]
        for span in meta.window_scores:
            keys = kv.gather_keys(span.block_tables[kv.group])
            scored = span.kv_len if span.context is None else span.context
            add_window_scores(span.out[layer, :, :scored], q[span.start : span.end], keys[: span.kv_len], span.first_slot, scale,
                              span.weighted_from, span.weight)  # fmt: skip

    def rotate_in(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v in the pool's Hadamard basis when it stores K/V rotated (kv/rotation.py)."""
        rotation = self.pool.rotation
        if rotation is None:
            return q, k, v
        return rotation.forward(q, k, v, in_place=True)

    def rotate_out(self, out: torch.Tensor) -> torch.Tensor:
        rotation = self.pool.rotation
        return out if rotation is None else rotation.inverse(out, in_place=True)

    def store(self, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        kv = self.layers[layer]
        kv.store(meta.slot_mappings[kv.group], k, v)


BACKENDS: dict[str, type[AttentionBackend]] = {}


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    BACKENDS[cls.name] = cls
    return cls


def create_backend(name: str, pool: "PagedKVPool") -> AttentionBackend:
    from kvserve.attention import cpu_paged, torch_sdpa  # noqa: F401  -- registers the implementations

    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](pool)
