"""Offline throughput: kvserve LLM.generate against transformers generate, same GGUF, same machine.

64 requests, prompts of 64..512 tokens (seeded slices of real prose), 128 new tokens each, under
each sampling setting users send: greedy; temperature 1.0 (the API's default); temperature 0.8
with top-p 0.95; temperature 0.7 with top-k 40, top-p 0.9 and repetition penalty 1.1. For each:
generated tok/s at 64 requests and single-request decode tok/s, with the ratio to greedy. HF runs
batched with left padding; its dtype is the faster of fp32/bf16 (probed on one small batch), then
its batch size the best of 8/16/32/64, greedy and at temperature 0.8 / top-p 0.95. Also the
prefill tok/s of a 2,048-token prompt. Prints ratios against the HF baseline from this run.

    .venv/bin/python bench/throughput.py            # full run (~20 min on 2 cores)
    .venv/bin/python bench/throughput.py --quick    # 16 requests, HF batch 16 only
    .venv/bin/python bench/throughput.py --skip-hf  # kvserve's rows only
    .venv/bin/python bench/throughput.py --skip-hf --rounds 3  # settings in turns, medians
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from common import make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.registry import resolve_model_path  # noqa: E402


SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "temperature 0.7, top-k 40, top-p 0.9, repetition 1.1": dict(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1),
}


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int, **sampling) -> float:
    """Generated tokens/s of one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=pad_id,
                             **(dict(do_sample=True, **sampling) if sampling else dict(do_sample=False)))
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / elapsed


def load_hf(path: Path, dtype: torch.dtype):
    """transformers' model of a GGUF file (dequantized) or an HF directory, EOS off (every request runs to its length)."""
    from transformers import AutoModelForCausalLM

    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="16 requests and HF at batch 16 only")
    parser.add_argument("--weight-dtype", default=None, help="kvserve's --weight-dtype (default: the engine's auto)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every setting this many times, in turns, and report medians (this machine's "
                        "throughput drifts by 10-20%% within minutes, so a ratio of rows taken one after another moves too)")
    parser.add_argument("--hf-dtypes", default="float32,bfloat16", help="HF dtypes to probe (the faster one is swept)")
    args = parser.parse_args()
    if args.quick:
        args.requests = 16
    batch_sizes = [16] if args.quick else [8, 16, 32, 64]

    llm = LLM(args.model, max_num_seqs=args.requests, **({"weight_dtype": args.weight_dtype} if args.weight_dtype else {}))
    tok = llm.tokenizer
    bos = llm.engine.model_config.bos_token_id
    prompts = make_prompts(tok, args.requests, 64, 512, seed=0, bos=bos)
    print(f"workload: {len(prompts)} requests, prompt tokens {min(map(len, prompts))}..{max(map(len, prompts))} "
          f"(total {sum(map(len, prompts))}), {args.new_tokens} new tokens each")

    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, setting in SETTINGS.items():
            params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=0, **setting)
            # every setting computes its prompts: the rows after the first would otherwise read the first's from the prefix cache
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            batched = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
            llm.reset_prefix_cache()
            single = llm.generate([prompts[0][:128]], params, use_tqdm=False)[0]
            m = single.metrics
            samples[name].append((batched, (len(single.token_ids) - 1) / (m["last_token_time"] - m["first_token_time"])))
            print(f"kvserve ({llm.engine.config.dtype}) {name}: {samples[name][-1][0]:.1f} generated tok/s at {len(prompts)} "
                  f"requests, {samples[name][-1][1]:.1f} tok/s single-request decode", flush=True)
    rows = {name: (statistics.median(b for b, _ in runs), statistics.median(s for _, s in runs)) for name, runs in samples.items()}
    ours, decode_tps = rows["greedy"]
    median = f" (median of {args.rounds})" if args.rounds > 1 else ""
    print(f"\n| sampling | tok/s, {len(prompts)} requests{median} | vs greedy | single-request decode tok/s{median} | vs greedy |")
    print("|---|---:|---:|---:|---:|")
    for name, (batched, single) in rows.items():
        print(f"| {name} | {batched:.1f} | {batched / ours:.2f}x | {single:.1f} | {single / decode_tps:.2f}x |")

    long_prompt = make_prompts(tok, 1, 2048, 2048, seed=1, bos=bos)[0]
    start = time.perf_counter()
    llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    prefill_tps = len(long_prompt) / (time.perf_counter() - start)
    print(f"kvserve prefill of a 2,048-token prompt: {prefill_tps:.1f} tok/s ({llm.stats()['num_preemptions']} preemptions in all)")
    del llm
    gc.collect()

    if args.skip_hf:
        return
    path = resolve_model_path(args.model)
    pad = tok._tok.pad_token_id if tok._tok.pad_token_id is not None else 0
    probe = {}
    if "," not in args.hf_dtypes:
        probe[args.hf_dtypes] = 0.0
        args.hf_dtypes = ""
    for name in filter(None, args.hf_dtypes.split(",")):
        model = load_hf(path, getattr(torch, name))
        probe[name] = hf_generate(model, prompts[:8], 16, pad)
        print(f"HF probe {name}: {probe[name]:.1f} tok/s (batch 8, 16 tokens)")
        del model
        gc.collect()
    best_dtype = max(probe, key=probe.get)
    model = load_hf(path, getattr(torch, best_dtype))
    results = {}
    for bs in batch_sizes:
        batch = prompts[:bs]
        results[bs] = hf_generate(model, batch, args.new_tokens, pad)
        print(f"HF {best_dtype} batch {bs}: {results[bs]:.1f} generated tok/s", flush=True)
    best_bs = max(results, key=results.get)
    hf = results[best_bs]
    hf_sampled = hf_generate(model, prompts[:best_bs], args.new_tokens, pad, temperature=0.8, top_p=0.95)
    sampled = rows["temperature 0.8, top-p 0.95"][0]
    print("\n| engine | generated tok/s | ratio |")
    print("|---|---:|---:|")
    print(f"| transformers generate ({best_dtype}, batch {best_bs}), greedy | {hf:.1f} | 1.00x |")
    print(f"| kvserve LLM.generate, greedy | {ours:.1f} | {ours / hf:.2f}x |")
    print(f"| transformers generate ({best_dtype}, batch {best_bs}), temperature 0.8, top-p 0.95 | {hf_sampled:.1f} | 1.00x |")
    print(f"| kvserve LLM.generate, temperature 0.8, top-p 0.95 | {sampled:.1f} | {sampled / hf_sampled:.2f}x |")


if __name__ == "__main__":
    main()
