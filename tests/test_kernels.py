"""The native CPU kernels against plain torch references."""

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.engine import resolve_attention_backend
from kvserve.attention.torch_sdpa import context_mask
from kvserve.kernels import attention, fused, library, products, sampling
from kvserve.kernels.args import STRUCTS, KVView
from kvserve.kernels.build import cpu_flags, load_kernels
from kvserve.kv.spec import KVCacheSpec

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (heads, kv heads, head_dim): GQA groups of 4, 3 and 1; head dims on the vector path (256, 64, 32) and off it (24)
SHAPES = [(4, 1, 256), (6, 2, 24), (9, 3, 64), (8, 8, 32)]


def test_kernels_build_here():
    assert library.cpu_kernels_available(), "g++ should be present on every machine this project runs on"


def reference_attention(q, key_cache, value_cache, table, block_size, query_positions, window):
    """Gather the context slot by slot and run SDPA in float32 under the causal (and window) mask."""
    n, heads, head_dim = q.shape
    kv_heads = key_cache.shape[1]
    end = int(query_positions.max()) + 1
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(end)])
    keys = key_cache[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    values = value_cache[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    mask = context_mask(query_positions, query_positions + 1, end, window)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values, attn_mask=mask, scale=head_dim**-0.5)
    return out.transpose(0, 1)


def random_pool(num_blocks, block_size, kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks * block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size,window", [(16, None), (16, 40), (8, None), (8, 5)])
def test_paged_decode_attention_matches_sdpa(dtype, shape, block_size, window):
    heads, kv_heads, head_dim = shape
    num_blocks = 48
    key_cache, value_cache = random_pool(num_blocks, block_size, kv_heads, head_dim, dtype, seed=1)
    lengths = torch.tensor([1, 7, block_size, block_size + 1, 100, 3 * block_size - 1])
    max_blocks = -(-int(lengths.max()) // block_size)
    g = torch.Generator().manual_seed(2)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lengths])
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    spec = KVCacheSpec(1, key_cache.shape[1], key_cache.shape[2], "float32", block_size)
    view = attention.kv_view(spec, key_cache, value_cache)
    out = attention.paged_decode_attention(q, view, tables, lengths, head_dim**-0.5, window)
    for row, length in enumerate(lengths.tolist()):
        ref = reference_attention(q[row : row + 1], key_cache, value_cache, tables[row].tolist(), block_size, torch.tensor([length - 1]), window)
        err = (out[row].float() - ref[0]).abs().max().item()
        assert err < TOLERANCE[dtype], f"row {row} (context {length}): max error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("start,count,window", [(0, 70, None), (0, 70, 20), (37, 50, None), (100, 30, 20), (0, 1, None), (5, 1, 3)])
def test_paged_prefill_attention_matches_sdpa(dtype, shape, start, count, window):
    heads, kv_heads, head_dim = shape
    block_size, num_blocks = 16, 16
    key_cache, value_cache = random_pool(num_blocks, block_size, kv_heads, head_dim, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    table = torch.randperm(num_blocks, generator=g)[: -(-(start + count) // block_size)]
    q = torch.randn(count, heads, head_dim, generator=g).to(dtype)
    view = attention.kv_view(KVCacheSpec(1, kv_heads, head_dim, "float32", block_size), key_cache, value_cache)
    out = attention.paged_prefill_attention(q, view, table, start, head_dim**-0.5, window)
    ref = reference_attention(q, key_cache, value_cache, table.tolist(), block_size, torch.arange(start, start + count), window)
    err = (out.float() - ref).abs().max().item()
    assert err < TOLERANCE[dtype], f"max error {err:.2e}"


def test_kernels_reject_a_table_that_does_not_cover_the_context():
    key_cache, value_cache = random_pool(4, 16, 1, 32, torch.float32, seed=0)
    q = torch.randn(1, 2, 32)
    view = attention.kv_view(KVCacheSpec(1, 1, 32, "float32", 16), key_cache, value_cache)
    with pytest.raises(ValueError, match="block table"):
        attention.paged_decode_attention(q, view, torch.tensor([[0]]), torch.tensor([17]), 0.1, None)
    with pytest.raises(ValueError, match="block table"):
        attention.paged_prefill_attention(torch.randn(17, 2, 32), view, torch.tensor([0]), 0, 0.1, None)


def test_argument_structs_match_the_c_layout():
    from kvserve.kernels.args import layout_mismatches
    from kvserve.kernels.build import load_kernels

    assert len(STRUCTS) == 23
    assert layout_mismatches(load_kernels()) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_read_any_layout_the_view_describes(dtype):
    """Blocks that interleave K and V ([block][K|V][token][head][dim]): the view's strides alone tell
    the kernels where each row is."""
    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 64, 8, 12
    g = torch.Generator().manual_seed(9)
    blocks = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    key_cache = blocks[:, 0].reshape(-1, kv_heads, head_dim)  # copies, in the plain layout, for the reference
    value_cache = blocks[:, 1].reshape(-1, kv_heads, head_dim)
    view = KVView(blocks[:, 0].data_ptr(), blocks[:, 1].data_ptr(), None, None, 2 * block_size * kv_heads * head_dim,
                  kv_heads * head_dim, 0, 0, attention.NO_RESIDUAL, library._DTYPE_CODES[dtype], library._DTYPE_CODES[dtype],
                  block_size, kv_heads, head_dim, 32, 32)  # fmt: skip
    lengths = torch.tensor([5, 40, 61])
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:8] for _ in lengths])
    q = torch.randn(3, heads, head_dim, generator=g).to(dtype)
    out = attention.paged_decode_attention(q, view, tables, lengths, head_dim**-0.5, None)
    for row, length in enumerate(lengths.tolist()):
        ref = reference_attention(q[row : row + 1], key_cache, value_cache, tables[row].tolist(), block_size, torch.tensor([length - 1]), None)
        assert (out[row].float() - ref[0]).abs().max().item() < TOLERANCE[dtype]
    chunk = torch.randn(20, heads, head_dim, generator=g).to(dtype)
    out = attention.paged_prefill_attention(chunk, view, tables[1], 25, head_dim**-0.5, 16)
    ref = reference_attention(chunk, key_cache, value_cache, tables[1].tolist(), block_size, torch.arange(25, 45), 16)
    assert (out.float() - ref).abs().max().item() < TOLERANCE[dtype]


def test_backend_resolution():
    assert resolve_attention_backend("auto", torch.device("cpu"), torch.float32) == "cpu_paged"
    assert resolve_attention_backend("auto", torch.device("meta"), torch.float32) == "torch_sdpa"
    assert resolve_attention_backend("torch_sdpa", torch.device("cpu"), torch.float32) == "torch_sdpa"
    with pytest.raises(ValueError, match="cpu_paged"):
        resolve_attention_backend("cpu_paged", torch.device("meta"), torch.float32)


def torch_norm(x, weight, eps, scale_after_cast):
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if scale_after_cast:
        return (weight * normed.to(x.dtype)).to(x.dtype)
    return (normed * weight).to(x.dtype)


def close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    return (a.float() - b.float()).abs().max().item() <= tol * max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_after_cast", [False, True])
def test_rms_norm_and_residual_add_match_torch(dtype, scale_after_cast):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 96, generator=g).to(dtype)
    addend = torch.randn(37, 96, generator=g).to(dtype)
    w1, w2 = torch.rand(96, generator=g) + 0.5, torch.rand(96, generator=g) + 0.5
    assert close(fused.rms_norm(x, w1, 1e-6, scale_after_cast), torch_norm(x, w1, 1e-6, scale_after_cast), dtype)
    strided = torch.randn(37, 3, 96, generator=g).to(dtype)[:, 1]  # rows 3 * 96 apart
    assert close(fused.rms_norm(strided, w1, 1e-6, scale_after_cast), torch_norm(strided, w1, 1e-6, scale_after_cast), dtype)
    for addend_weight in (None, w2):
        residual = x.clone()
        out = fused.add_rms_norm(residual, addend, addend_weight, w1, 1e-6, scale_after_cast)
        expected = x + (torch_norm(addend, addend_weight, 1e-6, scale_after_cast) if addend_weight is not None else addend)
        assert close(residual, expected, dtype)
        assert close(out, torch_norm(expected, w1, 1e-6, scale_after_cast), dtype)
    residual = x.clone()
    assert fused.add_rms_norm(residual, addend, None, None, 1e-6, scale_after_cast) is None
    assert close(residual, x + addend, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_matches_the_torch_layers(dtype, qk_norm):
    from kvserve.model.config import RopeConfig
    from kvserve.model.layers import RMSNorm, RotaryEmbedding

    heads, kv_heads, head_dim, tokens = 6, 2, 24, 9
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64)
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 30, 31, 5, 6, 7, 63])
    q_norm, k_norm = RMSNorm(head_dim, 1e-6, True), RMSNorm(head_dim, 1e-6, True)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
        k_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    if qk_norm:
        q, k = q_norm(q), k_norm(k)
    ref_q, ref_k = rotary(positions, q, k)
    got_q, got_k = fused.qk_norm_rope(
        qkv, heads, kv_heads, head_dim, q_norm.weight.data if qk_norm else None, k_norm.weight.data if qk_norm else None,
        1e-6, positions, rotary.cos, rotary.sin,
    )  # fmt: skip
    assert close(got_q, ref_q, dtype) and close(got_k, ref_k, dtype)
    assert rotary.cos.shape == rotary.sin.shape == (64, head_dim // 2)  # one angle per rotated pair, not repeated per half
    with pytest.raises(ValueError, match="head_dim / 2"):
        fused.qk_norm_rope(qkv, heads, kv_heads, head_dim, None, None, 1e-6, positions, rotary.cos.repeat(1, 2), rotary.sin.repeat(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_gated_activation_matches_torch(dtype, activation):
    g = torch.Generator().manual_seed(7)
    gate_up = (4 * torch.randn(13, 2 * 160, generator=g)).to(dtype)
    gate, up = gate_up.split(160, dim=-1)
    act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
    assert close(fused.gated_activation(gate_up, activation), act * up, dtype)


def test_disabling_the_kernels_falls_back_to_torch_ops():
    code = (
        "import torch; from kvserve.kernels import library; from kvserve.engine.engine import resolve_attention_backend; "
        "print(library.cpu_kernels_available(), resolve_attention_backend('auto', torch.device('cpu'), torch.float32))"
    )
    env = {**os.environ, "KVSERVE_DISABLE_KERNELS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "torch_sdpa"]


needs_bf16_dot = pytest.mark.skipif(not products.bf16_dot_available(), reason="this CPU has no AVX512-BF16")
needs_int8_screen = pytest.mark.skipif(not sampling.int8_screen_available(), reason="this CPU has no AVX512-VNNI/BF16")


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 70])
@pytest.mark.parametrize("n, k", [(1000, 96), (37, 640), (2048, 34)])
def test_packed_matmul_matches_torch(rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = products.pack_weight(weight)
    out, argmax = products.packed_matmul(x, packed, out_dtype=torch.float32, want_argmax=True)
    ref = x.double() @ weight.double().t()
    # products of bf16 are exact in float; only the float32 accumulation differs from the float64 reference
    assert (out.double() - ref).abs().max().item() < 1e-4 * k
    assert torch.equal(argmax, out.argmax(dim=1))
    same_dtype, _ = products.packed_matmul(x, packed)
    assert same_dtype.dtype == torch.bfloat16 and torch.equal(same_dtype, out.bfloat16())
    # a strided view of rows (inner stride 1) reads the same values
    wide = torch.zeros(rows, k + 6, dtype=torch.bfloat16)
    wide[:, :k] = x
    assert torch.equal(products.packed_matmul(wide[:, :k], packed, out_dtype=torch.float32)[0], out)


@needs_bf16_dot
def test_packed_argmax_breaks_ties_toward_the_lowest_index():
    weight = torch.zeros(5000, 32, dtype=torch.bfloat16)
    weight[[70, 71, 4100, 4999]] = 1.0  # equal logits, in one tile and in different threads' blocks
    weight[4998] = -1.0
    _, argmax = products.packed_matmul(torch.ones(9, 32, dtype=torch.bfloat16), products.pack_weight(weight), want_output=False, want_argmax=True)
    assert argmax.tolist() == [70] * 9
    # all logits negative: the zero rows padding the last tile (n = 4999 is not a multiple of 16) never win
    _, argmax = products.packed_matmul(torch.ones(2, 32, dtype=torch.bfloat16), products.pack_weight(-weight[:4999].abs() - 1), want_output=False, want_argmax=True)
    assert argmax.tolist() == [0, 0]


@needs_bf16_dot
def test_packed_weights_reject_what_they_cannot_take():
    assert not products.can_pack(torch.zeros(16, 33, dtype=torch.bfloat16))  # odd inner size
    assert not products.can_pack(torch.zeros(16, 32))  # float32
    with pytest.raises(ValueError, match="bf16"):
        products.pack_weight(torch.zeros(16, 32))
    packed = products.pack_weight(torch.zeros(16, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="packed_matmul"):
        products.packed_matmul(torch.zeros(2, 30, dtype=torch.bfloat16), packed)


def lm_head_like(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows with uneven norms and a few outlier dims, like a real tied embedding."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.2)
    weight[:, :3] *= 6
    return weight.bfloat16()


def lm_head_product(weight: torch.Tensor, layout: str):
    """The weight the full logits are computed with, and its argmax product: packed_matmul's, or
    amx_matmul's (skipped without AMX tiles)."""
    if layout == "amx":
        if not products.amx_ready():
            pytest.skip("no AMX tiles on this CPU (the packed cases cover the screen)")
        packed = products.amx_pack_weight(weight)
        return packed, lambda x: products.amx_matmul(x, packed, want_output=False, want_argmax=True)[1]
    packed = products.pack_weight(weight)
    return packed, lambda x: products.packed_matmul(x, packed, want_output=False, want_argmax=True)[1]


@needs_int8_screen
@pytest.mark.parametrize("layout", ["packed", "amx"])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("n, k", [(20000, 640), (4099, 96), (3000, 36)])
def test_screened_argmax_is_bit_identical_to_the_full_product(rows, n, k, layout):
    weight = lm_head_like(n, k, seed=n + k)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 20  # an outlier channel in the hidden state
    x = x.bfloat16()
    if layout == "amx" and k % 32:
        with pytest.raises(ValueError, match="k % 32"):
            sampling.screen_weight(products.amx_pack_weight(weight), weight)
        return
    packed, full_argmax = lm_head_product(weight, layout)
    screened = sampling.screen_weight(packed, weight)
    argmax, rescored = sampling.screened_argmax(x, screened)
    assert torch.equal(argmax, full_argmax(x))
    tiles = -(-n // 16)
    assert (rescored >= 1).all() and rescored.float().mean() < tiles / 4, f"screening kept {rescored.tolist()} of {tiles} tiles"


@needs_int8_screen
@pytest.mark.parametrize("layout", ["packed", "amx"])
def test_screened_argmax_on_near_ties_and_exact_ties(layout):
    k = 64
    weight = lm_head_like(8192, k, seed=3)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    # rows 7000 and 123 become exact copies of the winner; 5000 differs from it by one bf16 ulp in one dim
    winner = int(lm_head_product(weight, layout)[1](x)[0])
    weight[7000] = weight[winner]
    weight[123] = weight[winner]
    weight[5000] = weight[winner]
    weight[5000, 0] = torch.nextafter(weight[5000, 0].float(), torch.tensor(float("inf"))).bfloat16()
    packed, full_argmax = lm_head_product(weight, layout)
    argmax, _ = sampling.screened_argmax(x, sampling.screen_weight(packed, weight))
    assert torch.equal(argmax, full_argmax(x))


def test_kernels_built_for_an_older_cpu_fall_back_where_it_lacks_instructions():
    """KVSERVE_MARCH=haswell builds the AVX2 kernels (what a CPU without AVX-512 gets): the bf16-dot
    and int8 paths report themselves absent and bf16 generation still runs on the native backend."""
    code = (
        "import torch; from kvserve.kernels import library, products, sampling; "
        "print(library.cpu_kernels_available(), products.bf16_dot_available(), sampling.int8_screen_available(), "
        "products.can_pack(torch.zeros(16, 32, dtype=torch.bfloat16)))"
    )
    env = {**os.environ, "KVSERVE_MARCH": "haswell"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "False", "False"]


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_linear_on_packed_weights_matches_f_linear(rows, monkeypatch):
    """Without AMX a bf16 weight is packed for packed_matmul, which takes every product (the
    row-major copy freed); what it does not take unpacks on demand."""
    from kvserve.model.layers import Linear

    monkeypatch.setattr(products, "amx_ready", lambda: False)
    packed_calls = []
    real_packed_matmul = products.packed_matmul
    monkeypatch.setattr(products, "packed_matmul", lambda *a, **k: packed_calls.append(a[0].shape) or real_packed_matmul(*a, **k))
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96).bfloat16()
    with torch.no_grad():
        ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        weight = layer.weight.clone()
        layer.enable_native()
        assert layer.packed is not None and layer.amx is None and layer.weight.numel() == 0
        assert torch.equal(products.unpack_weight(layer.packed), weight)
        out = layer(x)
        assert packed_calls == [x.shape]
        fallback = layer(x.float()[None])[0]  # what the packed kernel does not take unpacks on demand
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max().item() < 0.05
    assert (fallback - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_linear_takes_the_amx_kernel_for_every_row_count_where_amx_is_ready(rows, monkeypatch):
    """On an AMX CPU (forced here, the tile instructions emulated) a bf16 weight is packed once in
    AMX tiles and every product, whatever its rows, runs on amx_matmul; bits equal row by row."""
    from kvserve.kernels.build import build_amx_emulation
    from kvserve.model.layers import Linear

    emulated = build_amx_emulation()
    real_pack, real_matmul = products.amx_pack_weight, products.amx_matmul
    calls = []
    monkeypatch.setattr(products, "amx_ready", lambda: True)
    monkeypatch.setattr(products, "bf16_dot_available", lambda: True)  # every AMX CPU has AVX512-BF16 (this one may not)
    monkeypatch.setattr(products, "amx_pack_weight", lambda w: real_pack(w, library=emulated))
    monkeypatch.setattr(products, "amx_matmul", lambda x, w, **k: calls.append(x.shape[0]) or real_matmul(x, w, library=emulated, **k))
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 96).bfloat16()
    with torch.no_grad():
        ref = F.linear(x.float(), layer.weight.float())
        weight = layer.weight.clone()
        layer.enable_native()
        assert layer.amx is not None and layer.packed is None and layer.weight.numel() == 0
        assert torch.equal(products.amx_unpack_weight(layer.amx), weight)
        out = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert calls == [rows] + [1] * rows
    assert torch.equal(out, alone)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max().item() < 0.05


@pytest.mark.parametrize("layout", ["packed", "amx", "float32", "float-bf16"])
def test_packed_rows_are_the_weights_rows_in_every_layout(layout):
    """A tied embedding looks its tokens up in the lm_head's packed copy: the rows gathered from each
    layout (ragged tiles: 200 rows, and k = 80 pads AMX's 32-wide k tiles) are the weight's own."""
    from kvserve.model.layers import PackedEmbedding

    if layout == "packed" and not products.bf16_dot_available():
        pytest.skip("this CPU has no AVX512-BF16")
    if not library.cpu_kernels_available():
        pytest.skip("no native kernels")
    torch.manual_seed(3)
    weight = torch.randn(200, 80, dtype=torch.float32 if layout == "float32" else torch.bfloat16)
    pack = {"packed": products.pack_weight, "amx": products.amx_pack_weight}.get(layout, products.pack_float_weight)
    packed = pack(weight)
    ids = torch.tensor([[0, 15, 16, 199], [7, 7, 183, 31]])
    rows = products.packed_rows(packed, ids)
    assert rows.dtype == weight.dtype and rows.shape == (8, 80)
    assert torch.equal(rows, weight[ids.reshape(-1)])
    assert torch.equal(products.packed_rows(packed, torch.arange(200)), weight)
    assert torch.equal(PackedEmbedding(packed)(ids), weight[ids])


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied, untied
def test_the_lm_head_is_held_once_in_its_packed_copy(tiny_dir, family):
    """With the native kernels the lm_head keeps only its packed copy: a tied embedding looks its
    rows up there (the same values, so the same tokens and logprobs as the row-major embedding), an
    untied model keeps its own embedding, and the torch fallbacks unpack the copy on demand."""
    from torch import nn

    from kvserve import LLM, SamplingParams
    from kvserve.model.layers import PackedEmbedding

    llm = LLM(str(tiny_dir(family)), dtype="bfloat16", kv_cache_memory=0.02)
    model = llm.engine.model
    packed = model.amx_lm_head or model.packed_lm_head or model.float_lm_head
    if packed is None:
        pytest.skip("no native lm_head kernel on this CPU")
    assert model.lm_head.weight.numel() == 0
    source = hf_model_weights(tiny_dir(family))
    expected = source["lm_head.weight" if family == "llama" else "model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(model._row_major_lm_head(), expected)
    if family == "llama":
        assert isinstance(model.embed_tokens, nn.Embedding)
        return
    assert isinstance(model.embed_tokens, PackedEmbedding)
    ids = torch.arange(expected.shape[0]).view(4, -1)
    assert torch.equal(model.embed_tokens(ids), expected[ids])
    prompts = [[5, 9, 200, 13, 7], [1, 2, 3]]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    packed_run = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    model.embed_tokens = nn.Embedding.from_pretrained(expected, freeze=True)  # the row-major embedding, as before
    llm.reset_prefix_cache()
    row_major_run = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert packed_run == row_major_run


def hf_model_weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for f in sorted(path.glob("*.safetensors")) for name, t in load_file(f).items()}


def test_the_amx_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("KVSERVE_DISABLE_AMX", "1")
    assert not products.amx_available()
    monkeypatch.delenv("KVSERVE_DISABLE_AMX")
    assert products.amx_available() == (products.cpu_has_amx_bf16() and load_kernels().kvserve_amx_available() == 1)


@pytest.mark.parametrize("flags,expected", [
    ({"sse2", "avx2", "avx512f"}, "float32"),  # the AVX2/AVX-512 EPYC: bf16 GEMMs emulated
    ({"sse2", "avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"sse2", "avx2", "avx512_bf16", "amx_bf16"}, "bfloat16"),
])  # fmt: skip
def test_dtype_auto_follows_the_x86_flags_not_a_timing(monkeypatch, flags, expected):
    """A timed matmul flipped --dtype auto to float32 on a loaded AMX machine: on x86 the flags decide."""
    import kvserve.config as config

    def no_timing():
        raise AssertionError("x86 flags are known: nothing to time")

    monkeypatch.setattr(config, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(config, "_faster_in_a_timed_matmul", no_timing)
    config.fastest_dtype.cache_clear()
    try:
        assert config.fastest_dtype("cpu") == expected
    finally:
        config.fastest_dtype.cache_clear()


def test_the_cpu_flags_are_read_from_cpuinfo():
    flags = cpu_flags()
    assert isinstance(flags, frozenset)
    if os.path.exists("/proc/cpuinfo") and platform.machine() in ("x86_64", "AMD64"):
        assert "sse2" in flags


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("count,window", [(70, None), (70, 20), (70, 70), (1, None), (33, 1)])
def test_a_prefill_that_opens_its_sequence_on_sdpa_matches_the_reference(shape, count, window):
    """The torch_sdpa backend's first chunk (torch's flash SDPA on the chunk's fresh K/V, a banded
    mask for a window shorter than the chunk) against the float32 reference, bf16 as it runs."""
    from kvserve.attention.metadata import AttentionMetadata, PrefillSpan
    from kvserve.attention.torch_sdpa import fresh_prefill_attention

    heads, kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(count)
    q = torch.randn(count, heads, head_dim, generator=g).bfloat16()
    k, v = (torch.randn(count, kv_heads, head_dim, generator=g).bfloat16() for _ in range(2))
    table = torch.arange(-(-count // 16))
    span = PrefillSpan(0, count, [0], [table])
    meta = AttentionMetadata(torch.arange(count), [torch.arange(count)])
    out = fresh_prefill_attention(q, k, v, span, meta, head_dim**-0.5, window)
    ref = reference_attention(q, k, v, table, 16, torch.arange(count), window)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("backend_name", ["cpu_paged", "torch_sdpa"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("start,count,window", [(37, 50, None), (100, 70, 20), (100, 70, 90), (160, 33, 16), (0, 40, 7), (5, 1, 3)])
def test_a_prefill_over_cached_slots_on_sdpa_matches_the_reference(backend_name, shape, start, count, window):
    """cached_prefill_attention (the torch_sdpa backend's path for every chunk it does not open
    fresh, over either backend's pool): the blocks a window has left are not read (poisoned here), a window
    shorter than the chunk runs in pieces; against the float32 reference, bf16 as it runs."""
    from kvserve.attention.backend import create_backend
    from kvserve.attention.metadata import AttentionMetadata, PrefillSpan
    from kvserve.attention.torch_sdpa import cached_prefill_attention
    from kvserve.kv.pool import PagedKVPool

    heads, kv_heads, head_dim = shape
    block_size, num_blocks = 16, 24
    pool = PagedKVPool(KVCacheSpec(1, kv_heads, head_dim, "bfloat16", block_size, layer_windows=(window,)), num_blocks, torch.device("cpu"))
    kv = pool.layers[0]
    g = torch.Generator().manual_seed(start + count)
    kv.key.copy_(torch.randn(kv.key.shape, generator=g))
    kv.value.copy_(torch.randn(kv.value.shape, generator=g))
    table = torch.randperm(num_blocks, generator=g)[: -(-(start + count) // block_size)]
    if window is not None:  # the blocks every query's window has left: their K/V must not reach the output
        for b in table[: max(0, start - window + 1) // block_size].tolist():
            kv.key[b * block_size : (b + 1) * block_size] = float("nan")
    q = torch.randn(count, heads, head_dim, generator=g).bfloat16()
    span = PrefillSpan(0, count, [start], [table])
    meta = AttentionMetadata(torch.arange(count), [table])
    out = cached_prefill_attention(create_backend(backend_name, pool), 0, q, 0, span, meta, head_dim**-0.5, window)
    ref = reference_attention(q, kv.key.float().nan_to_num(), kv.value.float(), table.tolist(), block_size, torch.arange(start, start + count), window)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < TOLERANCE[torch.bfloat16]


def test_every_kernel_source_is_in_the_builds_digest():
    """The cached library is keyed by its sources' bytes: a header left out of the digest would keep an
    old build after the header changed."""
    from pathlib import Path

    from kvserve.kernels import build

    here = Path(build.__file__).parent
    listed = set(build.SOURCES) | set(build.HEADERS)
    assert {p.name for p in here.glob("*.h")} | {p.name for p in here.glob("*.cpp")} <= listed


@pytest.mark.parametrize("heads, kv_heads, dim, q_dtype, k_dtype", [(14, 2, 64, torch.bfloat16, torch.float32), (4, 1, 256, torch.bfloat16, torch.bfloat16),
                                                                     (8, 8, 32, torch.float32, torch.float32), (12, 4, 16, torch.float16, torch.float16)])  # fmt: skip
def test_window_scores_kernel_is_the_torch_scores_and_chunks_add_the_same_bits(heads, kv_heads, dim, q_dtype, k_dtype):
    """SnapKV's window scores (window_scores.cpp) against attention/window_scores.py's torch version,
    weighted rows, causal hiding and a column limit included; a window cut into chunks gives the
    one-chunk result to the bit (the rows are added in order)."""
    from kvserve.attention.window_scores import add_window_scores, native_window_scores, window_attention

    if not native_window_scores():
        pytest.skip("the window-score kernel is built for AVX-512 CPUs (torch's version runs elsewhere)")
    g = torch.Generator().manual_seed(heads + dim)
    w, length, columns = 37, 203, 190
    q = (torch.randn(w, heads + 2 * kv_heads, dim, generator=g) * 2).to(q_dtype)[:, :heads]  # a fused QKV row's q: token stride > heads * dim
    keys = torch.randn(length, kv_heads, dim, generator=g).to(k_dtype)
    first = length - w
    expected = torch.full((kv_heads, columns), 0.5)
    expected += window_attention(q, keys, first, dim**-0.5, 30, 0.25)[:, :columns]
    whole = torch.full((kv_heads, length + 5), 0.5)[:, :columns]
    add_window_scores(whole, q, keys, first, dim**-0.5, 30, 0.25)
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-6)
    cut = torch.full((kv_heads, length + 5), 0.5)[:, :columns]
    for start, end in ((0, 11), (11, 12), (12, w)):  # the chunks' rows, each reading the keys cached up to it
        add_window_scores(cut[:, : first + end], q[start:end], keys[: first + end], first + start, dim**-0.5, max(30 - start, 0), 0.25)
    assert torch.equal(cut, whole)
