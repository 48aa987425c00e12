"""A tied embedding's lookup from the lm_head's packed copy (PackedEmbedding) against the row-major
nn.Embedding it replaced, on a random [vocab, hidden] bf16 matrix of a real model's shape.

Both give the same rows (checked here); the packed layout spreads a row's k-pairs over 16-row
tiles, so a lookup reads a cache line per pair. Median of --repeats calls per id count, the two
lookups alternating, and the ratio. Put it beside a step's time: a decode step takes 15-100 ms on
2 cores, a 2,048-token prefill chunk over a second.

    .venv/bin/python bench/embedding_lookup.py [--vocab 262144 --hidden 640] [--ids 1 64 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from kvserve.kernels import products
from kvserve.model.layers import PackedEmbedding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("--vocab", type=int, default=262144, help="rows (Gemma 3's vocabulary by default)")
    parser.add_argument("--hidden", type=int, default=640, help="columns (Gemma 3 270M's hidden size by default)")
    parser.add_argument("--ids", type=int, nargs="+", default=[1, 64, 2048], help="token ids per lookup")
    parser.add_argument("--repeats", type=int, default=200, help="calls of each lookup per id count")
    args = parser.parse_args()
    if not products.can_pack(torch.zeros(16, 2, dtype=torch.bfloat16)):
        parser.error("this CPU packs no bf16 weights (no AVX512-BF16): its float32 lm_head takes the float tiles")
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden).bfloat16()
    lookups = {"nn.Embedding": nn.Embedding.from_pretrained(weight, freeze=True), "PackedEmbedding": PackedEmbedding(products.pack_weight(weight))}
    print(f"[{args.vocab}, {args.hidden}] bf16, {torch.get_num_threads()} threads; median microseconds per lookup")
    print("| ids | nn.Embedding | PackedEmbedding | packed / row-major |\n|---:|---:|---:|---:|")
    for count in args.ids:
        ids = torch.randint(0, args.vocab, (count,))
        assert torch.equal(lookups["nn.Embedding"](ids), lookups["PackedEmbedding"](ids))
        times: dict[str, list[float]] = {name: [] for name in lookups}
        for _ in range(args.repeats):
            for name, lookup in lookups.items():
                start = time.perf_counter()
                lookup(ids)
                times[name].append(time.perf_counter() - start)
        row, packed = (statistics.median(times[name]) * 1e6 for name in lookups)
        print(f"| {count} | {row:.1f} | {packed:.1f} | {packed / row:.2f}x |")


if __name__ == "__main__":
    main()
