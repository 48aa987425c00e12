"""OpenVINO GenAI's side of bench/batched_bench.py, run by a Python that has openvino-genai (the
`peers` tools, never kvserve's environment; bench/export_openvino.py says how to make one and the
model directories). Reads a JSON job on stdin and prints one JSON line of results:

    {"model": DIR, "parallel": [1, 16, 64], "prompts": {"1": [[ids...]], ...}, "new_tokens": 128,
     "threads": 2, "warmup": [[ids...]]}  ->  {"rates": {"1": tok/s, ...}, "kv_cache_precision": "u8", ...}

The ContinuousBatchingPipeline runs on the CPU with INFERENCE_NUM_THREADS = threads, CPU pinning off
(the machine is shared), prefix caching off, greedy decoding with EOS ignored: the same token ids,
lengths and threads as kvserve's and llama.cpp's rows. A rate is generated tokens over the whole job
(prefill included), as theirs are.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as og


def main() -> None:
    job = json.load(sys.stdin)
    scheduler = og.SchedulerConfig()
    scheduler.cache_size = int(job.get("cache_gb", 2))
    scheduler.max_num_seqs = max(job["parallel"])
    scheduler.max_num_batched_tokens = int(job.get("max_num_batched_tokens", 2048))
    scheduler.enable_prefix_caching = False
    properties = {"INFERENCE_NUM_THREADS": int(job["threads"]), "ENABLE_CPU_PINNING": False}
    pipe = og.ContinuousBatchingPipeline(job["model"], scheduler, "CPU", properties)
    new_tokens = int(job["new_tokens"])

    def run(prompts: list[list[int]], tokens: int) -> float:
        each = og.GenerationConfig()
        each.max_new_tokens = tokens
        each.ignore_eos = True
        each.do_sample = False
        inputs = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        start = time.perf_counter()
        pipe.generate(inputs, [each] * len(inputs))
        return time.perf_counter() - start

    run(job["warmup"], 4)
    rates = {}
    for n in job["parallel"]:
        prompts = job["prompts"][str(n)]
        run(prompts, 2)  # each shape once before it is timed, as kvserve's rows are
        rates[str(n)] = n * new_tokens / run(prompts, new_tokens)
    core = ov.Core()
    print(json.dumps({
        "rates": rates,
        "openvino_genai": og.__version__,
        "kv_cache_precision": core.get_property("CPU", "KV_CACHE_PRECISION").get_type_name(),
        "inference_precision": core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
