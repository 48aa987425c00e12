"""Where a bf16 projection should run on a CPU with AMX: our AMX kernel (products.amx_matmul, whose
result for a row never depends on the batch) against torch's oneDNN GEMM (F.linear, AMX tiles too)
and the packed AVX512-BF16 kernel, on Gemma 3 270M's projection shapes and its lm_head.

    .venv/bin/python bench/amx_gemm.py [--rows 1,4,8,16,64,256,2048] [--lm-head-max-rows 256]

Prints milliseconds per call (bf16 output for all three) and the AMX kernel's speed-up over
oneDNN and over the packed kernel. The lm_head stops at --lm-head-max-rows: its bf16 output is
0.5 MiB per row (1 GiB at 2,048 rows). Without AMX it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.kernels import products

sys.path.insert(0, str(Path(__file__).parent))
from common import best_call_seconds  # noqa: E402

SHAPES = ((1536, 640, "QKV"), (4096, 640, "gate/up"), (640, 2048, "down"), (640, 1024, "o_proj"), (262144, 640, "lm_head"))


def repeats(rows: int, n: int, k: int) -> int:
    """Calls per timing round: ~2 GFLOP of work, 3 to 2,000 calls."""
    return max(3, min(2000, int(2e9 // (rows * n * k))))


def time_shape(n: int, k: int, what: str, rows_list: list[int], g: torch.Generator) -> None:
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    amx = products.amx_pack_weight(weight)
    packed = products.pack_weight(weight) if products.bf16_dot_available() else None
    for rows in rows_list:
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        repeat = repeats(rows, n, k)
        ours = 1000 * best_call_seconds(lambda: products.amx_matmul(x, amx), repeat)
        onednn = 1000 * best_call_seconds(lambda: F.linear(x, weight), repeat)
        avx = 1000 * best_call_seconds(lambda: products.packed_matmul(x, packed), repeat) if packed is not None else float("nan")
        print(f"| {what} {n}x{k} | {rows} | {ours:.3f} | {onednn:.3f} | {avx:.3f} | {onednn / ours:.2f}x | {avx / ours:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,8,16,64,256,2048")
    parser.add_argument("--lm-head-max-rows", type=int, default=256)
    args = parser.parse_args()
    if not products.amx_available():
        print(f"AMX is absent here (CPU reports amx_bf16: {products.cpu_has_amx_bf16()}; KVSERVE_DISABLE_AMX=1 also "
              "switches it off): nothing to time")  # fmt: skip
        return
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{torch.get_num_threads()} threads; the engine runs every bf16 projection on the AMX kernel (products.amx_ready())")
    print("| product | rows | AMX kernel (ms) | oneDNN (ms) | packed (ms) | AMX kernel vs oneDNN | AMX kernel vs packed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for n, k, what in SHAPES:
        rows = [r for r in rows_list if what != "lm_head" or r <= args.lm_head_max_rows]
        time_shape(n, k, what, rows, g)


if __name__ == "__main__":
    main()
