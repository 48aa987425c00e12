"""The native decode attention kernel alone, on the shapes where one step has fewer (sequence, KV
head) tasks than threads: one or a few long sequences of SmolLM2 (3 KV heads of 64, group 3) and of
Gemma 3's full-attention layers (1 KV head of 256, group 4), in the formats the engine stores.

    .venv/bin/python bench/decode_attention.py [--contexts 2048,8000,32000] [--seqs 1,2]

Prints microseconds per call of one layer (the best of --rounds, each the mean of --repeat calls)
and the GB/s of K/V that is. Since contexts of 1,024 slots or more are split into parts of 512
computed apart (flash-decoding), both threads work on one sequence of a one-KV-head model; run it
against an older checkout to see what the split is worth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvserve.kernels import attention, library
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.spec import KV_FORMATS, KVCacheSpec

sys.path.insert(0, str(Path(__file__).parent))
from common import best_call_seconds  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # query heads, KV heads, head_dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8000,32000", help="context lengths (slots) of every sequence")
    parser.add_argument("--seqs", default="1,2", help="sequences decoding together")
    parser.add_argument("--formats", default="bfloat16,int8,int4", help="KV cache formats")
    parser.add_argument("--repeat", type=int, default=50, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not library.cpu_kernels_available():
        raise SystemExit("the native kernels did not build")
    contexts = [int(c) for c in args.contexts.split(",")]
    g = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads; us per call of one layer's decode attention (GB/s of K/V read)")
    print(f"{'shape':8} {'format':9} {'seqs':>4} " + " ".join(f"{c:>16,}" for c in contexts))
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for kv_dtype in args.formats.split(","):
            kivi = KV_FORMATS[kv_dtype].kind == "kivi"
            bs = 32 if kivi else 16
            for seqs in (int(s) for s in args.seqs.split(",")):
                blocks_per_seq = -(-max(contexts) // bs)
                blocks = seqs * blocks_per_seq
                spec = KVCacheSpec(1, kv_heads, dim, kv_dtype, bs, residual_dtype="bfloat16")
                pool = PagedKVPool(spec, blocks, torch.device("cpu"))
                layer = pool.layers[0]
                # random K/V in every block; KIVI's are stored in its full-precision residual blocks
                # and quantized from there, a chunk at a time, as the engine does
                chunk = min(8, pool.num_residual_blocks) if kivi else 256
                for b in range(0, blocks, chunk):
                    n = min(chunk, blocks - b)
                    first = pool.first_residual if kivi else b
                    k, v = (torch.randn(n * bs, kv_heads, dim, generator=g) for _ in range(2))
                    layer.store(torch.arange(first * bs, (first + n) * bs), k, v)
                    if kivi:
                        pool.quantize([(first + i, b + i) for i in range(n)])
                tables = torch.randperm(blocks, generator=g).view(seqs, blocks_per_seq)
                q = torch.randn(seqs, heads, dim, generator=g).to(torch.bfloat16)
                cells = []
                for context in contexts:
                    lens = torch.full((seqs,), context, dtype=torch.int64)
                    us = 1e6 * best_call_seconds(lambda: attention.paged_decode_attention(q, layer.view, tables, lens, dim**-0.5, None),
                                     args.repeat, args.rounds)  # fmt: skip
                    gbs = seqs * context * spec.bytes_per_token / 1e3 / us
                    cells.append(f"{us:9.1f} ({gbs:4.1f})")
                print(f"{shape:8} {kv_dtype:9} {seqs:>4} " + " ".join(f"{c:>16}" for c in cells))
                del pool, layer


if __name__ == "__main__":
    main()
