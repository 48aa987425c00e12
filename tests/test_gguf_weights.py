"""Weights kept in their GGUF blocks: the kernel decodes every block type to exactly gguf-py's values,
its products are float32 FMA chains over them (a float64 reference within float32's accumulation
error, the same bits for a row alone or batched, on this CPU's build and an AVX2-only one), and a
GGUF model held that way is the file's size and gives the float32-weight path's bits."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import gguf, library
from kvserve.model.errors import ModelLoadError
from tiny_models import TINY_GGUF_TYPES, tiny_gguf

pytestmark = pytest.mark.skipif(not library.cpu_kernels_available(), reason="needs the native kernels")

TYPES = list(gguf.GGUF_BLOCKS)
# byte offsets of each block's fp16 scale fields (random bytes there could be inf or NaN)
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k values as random blocks of this type (every code and scale bit pattern), with
    finite fp16 scales."""
    _, values, size = gguf.GGUF_BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // values, size), dtype=np.uint8)
    for at in HALF_FIELDS[type_name]:
        blocks[:, at : at + 2] = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def reference(type_name: str, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(blocks, GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float32)


def weight_of(type_name: str, n: int, k: int, seed: int = 0) -> tuple[gguf.GgufWeight, np.ndarray]:
    blocks = random_blocks(type_name, n, k, seed)
    return gguf.gguf_weight(torch.from_numpy(blocks), type_name, n, k), reference(type_name, blocks, n, k)


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_decode_to_gguf_py_values_exactly(type_name):
    weight, ref = weight_of(type_name, 37, 512)
    assert np.array_equal(gguf.gguf_dequantize(weight).numpy().view(np.uint32), ref.view(np.uint32))
    ids = torch.tensor([[5, 0], [36, 5]])
    picked = gguf.gguf_dequantize(weight, ids)
    assert picked.shape == (2, 2, 512)
    assert np.array_equal(picked.numpy().view(np.uint32), ref[ids.numpy()].view(np.uint32))


def magnitudes(type_name: str, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """|scale * code| + |min| per weight: what bounds the rounding of a product that keeps the two
    terms apart (bf16 rows on the codes: scale * sum(x * code) + min * sum(x))."""
    if type_name not in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        return np.abs(reference(type_name, blocks, n, k))
    size = gguf.GGUF_BLOCKS[type_name][2]
    scale_only, min_only = (blocks.reshape(-1, size).copy() for _ in range(2))
    scale_only[:, 2:4] = 0  # m (or dmin) = 0
    min_only[:, 0:2] = 0  # d = 0
    return np.abs(reference(type_name, scale_only.reshape(n, -1), n, k)) + np.abs(reference(type_name, min_only.reshape(n, -1), n, k))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_product_decodes_every_tile_exactly(type_name, dtype):
    """Identity rows pick weight columns out of the product: exact (up to the sign of a zero: 0 + -0
    is +0), float32 rows (one FMA of 1.0 per output) and bf16 rows alike: on a CPU with AVX512-BF16
    a bf16 row multiplies the blocks' integer codes and applies each block's scale (and min) in
    float32, so a weight is gguf-py's float32 value, never rounded to bf16. k rows run the
    decode-a-tile path, one row the fused one."""
    weight, ref = weight_of(type_name, 37, 256, seed=1)
    eye = torch.eye(256, dtype=dtype)
    assert np.array_equal(gguf.gguf_matmul(eye, weight, out_dtype=torch.float32)[0].numpy().T, ref)
    for column in (0, 17, 255):
        row = gguf.gguf_matmul(eye[column : column + 1].contiguous(), weight, out_dtype=torch.float32)[0][0]
        assert np.array_equal(row.numpy(), ref[:, column])


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 7, 8, 64])
def test_the_product_matches_a_float64_reference(type_name, rows):
    n, k = 37, 512
    blocks = random_blocks(type_name, n, k, seed=rows)
    weight, ref = gguf.gguf_weight(torch.from_numpy(blocks), type_name, n, k), reference(type_name, blocks, n, k)
    w64 = torch.from_numpy(ref).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for x in (x, x.bfloat16()):
        out, argmax = gguf.gguf_matmul(x, weight, out_dtype=torch.float32, want_argmax=True)
        exact = x.double() @ w64.T
        magnitude = w64.abs() if x.dtype == torch.float32 else torch.from_numpy(magnitudes(type_name, blocks, n, k)).double()
        bound = k * 2.0**-23 * (x.double().abs() @ magnitude.T)  # float32 accumulation over k terms
        assert ((out.double() - exact).abs() <= bound).all()
        assert torch.equal(argmax, out.argmax(1))
        bf16 = gguf.gguf_matmul(x, weight, out_dtype=torch.bfloat16)[0]
        assert torch.equal(bf16, out.bfloat16())


# float32 rows: four types cover the decoding paths; bf16 rows: every type's codes
@pytest.mark.parametrize(
    "type_name,dtype",
    [pytest.param(t, torch.float32, id=f"{t}-float32") for t in ("Q8_0", "Q5_0", "Q4_K", "Q6_K")]
    + [pytest.param(t, torch.bfloat16, id=f"{t}-bfloat16") for t in TYPES],
)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(type_name, dtype):
    """Up to 8 rows fold each decoded value (float rows) or pair of codes (bf16 rows) straight into
    their chains; more decode a tile once per chunk of rows and multiply it there: the same
    operations per output either way."""
    weight, _ = weight_of(type_name, 70, 512, seed=3)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)).to(dtype)
    batched, argmax = gguf.gguf_matmul(x, weight, out_dtype=torch.float32, want_argmax=True)
    for count in (1, 2, 4, 5, 6, 7, 8, 9, 13):
        part, part_argmax = gguf.gguf_matmul(x[:count], weight, out_dtype=torch.float32, want_argmax=True)
        assert torch.equal(part, batched[:count]) and torch.equal(part_argmax, argmax[:count])
    for i in (0, 33, 63):
        assert torch.equal(gguf.gguf_matmul(x[i : i + 1], weight, out_dtype=torch.float32)[0], batched[i : i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_fused_projections_parts_in_one_call_give_each_parts_own_bits(dtype):
    """A fused projection's parts (mixed types, as a Q4_K_M file mixes them) run in one call, one
    parallel loop over all their tiles for a decode step: each part's columns are its own product's
    bits, at every row count, into a fresh matrix or a column slice of a wider one."""
    shapes = [("Q5_0", 37), ("Q8_0", 16), ("Q4_K", 70), ("Q6_K", 3), ("Q4_1", 20)]
    parts = tuple(weight_of(type_name, n, 256, seed=i)[0] for i, (type_name, n) in enumerate(shapes))
    width = sum(n for _, n in shapes)
    product = gguf.GgufProduct(parts)
    for rows in (1, 3, 8, 9, 20):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
        alone = torch.cat([gguf.gguf_matmul(x, part, out_dtype=torch.float32)[0] for part in parts], dim=1)
        assert torch.equal(product(x, out_dtype=torch.float32), alone)
        wide = torch.zeros(rows, width + 10, dtype=dtype)
        product(x, out=wide[:, 4 : 4 + width])
        assert torch.equal(wide[:, 4 : 4 + width], alone.to(dtype)) and not wide[:, :4].any() and not wide[:, 4 + width :].any()
    with pytest.raises(ValueError, match="sharing k"):
        gguf.GgufProduct((parts[0], weight_of("Q8_0", 16, 64)[0]))
    with pytest.raises(ValueError, match="out must be"):
        product(x, out=torch.empty(20, width - 1, dtype=dtype))
    with pytest.raises(ValueError, match="x must be"):
        product(x[:, :128].contiguous())


def test_outputs_go_into_a_column_slice_and_argmax_alone():
    weight, _ = weight_of("Q4_1", 40, 96, seed=4)
    x = torch.randn(9, 96)
    full = gguf.gguf_matmul(x, weight)[0]
    wide = torch.zeros(9, 100)
    gguf.gguf_matmul(x, weight, out=wide[:, 30:70])
    assert torch.equal(wide[:, 30:70], full) and not wide[:, :30].any() and not wide[:, 70:].any()
    out, argmax = gguf.gguf_matmul(x, weight, want_output=False, want_argmax=True)
    assert out is None and torch.equal(argmax, full.argmax(1))


def test_bad_inputs_are_refused():
    blocks = torch.from_numpy(random_blocks("Q8_0", 4, 64))
    with pytest.raises(ValueError, match="not one the kernels read"):
        gguf.gguf_weight(blocks, "Q2_K", 4, 64)
    with pytest.raises(ValueError, match="bytes"):
        gguf.gguf_weight(blocks[:3], "Q8_0", 4, 64)
    with pytest.raises(ValueError, match="multiple"):
        gguf.gguf_weight(blocks, "Q8_0", 4, 48)
    weight = gguf.gguf_weight(blocks, "Q8_0", 4, 64)
    with pytest.raises(IndexError):
        gguf.gguf_dequantize(weight, torch.tensor([4]))
    with pytest.raises(ValueError):
        gguf.gguf_matmul(torch.randn(2, 63), weight)
    with pytest.raises(ValueError):
        gguf.gguf_matmul(torch.randn(2, 64), weight, out=torch.empty(2, 3))


AVX2_CHECK = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[2])
from test_gguf_weights import TYPES, weight_of
from kvserve.kernels import gguf
out = []
for type_name in TYPES:
    weight, _ = weight_of(type_name, 35, 256, seed=5)
    for rows in (1, 6, 8, 40):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        out += list(gguf.gguf_matmul(x, weight, out_dtype=torch.float32, want_argmax=True))
    out.append(gguf.gguf_dequantize(weight))
torch.save(out, sys.argv[1])
"""


def test_the_avx2_build_gives_the_same_bits(tmp_path):
    """KVSERVE_MARCH=haswell builds the AVX2 kernel (ymm halves, 6-row blocks); this CPU's build may
    be AVX-512 (8-row blocks, one zmm per tile): the same values and FMA chains, so the same bits."""
    results = {}
    for march in ("haswell", None):
        env = {key: value for key, value in os.environ.items() if key != "KVSERVE_MARCH"}
        if march:
            env["KVSERVE_MARCH"] = march
        path = tmp_path / f"{march or 'native'}.pt"
        subprocess.run([sys.executable, "-c", AVX2_CHECK, str(path), os.path.dirname(__file__)], env=env, check=True, capture_output=True)
        results[march] = torch.load(path)
    assert len(results["haswell"]) == len(results[None]) > 0
    for avx2, native in zip(results["haswell"], results[None]):
        assert torch.equal(avx2, native)


# --------------------------------------------------------------------------- a GGUF model
PROMPTS = [[1, 5, 9, 20, 33, 7, 7, 100], [3, 4, 5], list(range(40, 90))]


def tiny_llm(tiny_root, weight_dtype: str, dtype: str = "float32", **settings) -> LLM:
    path = tiny_gguf(tiny_root, quantized=True)
    return LLM(str(path), weight_dtype=weight_dtype, dtype=dtype, kv_cache_memory=0.02, skip_tokenizer_init=True, **settings)


def traces(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(tuple(o.token_ids), tuple((lp.logprob, tuple(sorted(lp.top.items()))) for lp in o.logprobs or ())) for o in outs]


def test_a_gguf_model_is_held_in_its_blocks_at_the_files_size(tiny_root):
    from kvserve.model.layers import GgufEmbedding
    from kvserve.model.loader import gguf_index

    llm = tiny_llm(tiny_root, "auto")
    model = llm.engine.model
    assert isinstance(model.embed_tokens, GgufEmbedding) and model.gguf_lm_head is not None
    qkv = model.layers[0].self_attn.qkv_proj
    assert [p.type_name for p in qkv.gguf] == ["Q5_0", "Q5_0", "Q8_0"] and qkv.weight.numel() == 0
    assert [p.type_name for p in model.layers[0].mlp.gate_up_proj.gguf] == ["Q4_0", "Q4_1"]
    assert model.layers[0].self_attn.o_proj.gguf is None  # an F32 tensor stays a float weight
    held = {id(p.data): p.nbytes for m in model.modules() for p in getattr(m, "gguf", None) or ()}
    held |= {id(model.embed_tokens.blocks.data): model.embed_tokens.blocks.nbytes, id(model.gguf_lm_head.data): model.gguf_lm_head.nbytes}
    index = gguf_index(tiny_gguf(tiny_root, quantized=True))
    quantized = sum(t["bytes"] for t in index["tensors"] if t["type"] in gguf.GGUF_BLOCKS)
    assert sum(held.values()) == quantized  # every quantized tensor once, at its size in the file
    assert set(TINY_GGUF_TYPES.values()) <= {t["type"] for t in index["tensors"]}


def test_gguf_blocks_give_the_float32_weights_bits(tiny_root):
    """Dequantized into float32, the weights hold the same values and float_matmul runs the same FMA
    chains: greedy and seeded tokens with their logprobs agree to the bit. (bf16 weights round the
    values, so only float32 compares.)"""
    dtype = "float32"
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True, logprobs=2)]  # fmt: skip
    batch = [(p, s) for p in PROMPTS for s in params]
    gguf = traces(tiny_llm(tiny_root, "gguf", dtype, gguf_activations="exact"), [p for p, _ in batch], [s for _, s in batch])
    dense = traces(tiny_llm(tiny_root, dtype, dtype), [p for p, _ in batch], [s for _, s in batch])
    assert gguf == dense


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activations", ["exact", "int8", "bf16"])
def test_every_way_a_request_runs_gives_the_same_bits_on_gguf_blocks(tiny_root, dtype, activations):
    from conftest import random_prompts

    if activations == "int8" and not gguf.gguf_int8_available():
        pytest.skip("int8 rows need AVX512-VNNI/BW/VBMI")
    if activations == "bf16" and (dtype != "bfloat16" or not gguf.gguf_tiles_available()):
        pytest.skip("bf16 tiles take bf16 rows, on a CPU whose AMX tiles run")

    shared = random_prompts(1, 37, 37, seed=41)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 30, seed=42)]
    others = random_prompts(63, 5, 60, seed=43)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True, logprobs=2)
    requests = [(p, s) for p in prompts for s in (greedy, seeded)]
    llm = tiny_llm(tiny_root, "gguf", dtype, max_num_seqs=64, enable_prefix_caching=False, gguf_activations=activations)
    assert llm.engine.gguf_activations == activations
    alone = [traces(llm, [p], s)[0] for p, s in requests]
    for count in (7, 63):
        batch = requests + [(o, greedy) for o in others[:count]]
        assert traces(llm, [p for p, _ in batch], [s for _, s in batch])[: len(requests)] == alone, f"batched with {count}"
    cached = tiny_llm(tiny_root, "gguf", dtype, enable_prefix_caching=True, gguf_activations=activations)
    traces(cached, [shared], greedy)
    assert [traces(cached, [p], s)[0] for p, s in requests] == alone, "after a prefix hit"
    chunked = tiny_llm(tiny_root, "gguf", dtype, enable_prefix_caching=False, max_num_batched_tokens=16, gguf_activations=activations)
    assert [traces(chunked, [p], s)[0] for p, s in requests] == alone, "prefilled in chunks of 16"


def test_weight_dtype_choices_are_checked(tiny_root, tiny_dir, tmp_path):
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match="needs --dtype bfloat16"):
        EngineConfig(weight_dtype="bfloat16", dtype="float32")
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        EngineConfig(weight_dtype="int3")
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(tiny_dir("llama")), weight_dtype="gguf", dtype="float32", kv_cache_memory=0.02)
    with pytest.raises(ValueError, match="float32 or bfloat16 activations"):
        tiny_llm(tiny_root, "gguf", "float16")
    # auto: the blocks with float32 activations; bf16 activations keep bf16 weights (their AMX/bf16-dot kernels)
    assert tiny_llm(tiny_root, "auto", "float32").engine.model.gguf_lm_head is not None
    assert tiny_llm(tiny_root, "auto", "bfloat16").engine.model.gguf_lm_head is None
    # a type the kernels do not read: refused by name under gguf, dequantized under auto
    odd = tiny_gguf(str(tmp_path), quantized=True, types={**TINY_GGUF_TYPES, "ffn_down": "IQ4_NL"})
    with pytest.raises(ModelLoadError, match="IQ4_NL"):
        LLM(str(odd), weight_dtype="gguf", dtype="float32", kv_cache_memory=0.02, skip_tokenizer_init=True)
    fallback = LLM(str(odd), weight_dtype="auto", dtype="float32", kv_cache_memory=0.02, skip_tokenizer_init=True)
    assert fallback.engine.model.gguf_lm_head is None
    assert len(fallback.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].token_ids) == 3


def test_a_quantized_norm_is_dequantized_beside_the_blocks(tmp_path):
    """A quantized 1-D tensor (a norm in Q8_0) is no product's weight: it is dequantized, and the
    model still gives the float32-weights path's bits."""
    path = str(tiny_gguf(str(tmp_path), quantized=True, types={**TINY_GGUF_TYPES, "attn_norm": "Q8_0"}))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    runs = []
    for weight_dtype in ("gguf", "float32"):
        llm = LLM(path, weight_dtype=weight_dtype, dtype="float32", kv_cache_memory=0.02, skip_tokenizer_init=True)
        runs.append(traces(llm, PROMPTS, params))
    assert runs[0] == runs[1]


# --------------------------------------------------------------------------- the int8 screen of a Q8_0 lm_head
needs_screen = pytest.mark.skipif(not gguf.gguf_screen_available(), reason="the Q8_0 screen needs AVX512-BF16, VNNI and VBMI")


def near_tie_weight(n: int, k: int, seed: int = 0) -> gguf.GgufWeight:
    """Q8_0 rows that differ from one base row by a code or two (logits closer together than the
    screen's error bound, so the exact rescoring decides), with exact duplicates (ties)."""
    rng = np.random.default_rng(seed)
    blocks_per_row = k // 32
    base = rng.integers(-127, 128, size=(blocks_per_row, 32), dtype=np.int16)
    scales = (rng.uniform(0.5, 1.5, size=blocks_per_row) * 0.01).astype(np.float16)
    rows = np.empty((n, blocks_per_row, 34), dtype=np.uint8)
    for i in range(n):
        codes = base.copy()
        for _ in range(rng.integers(1, 3)):
            b, j = rng.integers(blocks_per_row), rng.integers(32)
            codes[b, j] = np.clip(codes[b, j] + rng.choice([-1, 1]), -127, 127)
        rows[i, :, :2] = scales.view(np.uint8).reshape(-1, 2)
        rows[i, :, 2:] = codes.astype(np.int8).view(np.uint8)
    rows[n // 2] = rows[3]  # a tie: the lower index must win
    rows[n - 1] = rows[3]
    return gguf.gguf_weight(torch.from_numpy(rows.reshape(n, -1).copy()), "Q8_0", n, k)


@needs_screen
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_the_screened_argmax_is_the_full_products(rows):
    g = torch.Generator().manual_seed(rows)
    for weight, screens in ((weight_of("Q8_0", 1000, 256, seed=rows)[0], True), (near_tie_weight(301, 128, seed=rows), False)):
        screen = gguf.gguf_screen(weight)
        x = torch.randn(rows, weight.k, generator=g)
        x[:, 5] *= 40  # an outlier dim: its block's scale is coarse
        if rows > 2:
            x[1] = x[0]  # the same row twice
        x = x.to(torch.bfloat16)
        full = gguf.gguf_matmul(x, weight, want_output=False, want_argmax=True)[1]
        got, rescored = gguf.gguf_screened_argmax(x, screen)
        assert torch.equal(got, full)
        tiles = -(-weight.n // 16)
        assert rows <= rescored < rows * tiles if screens else rescored <= rows * tiles  # random rows: most tiles screened out


@needs_screen
def test_the_near_ties_are_decided_by_the_exact_rescoring():
    weight = near_tie_weight(301, 128, seed=5)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    full = gguf.gguf_matmul(x, weight, want_output=False, want_argmax=True)[1]
    got, rescored = gguf.gguf_screened_argmax(x, gguf.gguf_screen(weight))
    assert torch.equal(got, full) and rescored >= 16 * 10  # most tiles stay candidates
    tied = torch.zeros(1, 128, dtype=torch.bfloat16)  # every logit 0: the lowest index
    assert gguf.gguf_screened_argmax(tied, gguf.gguf_screen(weight))[0].tolist() == [0]


@needs_screen
def test_the_screen_refuses_what_it_does_not_cover():
    weight, _ = weight_of("Q8_0", 64, 64)
    screen = gguf.gguf_screen(weight)
    bad = torch.randn(2, 64).to(torch.bfloat16)
    bad[1, 3] = float("nan")
    assert gguf.gguf_screened_argmax(bad, screen) == (None, 0)  # the caller takes the full product
    # where float32 over- or underflows (vdpbf16ps flushes subnormals) the screen hands rows back too (found by QA)
    g = torch.Generator().manual_seed(9)
    for scale in (1e36, 1e30, 1e20, 1e-20, 1e-31, 1e-38, 1e-39):
        x = (torch.randn(9, 64, generator=g) * scale).to(torch.bfloat16)
        got = gguf.gguf_screened_argmax(x, screen)[0]
        full = gguf.gguf_matmul(x, weight, want_output=False, want_argmax=True)[1]
        assert got is None if scale > 2.0**64 or scale < 2.0**-90 else torch.equal(got, full), scale
    one_hot = torch.zeros(1, 64)
    one_hot[0, 5] = 1e-40
    assert gguf.gguf_screened_argmax(one_hot.to(torch.bfloat16), screen) == (None, 0)
    with pytest.raises(ValueError, match="bf16"):
        gguf.gguf_screened_argmax(torch.randn(2, 64), screen)
    with pytest.raises(ValueError, match="Q8_0"):
        gguf.gguf_screen(weight_of("Q4_0", 64, 64)[0])


@needs_screen
def test_greedy_rows_on_a_q8_0_lm_head_take_the_screen_with_the_same_tokens(tmp_path):
    from kvserve.model import transformer

    path = tiny_gguf(str(tmp_path), quantized=True, types={**TINY_GGUF_TYPES, "output": "Q8_0"})
    llm = LLM(str(path), weight_dtype="gguf", dtype="bfloat16", kv_cache_memory=0.02, skip_tokenizer_init=True, enable_prefix_caching=False)
    model = llm.engine.model
    assert model.gguf_screen is not None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [p[i:] + [i] for p in PROMPTS for i in range(4)]  # 12 requests: steps of 9 rows or more take the screen
    calls = []
    screened = gguf.gguf_screened_argmax
    try:
        transformer.gguf.gguf_screened_argmax = lambda *a: calls.append(1) or screened(*a)
        with_screen = traces(llm, prompts, params)
    finally:
        transformer.gguf.gguf_screened_argmax = screened
    assert calls, "greedy rows took the screen"
    model.gguf_screen = None
    assert traces(llm, prompts, params) == with_screen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_untied_embedding_stays_in_its_blocks_under_dequantized_weights(tiny_root, dtype):
    """Dequantized weights from a GGUF whose embedding is untied (the tiny Llama: a Q8_0 token_embd,
    a Q4_1 output) keep the embedding in the file's blocks: a looked-up row dequantizes to the
    values the float copy held, so the same tokens and logprobs come out as with that copy."""
    from gguf import GGUFReader
    from torch import nn

    from kvserve.model.layers import GgufEmbedding

    path = tiny_gguf(tiny_root, quantized=True)
    llm = LLM(str(path), dtype=dtype, weight_dtype=dtype, kv_cache_memory=0.02, skip_tokenizer_init=True)
    model = llm.engine.model
    assert isinstance(model.embed_tokens, GgufEmbedding) and model.gguf_lm_head is None and llm.stats()["weight_dtype"] == dtype
    (tensor,) = [t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight"]
    n, k = model.config.vocab_size, model.config.hidden_size
    expected = torch.from_numpy(reference(tensor.tensor_type.name, np.asarray(tensor.data), n, k)).to(getattr(torch, dtype))
    ids = torch.arange(n).view(2, -1)
    assert torch.equal(model.embed_tokens(ids), expected[ids])
    assert model.embed_tokens.blocks.data.numel() == -(-n // 16) * 16 * int(tensor.n_bytes) // n  # the file's bytes, in tiles of 16 rows
    prompts = [[5, 9, 200, 13, 7], [1, 2, 3]]
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3, ignore_eos=True)
    blocks_run = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    model.embed_tokens = nn.Embedding.from_pretrained(expected, freeze=True)  # the float copy, as before
    llm.reset_prefix_cache()
    assert blocks_run == [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
