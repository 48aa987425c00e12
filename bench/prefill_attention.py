"""A bf16 prefill chunk that follows cached slots: the native paged kernel (which the engine runs for
every chunk, the same per-row code as decode) against torch's flash SDPA over the gathered blocks
(attention/torch_sdpa.py's cached_prefill_attention, oneDNN's AMX tiles on CPUs that have them),
at 1 to 2,048 rows over 1K-8K cached slots, full attention and a 512-slot sliding window.

    .venv/bin/python bench/prefill_attention.py [--rows 1,8,16,64,512,2048] [--contexts 1024,8192]

Prints milliseconds per layer call and SDPA's speed-up (above 1: SDPA is faster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvserve.attention.backend import create_backend
from kvserve.attention.metadata import AttentionMetadata, PrefillSpan
from kvserve.attention.torch_sdpa import cached_prefill_attention
from kvserve.kernels import attention, products
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.spec import KVCacheSpec

sys.path.insert(0, str(Path(__file__).parent))
from common import best_call_seconds  # noqa: E402

SHAPES = ((4, 1, 256, "Gemma 3 270M"), (9, 3, 64, "SmolLM2-135M"), (14, 2, 64, "Qwen2.5-0.5B"))
BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16,64,512,2048")
    parser.add_argument("--contexts", default="1024,8192", help="slots cached before the chunk")
    args = parser.parse_args()
    print(f"{torch.get_num_threads()} threads; AMX bf16: {products.cpu_has_amx_bf16()}")
    print("| model shape | window | cached | rows | native (ms) | SDPA (ms) | SDPA speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, name in SHAPES:
        for window in (None, 512):
            for cached in (int(c) for c in args.contexts.split(",")):
                for rows in (int(r) for r in args.rows.split(",")):
                    total = cached + rows
                    blocks = -(-total // BLOCK)
                    spec = KVCacheSpec(1, kv_heads, dim, "bfloat16", BLOCK, layer_windows=(window,))
                    pool = PagedKVPool(spec, blocks, torch.device("cpu"))
                    kv = pool.layers[0]
                    kv.key.copy_(torch.randn(kv.key.shape, generator=g))
                    kv.value.copy_(torch.randn(kv.value.shape, generator=g))
                    table = torch.randperm(blocks, generator=g)
                    q = torch.randn(rows, heads, dim, generator=g).bfloat16()
                    span = PrefillSpan(0, rows, [cached], [table])
                    backend = create_backend("cpu_paged", pool)
                    scale = dim**-0.5
                    repeat = max(3, 200 // rows)
                    native = 1000 * best_call_seconds(lambda: attention.paged_prefill_attention(q, kv.view, table, cached, scale, window), repeat)
                    sdpa = 1000 * best_call_seconds(  # a fresh step each call: its mask is built, as the step's first layer builds it
                        lambda: cached_prefill_attention(backend, 0, q, 0, span, AttentionMetadata(torch.arange(rows), [table]), scale, window),
                        repeat,
                    )  # fmt: skip
                    print(f"| {name} | {window or 'full'} | {cached} | {rows} | {native:.3f} | {sdpa:.3f} | {native / sdpa:.2f}x |")


if __name__ == "__main__":
    main()
