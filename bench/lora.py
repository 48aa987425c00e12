"""LoRA adapters against the base model on the same engine: N requests spread over `--adapters`
rank-`--rank` adapters on every projection (q, k, v, o, gate, up, down) against the same N on the
base model, and one stream with one adapter against one without. Generated tok/s over the whole job
(prefill included), each measured `--rounds` times alternately, best kept; and the bytes each
adapter holds resident. The adapters are random PEFT files written for the model's shapes.

    .venv/bin/python bench/lora.py [--model gemma-3-270m] [--parallel 64] [--adapters 4] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from batched_bench import job_prompts, machine_line  # noqa: E402
from kvserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from kvserve.lora.adapter import TARGETS, module_shape  # noqa: E402


def write_adapter(directory: Path, config, rank: int, seed: int) -> Path:
    """A PEFT adapter of random weights (A as peft's Kaiming-uniform init, B small and non-zero)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGETS:
            out, inner = module_shape(config, module)
            where = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.rand(rank, inner, generator=g) * 2 - 1) / inner**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                               "target_modules": list(TARGETS), "bias": "none"}))  # fmt: skip
    return directory


def rate(llm: LLM, prompts: list[list[int]], new_tokens: int, loras) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m", help="alias, GGUF file or HF directory")
    parser.add_argument("--parallel", type=int, default=64, help="requests of the batched job")
    parser.add_argument("--adapters", type=int, default=4, help="adapters the batched job's requests are spread over")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(model=args.model, max_num_seqs=args.parallel, enable_prefix_caching=False, enable_lora=True, max_loras=args.adapters,
              max_lora_rank=args.rank)  # fmt: skip
    config = llm.engine.model_config
    vocab = config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"bench-{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i)))
                 for i in range(args.adapters)]  # fmt: skip
        spread = [loras[i % len(loras)] for i in range(args.parallel)]
        rate(llm, job_prompts(2, 64, vocab, 99), 4, [loras[0], None])  # warm-up: kernels, adapters resident
        rate(llm, job_prompts(args.adapters, 64, vocab, 98), 4, loras)
        jobs = {"batched": (args.parallel, spread), "single": (1, loras[0])}
        best: dict[tuple[str, str], float] = {}
        for r in range(args.rounds):
            for job, (n, with_lora) in jobs.items():
                prompts = job_prompts(n, args.prompt_len, vocab, seed=1000 * r + n)
                for name, chosen in (("base", None), ("lora", with_lora)):
                    value = rate(llm, prompts, args.new_tokens, chosen)
                    best[(job, name)] = max(best.get((job, name), 0.0), value)
        resident = llm.engine.lora.resident_bytes
    print(f"{args.model} ({llm.engine.config.dtype}, weights {llm.engine.weights_description()}), {args.prompt_len}-token prompts, "
          f"{args.new_tokens} greedy tokens each; generated tok/s over the whole job, best of {args.rounds}")  # fmt: skip
    print(machine_line())
    print("| job | base model | with LoRA | LoRA / base |")
    print("|---|---:|---:|---:|")
    labels = {"batched": f"{args.parallel} requests over {args.adapters} rank-{args.rank} adapters", "single": "1 stream, 1 adapter"}
    for job in jobs:
        base, lora = best[(job, "base")], best[(job, "lora")]
        print(f"| {labels[job]} | {base:.1f} | {lora:.1f} | {lora / base:.2f}x |")
    print(f"resident adapter products: {resident / len(loras) / 2**20:.2f} MiB per adapter ({resident / 2**20:.1f} MiB for {len(loras)})")


if __name__ == "__main__":
    main()
