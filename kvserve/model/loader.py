"""Load weights from an HF directory (safetensors) or a GGUF file into CausalLM.

A GGUF file's quantized projections, embedding and lm_head are kept in their blocks (one copy, the
file's bytes; kernels/gguf_matmul.cpp computes on them) under `--weight-dtype gguf`, the default
for GGUF files where the CPU kernels run. Under `--weight-dtype float32|bfloat16` its tensors are
dequantized with the `gguf` package's codecs once and cached on disk as safetensors under the
file's hash, so the second start only maps the cached file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kvserve.kernels import library
from kvserve.kernels.gguf import GGUF_BLOCKS, GgufWeight, gguf_dequantize, gguf_int8_available, gguf_tiles_available, gguf_weight
from kvserve.cache_dir import cache_root, file_digest, replaced_atomically
from kvserve.model.config import ModelConfig, RopeConfig
from kvserve.model.errors import ModelLoadError, describe
from kvserve.model.layers import GgufEmbedding
from kvserve.model.transformer import CausalLM

log = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_to_hf_name(name: str, architecture: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    table = _GGUF_GEMMA_LAYER_NAMES if architecture == "gemma3" else _GGUF_LAYER_NAMES
    if not match or match.group(2) not in table:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{match.group(1)}.{table[match.group(2)]}.{kind}"


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows for llama-architecture GGUF files."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# --------------------------------------------------------------------------- GGUF
class _TruncatedGGUF(Exception):
    def __init__(self, end: int) -> None:
        self.end = end


def _checked_reader(path: Path):
    """GGUFReader that, before viewing the tensors, checks the file holds the bytes they need (the
    reader itself fails inside numpy with a message about dtypes when it does not)."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class Reader(GGUFReader):
        def _build_tensors(self, start_offs, fields) -> None:
            end = 0
            for field in fields:
                _, _, _, dims, raw_dtype, offset = field.parts
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                end = max(end, int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block_size)
            if end > len(self.data):
                raise _TruncatedGGUF(end)
            super()._build_tensors(start_offs, fields)

    return Reader(path)


def open_gguf(path: Path):
    """A GGUFReader over the file, or ModelLoadError saying what is wrong with it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(path, f"not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = _checked_reader(path)
    except _TruncatedGGUF as exc:
        raise ModelLoadError(path, f"truncated GGUF file: its tensors end at byte {exc.end:,} but the file has {size:,} bytes") from None
    except Exception as exc:  # noqa: BLE001 - whatever the reader trips on, the header is short or garbled
        # what the reader tripped on is numpy's business (dtypes, buffer sizes), not the user's: debug log only
        log.debug("GGUF header of %s: %s", path, describe(exc))
        raise ModelLoadError(path, f"truncated or corrupt GGUF file ({size:,} bytes): its header (metadata and tensor "
                             "list) cannot be read; download the file again") from None  # fmt: skip
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(path, f"truncated GGUF file: its tensors end at byte {end:,} but the file has {size:,} bytes")
    return reader


def _dequantize_gguf(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    reader = open_gguf(path)
    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", leave=False):
        state.update(_dequantize_tensor(path, tensor, gguf_to_hf_name(tensor.name, config.architecture), config))
    return state


def _dequantize_tensor(path: Path, tensor, name: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """{name: the tensor as float32}, in HF's conventions."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)
        return {name: _hf_conventions(name, weight, config)}
    except Exception as exc:  # noqa: BLE001 - a tensor the codecs (or the metadata's head counts) cannot read is the file's fault
        raise ModelLoadError(path, f"tensor {tensor.name!r} ({tensor.tensor_type.name}, shape {shape}) cannot be read: {describe(exc)}") from None


def _hf_conventions(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A float tensor as HF's checkpoints hold it (llama.cpp permutes llama's q/k rows and stores
    Gemma's norms as 1 + w)."""
    if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        weight = _unpermute_rope(weight, config.num_heads if "q_proj" in name else config.num_kv_heads)
    if config.is_gemma and name.endswith("norm.weight"):
        weight = weight - 1.0
    return weight


def gguf_cache_dir(path: Path) -> Path:
    return cache_root() / "gguf" / file_digest(path)


def load_gguf_checkpoint(path: Path) -> tuple[ModelConfig, Path, dict]:
    """Returns the config, the cached safetensors path of dequantized weights, and the metadata."""
    index = gguf_index(path)
    config = model_config_from_index(index)
    weights = gguf_cache_dir(path) / "model.safetensors"
    if not weights.exists():
        state = _dequantize_gguf(path, config)
        with replaced_atomically(weights) as partial:
            save_file(state, str(partial))
    return config, weights, index["metadata"]


def _config_from_cached(raw: dict) -> ModelConfig:
    raw = dict(raw)
    raw["rope"] = RopeConfig(**raw["rope"])
    raw["local_rope"] = RopeConfig(**raw["local_rope"]) if raw.get("local_rope") else None
    raw["layer_types"] = tuple(raw["layer_types"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    return ModelConfig(**raw)


# --------------------------------------------------------------------------- HF directories
def _safetensor_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(directory, "model directory has no .safetensors files")
    for file in files:
        _open_safetensors(file)  # a truncated or corrupt file fails here, before anything is built
    return files


def _open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for bad headers
        raise ModelLoadError(file, f"truncated or corrupt safetensors file ({file.stat().st_size:,} bytes): {describe(exc)}") from None


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    for file in files:
        handle = _open_safetensors(file)  # stays open while its getters live

        def get(handle=handle, name=None, file=file) -> torch.Tensor:
            try:
                return handle.get_tensor(name)
            except Exception as exc:  # noqa: BLE001
                raise ModelLoadError(file, f"tensor {name!r} cannot be read: {describe(exc)}") from None

        for name in handle.keys():
            yield name, (lambda get=get, name=name: get(name=name))


# --------------------------------------------------------------------------- assembly
def _internal_state(config: ModelConfig, get: Callable[[str], torch.Tensor | None], held: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Map HF-named tensors onto CausalLM's fused parameters, but for those in `held` (kept in GGUF
    blocks)."""

    def need(name: str) -> torch.Tensor:
        tensor = get(name)
        if tensor is None:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return tensor

    def norm(name: str) -> torch.Tensor:
        weight = need(name).float()
        return weight + 1.0 if config.is_gemma else weight

    out: dict[str, torch.Tensor] = {"norm.weight": norm("model.norm.weight")}
    if "embed_tokens.weight" not in held:
        out["embed_tokens.weight"] = need("model.embed_tokens.weight")
    if not config.tie_word_embeddings and "lm_head.weight" not in held:
        out["lm_head.weight"] = need("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        if dst + "self_attn.qkv_proj.weight" not in held:
            out[dst + "self_attn.qkv_proj.weight"] = torch.cat([need(attn + f"{p}_proj.weight") for p in "qkv"])
        if dst + "self_attn.o_proj.weight" not in held:
            out[dst + "self_attn.o_proj.weight"] = need(attn + "o_proj.weight")
        if config.attention_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([need(attn + f"{p}_proj.bias") for p in "qkv"])
        if config.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = norm(attn + "q_norm.weight")
            out[dst + "self_attn.k_norm.weight"] = norm(attn + "k_norm.weight")
        mlp = src + "mlp."
        if dst + "mlp.gate_up_proj.weight" not in held:
            out[dst + "mlp.gate_up_proj.weight"] = torch.cat([need(mlp + "gate_proj.weight"), need(mlp + "up_proj.weight")])
        if dst + "mlp.down_proj.weight" not in held:
            out[dst + "mlp.down_proj.weight"] = need(mlp + "down_proj.weight")
        norms = ["input_layernorm", "post_attention_layernorm"]
        if config.is_gemma:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for n in norms:
            out[dst + f"{n}.weight"] = norm(src + f"{n}.weight")
    return out


def _normalize_hf_name(name: str) -> str:
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name.startswith("language_model.lm_head"):
        return name[len("language_model.") :]
    return name


FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    weight_files: tuple[Path, ...]  # safetensors files; () when the weights are read from the GGUF file itself
    metadata: dict  # GGUF scalar metadata; {} for HF directories
    weight_format: str = "float"  # "gguf": quantized tensors kept in their blocks; "int8" / "int4": quantized at load (QUANTIZED_AT_LOAD)
    activations: str = "exact"  # how the blocks' products take their rows (GGUF_ACTIVATIONS of kernels/gguf.py)


def gguf_index(path: Path) -> dict:
    """{"config", "metadata", "tensors": [{name, type, shape (HF order), offset, bytes}]} of a GGUF
    file, read once (GGUFReader parses the whole vocabulary: seconds) and cached under its hash."""
    index_file = gguf_cache_dir(path) / "index.json"
    if index_file.exists():
        return json.loads(index_file.read_text())
    from gguf import GGUFValueType

    reader = open_gguf(path)
    meta = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > 64:
            continue  # vocabularies and merges: the tokenizer reads those itself
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed for the model
            continue
    tensors = [
        {"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in reversed(t.shape.tolist())], "offset": int(t.data_offset),
         "bytes": int(t.n_bytes)}
        for t in reader.tensors
    ]  # fmt: skip
    try:
        config = ModelConfig.from_gguf_metadata(meta, {t["name"]: tuple(t["shape"]) for t in tensors})
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(path, f"its metadata does not describe a model kvserve runs: {describe(exc)}") from None
    scalar_meta = {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool))}
    index = {"config": asdict(config), "metadata": scalar_meta, "tensors": tensors}
    with replaced_atomically(index_file) as partial:
        partial.write_text(json.dumps(index))
    return index


def model_config_from_index(index: dict) -> ModelConfig:
    return _config_from_cached(index["config"])


def gguf_unreadable_types(path: Path) -> list[str]:
    """The quantized tensor types in a GGUF file that the GGUF kernels do not read ([] when all are)."""
    types = {t["type"] for t in gguf_index(path)["tensors"]}
    return sorted(types - set(GGUF_BLOCKS) - set(FLOAT_GGUF_TYPES))


def resolve_weight_format(path: Path, weight_dtype: str, device: str, dtype: str) -> str:
    """"gguf" (keep the file's blocks) or "float" (dequantize into --dtype) for this checkpoint.

    auto takes the blocks where the activations are float32 (CPUs without native bf16 products,
    where float32 weights took the same kernels at 4-7x the bytes). With bf16 activations (AMX or
    AVX512-BF16 CPUs) the bf16 weights keep their AMX / bf16-dot kernels: the blocks' products,
    on AMX tiles too (--gguf-activations bf16), are slower there at some batch size (docs/models.md)."""
    if weight_dtype in ("bfloat16", "float32"):  # EngineConfig checked it equals --dtype
        return "float"
    is_gguf = path.is_file()
    on_cpu = torch.device(device).type == "cpu" and library.cpu_kernels_available()
    if weight_dtype in QUANTIZED_AT_LOAD:
        if not on_cpu:
            raise ValueError(f"--weight-dtype {weight_dtype} computes on GGUF blocks with the CPU kernels: it needs --device cpu and a C++ "
                             "compiler")  # fmt: skip
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--weight-dtype {weight_dtype} takes float32 or bfloat16 activations; --dtype is {dtype}")
        return weight_dtype
    if weight_dtype == "auto":
        if not (is_gguf and on_cpu and dtype == "float32"):
            return "float"
        unreadable = gguf_unreadable_types(path)
        if unreadable:
            log.warning("%s holds %s tensors, which the GGUF kernels do not read: its weights are dequantized into %s instead "
                        "(--weight-dtype)", path.name, ", ".join(unreadable), dtype)  # fmt: skip
            return "float"
        return "gguf"
    if not is_gguf:
        raise ValueError(f"--weight-dtype gguf keeps a GGUF file's quantized blocks; {path} is not a GGUF file")
    if not on_cpu:
        raise ValueError("--weight-dtype gguf computes on the GGUF blocks with the CPU kernels: it needs --device cpu and a C++ compiler")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--weight-dtype gguf takes float32 or bfloat16 activations; --dtype is {dtype}")
    unreadable = gguf_unreadable_types(path)
    if unreadable:
        raise ModelLoadError(path, f"holds {', '.join(unreadable)} tensors; the GGUF kernels read {', '.join(GGUF_BLOCKS)} "
                             "(start with --weight-dtype float32 or bfloat16 to dequantize them)")  # fmt: skip
    return "gguf"


def resolve_gguf_activations(gguf_activations: str, weight_format: str, dtype: str = "bfloat16") -> str:
    """How the projections on blocks ("gguf" and "int8" weights) take their rows: "exact", "int8" or
    "bf16" (AMX tiles); "exact" for float weights, which have no blocks (a value other than auto or
    exact is then ignored, with a warning). auto is exact: int8 rows cost 0.10-0.22% perplexity on
    the three packaged models (`kvserve eval`, docs/models.md), over the +0.1% a default may cost;
    bf16 tiles are slower than the exact blocks for one stream (docs/models.md)."""
    if weight_format not in ("gguf", *QUANTIZED_AT_LOAD):
        if gguf_activations not in ("auto", "exact"):
            log.warning("--gguf-activations %s applies to weights held in blocks (--weight-dtype gguf, int8 or int4); these weights are "
                        "held as %s copies, so it is ignored", gguf_activations, dtype)  # fmt: skip
        return "exact"
    if gguf_activations == "auto":
        return "exact"
    if gguf_activations == "int8" and not gguf_int8_available():
        raise ValueError("--gguf-activations int8 needs a CPU with AVX512-VNNI, AVX512-BW and AVX512-VBMI (use exact or auto)")
    if gguf_activations == "bf16":
        if dtype != "bfloat16":
            raise ValueError(f"--gguf-activations bf16 multiplies bf16 rows: it needs --dtype bfloat16 (--dtype is {dtype})")
        if os.environ.get("KVSERVE_DISABLE_AMX") == "1":
            raise ValueError("--gguf-activations bf16 runs on AMX tiles, which KVSERVE_DISABLE_AMX=1 turns off (unset it, or use exact or auto)")
        if not gguf_tiles_available():
            raise ValueError("--gguf-activations bf16 runs on AMX tiles, which this CPU lacks or cannot use here (use exact or auto)")
    return gguf_activations


def load_checkpoint(path: Path, weight_format: str = "float", activations: str = "exact") -> Checkpoint:
    """Read a checkpoint's config and locate its weights (weight_format "float": dequantizing a GGUF
    once, then cached; "gguf": the file's own blocks, read at build; "int8" / "int4": the float
    weights (a GGUF file's dequantized) quantized to Q8_0 / Q4_1 blocks at build)."""
    activations = activations if weight_format in ("gguf", *QUANTIZED_AT_LOAD) else "exact"
    if path.is_file() and weight_format == "gguf":
        index = gguf_index(path)
        return Checkpoint(path, model_config_from_index(index), (), index["metadata"], "gguf", activations)
    held = weight_format if weight_format in QUANTIZED_AT_LOAD else "float"
    if path.is_file():
        config, weight_file, metadata = load_gguf_checkpoint(path)
        return Checkpoint(path, config, (weight_file,), metadata, held, activations)
    return Checkpoint(path, ModelConfig.from_hf_file(path), tuple(_safetensor_files(path)), {}, held, activations)


def build_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, max_positions: int) -> CausalLM:
    """Instantiate CausalLM and fill it with the checkpoint's weights (norms stay in float32)."""
    try:
        return _build_model(checkpoint, dtype, device, max_positions)
    except (ValueError, RuntimeError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        where = checkpoint.path / "config.json" if checkpoint.path.is_dir() else checkpoint.path
        raise ModelLoadError(where, f"the model config does not match the weights: {describe(exc)}") from None


def _read_gguf_tensors(path: Path, config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, GgufWeight]]:
    """The file's float tensors (as float32, HF-named) and its quantized ones kept in their blocks."""
    tensors = gguf_index(path)["tensors"]
    data = np.memmap(path, dtype=np.uint8, mode="r")
    floats: dict[str, torch.Tensor] = {}
    blocks: dict[str, GgufWeight] = {}
    for tensor in tqdm(tensors, desc=f"reading {path.name}", unit="tensor", leave=False):
        name = gguf_to_hf_name(tensor["name"], config.architecture)
        shape, type_name = tuple(tensor["shape"]), tensor["type"]
        try:
            raw_tensor = _raw_tensor(data, tensor)
            raw = raw_tensor.numpy()
            if type_name in FLOAT_GGUF_TYPES:
                floats[name] = _hf_conventions(name, _float_tensor(raw_tensor, type_name).reshape(shape), config)
                continue
            if len(shape) != 2 or shape[-1] % GGUF_BLOCKS[type_name][1]:
                # a quantized norm or a row that is no whole number of blocks: not a product's weight, dequantized
                floats[name] = _hf_conventions(name, _dequantized(np.asarray(raw), type_name, shape), config)
                continue
            rows = raw_tensor.reshape(shape[0], -1)
            if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                rows = _unpermute_rope(rows, config.num_heads if "q_proj" in name else config.num_kv_heads)
            blocks[name] = gguf_weight(rows, type_name, shape[0], shape[-1])
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(path, f"tensor {tensor['name']!r} ({type_name}, shape {shape}) cannot be read: {describe(exc)}") from None
    return floats, blocks


def _raw_tensor(data: np.memmap, tensor: dict) -> torch.Tensor:
    """A tensor's bytes in the file's read-only map (a view: whoever keeps them copies them)."""
    raw = data[tensor["offset"] : tensor["offset"] + tensor["bytes"]]
    if len(raw) != tensor["bytes"]:
        raise ValueError(f"the file ends inside it ({len(raw):,} of {tensor['bytes']:,} bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of the map's read-only memory
        return torch.from_numpy(np.asarray(raw))


def untied_embedding_tensor(index: dict, config: ModelConfig) -> dict | None:
    """The index entry of an untied GGUF model's token embedding when dequantized weights keep it in
    its file blocks (_embedding_blocks; kvserve plan counts it so): a type the kernels read, whole
    blocks per row. None otherwise (a tied one is read from the lm_head's packed copy)."""
    if config.tie_word_embeddings:
        return None
    tensor = next((t for t in index["tensors"] if t["name"] == "token_embd.weight"), None)
    if tensor is None or tensor["type"] not in GGUF_BLOCKS or tuple(tensor["shape"]) != (config.vocab_size, config.hidden_size) \
            or config.hidden_size % GGUF_BLOCKS[tensor["type"]][1]:  # fmt: skip
        return None
    return tensor


def _embedding_blocks(path: Path, config: ModelConfig) -> dict[str, tuple[GgufWeight, ...]]:
    """An untied GGUF model's token embedding in its file blocks, for dequantized weights: it is only
    ever looked up, and a looked-up row dequantizes to the values the float copy held."""
    tensor = untied_embedding_tensor(gguf_index(path), config)
    if tensor is None:
        return {}
    try:
        rows = _raw_tensor(np.memmap(path, dtype=np.uint8, mode="r"), tensor).reshape(config.vocab_size, -1)
    except ValueError as exc:
        raise ModelLoadError(path, f"tensor 'token_embd.weight' cannot be read: {describe(exc)}") from None
    return {"embed_tokens.weight": (gguf_weight(rows, tensor["type"], config.vocab_size, config.hidden_size),)}


def _dequantized(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(raw.reshape(1, -1), GGMLQuantizationType[type_name]), dtype=np.float32)).reshape(shape)


def _float_tensor(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """A GGUF F32 / F16 / BF16 tensor's bytes as a float32 tensor (a copy)."""
    if type_name == "F32":
        return raw.view(torch.float32).clone()
    return raw.view(torch.float16 if type_name == "F16" else torch.bfloat16).float()


def _gguf_groups(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """{CausalLM parameter: the HF tensors it is made of, stacked on the output axis}, for every
    weight that may be held in GGUF blocks."""
    groups = {"embed_tokens.weight": ("model.embed_tokens.weight",)}
    if not config.tie_word_embeddings:
        groups["lm_head.weight"] = ("lm_head.weight",)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        groups[dst + "self_attn.qkv_proj.weight"] = tuple(src + f"self_attn.{p}_proj.weight" for p in "qkv")
        groups[dst + "self_attn.o_proj.weight"] = (src + "self_attn.o_proj.weight",)
        groups[dst + "mlp.gate_up_proj.weight"] = (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight")
        groups[dst + "mlp.down_proj.weight"] = (src + "mlp.down_proj.weight",)
    return groups


# --weight-dtype int8 / int4: the GGUF block type of the projections. The embedding and the lm_head
# are Q8_0 in both (the lm_head's int8 screen reads Q8_0, and OpenVINO keeps them int8 under int4
# too); int4 keeps v_proj and down_proj in Q8_0 as well, as llama.cpp's Q4_K_M keeps them at 6 bits
# (Qwen2.5-Coder-0.5B: +11.2% perplexity so, +19.3% with them in Q4_1; docs/models.md)
QUANTIZED_AT_LOAD = {"int8": "Q8_0", "int4": "Q4_1"}


def _quantized_weights(config: ModelConfig, getters: dict[str, Callable[[], torch.Tensor]], weight_format: str) -> dict[str, tuple[GgufWeight, ...]]:
    """--weight-dtype int8: every projection, the embedding and the lm_head quantized to int8 with
    a scale per 32 weights of a row (GGUF's Q8_0 blocks); int4: the q, k, o, gate and up projections
    to 4 bits with a scale and a minimum per 32 weights (Q4_1, asymmetric groups of 32 as OpenVINO's
    int4_asym), v_proj, down_proj, the embedding and lm_head to Q8_0. Computed by the GGUF kernels."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    held: dict[str, tuple[GgufWeight, ...]] = {}
    kept: list[str] = []  # weights whose rows are no whole number of blocks
    groups = _gguf_groups(config)
    for param, names in tqdm(groups.items(), desc=f"quantizing weights to {weight_format}", unit="weight", leave=False):
        kept_8bit = param in ("embed_tokens.weight", "lm_head.weight") or param.endswith("down_proj.weight")
        if not all(name in getters for name in names):
            continue  # a missing tensor is reported by _internal_state
        parts = []
        for name in names:
            type_name = "Q8_0" if kept_8bit or name.endswith("v_proj.weight") else QUANTIZED_AT_LOAD[weight_format]
            weight = getters[name]()
            if weight.dim() != 2:
                raise ValueError(f"weight {name} has shape {tuple(weight.shape)}: a matrix was expected")
            n, k = weight.shape
            if k % 32:
                kept.append(param)  # stays in --dtype
                break
            weight = weight.float()
            largest = float(weight.abs().max()) if weight.numel() else 0.0
            if not largest <= LARGEST_AT_LOAD[type_name]:  # also NaN and inf
                raise ValueError(f"weight {name} holds {largest:g}, beyond what {type_name}'s fp16 scale reaches "
                                 f"({LARGEST_AT_LOAD[type_name]:g}); load it with --weight-dtype float32 or bfloat16")  # fmt: skip
            rows = quantize(weight.numpy(), GGMLQuantizationType[type_name])
            parts.append(gguf_weight(torch.from_numpy(rows), type_name, n, k))
        else:
            held[param] = tuple(parts)
    if kept:
        log.warning("--weight-dtype %s: %d of %d weights (%s) have rows that are no whole number of 32 values and stay in "
                    "--dtype", weight_format, len(kept), len(groups), ", ".join(kept[:3]) + (", ..." if len(kept) > 3 else ""))  # fmt: skip
    return held


# the largest |weight| a block holds: Q8_0's fp16 scale times its largest code; Q4_1's fp16 minimum
LARGEST_AT_LOAD = {"Q8_0": 65504.0 * 127, "Q4_1": 65504.0}


def _hold_gguf(model: CausalLM, config: ModelConfig, held: dict[str, tuple[GgufWeight, ...]], dtype: torch.dtype, activations: str) -> None:
    """Give the projections, the embedding and the lm_head whose tensors are all quantized their
    GGUF blocks (the tied lm_head reads the embedding's). The projections take their rows as
    `activations` says; the lm_head's products stay exact (a greedy batch's argmax takes the exact
    int8 screen, which must agree with the full product a smaller batch takes)."""
    modules = dict(model.named_modules())
    for param, parts in held.items():
        module = param.removesuffix(".weight")
        if module == "embed_tokens":
            if (parts[0].n, parts[0].k) != (config.vocab_size, config.hidden_size):
                raise ValueError(f"weight embed_tokens.weight has shape ({parts[0].n}, {parts[0].k}), expected ({config.vocab_size}, "
                                 f"{config.hidden_size})")  # fmt: skip
            model.embed_tokens = GgufEmbedding(parts[0], dtype)
            if config.tie_word_embeddings:
                model.hold_gguf_lm_head(parts[0])
        elif module == "lm_head":
            model.hold_gguf_lm_head(parts[0])
        else:
            modules[module].hold_gguf(tuple(part.with_activations(activations) for part in parts))


def _build_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, max_positions: int) -> CausalLM:
    config = checkpoint.config
    held: dict[str, tuple[GgufWeight, ...]] = {}
    if checkpoint.weight_format == "gguf":
        floats, blocks = _read_gguf_tensors(checkpoint.path, config)
        groups = {param: names for param, names in _gguf_groups(config).items() if all(n in blocks for n in names)}
        held = {param: tuple(blocks[n] for n in names) for param, names in groups.items()}
        # a weight made of float and quantized tensors (or a quantized tensor that is no projection) is dequantized
        kept = {n for names in groups.values() for n in names}
        loose = {name: weight for name, weight in blocks.items() if name not in kept}
        floats.update({name: gguf_dequantize(weight) for name, weight in loose.items()})
        state = _internal_state(config, floats.get, frozenset(held))
    else:
        getters = {_normalize_hf_name(name): getter for name, getter in _iter_safetensors(list(checkpoint.weight_files))}
        if checkpoint.weight_format in QUANTIZED_AT_LOAD:
            held = _quantized_weights(config, getters, checkpoint.weight_format)
        elif checkpoint.path.is_file() and device.type == "cpu" and library.cpu_kernels_available():
            held = _embedding_blocks(checkpoint.path, config)
        state = _internal_state(config, lambda name: getters[name]() if name in getters else None, frozenset(held))
    with torch.device("meta"):
        model = CausalLM(config, max_positions)
    model = model.to_empty(device=device)
    # rotary tables are buffers computed at construction; rebuild them for real on the device
    for rotary in model.rotaries:
        fresh = type(rotary)(_rope_of(model, rotary), config.head_dim, max_positions)
        rotary.cos, rotary.sin = fresh.cos.to(device), fresh.sin.to(device)
    _hold_gguf(model, config, held, dtype, checkpoint.activations)
    params = dict(model.named_parameters())
    tied = {"lm_head.weight"} if config.tie_word_embeddings or model.gguf_lm_head is not None else set()
    missing = set(params) - set(state) - set(held) - tied
    if missing:
        raise ValueError(f"checkpoint lacks weights for {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            want = torch.float32 if name.endswith("norm.weight") else dtype
            target.data = tensor.to(device=device, dtype=want, copy=True)  # never a view of the file map
    if config.tie_word_embeddings and model.gguf_lm_head is None:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def _rope_of(model: CausalLM, rotary) -> RopeConfig:
    for i, layer in enumerate(model.layers):
        if layer.self_attn.rotary is rotary:
            return model.config.layer_rope(i)
    raise AssertionError("rotary table not used by any layer")
