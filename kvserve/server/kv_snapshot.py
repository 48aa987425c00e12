"""GET /v1/kv/snapshot: the KV cache as the dashboard draws it, taken on the engine thread between two
steps so every count belongs to one moment.

Each block is in one of four states: free, free but still cached (a prefix hit can revive it),
owned by one request, or shared by several (a prefix or the prompt of n samples). The grid holds at
most MAX_CELLS cells: past that many blocks a cell stands for a run of consecutive blocks and shows
the busiest state among them, while the counts stay exact. No token, prompt or salt is in it.
"""

from __future__ import annotations

import time

import numpy as np

from kvserve.engine.engine import LLMEngine
from kvserve.kv.block_pool import BlockPool

STATES = ("free", "cached", "owned", "shared")
MAX_CELLS = 4096
USAGE_HIGH, USAGE_LOW = 0.9, 0.5
_BLOCK_FIELDS = np.dtype([("ref_count", np.int32), ("cached", np.bool_), ("group", np.int32)])  # the alert rules' lines (deploy/prometheus/kvserve-rules.yml)


def block_states(pool: BlockPool) -> tuple[np.ndarray, np.ndarray]:
    """Each block's state (an index into STATES) and the KV group it was last allocated to."""
    fields = np.fromiter(((b.ref_count, b.block_hash is not None, b.group) for b in pool.blocks), _BLOCK_FIELDS, pool.num_blocks)
    refs = fields["ref_count"]
    states = np.where(refs >= 2, 3, np.where(refs == 1, 2, np.where(fields["cached"], 1, 0))).astype(np.int8)
    return states, fields["group"]


def grid(states: np.ndarray, max_cells: int = MAX_CELLS) -> tuple[str, int]:
    """The states as one digit per cell, and how many blocks a cell stands for (its busiest state)."""
    per_cell = max(1, -(-len(states) // max_cells))
    cells = -(-len(states) // per_cell)
    padded = np.zeros(cells * per_cell, np.int8)
    padded[: len(states)] = states
    busiest = padded.reshape(cells, per_cell).max(axis=1)
    return (busiest + ord("0")).astype(np.uint8).tobytes().decode("ascii"), per_cell


def pool_snapshot(name: str, pool: BlockPool, group_names: list[str]) -> dict:
    states, groups = block_states(pool)
    cells, per_cell = grid(states)
    held = states >= 2
    return {
        "name": name,
        "num_blocks": pool.num_blocks,
        "counts": {state: int((states == i).sum()) for i, state in enumerate(STATES)},
        "groups": [{"group": g, "attention": group_names[g], "owned": int(((groups == g) & (states == 2)).sum()),
                    "shared": int(((groups == g) & (states == 3)).sum())} for g in range(len(group_names))],  # fmt: skip
        "held_blocks": int(held.sum()),
        "blocks_per_cell": per_cell,
        "cells": cells,
    }


def kv_snapshot(engine: LLMEngine, model_name: str) -> dict:
    """Engine thread only (AsyncEngine.call): the pool's blocks do not move while it reads them."""
    started = time.perf_counter()
    kv, spec = engine.kv, engine.kv_spec
    group_names = [g.attention for g in kv.groups]
    pools = [pool_snapshot("pool", kv.pool, group_names)]
    if kv.residual_pool is not None:
        pools.append(pool_snapshot("residual", kv.residual_pool, group_names))
    prefix = engine.prefix_cache_stats()
    tiers = engine.kv.offloader.stats()["kv_tiers"] if engine.kv.offloader is not None else {}
    layers = [len(g.layers) for g in kv.groups]
    return {
        "model": model_name,
        "time": time.time(),
        "states": list(STATES),
        "block_size": spec.block_size,
        "num_blocks": kv.num_blocks,
        "num_free_blocks": kv.num_free_blocks,
        "usage": kv.usage,
        "thresholds": {"high": USAGE_HIGH, "low": USAGE_LOW},
        "requests": {"running": engine.num_running, "waiting": engine.num_waiting},
        "format": spec.kv_dtype,
        "bytes_per_token": spec.bytes_per_token,
        "groups": [{"group": g, "attention": name, "layers": n, "bytes_per_token": spec.bytes_per_token * n / sum(layers)}
                   for g, (name, n) in enumerate(zip(group_names, layers))],  # fmt: skip
        "pools": pools,
        "prefix_cache": {
            "kind": prefix["prefix_cache"],
            "hit_tokens": prefix["prefix_cache_hits_total"],
            "queried_tokens": prefix["prefix_cache_queries_total"],  # kvserve:prefix_cache_hits_total / ..._queries_total
            "hit_rate_tokens": prefix["prefix_cache_hits_total"] / max(prefix["prefix_cache_queries_total"], 1),
            "requests_hit_rate": prefix["prefix_cache_request_hit_rate"],
            "evicted_blocks": prefix["prefix_cache_evictions_total"],
        },
        "tiers": {name: {key: t[key] for key in ("usage_bytes", "capacity_bytes", "hit_tokens") if key in t} for name, t in tiers.items()},
        "snapshot_ms": (time.perf_counter() - started) * 1000,
    }
