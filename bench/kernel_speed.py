"""Each native CPU kernel against the torch ops it replaces, same process, Gemma 3 270M shapes.

    .venv/bin/python bench/kernel_speed.py [--dtype bfloat16|float32]

Prints milliseconds per call and the speed-up. Decode attention: 64 sequences whose contexts
(64..640 tokens) sit in scattered blocks of a pool larger than the caches, one KV head, group 4,
head_dim 256. Prefill attention: one prompt, causal. float_matmul (float32, or bf16 without
AVX512-BF16): the greedy 262K x 640 lm_head with 1-8 rows.
On a CPU with AVX512-BF16 (bf16 only): the packed bf16 GEMM on the layer shapes at 64
and 2,048 rows, and the greedy lm_head of a 64-row batch, packed and int8-screened. Fused ops:
a 2,048-token prefill chunk and a 64-row decode batch.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvserve.attention.torch_sdpa import context_mask
from kvserve.kernels import attention, fused, library, products, sampling
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.spec import KVCacheSpec


def per_call_ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


def row(name: str, ours: float, theirs: float, what: str) -> None:
    print(f"| {name} | {ours:.2f} | {theirs:.2f} ({what}) | {theirs / ours:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    dtype = getattr(torch, parser.parse_args().dtype)
    assert library.cpu_kernels_available(), "the kernels did not build"
    g = torch.Generator().manual_seed(0)
    print(f"dtype {dtype}, {torch.get_num_threads()} threads\n")
    print("| op | kvserve kernel (ms) | torch (ms) | speed-up |")
    print("|---|---:|---:|---:|")

    # decode attention over a 1 GiB-per-layer-pair pool (much larger than the caches)
    batch, heads, head_dim, block_size, num_blocks = 64, 4, 256, 16, 65536
    pool = PagedKVPool(KVCacheSpec(1, 1, head_dim, str(dtype).removeprefix("torch."), block_size), num_blocks, torch.device("cpu"))
    layer = pool.layers[0]
    for start in range(0, num_blocks * block_size, 1 << 18):
        slots = torch.arange(start, min(start + (1 << 18), num_blocks * block_size))
        layer.store(slots, torch.randn(len(slots), 1, head_dim, generator=g), torch.randn(len(slots), 1, head_dim, generator=g))
    key_cache, value_cache = layer.key, layer.value  # [slots, 1, head_dim] in the cache's dtype
    lengths = torch.randint(64, 641, (batch,), generator=g)
    max_blocks = -(-int(lengths.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    mask = context_mask(lengths - 1, lengths, max_blocks * block_size, None).view(batch, 1, 1, -1)

    def torch_decode():
        keys = key_cache.view(num_blocks, block_size, 1, head_dim).index_select(0, tables.flatten())
        values = value_cache.view(num_blocks, block_size, 1, head_dim).index_select(0, tables.flatten())
        keys = keys.view(batch, -1, 1, head_dim).transpose(1, 2)
        values = values.view(batch, -1, 1, head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q.view(batch, 1, heads, head_dim), keys, values, attn_mask=mask)

    ours = per_call_ms(lambda: attention.paged_decode_attention(q, layer.view, tables, lengths, 0.0625, None), 20)
    row("decode attention, 64 seqs, 64..640 tokens", ours, per_call_ms(torch_decode, 20), "block gather + SDPA")

    for n in (300, 512, 2048):
        table = torch.arange(-(-n // block_size))
        prompt_q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
        keys, values = key_cache[:n].transpose(0, 1)[None], value_cache[:n].transpose(0, 1)[None]
        queries = prompt_q.transpose(0, 1)[None]
        ours = per_call_ms(lambda: attention.paged_prefill_attention(prompt_q, layer.view, table, 0, 0.0625, None), 5)
        theirs = per_call_ms(lambda: F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True), 5)
        row(f"prefill attention, {n}-token prompt", ours, theirs, "causal flash SDPA")

    lm_head = torch.randn(262144, 640, generator=g).to(dtype)
    if dtype == torch.float32 or not products.bf16_dot_available():
        float_packed = products.pack_float_weight(lm_head)
        for rows in (1, 4, 8):
            hidden = torch.randn(rows, 640, generator=g).to(dtype)
            ours = per_call_ms(lambda: products.float_matmul(hidden, float_packed, want_output=False, want_argmax=True), 10)
            theirs = per_call_ms(lambda: (hidden @ lm_head.t()).argmax(dim=1), 10)
            row(f"float_matmul lm_head argmax, {rows} row(s)", ours, theirs, "matmul + argmax")
        del float_packed

    if dtype == torch.bfloat16 and products.bf16_dot_available():
        # AVX512-BF16 packed GEMM: the projections at decode (64 rows) and prefill (2,048 rows) size
        for rows, n, k, what in ((64, 1536, 640, "QKV"), (64, 4096, 640, "gate/up"), (64, 640, 2048, "down"),
                                 (2048, 1536, 640, "QKV"), (2048, 4096, 640, "gate/up"), (2048, 640, 2048, "down")):
            weight = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(rows, k, generator=g).to(dtype)
            packed = products.pack_weight(weight)
            ours = per_call_ms(lambda: products.packed_matmul(x, packed), 10)
            row(f"packed bf16 GEMM, {what} {rows}x{n}x{k}", ours, per_call_ms(lambda: torch.mm(x, weight.t()), 10), "torch.mm")
        # greedy lm_head over a 64-row decode batch: packed bf16 argmax, then the int8-screened one
        packed = products.pack_weight(lm_head)
        hidden = torch.randn(64, 640, generator=g).to(dtype)
        hidden[:, 7] *= 10  # an outlier channel, as real hidden states have
        theirs = per_call_ms(lambda: (hidden @ lm_head.t()).argmax(dim=1), 5)
        row("lm_head argmax, 64 rows, packed bf16", per_call_ms(lambda: products.packed_matmul(hidden, packed, want_output=False, want_argmax=True), 10), theirs, "matmul + argmax")
        if sampling.int8_screen_available():
            screened = sampling.screen_weight(packed, lm_head)
            ours = per_call_ms(lambda: sampling.screened_argmax(hidden, screened), 10)
            row("lm_head argmax, 64 rows, int8-screened (exact)", ours, theirs, "matmul + argmax")

    for rows in (2048, 64):
        x = torch.randn(rows, 640, generator=g).to(dtype)
        addend = torch.randn(rows, 640, generator=g).to(dtype)
        w = torch.rand(640, generator=g) + 0.5

        def torch_add_norm():
            residual = x + (F.rms_norm(addend.float(), (640,), eps=1e-6) * w).to(dtype)
            return (F.rms_norm(residual.float(), (640,), eps=1e-6) * w).to(dtype)

        ours = per_call_ms(lambda: fused.add_rms_norm(x.clone(), addend, w, w, 1e-6, False), 20)
        row(f"sandwich norm + residual add + norm, {rows} rows", ours, per_call_ms(torch_add_norm, 20), "torch ops")
        gate_up = torch.randn(rows, 4096, generator=g).to(dtype)
        ours = per_call_ms(lambda: fused.gated_activation(gate_up, "gelu_tanh"), 20)
        theirs = per_call_ms(lambda: F.gelu(gate_up[:, :2048], approximate="tanh") * gate_up[:, 2048:], 20)
        row(f"GELU gate x up, {rows} rows", ours, theirs, "torch ops")


if __name__ == "__main__":
    main()
