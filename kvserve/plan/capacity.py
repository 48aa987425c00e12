"""Capacity arithmetic for `kvserve plan`, built on kv/spec.py (the engine's own byte math)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from kvserve.engine.beam import MAX_BEAM_WIDTH
from kvserve.engine.speculative import MAX_SPECULATIVE_TOKENS
from kvserve.kv.spec import DEFAULT_QUANT_RESIDUAL, GIB, KV_DTYPES, KVCacheSpec, block_size_for
from kvserve.model.config import ModelConfig


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...] = ()
    hybrid: bool = True  # False: --disable-hybrid-kv-cache-manager, every layer holds every block
    residual_dtype: str = "bfloat16"  # int4 / int2: the full-precision residual blocks are in the model's --dtype
    quant_residual: int = DEFAULT_QUANT_RESIDUAL  # int4 / int2: --kv-quant-residual
    sink_block: bool = True  # int4 / int2: --kv-quant-sink-block

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.replace('num_', '').replace('_', '-')} must be positive, got {getattr(self, name)}")

    @staticmethod
    def from_model(config: ModelConfig, hybrid: bool = True, residual_dtype: str = "bfloat16", quant_residual: int = DEFAULT_QUANT_RESIDUAL,
                   sink_block: bool = True) -> "KVShape":  # fmt: skip
        windows = tuple(config.layer_window(i) for i in range(config.num_layers))
        return KVShape(config.num_layers, config.num_kv_heads, config.head_dim, windows if any(windows) else (), hybrid, residual_dtype,
                       quant_residual, sink_block)  # fmt: skip

    def spec(self, kv_dtype: str, block_size: int) -> KVCacheSpec:
        """int4 / int2 take blocks of a multiple of their group size (32), as the engine does."""
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, kv_dtype, block_size_for(kv_dtype, block_size),
                           self.layer_windows, self.hybrid, residual=self.quant_residual, residual_dtype=self.residual_dtype,
                           sink_block=self.sink_block)  # fmt: skip


NO_LIMIT = 1 << 30  # tokens: no model context known
MAX_GIB = 1 << 20  # a memory budget past a pebibyte is a typo


@dataclass(frozen=True)
class Workload:
    seq_lens: tuple[int, ...]
    block_size: int = 16
    shared_prefix_len: int = 0
    shared_prefix_seqs: int = 0
    max_num_batched_tokens: int = 2048  # the engine's prefill chunk: a sliding-window group holds a chunk and its window
    max_model_len: int = NO_LIMIT  # the model's context, when known
    max_num_seqs: int = 64
    num_speculative_tokens: int = 0  # speculative decoding: slots each sequence holds for its guesses during a step
    beam_width: int = 1  # beam search: branches per sequence, sharing their prompt's whole blocks
    output_lens: tuple[int, ...] = ()  # the output part of each sequence (what beams do not share); needed with beam_width > 1

    def __post_init__(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num-speculative-tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] (the engine's "
                             f"limit), got {self.num_speculative_tokens!r}")  # fmt: skip
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam-width must be an integer in [1, {MAX_BEAM_WIDTH}] (the engine's limit), got {self.beam_width!r}")
        if self.beam_width > 1 and self.num_speculative_tokens:
            raise ValueError("beams do not guess: give --beam-width or --num-speculative-tokens, not both")
        if self.beam_width > 1 and len(self.output_lens) != len(self.seq_lens):
            raise ValueError("beam-width counts the blocks beams do not share, their outputs: give --trace (prompt_len, "
                             "output_len per line) or --output-len")  # fmt: skip
        if any(not 0 < o <= n for o, n in zip(self.output_lens, self.seq_lens)):
            raise ValueError("every output length must be positive and at most its sequence's length")
        if not self.seq_lens:
            raise ValueError("seq-lens is empty: give at least one sequence length")
        if any(n <= 0 for n in self.seq_lens):
            raise ValueError(f"seq-lens must be positive, got {list(self.seq_lens)}")
        if self.block_size <= 0:
            raise ValueError(f"block-size must be positive, got {self.block_size}")
        if self.shared_prefix_len < 0 or self.shared_prefix_seqs < 0:
            raise ValueError("shared-prefix-len and shared-prefix-seqs must be >= 0")
        if self.shared_prefix_seqs > len(self.seq_lens):
            raise ValueError(f"shared-prefix-seqs ({self.shared_prefix_seqs}) exceeds the {len(self.seq_lens)} sequences")
        if self.shared_prefix_len > min(self.seq_lens):
            raise ValueError(f"shared-prefix-len ({self.shared_prefix_len}) exceeds the shortest sequence ({min(self.seq_lens)})")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_model_len != NO_LIMIT and max(self.seq_lens) > self.max_model_len:
            raise ValueError(f"the workload's longest sequence ({max(self.seq_lens):,} tokens, of --seq-lens or --trace) is longer "
                             f"than the model's context ({self.max_model_len:,} tokens); the engine refuses it")  # fmt: skip


@dataclass(frozen=True)
class Budget:
    memory_gib: float
    weights_gib: float
    headroom_gib: float

    def __post_init__(self) -> None:
        for name, value in (("memory-gib", self.memory_gib), ("weights-gib", self.weights_gib), ("headroom-gib", self.headroom_gib)):
            if not math.isfinite(value) or value > MAX_GIB:
                raise ValueError(f"{name} must be a finite number of GiB up to {MAX_GIB:,}, got {value}")
        if self.memory_gib <= 0:
            raise ValueError(f"memory-gib must be positive, got {self.memory_gib}")
        if self.weights_gib < 0 or self.headroom_gib < 0:
            raise ValueError("weights-gib and headroom-gib must be >= 0")
        if self.kv_bytes <= 0:
            raise ValueError(
                f"memory-gib {self.memory_gib} leaves nothing for the KV cache after {self.weights_gib:.3f} GiB of weights "
                f"and {self.headroom_gib} GiB of headroom"
            )

    @property
    def kv_bytes(self) -> int:
        return int((self.memory_gib - self.weights_gib - self.headroom_gib) * GIB)


def plan_dtype(shape: KVShape, kv_dtype: str, workload: Workload, budget: Budget | None) -> dict:
    spec = shape.spec(kv_dtype, workload.block_size)
    logical = sum(spec.logical_bytes(n) for n in workload.seq_lens)
    physical = sum(branched_bytes(spec, n, out, workload) for n, out in zip(workload.seq_lens, workload.output_lens or workload.seq_lens))
    # only whole blocks of a shared prefix that full-attention layers keep can be shared; every sharer after the first saves them
    saved = max(workload.shared_prefix_seqs - 1, 0) * spec.shared_prefix_bytes(workload.shared_prefix_len)
    result = {
        "kv_dtype": spec.kv_dtype,
        "bytes_per_token": spec.bytes_per_token,
        "scale_bytes_per_token": spec.scale_bytes_per_token,
        "element_bytes_per_token": spec.bytes_per_token - spec.scale_bytes_per_token,
        "block_size": spec.block_size,
        "bytes_per_block": spec.bytes_per_block,
        "kv_cache_groups": [{"layers": list(g.layers), "attention": g.attention} for g in spec.groups],
        "logical_bytes": logical,
        "physical_bytes": physical,
        "shared_bytes": physical - saved,
        "num_seqs": len(workload.seq_lens),
        "num_tokens": sum(workload.seq_lens),
    }
    if budget is not None:
        result.update(_fit(spec, workload, budget, physical - saved))
    return result


def branched_bytes(spec: KVCacheSpec, num_tokens: int, output_len: int, workload: Workload) -> int:
    """A sequence's blocks with its branches: k guessed slots during a verification step (speculative
    decoding), and beam_width - 1 more beams, each holding all but the prompt's whole blocks (shared)."""
    k, width = workload.num_speculative_tokens, workload.beam_width
    own = spec.physical_bytes(num_tokens + k)
    if width == 1:
        return own
    return own + (width - 1) * (spec.physical_bytes(num_tokens + k) - spec.shared_prefix_bytes(num_tokens - output_len))


def _fit(spec: KVCacheSpec, workload: Workload, budget: Budget, needed: int) -> dict:
    """What the budget holds, and what the workload would need from it."""
    chunk = workload.max_num_batched_tokens
    num_blocks = max(spec.num_blocks_for_memory(budget.kv_bytes), 0)
    # int4 / int2 keep each sequence's recent tokens in full-precision blocks taken from the same pool
    # (physical_bytes counts them between steps); the most they hold at once, every block one:
    residual_blocks = num_blocks // spec.residual_units if spec.residual_units else 0
    residual_bytes = sum(spec.residual_blocks_held(n) for n in workload.seq_lens) * spec.residual_units * spec.bytes_per_block
    mean_physical = statistics.fmean(branched_bytes(spec, n, out, workload)
                                     for n, out in zip(workload.seq_lens, workload.output_lens or workload.seq_lens))  # fmt: skip
    max_seqs = int(num_blocks * spec.bytes_per_block // mean_physical)
    longest = max(workload.seq_lens)
    # between steps every sequence holds its blocks; during a step one of them (at most one prefill
    # chunk per step) also holds a whole chunk and the window before it in each sliding-window group
    extra = max(spec.peak_blocks(n, chunk) - spec.blocks_held(n) for n in set(workload.seq_lens)) * spec.bytes_per_block
    # the engine admits --max-model-len only if its pool holds one sequence of that length at its peak
    longest_blocks = spec.min_blocks(longest, chunk)
    required = max(needed + extra, longest_blocks * spec.bytes_per_block)
    required_memory = budget.weights_gib + budget.headroom_gib + required / GIB
    result = {
        "kv_budget_bytes": budget.kv_bytes,
        "num_blocks": int(num_blocks),
        "residual_blocks": residual_blocks,
        "residual_bytes": residual_bytes,
        # the longest sequence the engine admits from this budget: its default --max-model-len
        "max_admitted_len": spec.max_tokens(int(num_blocks), chunk, workload.max_model_len),
        "max_concurrent_seqs": max_seqs,
        "fits": required <= budget.kv_bytes,
        "required_kv_bytes": required,
        "required_memory_gib": math.ceil(round(required_memory * 1000, 6)) / 1000,  # rounded up: enough, never short
        "recommended": None,
    }
    if longest_blocks <= num_blocks:
        # max_seqs counts sequences of the mean size without prefix sharing; a workload that fits runs whole
        all_at_once = len(workload.seq_lens) if result["fits"] else 1
        max_num_seqs = max(max_seqs, all_at_once)
        result["recommended"] = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": chunk,
            "kv_cache_memory": round(budget.kv_bytes / GIB, 3),
            "max_model_len": longest,
        }
    return result


def tier_tokens(spec: KVCacheSpec, tier_bytes: float, host: bool) -> int:
    """Tokens a KV tier of tier_bytes holds: every layer's K/V of a token (a block of each group per
    block_size tokens, sliding-window groups' included: they go down too), and each record's header,
    token ids and checksum, plus the host tier's index entry (kv/tiers/)."""
    from kvserve.kv.tiers.host import ENTRY_OVERHEAD
    from kvserve.kv.tiers.record import record_overhead

    per_record = record_overhead(spec.block_size) + (ENTRY_OVERHEAD + 40 if host else 0)
    per_token = spec.bytes_per_token + len(spec.groups) * per_record / spec.block_size
    return int(tier_bytes // per_token)


def plan(shape: KVShape, kv_dtype: str, workload: Workload, budget: Budget | None) -> dict:
    """The chosen dtype's plan at the top level, and every dtype side by side under by_dtype."""
    main = plan_dtype(shape, kv_dtype, workload, budget)
    main["shape"] = {
        "layers": shape.num_layers,
        "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "sliding_layers": sum(1 for w in shape.layer_windows if w is not None),
        "block_size": main["block_size"],
        "kv_quant_residual": shape.quant_residual,
        "kv_quant_sink_block": shape.sink_block,
    }
    main["by_dtype"] = {name: plan_dtype(shape, name, workload, budget) for name in KV_DTYPES}
    return main


def model_weight_bytes(config: ModelConfig, bytes_per_param: float) -> int:
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_layers
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 4 * h
    params = config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + layers * per_layer + h
    return int(params * bytes_per_param)
