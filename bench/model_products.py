"""A real model's products at decode batch sizes, on its GGUF blocks against bf16 weights.

    .venv/bin/python bench/model_products.py [--model gemma-3-270m] [--rows 1 16 64 256] [--repeats 30]

Three engines in one process, `--dtype bfloat16`: the GGUF blocks with int8 rows ("gguf int8":
`--weight-dtype gguf --gguf-activations int8`, where the CPU has AVX512-VNNI; its lm_head stays
exact), with exact rows ("gguf"), and bf16 weights (`--weight-dtype bfloat16`). For each row
count: one layer's four products (QKV, output, gate/up, down; the middle layer's) on random bf16
rows, and the greedy lm_head (`greedy_tokens`: the bf16 weights' int8 screen, the GGUF blocks' full
product) on real final hidden states, captured from the GGUF engine's own decode steps over prose.
Medians of --repeats calls in milliseconds, the two engines' calls alternating, and the ratio
bf16 / gguf (below 1: the GGUF blocks are slower). It says where a batch's step loses time on the
GGUF blocks: the layers (times the layer count) or the lm_head. Where the GGUF lm_head is screened
(Q8_0), it also prints how many of its tiles the screen recomputed exactly per row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kernels import gguf  # noqa: E402

ENGINES = {"gguf int8": dict(weight_dtype="gguf", gguf_activations="int8"), "gguf": dict(weight_dtype="gguf", gguf_activations="exact"),
           "bfloat16": dict(weight_dtype="bfloat16")}  # fmt: skip


def captured_hidden(llm: LLM, rows: int) -> torch.Tensor:
    """Final hidden states of `rows` decode rows (several steps of a 16-request batch over prose)."""
    model = llm.engine.model
    caught: list[torch.Tensor] = []
    greedy = model.greedy_tokens

    def grab(hidden: torch.Tensor) -> torch.Tensor:
        if len(caught) < rows and hidden.shape[0] > 1:
            caught.extend(hidden.clone().unbind(0))
        return greedy(hidden)

    model.greedy_tokens = grab
    try:
        prompts = make_prompts(llm.tokenizer, 16, 64, 256, seed=3)
        llm.generate(prompts, SamplingParams(max_tokens=-(-rows // 16) + 2, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        model.greedy_tokens = greedy
    return torch.stack(caught[:rows])


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if min(args.rows) < 1:
        parser.error("--rows must be positive")
    WEIGHTS = tuple(w for w in ENGINES if w != "gguf int8" or gguf.gguf_int8_available())
    engines = {w: LLM(args.model, dtype="bfloat16", kv_cache_memory=0.3, enable_prefix_caching=False, **ENGINES[w]) for w in WEIGHTS}
    models = {w: llm.engine.model for w, llm in engines.items()}
    first = WEIGHTS[0]
    hidden = captured_hidden(engines[first], max(args.rows)).to(torch.bfloat16)
    middle = len(models[first].layers) // 2
    names = ("qkv", "o", "gate_up", "down", "lm_head")

    def products(model, rows: int) -> dict:
        layer = model.layers[middle]
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        calls = {name: (lambda lin=lin, x=torch.randn(rows, lin.in_features).to(torch.bfloat16): lin.forward(x)) for name, lin in zip(names, linears)}
        calls["lm_head"] = lambda h=hidden[:rows].contiguous(): model.greedy_tokens(h)
        return calls

    layer = models[first].layers[middle]
    types = {n: "+".join(p.type_name for p in lin.gguf) if lin.gguf else "float" for n, lin in
             zip(names, (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))}  # fmt: skip
    types["lm_head"] = models[first].gguf_lm_head.type_name if models[first].gguf_lm_head is not None else "float"
    num_layers = len(models[first].layers)
    blocks = [w for w in WEIGHTS if w != "bfloat16"]
    print(f"{args.model}: layer {middle} of {num_layers}, bf16 rows, medians of {args.repeats} (ms)\n")
    print("| rows | product (GGUF type) | " + " | ".join(f"{w} ms" for w in WEIGHTS) + " | " + " | ".join(f"bf16 / {w}" for w in blocks) + " |")
    print("|---:|---|" + "---:|" * (len(WEIGHTS) + len(blocks)))
    screened_tiles: list[str] = []
    with torch.inference_mode():
        for rows in args.rows:
            calls = {w: products(models[w], rows) for w in WEIGHTS}
            totals = dict.fromkeys(WEIGHTS, 0.0)
            for name in names:
                times: dict[str, list[float]] = {w: [] for w in WEIGHTS}
                for _ in range(3):  # alternate, a third of the repeats at a time
                    for w in WEIGHTS:
                        times[w] += timed(calls[w][name], -(-args.repeats // 3))
                median = {w: statistics.median(times[w]) for w in WEIGHTS}
                scale = 1 if name == "lm_head" else num_layers
                for w in WEIGHTS:
                    totals[w] += median[w] * scale
                print(f"| {rows} | {name} ({types[name]}) | " + " | ".join(f"{median[w]:.3f}" for w in WEIGHTS) + " | "
                      + " | ".join(f"{median['bfloat16'] / median[w]:.2f}x" for w in blocks) + " |")  # fmt: skip
            print(f"| {rows} | a step's products ({num_layers} layers + lm_head) | " + " | ".join(f"{totals[w]:.2f}" for w in WEIGHTS) + " | "
                  + " | ".join(f"{totals['bfloat16'] / totals[w]:.2f}x" for w in blocks) + " |")  # fmt: skip
            screen = models[first].gguf_screen
            if screen is not None:
                normed = models[first].norm(hidden[:rows].contiguous())
                _, rescored = gguf.gguf_screened_argmax(normed, screen)
                screened_tiles.append(f"{rows} rows: {rescored / rows:.1f}")
    if screened_tiles:
        print(f"\nthe Q8_0 screen's tiles rescored per row (of {-(-models[first].gguf_lm_head.n // 16)}): " + ", ".join(screened_tiles))


if __name__ == "__main__":
    main()
