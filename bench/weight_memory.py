"""Bytes of weight tensors the engine holds for a model, with the native kernels and without.

    .venv/bin/python bench/weight_memory.py [--model gemma-3-270m]

With AVX512-BF16 the projections are held once (packed), the tied embedding/lm_head three times
(row-major for the embedding lookup, packed bf16, int8 for the screened greedy argmax). Float32
weights (bf16 without AVX512-BF16) are packed for float_matmul: the projections held once, the
lm_head twice (row-major, packed).
"""

from __future__ import annotations

import argparse

import torch

from kvserve import LLM


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters())
    for name in ("packed", "float_packed", "amx"):
        tensors += [getattr(m, name).data for m in model.modules() if getattr(m, name, None) is not None]
    for packed in (model.packed_lm_head, model.amx_lm_head, model.float_lm_head):
        if packed is not None:
            tensors.append(packed.data)
    screened = model.screened_lm_head
    if screened is not None:
        tensors += [screened.int8, screened.row_scale, screened.row_error, screened.row_abs_q, screened.tile_abs_q, screened.tile_error]
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(unique.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    args = parser.parse_args()
    for backend in ("torch_sdpa", "cpu_paged"):
        llm = LLM(args.model, dtype="bfloat16", kv_cache_memory=0.1, attention_backend=backend)
        print(f"--attention-backend {backend}: {weight_bytes(llm.engine.model) / 1e6:,.0f} MB of weight tensors")


if __name__ == "__main__":
    main()
