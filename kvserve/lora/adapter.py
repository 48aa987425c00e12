"""A PEFT LoRA adapter read from its directory and checked against the base model.

adapter_config.json says the rank r, lora_alpha, use_rslora and the target modules; the weights are
lora_A [r, in] and lora_B [out, r] per targeted projection in adapter_model.safetensors. A row's
projection becomes W x + (B A x) * scaling, scaling = alpha / r (alpha / sqrt(r) with rslora), as
peft computes it. What this engine cannot serve exactly is refused with the file and the reason:
modules_to_save (whole modules replaced), DoRA, fan_in_fan_out weights, trained biases, per-module
rank or alpha patterns, an unknown module, a shape the base does not have, a rank over the limit.

The identity, a SHA-256 of the config fields that change the result and of every tensor's name,
shape, dtype and bytes, keys the adapter's K/V in the prefix cache: two adapters under one name,
or one adapter under two names, are told apart by their contents.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.model.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_ALPHA = 1e6
# config fields that change what an adapter computes beyond W x + (B A x) * scaling: set, they are refused
UNSERVED = {
    "modules_to_save": "replaces whole modules", "rank_pattern": "gives modules their own ranks",
    "alpha_pattern": "gives modules their own alphas", "layers_to_transform": "adapts some layers only",
    "layers_pattern": "adapts some layers only", "use_dora": "(DoRA) rescales the weights",
    "fan_in_fan_out": "stores the weights transposed", "alora_invocation_tokens": "(activated LoRA) starts at invocation tokens",
    "layer_replication": "repeats layers", "trainable_token_indices": "trains embedding rows",
    "use_qalora": "pools the inputs (QA-LoRA)", "lora_bias": "trains a bias beside lora_B", "target_parameters": "adapts parameters",
    "megatron_config": "shards the weights", "arrow_config": "routes among several adapters (Arrow)",
    "use_bdlora": "splits the weights into blocks (BD-LoRA)", "velora_config": "compresses the activations (VeLoRA)",
    "monteclora_config": "samples the weights (MonteCLoRA)", "kasa_config": "adds a singular-value term (KaSA)",
    "mica": "adds a term of its own (MiCA)",
}  # fmt: skip
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
          "down_proj": "mlp"}  # fmt: skip
MAX_WEIGHT = 1e4  # larger adapter values are no trained LoRA: they overflow the activations' dtype
MAX_PATTERN_CHARS = 1000
_SPECIAL_ROOTS = ("/proc/", "/sys/", "/dev/")


class AdapterError(ValueError):
    """An adapter that cannot be served, naming the file and what is wrong."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"LoRA adapter {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass
class LoRAAdapter:
    path: Path
    rank: int
    scaling: float
    identity: str  # hex SHA-256 of what the adapter computes
    # (layer, module) -> (A [r, in], B [out, r]) in float32 as read
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """[out, in] of a base projection."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h), "up_proj": (i, h),
            "down_proj": (h, i)}[module]  # fmt: skip


def adapter_bytes(config: ModelConfig, rank: int, element_bytes: int, modules: tuple[str, ...] = TARGETS) -> int:
    """The bytes an adapter of this rank on these projections holds resident (kvserve/lora/rows.py:
    lora_A [r, in] and lora_B [out, r] of each, in the activations' dtype), per the planner too."""
    return config.num_layers * sum(rank * sum(module_shape(config, m)) for m in modules) * element_bytes


def check_file(file: Path, where: Path) -> int:
    """A regular file's size; AdapterError for a missing one, a directory, a FIFO, a device or a
    kernel file (/proc, /sys, /dev: they can block a reader forever), or an empty one."""
    if not file.exists():
        if file.is_symlink():
            raise AdapterError(file, "a symbolic link to nothing")
        raise AdapterError(where, f"{file.name} is missing (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    real = os.path.realpath(file)
    if not file.is_file() or real.startswith(_SPECIAL_ROOTS):
        raise AdapterError(file, "not a regular file" + (f" (it is {real})" if real != str(file) else ""))
    size = file.stat().st_size
    if size == 0:
        raise AdapterError(file, "empty")
    return size


def read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if check_file(file, path) > MAX_CONFIG_BYTES:
        raise AdapterError(file, f"larger than {MAX_CONFIG_BYTES} bytes")
    try:
        with open(file, "rb") as handle:
            text = handle.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise AdapterError(file, f"larger than {MAX_CONFIG_BYTES} bytes")
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise AdapterError(file, f"not valid JSON ({str(exc)[:200] or type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise AdapterError(file, "not a JSON object")
    return config


def check_config(file: Path, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a config this engine serves exactly; AdapterError otherwise."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(file, f"peft_type {kind!r}: only LORA adapters are served")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(file, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(file, f"rank {rank} is over --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or abs(alpha) > MAX_ALPHA:
        raise AdapterError(file, f"lora_alpha must be a number of magnitude at most {MAX_ALPHA:g}, got {alpha!r}")
    for name, why in UNSERVED.items():
        if config.get(name) not in (None, False, [], {}):
            raise AdapterError(file, f"{name} {why}, which kvserve does not serve")
    if config.get("bias", "none") != "none":
        raise AdapterError(file, f"bias {config.get('bias')!r}: adapters with trained biases are not served")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise AdapterError(file, f"target_modules must name projections among {', '.join(TARGETS)}, got {targets!r}")
    if isinstance(targets, list):
        unknown = sorted({n.rsplit(".", 1)[-1] for n in names} - set(TARGETS))
        if unknown:
            raise AdapterError(file, f"target module(s) {', '.join(unknown)} unknown; kvserve adapts {', '.join(TARGETS)}")
    for name in ("target_modules", "exclude_modules"):
        value = config.get(name)
        if isinstance(value, str) and value != "all-linear":
            if len(value) > MAX_PATTERN_CHARS:
                raise AdapterError(file, f"{name} is a pattern of more than {MAX_PATTERN_CHARS} characters")
            try:
                re.compile(value)
            except re.error as exc:
                raise AdapterError(file, f"{name} {reprlib.repr(value)} is not a valid regular expression ({exc})") from None
        elif value is not None and not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise AdapterError(file, f"{name} must be a list of module names or a regular expression, got {reprlib.repr(value)}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _matches(rule, key: str) -> bool:
    """peft's rule: a pattern string matches the whole module name, a list entry its name or a dotted suffix of it."""
    if rule is None:
        return False
    if isinstance(rule, str):
        return rule == "all-linear" or re.fullmatch(rule, key) is not None
    return any(key == name or key.endswith("." + name) for name in rule)


def targets(config: dict, layer: int, module: str) -> bool:
    """Whether peft puts a LoRA on this projection under this config."""
    key = f"model.layers.{layer}.{_BLOCK[module]}.{module}"
    return _matches(config.get("target_modules"), key) and not _matches(config.get("exclude_modules"), key)


def load_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check an adapter directory against the base model's shapes."""
    if not isinstance(path, (str, Path)):
        raise AdapterError(Path(str(path)), "the path must be a string")
    if str(path).startswith(("http://", "https://", "hf://")):
        raise AdapterError(Path(str(path)), "a URL: adapters are read from a local directory (nothing is downloaded)")
    path = Path(path)
    try:
        if not path.exists():
            raise AdapterError(path, "does not exist (adapters are read from a local directory; hub ids are not downloaded)")
        if not path.is_dir():
            raise AdapterError(path, "not a directory (a PEFT adapter directory holds adapter_config.json and adapter_model.safetensors)")
        return _load(path, model, max_rank)
    except OSError as exc:
        raise AdapterError(path, f"cannot be read ({exc.strerror or type(exc).__name__})") from None


def _load(path: Path, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    from safetensors import SafetensorError, safe_open

    config = read_config(path)
    rank, scaling = check_config(path / CONFIG_FILE, config, max_rank)
    file = path / WEIGHTS_FILE
    check_file(file, path)
    digest = hashlib.sha256(json.dumps({"rank": rank, "scaling": scaling}, sort_keys=True).encode())
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt") as tensors:
            for key in sorted(tensors.keys()):
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(file, f"tensor {key!r} is no lora_A / lora_B weight of {', '.join(TARGETS)} in a decoder layer")
                layer, block, module, which = int(match[1]), match[2], match[3], match[4]
                if module not in TARGETS:
                    raise AdapterError(file, f"tensor {key!r}: module {module!r} unknown; kvserve adapts {', '.join(TARGETS)}")
                if block != _BLOCK[module]:
                    raise AdapterError(file, f"tensor {key!r}: {module} is a projection of {_BLOCK[module]}, not of {block}")
                if not 0 <= layer < model.num_layers:
                    raise AdapterError(file, f"tensor {key!r}: layer {layer}, the base model has {model.num_layers}")
                if not targets(config, layer, module):
                    raise AdapterError(file, f"tensor {key!r}: its module is not one the config adapts (target_modules "
                                       f"{reprlib.repr(config.get('target_modules'))}, exclude_modules "
                                       f"{reprlib.repr(config.get('exclude_modules'))}); peft would not apply it")  # fmt: skip
                tensor = tensors.get_tensor(key)
                if not tensor.is_floating_point():
                    raise AdapterError(file, f"tensor {key!r} holds {tensor.dtype}, not floats")
                out, inner = module_shape(model, module)
                want = (rank, inner) if which == "A" else (out, rank)
                if tuple(tensor.shape) != want:
                    raise AdapterError(file, f"tensor {key!r} has shape {tuple(tensor.shape)}; rank {rank} on this base model needs {want}")
                tensor = tensor.float()
                if not bool(torch.isfinite(tensor).all()):
                    raise AdapterError(file, f"tensor {key!r} holds NaN or infinity")
                if tensor.numel() and float(tensor.abs().max()) > MAX_WEIGHT:
                    raise AdapterError(file, f"tensor {key!r} holds values of magnitude {float(tensor.abs().max()):.3g}, over {MAX_WEIGHT:g}: "
                                       "no trained LoRA weight is that large, and its products would overflow")  # fmt: skip
                digest.update(f"{layer}.{module}.{which}".encode())
                digest.update(tensor.contiguous().numpy().tobytes())
                pieces.setdefault((layer, module), {})[which] = tensor
    except SafetensorError as exc:
        raise AdapterError(file, f"not a readable safetensors file ({exc})") from None
    weights = {}
    for (layer, module), parts in pieces.items():
        if set(parts) != {"A", "B"}:
            raise AdapterError(file, f"layer {layer} {module} has lora_{''.join(parts)} without lora_{'B' if 'A' in parts else 'A'}")
        weights[(layer, module)] = (parts["A"], parts["B"])
    if not weights:
        raise AdapterError(file, "holds no LoRA weights")
    return LoRAAdapter(path, rank, scaling, digest.hexdigest(), weights)
