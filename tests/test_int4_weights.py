"""--weight-dtype int4: a float checkpoint's q, k, o, gate and up projections quantized at load to 4 bits with a scale and
a minimum per 32 weights (GGUF's Q4_1 blocks, asymmetric groups of 32), v, down, the embedding and lm_head
to Q8_0, all computed by the GGUF kernels. Each held block is gguf-py's quantization of the
checkpoint's tensor; the model gives the bits of a float32 model whose weights are those blocks'
values; the planner counts what the engine holds."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import library
from kvserve.kernels.gguf import gguf_dequantize
from test_int8_weights import PROMPTS, hf_tensors, traces

pytestmark = pytest.mark.skipif(not library.cpu_kernels_available(), reason="needs the native kernels")


def block_values(weight: torch.Tensor, type_name: str) -> np.ndarray:
    """gguf-py's quantization of a float tensor to type_name, read back as float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[type_name]
    return dequantize(quantize(weight.float().numpy(), kind), kind).reshape(weight.shape).astype(np.float32)


def int4_llm(directory, dtype: str = "float32", **settings) -> LLM:
    return LLM(str(directory), weight_dtype="int4", dtype=dtype, kv_cache_memory=0.02, skip_tokenizer_init=True, **settings)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_projections_are_held_as_q4_1_and_the_embedding_as_q8_0(tiny_dir, family):
    directory = tiny_dir(family)
    tensors = hf_tensors(directory)
    llm = int4_llm(directory)
    model = llm.engine.model
    assert np.array_equal(gguf_dequantize(model.embed_tokens.blocks).numpy(), block_values(tensors["model.embed_tokens.weight"], "Q8_0"))
    lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    assert model.gguf_lm_head.type_name == "Q8_0"
    assert np.array_equal(gguf_dequantize(model.gguf_lm_head).numpy(), block_values(lm_head, "Q8_0"))
    layer = model.layers[1]
    qkv = layer.self_attn.qkv_proj
    assert [p.type_name for p in qkv.gguf] == ["Q4_1", "Q4_1", "Q8_0"] and qkv.weight.numel() == 0
    for part, name in zip(qkv.gguf, "qkv"):
        kind = "Q8_0" if name == "v" else "Q4_1"
        assert np.array_equal(gguf_dequantize(part).numpy(), block_values(tensors[f"model.layers.1.self_attn.{name}_proj.weight"], kind))
    assert [p.type_name for p in layer.mlp.gate_up_proj.gguf] == ["Q4_1", "Q4_1"]
    assert layer.mlp.down_proj.gguf[0].type_name == "Q8_0"
    assert llm.engine.weights_description() == "int4 (Q4_1 blocks; v, down and embedding Q8_0)"
    assert llm.engine.weight_dtype == "int4"


def test_int4_weights_give_the_bits_of_float32_weights_of_the_same_values(tiny_dir, tmp_path):
    """The GGUF kernels run the float32 FMA chains of float_matmul on Q4_1 blocks too: the int4
    model and a float32 model of the dequantized values agree to the bit, greedy and seeded."""
    source = tiny_dir("gemma3")
    rounded = tmp_path / "gemma3-q4"
    shutil.copytree(source, rounded)
    from safetensors.torch import save_file

    tensors = hf_tensors(source)
    eight_bit = ("embed_tokens", "v_proj", "down_proj")
    quantized = {name: torch.from_numpy(block_values(t, "Q8_0" if any(n in name for n in eight_bit) else "Q4_1")) if t.dim() == 2 else t
                 for name, t in tensors.items()}  # fmt: skip
    save_file(quantized, str(rounded / "model.safetensors"))
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True, logprobs=2)]  # fmt: skip
    dense = LLM(str(rounded), weight_dtype="float32", dtype="float32", kv_cache_memory=0.02, skip_tokenizer_init=True)
    assert traces(int4_llm(source), params) == traces(dense, params)
    assert not torch.equal(quantized["model.layers.0.mlp.up_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"])


def test_int4_is_checked_and_counted_like_the_other_weight_dtypes(tiny_dir, tiny_root, tmp_path):
    from kvserve.config import EngineConfig
    from kvserve.kv.spec import GIB
    from kvserve.model.loader import resolve_weight_format
    from kvserve.model.weight_bytes import weight_bytes
    from test_plan import run_plan
    from tiny_models import tiny_gguf

    directory = tiny_dir("gemma3")
    with pytest.raises(ValueError, match="int4 takes float32 or bfloat16 activations"):
        resolve_weight_format(directory, "int4", "cpu", "float16")
    with pytest.raises(ValueError, match="int4 takes float32 or bfloat16 activations"):
        EngineConfig(weight_dtype="int4", dtype="float16")
    proc = run_plan("--model", str(directory), "--seq-lens", "100", "--memory-gib", "1", "--headroom-gib", "0", "--dtype", "float32",
                    "--weight-dtype", "int4", "--json")  # fmt: skip
    planned = json.loads(proc.stdout)
    assert planned["weights_held_as"] == "int4 (Q4_1 blocks)"
    held = weight_bytes(int4_llm(directory).engine.model)
    assert abs((GIB - planned["kv_budget_bytes"]) - held) <= 0.01 * held
    # a GGUF file's dequantized weights quantized again, and bf16 activations
    gguf = int4_llm(tiny_gguf(tiny_root, quantized=True)).engine.model
    assert [p.type_name for p in gguf.layers[0].mlp.gate_up_proj.gguf] == ["Q4_1", "Q4_1"]
    bf16 = int4_llm(directory, dtype="bfloat16")
    assert len(bf16.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].token_ids) == 3
    # a weight beyond Q4_1's fp16 minimum is refused by name
    from kvserve.model.errors import ModelLoadError
    from test_int8_weights import with_tensor

    huge = hf_tensors(directory)["model.layers.0.mlp.up_proj.weight"].clone()
    huge[0, 0] = -1e6
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.up_proj.weight holds 1e\+06, beyond what Q4_1"):
        int4_llm(with_tensor(directory, tmp_path / "int4-huge", "model.layers.0.mlp.up_proj.weight", huge))
