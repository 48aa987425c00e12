"""--weight-dtype int8: a float checkpoint's projections, embedding and lm_head quantized at load to
int8 with a scale per 32 weights (GGUF's Q8_0 blocks) and computed by the GGUF kernels. Each held
block is gguf-py's Q8_0 of the checkpoint's tensor; the model gives the bits of a float32 model whose
weights are those blocks' values; one copy of each weight; the planner counts what the engine holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import library
from kvserve.kernels.gguf import gguf_dequantize

pytestmark = pytest.mark.skipif(not library.cpu_kernels_available(), reason="needs the native kernels")

PROMPTS = [[1, 5, 9, 20, 33, 7, 7, 100], [3, 4, 5], list(range(40, 90))]


def q8_0_values(weight: torch.Tensor) -> np.ndarray:
    """gguf-py's Q8_0 quantization of a float tensor, read back as float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q8 = GGMLQuantizationType.Q8_0
    return dequantize(quantize(weight.float().numpy(), q8), q8).reshape(weight.shape).astype(np.float32)


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def int8_llm(directory, dtype: str = "float32", **settings) -> LLM:
    return LLM(str(directory), weight_dtype="int8", dtype=dtype, kv_cache_memory=0.02, skip_tokenizer_init=True, **settings)


def traces(llm: LLM, params) -> list[tuple]:
    outs = llm.generate(PROMPTS * len(params), [p for p in params for _ in PROMPTS], use_tqdm=False)
    return [(tuple(o.token_ids), tuple((t.token_id, t.logprob, tuple(sorted(t.top.items()))) for t in o.logprobs)) for o in outs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_each_weight_is_held_once_as_gguf_py_q8_0_blocks(tiny_dir, family):
    from kvserve.model.layers import GgufEmbedding

    directory = tiny_dir(family)
    tensors = hf_tensors(directory)
    model = int8_llm(directory).engine.model
    assert isinstance(model.embed_tokens, GgufEmbedding) and model.gguf_lm_head is not None
    embed = gguf_dequantize(model.embed_tokens.blocks).numpy()
    assert np.array_equal(embed, q8_0_values(tensors["model.embed_tokens.weight"]))
    lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    assert np.array_equal(gguf_dequantize(model.gguf_lm_head).numpy(), q8_0_values(lm_head))
    layer = model.layers[1]
    qkv = layer.self_attn.qkv_proj
    assert [p.type_name for p in qkv.gguf] == ["Q8_0"] * 3 and qkv.weight.numel() == 0
    for part, name in zip(qkv.gguf, "qkv"):
        assert np.array_equal(gguf_dequantize(part).numpy(), q8_0_values(tensors[f"model.layers.1.self_attn.{name}_proj.weight"]))
    gate_up = layer.mlp.gate_up_proj
    assert len(gate_up.gguf) == 2 and gate_up.weight.numel() == 0 and layer.mlp.down_proj.gguf is not None
    o_proj = layer.self_attn.o_proj
    if family != "gemma3":  # 6 heads of 24: rows of 144 values are no whole number of 32-value blocks, kept in --dtype
        assert o_proj.gguf is None and o_proj.weight.dtype == torch.float32
    else:
        assert o_proj.gguf is not None
    if family == "qwen2":  # biases stay float beside the blocks
        assert qkv.bias is not None and qkv.bias.dtype == torch.float32


def test_int8_weights_give_the_bits_of_float32_weights_of_the_same_values(tiny_dir, tmp_path):
    """The GGUF kernels run the same float32 FMA chains as float_matmul, so the int8 model and a
    float32 model of the dequantized values agree to the bit: greedy and seeded, with logprobs."""
    source = tiny_dir("gemma3")
    rounded = tmp_path / "gemma3-q8"
    shutil.copytree(source, rounded)
    from safetensors.torch import save_file

    tensors = hf_tensors(source)
    quantized = {name: torch.from_numpy(q8_0_values(t)) if t.dim() == 2 else t for name, t in tensors.items()}
    save_file(quantized, str(rounded / "model.safetensors"))
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True, logprobs=2)]  # fmt: skip
    dense = LLM(str(rounded), weight_dtype="float32", dtype="float32", kv_cache_memory=0.02, skip_tokenizer_init=True)
    assert traces(int8_llm(source), params) == traces(dense, params)
    # and the weights differ from the checkpoint's: the test compares two different models' paths
    assert not torch.equal(quantized["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])


def test_int8_weights_stay_close_to_the_float_model(tiny_dir):
    """Weight-only int8 moves the logits little: the float32 model's greedy tokens are the int8
    model's top-2 at every step, and most are its argmax."""
    directory = tiny_dir("qwen2")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    exact = LLM(str(directory), dtype="float32", kv_cache_memory=0.02, skip_tokenizer_init=True)
    reference = exact.generate(PROMPTS, params, use_tqdm=False)
    forced = [p + list(o.token_ids) for p, o in zip(PROMPTS, reference)]  # the int8 model scores the float model's path
    scored = int8_llm(directory).generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    agree = total = 0
    for prompt, ref, out in zip(PROMPTS, reference, scored):
        for step, token in enumerate(ref.token_ids):
            entry = out.prompt_logprobs[len(prompt) + step]
            assert entry.token_id == token and entry.rank <= 2, f"step {step}: the float model's token is the int8 model's {entry.rank}"
            agree += entry.rank == 1
            total += 1
    assert agree >= 0.9 * total


def test_int8_is_checked_like_the_other_weight_dtypes(tiny_dir, tiny_root):
    from kvserve.model.loader import resolve_weight_format
    from tiny_models import tiny_gguf

    directory = tiny_dir("llama")
    with pytest.raises(ValueError, match="int8 takes float32 or bfloat16 activations"):
        resolve_weight_format(directory, "int8", "cpu", "float16")
    with pytest.raises(ValueError, match="needs --device cpu"):
        resolve_weight_format(directory, "int8", "cuda", "float32")
    assert resolve_weight_format(directory, "int8", "cpu", "bfloat16") == "int8"
    from kvserve.config import EngineConfig

    for bad, words in ((dict(dtype="float16"), "float32 or bfloat16 activations"), (dict(device="cuda"), "needs --device cpu")):
        with pytest.raises(ValueError, match=words):  # before any model loads (kvserve eval builds every --config's first)
            EngineConfig(weight_dtype="int8", **{"dtype": "float32", **bad})
    # a GGUF file: its dequantized weights quantized again (a float GGUF's way to int8)
    gguf = int8_llm(tiny_gguf(tiny_root, quantized=True)).engine.model
    assert [p.type_name for p in gguf.layers[0].mlp.gate_up_proj.gguf] == ["Q8_0", "Q8_0"]
    bf16 = int8_llm(directory, dtype="bfloat16")
    assert len(bf16.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].token_ids) == 3


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_planner_counts_int8_weights_as_the_engine_holds_them(tiny_dir, family):
    from kvserve.kv.spec import GIB
    from test_plan import run_plan

    from kvserve.model.weight_bytes import weight_bytes

    directory = tiny_dir(family)
    proc = run_plan("--model", str(directory), "--seq-lens", "100", "--memory-gib", "1", "--headroom-gib", "0", "--dtype", "float32",
                    "--weight-dtype", "int8", "--json")  # fmt: skip
    planned = json.loads(proc.stdout)
    assert planned["weights_held_as"] == "int8 (Q8_0 blocks)"
    held = weight_bytes(int8_llm(directory).engine.model)
    assert abs((GIB - planned["kv_budget_bytes"]) - held) <= 0.01 * held  # llama's o_proj (rows of 144 values) in float32


def with_tensor(source: Path, out: Path, name: str, tensor: torch.Tensor) -> Path:
    """A copy of a tiny HF model directory with one tensor replaced."""
    from safetensors.torch import save_file

    shutil.copytree(source, out)
    tensors = hf_tensors(source)
    tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_a_bad_checkpoint_is_refused_naming_the_tensor(tiny_dir, tmp_path):
    from kvserve.model.errors import ModelLoadError

    source = tiny_dir("llama")
    embedding = hf_tensors(source)["model.embed_tokens.weight"]
    for shape in ((480, 96), (600, 96), (512, 64)):  # an untied embedding of the wrong shape
        bad = with_tensor(source, tmp_path / f"embed-{shape[0]}-{shape[1]}", "model.embed_tokens.weight", torch.randn(shape))
        with pytest.raises(ModelLoadError, match=r"embed_tokens.weight has shape"):
            int8_llm(bad)
    huge = embedding.clone()
    huge[3, 5] = 1e10  # beyond Q8_0's fp16 scale: would quantize to inf / NaN
    with pytest.raises(ModelLoadError, match=r"model.embed_tokens.weight holds 1e\+10, beyond"):
        int8_llm(with_tensor(source, tmp_path / "huge", "model.embed_tokens.weight", huge))
    flat = with_tensor(source, tmp_path / "flat", "model.layers.0.mlp.down_proj.weight", torch.randn(96 * 160))
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.down_proj.weight has shape \(15360,\)"):
        int8_llm(flat)


def test_what_stays_float_is_logged_and_the_start_up_line_says_int8(tiny_dir, caplog):
    with caplog.at_level("WARNING", logger="kvserve.model.loader"):
        llm = int8_llm(tiny_dir("llama"))
    assert "3 of 14 weights (layers.0.self_attn.o_proj.weight" in caplog.text  # each layer's o_proj: rows of 144 values
    assert llm.engine.weights_description() == "int8 (Q8_0 blocks)"


def test_the_plans_engine_flags_carry_the_weight_dtype(tiny_dir):
    from test_plan import run_plan

    proc = run_plan("--model", str(tiny_dir("gemma3")), "--seq-lens", "100,100", "--memory-gib", "1", "--dtype", "float32",
                    "--weight-dtype", "int8")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Engine flags: --dtype float32 --weight-dtype int8" in proc.stdout, proc.stdout
