"""SnapKV's scores: the attention a sequence's last prompt queries pay each cached key.

Only the window's queries are scored (a [window, keys] matrix per head, never prompt x prompt).
A window can span prefill chunks: each chunk adds the scores of its own window queries, read
against every key cached up to it, so the sum is the same however the prompt was cut. On a CPU with
AVX-512 the native kernel (kernels/window_scores.cpp) adds the rows one after another, so it is
the same to the bit.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.kernels import args
from kvserve.kernels.build import load_kernels
from kvserve.kernels.library import _DTYPE_CODES, _check, _require


def window_attention(q: torch.Tensor, keys: torch.Tensor, first_slot: int, scale: float, weighted_from: int = 0,
                     weight: float = 1.0) -> torch.Tensor:  # fmt: skip
    """q [w, H, D] at slots first_slot.. ; keys [L, KVH, D] of slots 0..L-1. Each query's softmax over
    the keys it sees (causally), summed over the queries and the query heads of each KV head: [KVH, L];
    the queries from `weighted_from` on count `weight`."""
    w, heads, dim = q.shape
    length, kv_heads, _ = keys.shape
    group = heads // kv_heads
    # one batched product per KV head: its query heads' rows (query-major) against its keys
    queries = q.float().view(w, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, w * group, dim)
    logits = torch.bmm(queries, keys.float().permute(1, 2, 0)).mul_(scale).view(kv_heads, w, group, length)
    first_hidden = first_slot + 1  # query i sees slots 0 .. first_slot + i: only the last columns hide any
    if first_hidden < length:
        columns = torch.arange(first_hidden, length, device=q.device)
        hidden = columns[None, :] > torch.arange(first_slot, first_slot + w, device=q.device)[:, None]  # [w, columns]
        logits[..., first_hidden:].masked_fill_(hidden[None, :, None, :], float("-inf"))
    probs = logits.softmax(-1).view(kv_heads, w * group, length)
    row_weights = torch.ones(w, device=q.device)
    row_weights[min(weighted_from, w) :] = weight
    return torch.matmul(row_weights.repeat_interleave(group), probs)  # the weighted sum over queries and query heads


@functools.cache
def native_window_scores() -> bool:
    """Whether this CPU's kernels have the window-score kernel (AVX-512)."""
    library = load_kernels()
    return library is not None and bool(library.kvserve_window_scores_available())


def add_window_scores(out: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, first_slot: int, scale: float, weighted_from: int = 0,
                      weight: float = 1.0) -> None:  # fmt: skip
    """out [KVH, columns] (float32, unit inner stride) += window_attention(q, keys, ...)[:, :columns]:
    the native kernel on CPU tensors where the CPU has AVX-512, torch elsewhere."""
    columns = out.shape[1]
    native = (out.is_cpu and q.is_cpu and keys.is_cpu and out.dtype == torch.float32 and out.stride(1) == 1 and q.dtype in _DTYPE_CODES
              and keys.dtype in _DTYPE_CODES and q.stride(2) == 1 and q.stride(1) == q.shape[2] and keys.is_contiguous()
              and native_window_scores())  # fmt: skip
    if not native:
        out.add_(window_attention(q, keys, first_slot, scale, weighted_from, weight)[:, :columns])
        return
    w, heads, dim = q.shape
    call = args.WindowScoresArgs(out.data_ptr(), q.data_ptr(), keys.data_ptr(), out.stride(0), q.stride(0) if w > 1 else heads * dim,
                                 keys.shape[0], first_slot, columns, scale, weight, min(weighted_from, w), w, heads, keys.shape[1], dim,
                                 _DTYPE_CODES[q.dtype], _DTYPE_CODES[keys.dtype])  # fmt: skip
    _check(_require().kvserve_window_scores(ctypes.byref(call)), "window_scores")
