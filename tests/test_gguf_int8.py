"""GGUF products on rows quantized to int8 (`--gguf-activations int8`, kernels/gguf_int8.h): every type
against a float64 reference of the same quantized rows, the same bits for a row alone and in any
batch, fused parts, and the rows' quantization as llama.cpp's Q8_0 makes it."""

from __future__ import annotations

import pytest
import torch
from test_gguf_weights import TYPES, random_blocks, reference

from kvserve.kernels import gguf, library

pytestmark = pytest.mark.skipif(
    not library.cpu_kernels_available() or not gguf.gguf_int8_available(), reason="needs AVX512-VNNI/BW/VBMI kernels"
)


def int8_weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[gguf.GgufWeight, torch.Tensor]:
    blocks = random_blocks(type_name, n, k, seed)
    weight = gguf.gguf_weight(torch.from_numpy(blocks), type_name, n, k, activations="int8")
    return weight, torch.from_numpy(reference(type_name, blocks, n, k)).double()


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantizes it, dequantized in float64: per block of 32 values, d = max|x| / 127
    and q = round-half-even(x * (127 / max|x|)) in float32."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse).clamp(-128, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 64])
def test_the_product_is_the_quantized_rows_times_the_exact_weights(type_name, rows):
    """Bound: each sub-block's integer sum is exact; what rounds is its float32 conversion, the
    scale's product and the float32 sum over the k/32 (k/16) sub-blocks."""
    n, k = 37, 512
    weight, w64 = int8_weight(type_name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[:, 100] = 40.0  # an outlier channel, as real activations have
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        out, argmax = gguf.gguf_matmul(xs, weight, out_dtype=torch.float32, want_argmax=True)
        want = quantized_rows(xs) @ w64.T
        subs = k // (16 if type_name == "Q6_K" else 32)
        bound = 4 * subs * 2.0**-23 * (quantized_rows(xs).abs() @ w64.abs().T) + 1e-6
        assert ((out.double() - want).abs() <= bound).all(), (out.double() - want).abs().max()
        assert torch.equal(argmax, out.argmax(1))
        exact = xs.double() @ w64.T  # what the rows' quantization costs: about 1% of the output's scale here
        assert (out.double() - exact).norm() <= 0.02 * exact.norm()


@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(type_name):
    weight, _ = int8_weight(type_name, 70, 512, seed=3)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    batched, argmax = gguf.gguf_matmul(x, weight, out_dtype=torch.float32, want_argmax=True)
    for count in (1, 2, 7, 8, 9, 13):
        part, part_argmax = gguf.gguf_matmul(x[:count], weight, out_dtype=torch.float32, want_argmax=True)
        assert torch.equal(part, batched[:count]) and torch.equal(part_argmax, argmax[:count])
    for i in (0, 33, 63):
        assert torch.equal(gguf.gguf_matmul(x[i : i + 1], weight, out_dtype=torch.float32)[0], batched[i : i + 1])


@pytest.mark.parametrize("rows", [1, 6, 40])
def test_a_fused_projections_parts_give_each_parts_own_bits(rows):
    parts = tuple(int8_weight(t, n, 256, seed=i)[0] for i, (t, n) in enumerate([("Q5_0", 48), ("Q8_0", 16), ("Q4_K", 35)]))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    fused = gguf.GgufProduct(parts)(x)
    alone = torch.cat([gguf.gguf_matmul(x, part)[0] for part in parts], 1)
    assert torch.equal(fused, alone)
    with pytest.raises(ValueError, match="activations"):
        gguf.GgufProduct((parts[0], parts[1].with_activations("exact")))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_non_finite_rows_give_nan_and_zero_rows_give_zero(type_name):
    weight, _ = int8_weight(type_name, 32, 256)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(5))
    x[0] = 0
    x[1, 7] = float("inf")
    x[2, 5] = float("nan")  # one NaN among finite values: max ignores it, the check must not
    x[3, 31] = float("nan")
    x[4, 200] = -float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        out = gguf.gguf_matmul(x.to(dtype), weight, out_dtype=torch.float32)[0]
        assert torch.equal(out[0], torch.zeros(32)) and out[1:5].isnan().all() and out[5].isfinite().all()


def test_blocks_too_small_for_127_over_their_max_are_quantized_exactly():
    """127 / max|x| overflows float32 below max|x| ~ 3.7e-37: such a block is quantized in double."""
    weight, w64 = int8_weight("Q8_0", 16, 64)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    x[0, :32] *= 1e-38
    x[1, 32:] *= 1e-37
    x = x.float()
    out = gguf.gguf_matmul(x, weight)[0].double()
    blocks = x.double().reshape(2, 2, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    want = (torch.round(blocks * 127 / amax) * (amax.float() / 127).double()).reshape(2, 64) @ w64.T
    assert torch.allclose(out, want, rtol=1e-3, atol=1e-42)


def test_the_weight_says_how_its_rows_are_taken():
    blocks = torch.from_numpy(random_blocks("Q8_0", 16, 64))
    with pytest.raises(ValueError, match="activations"):
        gguf.gguf_weight(blocks, "Q8_0", 16, 64, activations="int4")
    exact = gguf.gguf_weight(blocks, "Q8_0", 16, 64)
    assert exact.activations == "exact" and exact.with_activations("int8").data is exact.data


def test_the_engine_flag_is_checked_and_names_how_the_rows_are_taken(tiny_root):
    from tiny_models import tiny_gguf

    from kvserve import LLM
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        EngineConfig(gguf_activations="int4")
    path = str(tiny_gguf(tiny_root, quantized=True))
    held = {}
    for mode in ("auto", "int8", "exact"):
        llm = LLM(path, weight_dtype="gguf", gguf_activations=mode, kv_cache_memory=0.02, skip_tokenizer_init=True)
        layer = llm.engine.model.layers[0]
        held[mode] = (llm.engine.gguf_activations, {p.activations for p in layer.self_attn.qkv_proj.gguf},
                      {p.activations for p in layer.mlp.down_proj.gguf or ()}, llm.engine.model.gguf_lm_head.activations,
                      llm.engine.cache_identity.dtype)  # fmt: skip
    assert held["auto"][:4] == ("exact", {"exact"}, {"exact"}, "exact")  # int8 rows cost more than a default may
    assert held["int8"][:4] == ("int8", {"int8"}, {"int8"}, "exact")
    assert held["exact"][:4] == held["auto"][:4] and held["exact"][4] == held["auto"][4]
    assert held["int8"][4] != held["exact"][4]  # another cache: their K/V differ
    float_weights = LLM(path, weight_dtype="float32", dtype="float32", gguf_activations="int8", kv_cache_memory=0.02, skip_tokenizer_init=True)
    assert float_weights.engine.gguf_activations == "exact"  # no blocks, nothing to quantize rows for
