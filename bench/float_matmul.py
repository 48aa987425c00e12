"""float_matmul (one FMA chain per output, the same bits at any batch size) against the path it
replaced: the skinny kernel for up to 8 rows, torch F.linear (MKL / oneDNN) above.

The skinny kernel is gone from the tree: it is built from git (--old-commit, the last commit that
had it) into a temporary directory. Above 8 rows the old lm_head ran chunked torch.mm, timed here as
F.linear. Best-of-N wall time per call, float32, torch's threads (which the kernels share).

    python bench/float_matmul.py [--repeats 5] [--threads N] [--old-commit 2c8eb8a]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.kernels import products

SHAPES = {"640x2048": (640, 2048), "2048x640": (2048, 640), "lm_head slice 32768x640": (32768, 640)}
ROWS = (1, 8, 64, 512)
SKINNY_MAX_ROWS = 8  # the old Linear took the skinny kernel up to here


class SkinnyMatmulArgs(ctypes.Structure):
    _fields_ = [
        ("weight", ctypes.c_void_p), ("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("argmax", ctypes.c_void_p), ("n", ctypes.c_int64),
        ("weight_dtype", ctypes.c_int32), ("rows", ctypes.c_int32), ("dim", ctypes.c_int32), ("out_dtype", ctypes.c_int32),
    ]  # fmt: skip


def old_skinny(commit: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The deleted skinny kernel built from `commit`, called as its wrapper did (x staged into zero-padded float32 rows)."""
    root = Path(__file__).resolve().parent.parent
    build = Path(tempfile.mkdtemp())
    for name in ("skinny_matmul.cpp", "args.h", "simd.h"):
        source = f"{commit}:kvserve/kernels/{name}"
        (build / name).write_text(subprocess.run(["git", "-C", str(root), "show", source], capture_output=True, text=True, check=True).stdout)
    flags = ["-march=native", "-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno", "-Wno-psabi"]
    subprocess.run(["g++", *flags, str(build / "skinny_matmul.cpp"), "-o", str(build / "skinny.so")], check=True)
    library = ctypes.CDLL(str(build / "skinny.so"))

    def call(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        rows, dim = x.shape
        staged = torch.zeros(1 << (rows - 1).bit_length(), dim)
        staged[:rows] = x
        args = SkinnyMatmulArgs(weight.data_ptr(), staged.data_ptr(), out.data_ptr(), None, weight.shape[0], 0, rows, dim, 0)
        if library.kvserve_skinny_matmul(ctypes.byref(args)):
            raise ValueError("skinny_matmul: bad arguments")

    return call


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--old-commit", default="2c8eb8a", help="a commit that still has kvserve/kernels/skinny_matmul.cpp")
    parser.add_argument("--threads", type=int, default=None, help="torch's (and so the kernels') threads; default: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    skinny = old_skinny(args.old_commit)
    g = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, float32, best of {args.repeats}")
    print("| weight [n, k] | rows | float_matmul (ms) | old path (ms) | old path | float_matmul / old |")
    print("|---|---:|---:|---:|---|---:|")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=g)
        packed = products.pack_float_weight(weight)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g)
            out = torch.empty(rows, n)
            ours = best_ms(lambda: products.float_matmul(x, packed, out=out), args.repeats)
            if rows <= SKINNY_MAX_ROWS:
                theirs, what = best_ms(lambda: skinny(x, weight, out), args.repeats), "skinny"
            else:
                theirs, what = best_ms(lambda: F.linear(x, weight), args.repeats), "F.linear"
            print(f"| {name} | {rows} | {ours:.3f} | {theirs:.3f} | {what} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
