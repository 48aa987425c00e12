"""KV eviction applied to the engine's requests: a request's policy (--kv-compression with its
overrides) and the compaction of its blocks once its prompt is computed (kv/eviction.py chooses
what is kept, the pool moves it). LLMEngine binds these as its methods."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kvserve.engine.sequence import Sequence
from kvserve.kv.eviction import CompressionRegion, EvictionPolicy, sink_and_recent, top_positions
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine


def eviction_policy(engine: LLMEngine, params: SamplingParams) -> EvictionPolicy | None:
    """The engine's --kv-compression with the request's overrides; None when it evicts nothing."""
    policy = engine.config.eviction
    if params.snapkv_query is not None:
        if (params.kv_compression or policy.method) != "snapkv":
            raise ValueError(f"snapkv_query needs kv_compression snapkv (this request's is {params.kv_compression or policy.method})")
        policy = dataclasses.replace(policy, query=params.snapkv_query)
    if params.kv_compression is not None or params.kv_keep_ratio is not None:
        method = params.kv_compression or policy.method
        if method == "none" and params.kv_keep_ratio is not None:
            raise ValueError("kv_keep_ratio needs kv_compression (snapkv, streaming or random): the engine compresses nothing")
        if method != "none" and params.kv_keep_ratio is None and policy.keep_ratio is None and policy.budget is None:
            raise ValueError(f"kv_compression {method} needs kv_keep_ratio (the engine has no --kv-keep-ratio or --kv-budget)")
        ratio, budget = (params.kv_keep_ratio, None) if params.kv_keep_ratio is not None else (policy.keep_ratio, policy.budget)
        policy = dataclasses.replace(policy, method=method, keep_ratio=ratio, budget=budget)
    if not policy.active:
        if params.kv_compress_from is not None:
            raise ValueError("kv_compress_from needs kv_compression (snapkv, streaming or random): the engine compresses nothing")
        return None
    if engine.kv_spec.layer_windows and all(w is not None for w in engine.kv_spec.layer_windows):
        raise ValueError(f"kv_compression {policy.method}: every layer of {engine.config.model} has a sliding window, and "
                         "compression applies to full-attention layers (a sliding window already bounds the others)")  # fmt: skip
    if policy.asks_generic_question and engine.tokenizer is None:
        raise ValueError(f"snapkv_query {policy.query} writes its generic question with the tokenizer, and this engine has "
                         "none (--skip-tokenizer-init, or no tokenizer files beside the weights): use snapkv_query window "
                         "(--snapkv-query window; both is --snapkv-query's default)")  # fmt: skip
    if engine.kv_spec.format.kind == "kivi":
        raise ValueError(f"kv_compression does not work with --kv-cache-dtype {engine.kv_spec.kv_dtype}")
    return policy


def earliest_hit_end(seq: Sequence, region: CompressionRegion | None) -> int | None:
    """Where a hit on a compressing request's prompt may end first (None: any request's default): the
    same prompt asked another question hits up to its own SnapKV window, which may begin a window
    before this one's; a sliding group keeps the blocks such a hit reads."""
    if region is None:
        return None
    return max(region.hit_end - (seq.eviction.window if seq.eviction.scores_window else 0), 0)


def evict(engine: LLMEngine, seq: Sequence) -> None:
    """Compress a prompt computed up to its compression point (its end, or `compress_at`); a
    streaming sequence again each time it holds a block more than its budget."""
    policy, n = seq.eviction, seq.num_computed_tokens
    if engine.pool is None:
        return
    region = seq.compression_region(engine.kv.block_size)  # from region.start on it is compressed; slots before are positions
    if seq.probe is not None:  # the generic question is computed: drop it, compress with its scores
        if n < seq.num_tokens:
            return
        engine.kv.truncate(seq.request_id, seq.probe_from)
        engine.num_probe_tokens += len(seq.probe)
        seq.num_computed_tokens = n = seq.probe_from
        seq.probe = None
    elif not seq.eviction_started:
        if n < seq.compression_point:
            return
        if policy.asks_generic_question and region.compresses(n):
            probe = engine._generic_question[: engine.max_model_len - n]  # its positions stay below max_model_len
            if seq.window_scores is None:  # "both" adds the question's scores to the window's
                seq.window_scores = torch.zeros(engine.kv_spec.num_layers, engine.kv_spec.num_kv_heads, n, device=engine.device)
            if probe:
                seq.probe, seq.probe_from = probe, n
                return
    start = region.start
    held = n - engine.kv.num_evicted(seq.request_id) - start
    kept = policy.tokens_kept(max(n - start, 0))
    scores = None
    if not seq.eviction_started:
        seq.eviction_started = True
        scores, seq.window_scores = seq.window_scores, None
    elif policy.method != "streaming" or held < kept + engine.kv.block_size:
        return
    if kept >= held:
        return
    spec = engine.kv_spec
    if policy.method == "streaming":
        keep = sink_and_recent(held, kept, policy.sinks).expand(spec.num_layers, spec.num_kv_heads, kept)
    else:
        if policy.method == "random":
            draws = torch.Generator().manual_seed(seq.seed % 2**63)
            scores = torch.rand(held, generator=draws).expand(spec.num_layers, spec.num_kv_heads, held)
        else:
            scores = scores[..., start : start + held]
        keep = top_positions(scores[..., :held], kept, policy.window, policy.kernel)
    first = start // engine.kv.block_size
    targets = {}
    for g, group in enumerate(engine.kv.groups):
        if group.window is not None:
            continue  # a sliding window already keeps only the recent tokens; its slots stay positions
        slices = [spec.layer_slots[layer][1] for layer in group.layers]
        targets[g] = engine.kv.compaction_targets(seq.request_id, g, kept, first)
        region = engine.kv.block_table(seq.request_id, g)[first:]
        engine.pool.compact(region, slices, keep[list(group.layers)], [b.block_id for b in targets[g]])
    engine.kv.evict(seq.request_id, n, start + kept, targets, first)
    engine.num_evicted_tokens += held - kept
    engine.num_compactions += 1
