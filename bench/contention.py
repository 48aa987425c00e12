"""One engine job alone and beside another process computing on the same cores, under OpenMP wait settings.

kvserve computes on torch's OpenMP threads (libgomp in torch's CPU wheel). Unless told otherwise, a
thread that finishes its share of a parallel region spins up to GOMP_SPINCOUNT=300,000 times
before it sleeps. With the cores to itself that wait is what keeps a step fast; when another busy
process shares the cores, the spinning thread holds a core that its straggling partner needs.
This runs the same job (SmolLM2, 8 requests of GPL-3 prose prefilled in chunks of 32 tokens, 16
greedy tokens each: many short steps) in a fresh process per setting, alone and beside a torch
process doing 512x512 matrix products on as many threads as there are cores, and prints seconds
and the ratio to the default's time alone.

    .venv/bin/python bench/contention.py
    .venv/bin/python bench/contention.py --settings default GOMP_SPINCOUNT=3000 OMP_WAIT_POLICY=PASSIVE --limit 240
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

JOB = """
import time
from pathlib import Path
from kvserve import LLM, SamplingParams
llm = LLM({model!r}, max_num_batched_tokens=32, enable_prefix_caching=False)
ids = llm.tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text())
prompts = [ids[i * 97: i * 97 + 64 + 12 * i] for i in range(8)]
params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print("SECONDS", time.perf_counter() - start, flush=True)
"""

COMPETITOR = """
import torch
a = torch.randn(512, 512)
while True:
    a = (a @ a).tanh()
"""


def run_job(model: str, setting: str, limit: float) -> float | None:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["TQDM_DISABLE"] = "1"
    if setting != "default":
        name, _, value = setting.partition("=")
        env[name] = value
    try:
        done = subprocess.run([sys.executable, "-c", JOB.format(model=model)], env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return None
    line = next((line for line in done.stdout.splitlines() if line.startswith("SECONDS")), None)
    if line is None:
        raise RuntimeError(f"the job failed under {setting}: {done.stderr[-2000:]}")
    return float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--settings", nargs="+", default=["default", "GOMP_SPINCOUNT=3000", "OMP_WAIT_POLICY=PASSIVE"],
                        help="'default' or NAME=VALUE environment settings for the job's process")  # fmt: skip
    parser.add_argument("--limit", type=float, default=180, help="seconds a job may run before it counts as more than that")
    args = parser.parse_args()
    times: dict[tuple[str, bool], float | None] = {}
    for shared in (False, True):
        competitor = None
        if shared:
            competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR], env={**os.environ, "TQDM_DISABLE": "1"})
            time.sleep(2)
        try:
            for setting in args.settings:
                times[setting, shared] = run_job(args.model, setting, args.limit)
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.wait()
    base = times.get(("default", False))

    def cell(value: float | None) -> str:
        if value is None:
            return f"> {args.limit:g} s"
        return f"{value:.1f} s" + (f" ({value / base:.2f}x)" if base else "")

    print(f"{args.model}, 8 requests, chunks of 32 tokens, 16 greedy tokens each; ratio to the default alone")
    print("| setting | alone | beside a busy torch process |")
    print("|---|---:|---:|")
    for setting in args.settings:
        print(f"| {setting} | {cell(times[setting, False])} | {cell(times[setting, True])} |")


if __name__ == "__main__":
    main()
