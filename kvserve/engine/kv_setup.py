"""What the engine derives from its configs before it builds anything: the attention backend, the
KV layout and its fp8 scales, the pool's size and the longest sequence, with the refusals of those
that cannot work. From configs alone, so `kvserve eval` checks every configuration without an engine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvserve.kernels import library
from kvserve.config import EngineConfig
from kvserve.device_memory import device_memory_bytes
from kvserve.kv.spec import GIB, KVCacheSpec
from kvserve.model.config import ModelConfig


def resolve_attention_backend(requested: str, device: torch.device, kv_dtype: torch.dtype) -> str:
    """`--attention-backend auto` takes the native paged kernel wherever it runs (CPU, a compiler present)."""
    native = library.supports(device, kv_dtype)
    if requested == "cpu_paged" and not native:
        raise ValueError("attention_backend 'cpu_paged' needs a CPU device, a C++ compiler and a float KV cache; use 'torch_sdpa'")
    if requested == "auto":
        return "cpu_paged" if native else "torch_sdpa"
    return requested


def kv_cache_spec(config: EngineConfig, model_config: ModelConfig) -> KVCacheSpec:
    """The engine's KV layout for a model: what the planner computes with, too."""
    windows = tuple(model_config.layer_window(i) for i in range(model_config.num_layers))
    return KVCacheSpec(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        kv_dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        layer_windows=windows if any(w is not None for w in windows) else (),
        hybrid=not config.disable_hybrid_kv_cache_manager,
        group_size=config.kv_quant_group_size,
        residual=config.kv_quant_residual,
        residual_dtype=config.dtype,
        sink_block=config.kv_quant_sink_block,
    )


KV_SCALE_RANGE = (1e-6, 1e6)  # an fp8 scale outside it turns every value into 0 or into the format's largest


def kv_scales(config: EngineConfig, spec: KVCacheSpec) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Calibrated fp8 scales, (K, V) per layer of [kv_heads], from the JSON file --kv-cache-scales."""
    if config.kv_cache_scales is None:
        return None
    path = Path(config.kv_cache_scales)
    shape = f"k_scale and v_scale, each {spec.num_layers} layers x {spec.num_kv_heads} heads of positive numbers"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--kv-cache-scales {path}: {exc} (a JSON file of {shape})") from None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(name), list) for name in ("k_scale", "v_scale")):
        raise ValueError(f"--kv-cache-scales {path}: expected an object with {shape}")

    def rows(name: str) -> list[torch.Tensor]:
        layers = raw[name]
        ok = len(layers) == spec.num_layers and all(
            isinstance(row, list) and len(row) == spec.num_kv_heads
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row) for row in layers
        )  # fmt: skip
        if not ok:
            raise ValueError(f"--kv-cache-scales {path}: {name} must be {spec.num_layers} layers x {spec.num_kv_heads} heads of numbers")
        return [torch.tensor(row, dtype=torch.float32) for row in layers]

    pairs = list(zip(rows("k_scale"), rows("v_scale")))
    low, high = KV_SCALE_RANGE
    if any(not bool(torch.all((t >= low) & (t <= high))) for pair in pairs for t in pair):
        raise ValueError(f"--kv-cache-scales {path}: scales must be finite numbers in [{low:g}, {high:g}]")
    return pairs


def kv_asked(config: EngineConfig) -> str:
    """The flag that sized the pool, as errors name it."""
    return f"num_kv_blocks={config.num_kv_blocks}" if config.num_kv_blocks else f"kv_cache_memory={config.kv_cache_memory:g} GiB"


def kv_capacity(config: EngineConfig, model_config: ModelConfig, spec: KVCacheSpec) -> tuple[int, int]:
    """(blocks in the pool, longest sequence): the engine's refusals of a pool and lengths that
    cannot work, from configs alone (`kvserve eval` checks every configuration before running one)."""
    device = torch.device(config.device)
    flag = "num_kv_blocks" if config.num_kv_blocks else "kv_cache_memory"
    num_blocks = config.num_kv_blocks or spec.num_blocks_for_memory(config.kv_cache_memory * GIB)
    if num_blocks <= 0:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} GiB holds no block of {spec.bytes_per_block} bytes")
    available = device_memory_bytes(device)
    if available is not None and num_blocks * spec.bytes_per_block > available:
        raise ValueError(f"{kv_asked(config)} is more than this {device.type} device gives this process in all ({available / GIB:.1f} GiB); "
                         "`kvserve plan` says what fits beside the weights")  # fmt: skip
    limit = model_config.max_position_embeddings
    capacity = spec.max_tokens(num_blocks, config.max_num_batched_tokens, limit)
    max_model_len = capacity if config.max_model_len is None else config.max_model_len
    if config.max_model_len is not None:
        if max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length {limit}")
        if max_model_len > capacity:
            raise ValueError(f"max_model_len={max_model_len} exceeds the KV cache capacity of {capacity} tokens for one sequence "
                             f"({num_blocks} blocks); raise {flag} or lower max_model_len")  # fmt: skip
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 (a prompt token and a generated one), got {max_model_len}")
    if max_model_len < 2:
        raise ValueError(f"the KV cache ({num_blocks} blocks) cannot hold a sequence of two tokens; raise {flag}")
    return num_blocks, max_model_len
