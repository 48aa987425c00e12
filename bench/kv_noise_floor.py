"""How much the reference itself tolerates: mean KL and perplexity delta when every K/V value the
engine stores is perturbed by uniform relative noise of at most r and rounded back to the cache's
dtype, for a few r. Puts the quantization table's KL in scale: a KL a format cannot go below is
one that nudging values by about one 16-bit rounding step already costs.

    .venv/bin/python bench/kv_noise_floor.py --model smollm2-135m-instruct --noise 0.002,0.004,0.008

Same harness, text and windows as `kvserve eval` (perplexity and KL only); "changed" is the share
of stored values the noise moved to another value of the cache's dtype.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve.config import EngineConfig  # noqa: E402
from kvserve.eval.harness import EvalPlan, Evaluation  # noqa: E402
from kvserve.eval.text import read_text  # noqa: E402
from kvserve.kv import pool as kv_pool  # noqa: E402


class Noise:
    """Wraps LayerKV.store: x -> x * (1 + r * U(-1, 1)) in float, cast back to x's dtype."""

    def __init__(self) -> None:
        self.relative = 0.0
        self.changed = self.total = 0
        self.generator = torch.Generator().manual_seed(0)
        self._store = kv_pool.LayerKV.store

    def install(self) -> None:
        noise = self

        def store(layer, slots, k, v):
            if noise.relative:
                k, v = noise.perturb(k), noise.perturb(v)
            return noise._store(layer, slots, k, v)

        kv_pool.LayerKV.store = store

    def perturb(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.rand(x.shape, generator=self.generator) * 2 - 1
        y = (x.float() * (1 + self.relative * u)).to(x.dtype)
        self.changed += int((y != x).sum())
        self.total += x.numel()
        return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--max-windows", type=int, default=4)
    parser.add_argument("--noise", default="0.002,0.004,0.008", help="comma-separated relative noise levels r")
    args = parser.parse_args()
    levels = [float(r) for r in args.noise.split(",")]
    plan = EvalPlan(context=args.context, max_windows=args.max_windows, greedy_prompts=0, needle_lengths=())
    noise = Noise()
    noise.install()
    evaluation = Evaluation(plan, read_text(args.text), progress=True)
    config = EngineConfig(model=args.model)
    try:
        reference = evaluation.run("reference", "", config)
        print(f"{args.model}, {evaluation.scored_tokens} tokens of {args.text} in {evaluation.num_windows} windows of {args.context}, "
              f"K/V stored as {reference.kv_cache_dtype}; reference perplexity {reference.perplexity:.3f}")
        print("| noise r | changed | Δppl | mean KL | top-1 |\n|---:|---:|---:|---:|---:|")
        for r in levels:
            noise.relative, noise.changed, noise.total = r, 0, 0
            result = evaluation.run(f"noise {r}", "", config)
            print(f"| {r:g} | {noise.changed / max(noise.total, 1):.3%} | {result.perplexity_delta_pct:+.2f}% | {result.mean_kl:.2e} | "
                  f"{result.top1_agreement:.1%} |", flush=True)
    finally:
        evaluation.close()


if __name__ == "__main__":
    main()
