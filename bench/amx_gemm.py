"""Where a bf16 projection should run: the packed AVX512-BF16 kernel against torch's oneDNN GEMM
(AMX tiles on CPUs that have them), on Gemma 3 270M's projection shapes, at 1 to 2,048 rows.

    .venv/bin/python bench/amx_gemm.py [--rows 1,2,4,8,16,64,256,2048]

Prints milliseconds per call and oneDNN's speed-up over the packed kernel; the engine sends a
product of kernels.AMX_GEMM_MIN_ROWS rows or more to oneDNN when the CPU has AMX
(kernels.amx_gemm_min_rows()), fewer to the packed kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve import kernels

sys.path.insert(0, str(Path(__file__).parent))
from common import best_call_seconds  # noqa: E402

SHAPES = ((1536, 640, "QKV"), (4096, 640, "gate/up"), (640, 2048, "down"), (640, 1024, "o_proj"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,64,256,2048")
    args = parser.parse_args()
    if not kernels.bf16_dot_available():
        raise SystemExit("this CPU has no AVX512-BF16: the engine packs no weight here")
    print(f"{torch.get_num_threads()} threads; AMX bf16: {kernels.cpu_has_amx_bf16()}; "
          f"engine dispatch: oneDNN from {kernels.amx_gemm_min_rows()} rows (None: packed kernel always)")  # fmt: skip
    print("| product | rows | packed (ms) | oneDNN (ms) | oneDNN speed-up |")
    print("|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for n, k, what in SHAPES:
        weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
        packed = kernels.pack_weight(weight)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            repeat = max(3, 2000 // rows)
            ours = 1000 * best_call_seconds(lambda: kernels.packed_matmul(x, packed), repeat)
            onednn = 1000 * best_call_seconds(lambda: F.linear(x, weight), repeat)
            print(f"| {what} {n}x{k} | {rows} | {ours:.3f} | {onednn:.3f} | {ours / onednn:.2f}x |")


if __name__ == "__main__":
    main()
