"""What a cache's blocks are keyed by besides their tokens (kv/hashing.py's CacheIdentity): the
checkpoint's content and the settings that change the bits of the K/V, so no block moves between
engines that would compute it differently."""

from __future__ import annotations

from pathlib import Path

from kvserve.cache_dir import file_digest, tree_digest
from kvserve.config import EngineConfig
from kvserve.model.config import ModelConfig


def checkpoint_digests(path: Path) -> tuple[str, str]:
    """(weights, tokenizer) content digests of a GGUF file (both inside it) or an HF directory."""
    if path.is_file():
        digest = file_digest(path)
        return digest, digest
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".json") and not p.name.startswith("tokenizer")]
    tokenizer = [p for p in path.iterdir() if p.name.startswith(("tokenizer", "special_tokens")) or p.suffix in (".model", ".jinja")]
    return tree_digest(weights), tree_digest(tokenizer)


# how the blocks' products took their rows, where not exact
ROWS_NAMES = {"int8": "/int8 rows", "bf16": "/bf16 tiles"}


def identity_fields(config: EngineConfig, model_config: ModelConfig, backend: str, weight_format: str = "float", activations: str = "exact") -> dict:
    """CacheIdentity's fields from the configs and the attention backend (the checkpoint's digests are the rest)."""
    return {
        # GGUF blocks compute in float32 from the exact dequantized values: other K/V than --dtype weights
        "dtype": config.dtype if weight_format == "float" else f"{config.dtype}/weights {weight_format}" + ROWS_NAMES.get(activations, ""),
        "kv_cache_dtype": config.kv_cache_dtype,
        "attention": f"{backend}/block {config.block_size}/hybrid {not config.disable_hybrid_kv_cache_manager}",
        "kv_quantization": f"group {config.kv_quant_group_size}/residual {config.kv_quant_residual}/sink {config.kv_quant_sink_block}"
                           f"/scales {config.kv_cache_scales}"
                           + ("/keys centered" if config.centers_keys else "") + f"/hadamard {config.rotates_kv(model_config.head_dim)}",
    }  # fmt: skip
