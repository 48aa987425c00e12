"""Decode steps' layers as one kernel program (model/fused_decode.py) give the per-module path's
bits: greedy and seeded tokens with their logprobs, on every family, float32 and bf16, float,
int8 and fp8 KV, dense and GGUF weights, batches that outgrow the program's rows. What the
program does not cover (KIVI KV, the torch attention backend) keeps the per-module path."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from kvserve.kernels import library, products
from kvserve.kernels.program import DecodeProgram

pytestmark = pytest.mark.skipif(not library.cpu_kernels_available(), reason="needs the native kernels")

PROMPTS = random_prompts(12, 5, 40, seed=7)
PARAMS = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]  # fmt: skip


def traces(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(tuple(o.token_ids), tuple((lp.logprob, tuple(sorted(lp.top.items()))) for lp in o.logprobs or ())) for o in outs]


def fused_against_per_module(llm: LLM, expect_program: bool = True) -> None:
    """Three requests, then twelve (a step of 12 rows outgrows the first program's 8): the same
    traces with the program on and off."""
    model = llm.engine.model
    for prompts in (PROMPTS[:3], PROMPTS):
        model.fused_decode = False
        per_module = traces(llm, prompts)
        model.fused_decode = True
        fused = traces(llm, prompts)
        assert fused == per_module
    if expect_program:
        assert model._fused is not None and model._fused.steps > 0 and model._fused.capacity >= 12, "the decode program ran"
    else:
        assert model._fused is None, "the per-module path ran"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "gemma3-w4"])
def test_the_decode_program_gives_the_per_module_bits(tiny_dir, family, dtype):
    llm = LLM(str(tiny_dir(family)), dtype=dtype, kv_cache_memory=0.02, max_num_seqs=16, enable_prefix_caching=False)
    fused_against_per_module(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_decode_program_stores_scaled_kv_as_the_pool_does(tiny_dir, kv_cache_dtype):
    """int8 rotates K/V (Hadamard) and centers keys; fp8 centers keys."""
    llm = LLM(str(tiny_dir("gemma3")), dtype="bfloat16", kv_cache_memory=0.02, max_num_seqs=16, kv_cache_dtype=kv_cache_dtype)
    assert (llm.engine.runner.attention.pool.rotation is not None) == (kv_cache_dtype == "int8")
    fused_against_per_module(llm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_program_runs_on_gguf_blocks(tiny_root, dtype):
    from test_gguf_weights import tiny_gguf

    llm = LLM(str(tiny_gguf(tiny_root, quantized=True)), weight_dtype="gguf", dtype=dtype, kv_cache_memory=0.02, max_num_seqs=16,
              skip_tokenizer_init=True)  # fmt: skip
    fused_against_per_module(llm)


@pytest.mark.parametrize(
    ("family", "settings"),
    [("qwen3", {"kv_cache_dtype": "int4", "kv_quant_residual": 32}), ("gemma3", {"attention_backend": "torch_sdpa"})],
    ids=["kivi-int4", "torch-sdpa"],
)
def test_what_the_program_does_not_cover_keeps_the_per_module_path(tiny_dir, family, settings):
    llm = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.02, max_num_seqs=16, enable_prefix_caching=False, **settings)
    fused_against_per_module(llm, expect_program=False)


def test_a_program_refuses_bad_steps():
    program = DecodeProgram(2)
    key, value = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    k, v = torch.ones(2, 8), torch.full((2, 8), 2.0)
    program.kv_copy(0, key, value, k, v)
    one = torch.zeros(1, dtype=torch.int64)
    table, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    program.run(one, [torch.tensor([3])], [table], [lens])
    assert torch.equal(key[3, 0], k[0]) and torch.equal(value[3, 0], v[0]) and not key[:3].any()
    with pytest.raises(ValueError, match=r"op 0 \(kv_copy\)"):
        program.run(one, [torch.tensor([4])], [table], [lens])  # a slot past the pool
    with pytest.raises(ValueError, match="1 to 2 rows"):
        program.run(torch.zeros(3, dtype=torch.int64), [torch.zeros(3, dtype=torch.int64)], [table], [lens])
    with pytest.raises(ValueError, match="contiguous int64"):
        program.run(one, [torch.tensor([1], dtype=torch.int32)], [table], [lens])
    with pytest.raises(ValueError, match="buffers are contiguous"):
        DecodeProgram(2).gated_activation(torch.zeros(3, 8), torch.zeros(3, 4), "silu")


def test_the_avx2_build_runs_the_same_program(tiny_dir, monkeypatch):
    from kvserve.kernels.build import load_kernels

    monkeypatch.setenv("KVSERVE_MARCH", "haswell")
    load_kernels.cache_clear()
    products.amx_ready.cache_clear()
    try:
        llm = LLM(str(tiny_dir("gemma3")), dtype="bfloat16", kv_cache_memory=0.02, max_num_seqs=16, enable_prefix_caching=False)
        fused_against_per_module(llm)
    finally:
        monkeypatch.undo()
        load_kernels.cache_clear()
        products.amx_ready.cache_clear()
        products.amx_ready()
