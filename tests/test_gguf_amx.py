"""GGUF blocks times bf16 rows on AMX tiles (kernels/gguf_amx.h, activations "bf16"): every output
equals the AMX GEMM's on the weight dequantized and cast to bf16, bit for bit, for every block type,
awkward shapes, both output dtypes, the argmax and a fused projection's parts.

The emulated build (tile instructions in scalar C++, build_amx_emulation) checks the B-tile decoding
and the walk on any CPU; the same checks run on the production build where the CPU has AMX, and an
engine holding a GGUF file's blocks with bf16 tiles gives the bf16 weights' tokens there."""

import ctypes

import pytest
import torch

from kvserve.kernels import args, gguf, products
from kvserve.kernels.build import build_amx_emulation, load_kernels
from kvserve.kernels.library import _DTYPE_CODES
from test_gguf_weights import random_blocks

TYPES = list(gguf.GGUF_BLOCKS)
REAL_AMX = pytest.mark.skipif(not products.amx_ready(), reason="needs a CPU whose AMX-BF16 tiles run")
TILES = gguf.GGUF_ACTIVATIONS.index("bf16")


@pytest.fixture(scope="module")
def emulated():
    return build_amx_emulation()


def blocks_of(type_name, n, k, seed=0):
    weight = gguf.gguf_weight(torch.from_numpy(random_blocks(type_name, n, k, seed)), type_name, n, k)
    return weight, gguf.gguf_dequantize(weight).to(torch.bfloat16)


def tiles_product(library, x, weight, out_dtype, want_argmax=False):
    """kvserve_gguf_matmul with bf16 tiles, called on `library` (the emulated or production build)."""
    rows = x.shape[0]
    out = torch.full((rows, weight.n), float("nan"), dtype=out_dtype)
    argmax = torch.full((rows,), -7, dtype=torch.int64) if want_argmax else None
    call = args.GgufMatmulArgs(weight.data.data_ptr(), x.data_ptr(), out.data_ptr(), argmax.data_ptr() if want_argmax else None, weight.n,
                               x.stride(0), weight.n, weight.k, rows, weight.type_code, _DTYPE_CODES[x.dtype], _DTYPE_CODES[out_dtype], TILES)  # fmt: skip
    assert library.kvserve_gguf_matmul(ctypes.byref(call)) == 0
    return out, argmax


def check_equals_the_bf16_gemm(library, type_name, n, k, rows):
    weight, dequantized = blocks_of(type_name, n, k, seed=n + k)
    packed = products.amx_pack_weight(dequantized, library=library)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    for out_dtype in (torch.float32, torch.bfloat16):
        ours, ours_argmax = tiles_product(library, x, weight, out_dtype, want_argmax=out_dtype == torch.float32)
        theirs, theirs_argmax = products.amx_matmul(x, packed, out_dtype=out_dtype, want_argmax=out_dtype == torch.float32, library=library)
        assert torch.equal(ours.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                           theirs.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)), (type_name, n, k, rows, out_dtype)
        if ours_argmax is not None:
            assert torch.equal(ours_argmax, theirs_argmax)


SHAPES = [(16, 256, 1), (37, 256, 17), (48, 512, 33), (100, 768, 2)]


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n, k, rows", SHAPES)
def test_emulated_tiles_equal_the_bf16_gemm_on_the_dequantized_weight(emulated, type_name, n, k, rows):
    check_equals_the_bf16_gemm(emulated, type_name, n, k, rows)


@REAL_AMX
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n, k, rows", [*SHAPES, (640, 2048, 64), (33, 256, 300)])
def test_real_tiles_equal_the_bf16_gemm_on_the_dequantized_weight(type_name, n, k, rows):
    check_equals_the_bf16_gemm(load_kernels(), type_name, n, k, rows)
    weight, dequantized = blocks_of(type_name, n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    ours, ours_argmax = gguf.gguf_matmul(x, weight.with_activations("bf16"), out_dtype=torch.float32, want_argmax=True)
    theirs, theirs_argmax = products.amx_matmul(x, products.amx_pack_weight(dequantized), out_dtype=torch.float32, want_argmax=True)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    assert torch.equal(ours_argmax, theirs_argmax)


@REAL_AMX
def test_real_tiles_rows_do_not_depend_on_the_batch():
    weight, _ = blocks_of("Q4_K", 100, 512)
    tiles = weight.with_activations("bf16")
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole, _ = gguf.gguf_matmul(x, tiles)
    for start, stop in [(0, 1), (5, 6), (17, 50), (69, 70)]:
        part, _ = gguf.gguf_matmul(x[start:stop].contiguous(), tiles)
        assert torch.equal(part.view(torch.int16), whole[start:stop].view(torch.int16))


@REAL_AMX
def test_real_tiles_parts_write_side_by_side_into_a_column_slice():
    q, _ = blocks_of("Q4_K", 48, 512, seed=1)
    v, _ = blocks_of("Q6_K", 17, 512, seed=2)
    parts = (q.with_activations("bf16"), v.with_activations("bf16"))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    wide = torch.zeros(9, 80, dtype=torch.bfloat16)
    gguf.GgufProduct(parts)(x, out=wide[:, 10:75])
    assert torch.equal(wide[:, 10:58], gguf.gguf_matmul(x, parts[0])[0])
    assert torch.equal(wide[:, 58:75], gguf.gguf_matmul(x, parts[1])[0])
    assert not wide[:, :10].any() and not wide[:, 75:].any()


@REAL_AMX
def test_float32_rows_are_refused_with_a_reason():
    weight, _ = blocks_of("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="bf16 activations take bf16 rows"):
        gguf.gguf_matmul(torch.randn(2, 64), weight.with_activations("bf16"))
    with pytest.raises(ValueError, match="bf16 activations take bf16 rows"):
        gguf.gguf_matmul(torch.randn(2, 64).to(torch.bfloat16), weight.with_activations("bf16"), out_dtype=torch.float16)


@pytest.mark.skipif(products.amx_ready(), reason="checks the refusal on a CPU whose AMX tiles do not run")
def test_without_amx_tiles_the_weight_is_refused():
    weight, _ = blocks_of("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="AMX tiles"):
        weight.with_activations("bf16")


def test_the_refusals_name_what_is_missing(monkeypatch):
    from kvserve.model import loader

    with pytest.raises(ValueError, match="--dtype bfloat16"):
        loader.resolve_gguf_activations("bf16", "gguf", "float32")
    monkeypatch.delenv("KVSERVE_DISABLE_AMX", raising=False)
    monkeypatch.setattr(loader, "gguf_tiles_available", lambda: False)
    with pytest.raises(ValueError, match="this CPU lacks"):
        loader.resolve_gguf_activations("bf16", "gguf", "bfloat16")


@REAL_AMX
def test_an_engine_on_bf16_tiles_gives_the_bf16_weights_tokens_and_logprobs(tiny_root):
    """The projections on bf16 tiles are the bf16 weights' products bit for bit; with the lm_head
    unquantized (a quantized one stays exact on its blocks) greedy and seeded tokens and their
    logprobs agree to the bit, and the cache identity keeps the two apart all the same."""
    from test_gguf_weights import PROMPTS, traces
    from tiny_models import TINY_GGUF_TYPES, tiny_gguf

    from kvserve import LLM, SamplingParams

    path = str(tiny_gguf(tiny_root, quantized=True, types={part: t for part, t in TINY_GGUF_TYPES.items() if part != "output"}))
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True, logprobs=2)]  # fmt: skip
    batch = [(p, s) for p in PROMPTS for s in params]
    runs, identities = {}, {}
    for weight_dtype, activations in (("gguf", "bf16"), ("bfloat16", "auto"), ("gguf", "exact")):
        llm = LLM(path, weight_dtype=weight_dtype, dtype="bfloat16", gguf_activations=activations, kv_cache_memory=0.02, skip_tokenizer_init=True)
        assert llm.engine.gguf_activations == ("exact" if activations == "auto" else activations)
        runs[weight_dtype, activations] = traces(llm, [p for p, _ in batch], [s for _, s in batch])
        identities[weight_dtype, activations] = llm.engine.cache_identity.dtype
    assert runs["gguf", "bf16"] == runs["bfloat16", "auto"]
    assert runs["gguf", "exact"] != runs["gguf", "bf16"]  # the exact blocks' values are not rounded to bf16
    assert identities["gguf", "bf16"] == "bfloat16/weights gguf/bf16 tiles"
    assert len(set(identities.values())) == 3


def test_the_config_refuses_bf16_tiles_without_bf16_activations_before_loading(caplog):
    from kvserve.config import EngineConfig
    from kvserve.model import loader

    with pytest.raises(ValueError, match="needs --dtype bfloat16"):
        EngineConfig(gguf_activations="bf16", dtype="float32")
    with caplog.at_level("WARNING"):
        assert loader.resolve_gguf_activations("bf16", "float", "bfloat16") == "exact"
    assert "ignored" in caplog.text  # no blocks: said, not silently dropped


def test_the_amx_switch_is_named_when_it_turns_the_tiles_off(monkeypatch):
    from kvserve.model import loader

    monkeypatch.setenv("KVSERVE_DISABLE_AMX", "1")
    with pytest.raises(ValueError, match="KVSERVE_DISABLE_AMX=1"):
        loader.resolve_gguf_activations("bf16", "gguf", "bfloat16")
