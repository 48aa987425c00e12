"""llama.cpp's `llama-batched-bench` workload on kvserve, and on llama.cpp itself when given its binary:
N parallel prompts of `--prompt-len` random tokens, `--new-tokens` greedy tokens each, for each N in
`--parallel`; prints generated tokens per second over the whole job (prefill included) and the
ratios to llama.cpp's (same GGUF file) and OpenVINO GenAI's (same token ids; models exported by
bench/export_openvino.py, run by bench/openvino_runner.py under `--openvino-python`) in the same run.

    .venv/bin/python bench/batched_bench.py [--model gemma-3-270m] [--parallel 1,16,64]
        [--llama-batched-bench PATH/llama-batched-bench] [--threads 2] [--weight-dtypes auto gguf]
        [--openvino-model /work/ov-models/gemma-3-270m-int4 --openvino-model ...-int8 --openvino-python /work/ov-venv/bin/python]

llama.cpp is run as `llama-batched-bench -m GGUF -c C -b 2048 -ub 512 -npp P -ntg T -npl N -t THREADS`;
its "T s" column (the whole job) gives its rate. Build it as docs/benchmarks.md says (AMX off).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kv.spec import KV_FORMATS  # noqa: E402
from kvserve.model.registry import resolve_model_path  # noqa: E402


def job_prompts(parallel: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """The job's random token ids: the same for kvserve and OpenVINO GenAI (llama.cpp draws its own)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(parallel)]


def kvserve_rate(llm: LLM, parallel: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> float:
    prompts = job_prompts(parallel, prompt_len, vocab, seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return parallel * new_tokens / (time.perf_counter() - start)


def llama_cpp_rates(binary: str, gguf: str, parallel: list[int], prompt_len: int, new_tokens: int, threads: int) -> dict[int, float]:
    """{N: generated tok/s over the whole job} from llama-batched-bench's table."""
    context = max(parallel) * (prompt_len + new_tokens) + 64
    cmd = [binary, "-m", gguf, "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(new_tokens),
           "-npl", ",".join(map(str, parallel)), "-t", str(threads)]  # fmt: skip
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as error:
        raise LlamaCppError(f"{binary}: {error.strerror or error}") from None
    if run.returncode != 0:
        tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-5:])
        raise LlamaCppError(f"{binary} exited with status {run.returncode}" + (f":\n{tail}" if tail else ""))
    rates = parse_rates(run.stdout, new_tokens)
    missing = sorted(set(parallel) - rates.keys())
    if missing:
        raise LlamaCppError(f"{binary} printed no llama-batched-bench row for parallel {missing}")
    return rates


class LlamaCppError(RuntimeError):
    """llama-batched-bench failed or printed no table: the message says why (its last lines of output)."""


def openvino_rates(python: str, model: str, parallel: list[int], prompt_len: int, new_tokens: int, threads: int, vocab: int) -> dict:
    """bench/openvino_runner.py's results for one exported model, run by `python` (one that has
    openvino-genai) on the token ids kvserve's rows take."""
    job = {"model": model, "parallel": parallel, "new_tokens": new_tokens, "threads": threads,
           "prompts": {str(n): job_prompts(n, prompt_len, vocab, seed=n) for n in parallel},
           "warmup": job_prompts(2, 64, vocab, seed=99)}  # fmt: skip
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openvino_runner.py")
    done = subprocess.run([python, runner], input=json.dumps(job), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"OpenVINO GenAI on {model} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["rates"] = {int(n): rate for n, rate in result["rates"].items()}
    return result


def machine_line() -> str:
    """The CPU model and its measured memory bandwidth (a 512 MiB copy with torch's threads, the best of 3)."""
    import torch

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "unknown CPU")
    source, target = torch.ones(128 << 20), torch.empty(128 << 20)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return f"{model}, {os.cpu_count()} cores, memory bandwidth {2 * source.nbytes / best / 1e9:.1f} GB/s (a copy: read + write)"


def executable_file(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def positive_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated (e.g. 1,16,64)")
    return values


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_rates(out: str, new_tokens: int) -> dict[int, float]:
    """{B: generated tok/s over the whole job} from llama-batched-bench's table (PP | TG | B | N_KV |
    T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s): B x TG / T."""
    rates = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 9 and re.fullmatch(r"\d+", cells[0] or "") and int(cells[1]) == new_tokens:
            rates[int(cells[2])] = int(cells[2]) * new_tokens / float(cells[8])
    return rates


def weight_form(value: str) -> str:
    held, _, rows = value.partition(":")
    if held not in ("auto", "gguf", "bfloat16", "float32", "int8") or rows not in ("", "auto", "exact", "int8", "bf16"):
        raise argparse.ArgumentTypeError(f"{value!r}: a --weight-dtype, optionally :auto, :exact, :int8 or :bf16")
    return value


def kv_form(value: str) -> str:
    if value != "auto" and value not in KV_FORMATS:
        raise argparse.ArgumentTypeError(f"{value!r}: auto or one of {', '.join(KV_FORMATS)}")
    return value


def column_name(weight_dtype: str, kv_dtype: str, args: argparse.Namespace) -> str:
    """kvserve's column: the flags that differ between its columns."""
    flags = [f"--weight-dtype {weight_dtype}"] * (len(args.weight_dtypes) > 1) + [f"--kv-cache-dtype {kv_dtype}"] * (len(args.kv_cache_dtypes) > 1)
    return f"kvserve ({', '.join(flags)})" if flags else "kvserve"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m", help="alias, GGUF file or HF directory")
    parser.add_argument("--parallel", type=positive_list, default=[1, 16, 64], help="parallel sequences per job, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per sequence")
    parser.add_argument("--llama-batched-bench", default=None, help="path to llama.cpp's llama-batched-bench binary")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's -t")
    parser.add_argument("--weight-dtypes", nargs="+", default=["auto"], type=weight_form,
                        help="kvserve's --weight-dtype (auto, gguf, bfloat16, float32, int8), optionally with its "
                        "--gguf-activations after a colon (gguf:exact, gguf:int8, gguf:bf16): one column per value, each engine loaded in turn")
    parser.add_argument("--rounds", type=int, default=1, help="kvserve's engines are all loaded and take turns this many times; best kept")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], type=kv_form,
                        help="kvserve's --kv-cache-dtype (auto, bfloat16, int8, fp8_e4m3, ...): one column per value and weight form")
    parser.add_argument("--openvino-model", action="append", default=[], metavar="DIR",
                        help="an OpenVINO GenAI model directory (bench/export_openvino.py) to run beside kvserve on the same token "
                        "ids and threads; repeat for several (int4, int8)")
    parser.add_argument("--openvino-python", default=sys.executable,
                        help="a Python with openvino-genai installed (the peers' environment, not kvserve's)")  # fmt: skip
    args = parser.parse_args()
    parallel = args.parallel
    if args.prompt_len <= 0 or args.new_tokens <= 0 or args.threads <= 0 or args.rounds <= 0:
        parser.error("--prompt-len, --new-tokens, --threads and --rounds must be positive")
    if args.llama_batched_bench and not executable_file(args.llama_batched_bench):
        parser.error(f"--llama-batched-bench {args.llama_batched_bench}: not an executable file")
    ours, dtype, engines = {}, None, {}
    for weight_dtype, kv_dtype in itertools.product(args.weight_dtypes, args.kv_cache_dtypes):
        held, _, rows = weight_dtype.partition(":")
        llm = LLM(model=args.model, max_num_seqs=max(parallel), enable_prefix_caching=False, weight_dtype=held, gguf_activations=rows or "auto",
                  kv_cache_dtype=kv_dtype)  # fmt: skip
        dtype = llm.engine.config.dtype
        vocab = llm.engine.model.config.vocab_size
        kvserve_rate(llm, 2, 64, 4, vocab, seed=99)  # warm-up: the kernels' first calls, then each measured shape once
        for n in parallel:
            kvserve_rate(llm, n, args.prompt_len, 2, vocab, seed=1000 + n)
        engines[(weight_dtype, kv_dtype)] = llm
    # the engines take turns within each round (the machine's speed drifts over minutes); each keeps its best
    for _ in range(args.rounds):
        for n in parallel:
            for key, llm in engines.items():
                value = kvserve_rate(llm, n, args.prompt_len, args.new_tokens, vocab, seed=n)
                ours.setdefault(key, {})[n] = max(ours.get(key, {}).get(n, 0.0), value)
    del engines, llm
    peers = {}
    for directory in args.openvino_model:
        try:
            run = openvino_rates(args.openvino_python, directory, parallel, args.prompt_len, args.new_tokens, args.threads, vocab)
        except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as error:
            print(f"OpenVINO GenAI's column for {directory} is left out: {error}", file=sys.stderr)
            continue
        name = f"OpenVINO GenAI {os.path.basename(os.path.normpath(directory))}"
        peers[name] = run["rates"]
        print(f"{name}: openvino-genai {run['openvino_genai']}, KV cache {run['kv_cache_precision']}, inference precision "
              f"{run['inference_precision']}, {args.threads} threads, CPU pinning off", file=sys.stderr)  # fmt: skip
    theirs = {}
    if args.llama_batched_bench:
        gguf = str(resolve_model_path(args.model))
        try:
            theirs = llama_cpp_rates(args.llama_batched_bench, gguf, parallel, args.prompt_len, args.new_tokens, args.threads)
        except LlamaCppError as error:
            print(f"llama.cpp's row is left out: {error}", file=sys.stderr)
    print(f"{args.model} ({dtype}), {args.prompt_len}-token prompts, {args.new_tokens} greedy tokens each; "
          "generated tok/s over the whole job")  # fmt: skip
    print(machine_line())
    names = [column_name(w, kv, args) for w, kv in ours]
    others = {**peers, **({"llama.cpp": theirs} if args.llama_batched_bench else {})}
    ratios = [(name, peer) for name in names for peer in others]
    print("| parallel | " + " | ".join(names + list(others)) + "".join(f" | {name} / {peer}" for name, peer in ratios) + " |")
    print("|---:|" + "---:|" * (len(names) + len(others) + len(ratios)))
    for n in parallel:
        rates = dict(zip(names, (table[n] for table in ours.values()))) | {peer: table.get(n) for peer, table in others.items()}
        cells = [f"{rates[name]:.1f}" if rates[name] else "-" for name in names + list(others)]
        cells += [f"{rates[name] / rates[peer]:.2f}x" if rates[peer] else "-" for name, peer in ratios]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
