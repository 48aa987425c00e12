"""Architecture description of a decoder-only model, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (default, linear, llama3)")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")

    @staticmethod
    def from_hf(params: dict[str, Any] | None, theta: float) -> "RopeConfig":
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        return RopeConfig(
            theta=float(params.get("rope_theta", theta)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    local_rope: RopeConfig | None = None  # rope of sliding layers where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("sliding-attention layers need a sliding_window")

    @property
    def is_gemma(self) -> bool:
        return self.architecture == "gemma3"

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("qwen3", "gemma3")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.layer_types[layer] == SLIDING_ATTENTION and self.local_rope is not None:
            return self.local_rope
        return self.rope

    # ------------------------------------------------------------------ HF config.json
    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(_HF_MODEL_TYPES))}"
            )
        if "text_config" in cfg and model_type == "gemma3":
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        arch = _HF_MODEL_TYPES[model_type]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        num_layers = cfg["num_hidden_layers"]
        rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(cfg.get("rope_theta", 10000.0 if arch != "gemma3" else 1_000_000.0))
        local_rope = None
        sliding_window = None
        if arch == "gemma3":
            if "full_attention" in rope_params:
                rope = RopeConfig.from_hf(rope_params["full_attention"], theta)
                local_rope = RopeConfig.from_hf(rope_params.get("sliding_attention"), 10000.0)
            else:
                rope = RopeConfig.from_hf(rope_params, theta)
                local_rope = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
            sliding_window = cfg.get("sliding_window")
            layer_types = cfg.get("layer_types") or [
                SLIDING_ATTENTION if (i + 1) % cfg.get("sliding_window_pattern", 6) else FULL_ATTENTION
                for i in range(num_layers)
            ]
        else:
            rope = RopeConfig.from_hf(rope_params, theta)
            if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
                raise ValueError("sliding-window Qwen/Llama checkpoints are not supported yet")
            layer_types = [FULL_ATTENTION] * num_layers
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope=rope,
            local_rope=local_rope,
            layer_types=tuple(layer_types),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            sliding_window=sliding_window,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @staticmethod
    def from_hf_file(path: str | Path) -> "ModelConfig":
        from kvserve.model.errors import ModelLoadError, describe

        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ModelLoadError(path, "no such file (a model directory needs its config.json)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(path, f"not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(path, f"not a JSON object but {type(raw).__name__}")
        try:
            return ModelConfig.from_hf_dict(raw)
        except KeyError as exc:
            raise ModelLoadError(path, f"lacks the key {exc.args[0]!r}") from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(path, describe(exc) if not isinstance(exc, ValueError) else str(exc)) from None

    # ------------------------------------------------------------------ GGUF metadata
    @staticmethod
    def from_gguf_metadata(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        head_dim = int(key("attention.key_length", hidden // num_heads))
        num_layers = int(key("block_count"))
        kv_heads = key("attention.head_count_kv", num_heads)
        vocab = tensor_shapes["token_embd.weight"][0]
        theta = float(key("rope.freq_base", 10000.0))
        scaling_type = key("rope.scaling.type")
        rope = RopeConfig(theta=theta)
        if scaling_type == "linear":
            rope = RopeConfig(theta=theta, rope_type="linear", factor=float(key("rope.scaling.factor", 1.0)))
        local_rope = None
        sliding_window = None
        layer_types = [FULL_ATTENTION] * num_layers
        if arch == "gemma3":
            sliding_window = int(key("attention.sliding_window", 4096))
            # llama.cpp's gemma3 graph: every sixth layer is global, local layers use theta 10k
            layer_types = [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(num_layers)]
            local_rope = RopeConfig(theta=10000.0)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(key("context_length", 4096)),
            rope=rope,
            local_rope=local_rope,
            layer_types=tuple(layer_types),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            sliding_window=sliding_window,
            query_pre_attn_scalar=float(head_dim) if arch == "gemma3" else None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )
