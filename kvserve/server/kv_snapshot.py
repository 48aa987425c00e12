"""GET /v1/kv/snapshot: the KV cache as the dashboard draws it, taken on the engine thread between two
steps so every count belongs to one moment.

Each block is in one of four states: free, free but still cached (a prefix hit can revive it),
owned by one request, or shared by several (a prefix or the prompt of n samples). The grid holds at
most MAX_CELLS cells: past that many blocks a cell stands for a run of consecutive blocks and shows
the busiest state among them, while the counts stay exact. Beside the grid: the prefix tree with
each block's reuse (prefix_tree.py), reuse per cache salt (named by a digest, never the salt), and
what each KV tier holds. No token text unless the server runs with --dashboard-show-tokens.
"""

from __future__ import annotations

import time
from operator import attrgetter

import numpy as np

from kvserve.engine.engine import LLMEngine
from kvserve.engine.engine_stats import adapter_reuse
from kvserve.kv.arena import QuantizedBlocks, ResidualBlocks
from kvserve.kv.block_pool import BlockPool
from kvserve.server.prefix_tree import prefix_tree, tree_group

STATES = ("free", "cached", "owned", "shared")
MAX_CELLS = 4096
MAX_SALT_ROWS = 32
USAGE_HIGH, USAGE_LOW = 0.9, 0.5  # the alert rules' lines (deploy/prometheus/kvserve-rules.yml)
_REF_COUNT, _HASH = attrgetter("ref_count"), attrgetter("block_hash")


def block_states(pool: BlockPool | QuantizedBlocks | ResidualBlocks) -> np.ndarray:
    """Each block's state, an index into STATES. A KIVI cache's quantized blocks under a full-precision
    block (kv/arena.py) take that block's state: its bytes are theirs."""
    blocks, n = pool.blocks, pool.num_blocks
    refs = np.fromiter(map(_REF_COUNT, blocks), np.int32, n)  # one C-level pass per field: ~10 ms per 100K blocks
    cached = np.fromiter(map(_HASH, blocks), object, n) != None  # noqa: E711 (elementwise)
    states = np.where(refs >= 2, 3, np.where(refs == 1, 2, np.where(cached, 1, 0))).astype(np.int8)
    if isinstance(pool, ResidualBlocks):  # a chunk holding quantized blocks is not free for a full-precision one
        states[(states == 0) & np.asarray(pool.arena.chunks_in_use()[: len(states)], bool)] = 2
    if isinstance(pool, QuantizedBlocks):
        arena = pool.arena
        chunks = arena.full_precision_chunks()
        if chunks:
            residual = block_states(arena.residual)[chunks]
            units = np.asarray(chunks)[:, None] * arena.residual_units + np.arange(arena.residual_units)
            states[units] = residual[:, None]
    return states


def grid(states: np.ndarray, max_cells: int = MAX_CELLS) -> tuple[str, int]:
    """The states as one digit per cell, and how many blocks a cell stands for (its busiest state)."""
    per_cell = max(1, -(-len(states) // max_cells))
    cells = -(-len(states) // per_cell)
    padded = np.zeros(cells * per_cell, np.int8)
    padded[: len(states)] = states
    busiest = padded.reshape(cells, per_cell).max(axis=1)
    return (busiest + ord("0")).astype(np.uint8).tobytes().decode("ascii"), per_cell


def pool_snapshot(name: str, pool: BlockPool, group_names: list[str]) -> dict:
    states = block_states(pool)
    cells, per_cell = grid(states)
    held = states >= 2
    # held blocks per group are counted by the pool; only the shared ones (usually few) are looked up
    shared = np.bincount([pool.blocks[i].group for i in np.flatnonzero(states == 3)], minlength=len(group_names))
    groups = []
    for g, attention in enumerate(group_names):
        groups.append({"group": g, "attention": attention, "owned": pool.num_used_blocks(g) - int(shared[g]), "shared": int(shared[g])})
    return {
        "name": name,
        "num_blocks": pool.num_blocks,
        "counts": {state: int((states == i).sum()) for i, state in enumerate(STATES)},
        "groups": groups,
        "held_blocks": int(held.sum()),
        "blocks_per_cell": per_cell,
        "cells": cells,
    }


def salt_rows(engine: LLMEngine) -> list[dict]:
    """The salts whose requests looked up the most tokens, busiest first."""
    salts = engine.kv.prefix_stats.salts
    top = sorted(salts.items(), key=lambda item: -item[1].queries)[:MAX_SALT_ROWS]
    return [{"salt": label, "requests": r.requests, "queried_tokens": r.queries, "hit_tokens": r.hits,
             "hit_rate_tokens": r.hits / max(r.queries, 1)} for label, r in top]  # fmt: skip


def kv_snapshot(engine: LLMEngine, model_name: str, show_tokens: bool = False) -> dict:
    """Engine thread only (AsyncEngine.call): the pool's blocks do not move while it reads them."""
    started = time.perf_counter()
    kv, spec = engine.kv, engine.kv_spec
    group_names = [g.attention for g in kv.groups]
    pools = [pool_snapshot("pool", kv.pool, group_names)]
    if kv.residual_pool is not None:
        pools.append(pool_snapshot("residual", kv.residual_pool, group_names))
    prefix = engine.prefix_cache_stats()
    offloader = engine.kv.offloader
    tiers = offloader.stats()["kv_tiers"] if offloader is not None else {}
    tree = None
    if kv.prefix_cache is not None:
        decode = engine.tokenizer.decode if show_tokens and engine.tokenizer is not None else None
        group = tree_group([spec.window for spec in kv.prefix_cache.groups])
        tree = prefix_tree(kv.prefix_cache, group, kv.prefix_stats, offloader.local if offloader is not None else (), decode)
    layers = [len(g.layers) for g in kv.groups]
    return {
        "model": model_name,
        "time": time.time(),
        "states": list(STATES),
        "block_size": spec.block_size,
        "num_blocks": kv.num_blocks,
        "num_free_blocks": kv.num_free_blocks,
        "usage": kv.usage,
        "conversations": {"pinned_blocks": kv.pins.num_blocks if kv.pins is not None else 0,
                          "pinned": len(kv.pins) if kv.pins is not None else 0,
                          "max_blocks": kv.pins.max_blocks if kv.pins is not None else 0},  # fmt: skip
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
        "speculative": _speculative(engine),
        "prefix_tree": tree,
        "salts": salt_rows(engine),
        "lora_adapters": adapter_reuse(engine),
        "tiers": {name: {key: t[key] for key in ("usage_bytes", "capacity_bytes", "entries", "hit_tokens") if key in t}
                  for name, t in tiers.items()},  # fmt: skip
        "show_tokens": show_tokens,
        "snapshot_ms": (time.perf_counter() - started) * 1000,
    }


def _speculative(engine: LLMEngine) -> dict | None:
    """Speculative decoding's method and how many of its guesses were kept (None without it)."""
    if engine.speculator is None:
        return None
    stats = engine.speculator.stats
    return {"method": engine.speculator.config.method, "num_speculative_tokens": engine.speculator.config.num_speculative_tokens,
            "draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.as_dict()["spec_decode_acceptance_rate"]}  # fmt: skip
