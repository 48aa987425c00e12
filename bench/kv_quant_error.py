"""Why a KV format costs what it costs: each layer's relative error of K and of V under each format,
on the K/V a real model writes for a real text.

    .venv/bin/python bench/kv_quant_error.py --model smollm2-135m-instruct --tokens 2048 [--hadamard]

Relative error is ||x - decode(encode(x))|| / ||x|| over the layer's whole K (or V); "outlier" is
the largest |x| of a layer over the root mean square of its values (large: a few channels set the
scale of every token).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import prose_token_ids  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.engine import LLMEngine  # noqa: E402
from kvserve.kv import pool as kv_pool  # noqa: E402
from kvserve.kv import quant  # noqa: E402
from kvserve.kv.rotation import Rotation  # noqa: E402
from kvserve.kv.spec import KVCacheSpec  # noqa: E402

FORMATS = ("fp8_e5m2", "fp8_e4m3", "int8", "int4", "int2")


def capture(model: str, tokens: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K and V [T, kv_heads, head_dim] as the engine stores them for `tokens` tokens of prose."""
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    original = kv_pool.LayerKV.store

    def store(self, slots, k, v):
        seen[id(self)].append((k.float().clone(), v.float().clone()))
        return original(self, slots, k, v)

    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=0.5, enable_prefix_caching=False))
    order = {id(layer): i for i, layer in enumerate(engine.pool.layers)}
    ids = prose_token_ids(engine.tokenizer)[:tokens]
    kv_pool.LayerKV.store = store
    try:
        engine.score(ids)
    finally:
        kv_pool.LayerKV.store = original
    return {order[key]: (torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])) for key, parts in seen.items()}


def relative_error(spec: KVCacheSpec, x: torch.Tensor, which: str) -> float:
    blocks = x[: x.shape[0] // spec.block_size * spec.block_size].view(-1, spec.block_size, *x.shape[1:])
    back = quant.decode(spec, quant.encode(spec, blocks, which), which)
    return ((back - blocks).norm() / blocks.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hadamard", action="store_true", help="turn K and V into the Hadamard basis the engine stores them in "
                        "(--kv-hadamard; int8's default) before the codecs")  # fmt: skip
    args = parser.parse_args()
    layers = capture(args.model, args.tokens)
    k0, _ = layers[0]
    if args.hadamard:
        rotation = Rotation(k0.shape[2], torch.device("cpu"))
        layers = {i: (rotation.forward(k), rotation.forward(v)) for i, (k, v) in layers.items()}
    specs = {f: KVCacheSpec(len(layers), k0.shape[1], k0.shape[2], f, block_size=32) for f in FORMATS}
    print(f"{args.model}: {len(layers)} layers, {args.tokens} tokens; relative error of K and V per layer")
    header = f"{'layer':>5} {'K outlier':>9} {'V outlier':>9}  " + "  ".join(f"{f + ' K':>11} {f + ' V':>11}" for f in FORMATS)
    print(header)
    totals = defaultdict(float)
    worst: dict[tuple[str, str], tuple[float, int]] = {}
    for i in sorted(layers):
        k, v = layers[i]
        cells = []
        for f in FORMATS:
            ek, ev = relative_error(specs[f], k, "key"), relative_error(specs[f], v, "value")
            totals[f, "key"] += ek / len(layers)
            totals[f, "value"] += ev / len(layers)
            for which, e in (("key", ek), ("value", ev)):
                worst[f, which] = max(worst.get((f, which), (0.0, -1)), (e, i))
            cells.append(f"{ek:11.4f} {ev:11.4f}")
        outlier = lambda x: (x.abs().max() / x.pow(2).mean().sqrt()).item()  # noqa: E731
        print(f"{i:5d} {outlier(k):9.1f} {outlier(v):9.1f}  " + "  ".join(cells))
    print(f"{'mean':>5} {'':9} {'':9}  " + "  ".join(f"{totals[f, 'key']:11.4f} {totals[f, 'value']:11.4f}" for f in FORMATS))
    print("\n| format | K, mean of layers | V, mean | worst K (layer) | worst V (layer) |\n|---|---:|---:|---:|---:|")
    for f in FORMATS:
        (wk, lk), (wv, lv) = worst[f, "key"], worst[f, "value"]
        print(f"| {f} | {100 * totals[f, 'key']:.2f}% | {100 * totals[f, 'value']:.2f}% | {100 * wk:.2f}% ({lk}) | {100 * wv:.2f}% ({lv}) |")


if __name__ == "__main__":
    main()
