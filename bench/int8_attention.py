"""int8 K/V attention on AMX tiles (attention_amx_int8.h) against the AVX512-VNNI vector path it
matches bit for bit (attention_int8.h), with bf16 K/V's AMX attention beside them: the native paged
kernel at the three packaged models' attention shapes, a decode batch (one query row per sequence)
and a prefill chunk after cached slots. Both paths run in this process, one after the other on the
same inputs (kvserve_set_attention_amx), and their outputs are checked equal.

    .venv/bin/python bench/int8_attention.py [--contexts 400,2048] [--decode-batch 64] [--chunk 512]

Prints milliseconds per layer call (the best of 3 rounds' means over --repeats calls) and the AMX tiles' speed-up over the vector
path (above 1: AMX is faster). Needs a CPU with AMX-INT8.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvserve.kernels import attention, products
from kvserve.kernels.build import load_kernels
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.spec import KVCacheSpec

sys.path.insert(0, str(Path(__file__).parent))
from common import best_call_seconds  # noqa: E402

SHAPES = ((4, 1, 256, "Gemma 3 270M"), (9, 3, 64, "SmolLM2-135M"), (14, 2, 64, "Qwen2.5-0.5B"))
BLOCK = 16


def filled_view(kv_dtype: str, kv_heads: int, dim: int, slots: int):
    spec = KVCacheSpec(1, kv_heads, dim, kv_dtype, BLOCK, residual_dtype="bfloat16")
    blocks = -(-slots // BLOCK)
    pool = PagedKVPool(spec, blocks + 1, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(blocks * BLOCK, kv_heads, dim, generator=g), torch.randn(blocks * BLOCK, kv_heads, dim, generator=g)
    pool.layers[0].store(torch.arange(blocks * BLOCK), k.bfloat16(), v.bfloat16())
    return pool, pool.layers[0].view, torch.arange(blocks)


def timed(library, call, repeats: int) -> dict[str, tuple[float, torch.Tensor]]:
    """{'amx': (seconds, output), 'vector': ...}: the two paths in turns, the best call of each"""
    results = {}
    for name, on in (("amx", 1), ("vector", 0)):
        library.kvserve_set_attention_amx(on)
        out = call()
        results[name] = (best_call_seconds(call, repeats), out)
    library.kvserve_set_attention_amx(int(products.amx_ready()))
    return results


MAX_CONTEXT = 131072  # slots: a pool of this many fits in a few GiB at these shapes


def context_list(text: str) -> list[int]:
    """--contexts: comma-separated slot counts, 1 .. MAX_CONTEXT"""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated positive integers, got {text!r}") from None
    if not all(1 <= v <= MAX_CONTEXT for v in values):
        raise argparse.ArgumentTypeError(f"each context must be 1 to {MAX_CONTEXT:,} slots, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("--contexts", type=context_list, default=[400, 2048],
                        help=f"slots each query row sees, comma-separated, 1 to {MAX_CONTEXT:,} (default: 400,2048)")
    parser.add_argument("--decode-batch", type=int, default=64, help="sequences in the decode batch, 1 to 1,024 (default: 64)")
    parser.add_argument("--chunk", type=int, default=512,
                        help="rows of the prefill chunk, the context's last rows; at most the context (default: 512)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="calls per round, 1 to 1,000 (3 rounds per path; the best round's mean is kept) (default: 20)")
    args = parser.parse_args(argv)
    contexts = args.contexts
    if not 1 <= args.decode_batch <= 1024 or args.chunk < 1 or not 1 <= args.repeats <= 1000:
        parser.error("--decode-batch takes 1 to 1,024, --chunk a positive integer, --repeats 1 to 1,000")
    library = load_kernels()
    if library is None or not library.kvserve_set_attention_amx(1) or not library.kvserve_attention_amx_int8():
        sys.exit("int8 K/V take AMX tiles only on a CPU with AMX-INT8 (and the native kernels built): nothing to compare here")
    print(f"{torch.get_num_threads()} threads; decode batch {args.decode_batch}, prefill chunk {args.chunk} rows; ms per layer call")
    print("| model shape | context | call | int8 on AMX | int8 vector | AMX speed-up | bf16 on AMX |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for heads, kv_heads, dim, name in SHAPES:
        for context in contexts:
            chunk = min(args.chunk, context)  # a context shorter than --chunk is prefilled whole (the table says how many rows)
            g = torch.Generator().manual_seed(1)
            decode_q = torch.randn(args.decode_batch, heads, dim, generator=g).bfloat16()
            prefill_q = torch.randn(chunk, heads, dim, generator=g).bfloat16()
            rows: dict[str, dict] = {}
            for kv_dtype in ("int8", "bfloat16"):
                _pool, view, table = filled_view(kv_dtype, kv_heads, dim, context)
                tables, lens = table[None].repeat(args.decode_batch, 1), torch.full((args.decode_batch,), context)
                calls = {"decode": lambda: attention.paged_decode_attention(decode_q, view, tables, lens, dim**-0.5, None),
                         "prefill": lambda: attention.paged_prefill_attention(prefill_q, view, table, context - chunk, dim**-0.5, None)}  # fmt: skip
                for call, fn in calls.items():
                    rows.setdefault(call, {})[kv_dtype] = timed(library, fn, args.repeats)
            for call, by_dtype in rows.items():
                int8 = by_dtype["int8"]
                if not torch.equal(int8["amx"][1], int8["vector"][1]):
                    sys.exit(f"{name}, {context} slots, {call}: int8 on AMX tiles differs from the vector path")
                amx, vector, bf16 = int8["amx"][0] * 1e3, int8["vector"][0] * 1e3, by_dtype["bfloat16"]["amx"][0] * 1e3
                label = f"decode x{args.decode_batch}" if call == "decode" else f"prefill {chunk} rows"
                print(f"| {name} ({heads} x {dim}, {kv_heads} KV) | {context:,} | {label} | {amx:.3f} | {vector:.3f} | {vector / amx:.2f}x | {bf16:.3f} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
