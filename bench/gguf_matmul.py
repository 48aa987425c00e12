"""The GGUF block product against the same weights dequantized, per block type and row count.

    .venv/bin/python bench/gguf_matmul.py [--n 4096] [--k 1024] [--types Q8_0 Q4_K] [--rows 1 8 64] \
        [--activations exact|int8|bf16]

Random blocks of each type ([n, k]), bf16 rows (float32 with --dtype float32), taken as
--activations says (bf16: AMX tiles, on a CPU whose tiles run). For each row count: the GGUF
kernel's rate in billions of weights x rows per second, and its speed against the kernel the
dequantized weights take in the same dtype (bf16: the AMX GEMM where its tiles run, else the packed
AVX512-BF16 GEMM where the CPU has it; float32: float_matmul). Calls alternate and each keeps its best of --rounds, because this
machine's speed drifts between runs. A weight of 4096 x 1024 stays in the caches: this is the
kernels' compute rate; a decode step over a real model also streams the weights from memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvserve.kernels import gguf, library, products  # noqa: E402
from test_gguf_weights import random_blocks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096, help="output rows of the weight")
    parser.add_argument("--k", type=int, default=1024, help="input columns (a multiple of 256 for the K types)")
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"], choices=list(gguf.GGUF_BLOCKS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the rows' dtype")
    parser.add_argument("--activations", choices=list(gguf.GGUF_ACTIVATIONS), default="exact", help="how the GGUF products take the rows")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not library.cpu_kernels_available():
        sys.exit("the native kernels are not built here")
    dtype = getattr(torch, args.dtype)
    amx = dtype == torch.bfloat16 and products.amx_ready()
    packed_bf16 = dtype == torch.bfloat16 and products.bf16_dot_available()
    other = "the AMX GEMM" if amx else "packed bf16" if packed_bf16 else "float_matmul"
    print(f"{args.n} x {args.k} weight, {args.dtype} rows, {args.activations} activations; G = 1e9 weights x rows per second "
          f"(best of {args.rounds}); vs {other} on the dequantized weights\n")
    print("| type | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for type_name in args.types:
        blocks = random_blocks(type_name, args.n, args.k)
        weight = gguf.gguf_weight(torch.from_numpy(blocks), type_name, args.n, args.k, args.activations)
        dequantized = gguf.gguf_dequantize(weight).to(dtype)
        if amx:
            packed = products.amx_pack_weight(dequantized)
            theirs = lambda x: products.amx_matmul(x, packed, out_dtype=dtype)  # noqa: E731
        elif packed_bf16:
            packed = products.pack_weight(dequantized)
            theirs = lambda x: products.packed_matmul(x, packed)  # noqa: E731
        else:
            packed = products.pack_float_weight(dequantized)
            theirs = lambda x: products.float_matmul(x, packed)  # noqa: E731
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, args.k).to(dtype)
            calls = {"gguf": lambda: gguf.gguf_matmul(x, weight), "theirs": lambda: theirs(x)}
            repeat = max(2, 100 // rows)
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(args.rounds):
                for name, call in calls.items():
                    start = time.perf_counter()
                    for _ in range(repeat):
                        call()
                    best[name] = min(best[name], (time.perf_counter() - start) / repeat)
            rate = args.n * args.k * rows / best["gguf"] / 1e9
            cells.append(f"{rate:.0f} G ({best['theirs'] / best['gguf']:.2f}x)")
        print(f"| {type_name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
