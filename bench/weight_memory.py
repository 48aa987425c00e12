"""Bytes of weight tensors the engine holds for a model, per --weight-dtype, against the GGUF file.

    .venv/bin/python bench/weight_memory.py [--models gemma-3-270m smollm2-135m-instruct ...]

For each model and weight dtype (gguf: the file's quantized blocks, one copy; the --dtype path:
dequantized and packed for the native kernels), in a fresh process: the weight tensors' bytes
(every parameter, packed copy, GGUF block tensor and int8 screen, each buffer counted once), their
ratio to the GGUF file's tensor bytes, and how much the process's resident memory grew while the
engine loaded (weights, tables, the tokenizer, a 0.1 GiB KV pool).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvserve.model.weight_bytes import weight_bytes

DEFAULT_MODELS = ("gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def measure(model: str, weight_dtype: str) -> dict:
    from kvserve import LLM
    from kvserve.model.loader import gguf_index
    from kvserve.model.registry import resolve_model_path

    file_bytes = sum(t["bytes"] for t in gguf_index(resolve_model_path(model))["tensors"])
    before = resident_bytes()
    llm = LLM(model, weight_dtype=weight_dtype, kv_cache_memory=0.1)
    grown = resident_bytes() - before
    held = weight_bytes(llm.engine.model)
    return {"model": model, "weight_dtype": weight_dtype, "dtype": llm.engine.config.dtype, "weight_mb": held / 1e6,
            "file_mb": file_bytes / 1e6, "ratio": held / file_bytes, "rss_mb": grown / 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--weight-dtypes", nargs="+", default=["gguf", "auto-dtype"],
                        help="auto-dtype: the weights dequantized into --dtype auto (the path before GGUF blocks)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "WEIGHT_DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, weight_dtype = args.one
        if weight_dtype == "auto-dtype":
            from kvserve.config import EngineConfig

            weight_dtype = EngineConfig(model=model).dtype
        print(json.dumps(measure(model, weight_dtype)))
        return
    print(f"{'model':30} {'weights':10} {'dtype':9} {'held MB':>9} {'file MB':>9} {'ratio':>6} {'RSS +MB':>8}")
    for model in args.models:
        for weight_dtype in args.weight_dtypes:
            result = subprocess.run([sys.executable, __file__, "--one", model, weight_dtype], capture_output=True, text=True)
            if result.returncode:
                print(f"{model} {weight_dtype}: failed\n{result.stderr[-2000:]}")
                continue
            r = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{model:30} {r['weight_dtype']:10} {r['dtype']:9} {r['weight_mb']:9.0f} {r['file_mb']:9.0f} {r['ratio']:6.2f} {r['rss_mb']:8.0f}")


if __name__ == "__main__":
    main()
