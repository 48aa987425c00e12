"""`kvserve plan`: how many sequences of what length fit, per KV dtype, and which limits to set."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvserve.kv.spec import GIB, KV_DTYPES, normalize_kv_dtype
from kvserve.model.config import ModelConfig
from kvserve.plan.capacity import Budget, KVShape, Workload, model_weight_bytes, plan
from kvserve.plan.replay import read_trace, replay

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("model shape (from --model, or from the three flags)")
    shape.add_argument("--model", default=None, help="alias, GGUF file, HF directory or config.json to read the shape from")
    shape.add_argument("--layers", type=int, default=None, help="transformer layers")
    shape.add_argument("--kv-heads", type=int, default=None, help="key/value heads per layer (GQA groups)")
    shape.add_argument("--head-dim", type=int, default=None, help="dimension of one head")
    shape.add_argument("--kv-dtype", default="float16", help=f"KV element type: {', '.join(KV_DTYPES)} (aliases fp16, bf16, fp32)")
    work = parser.add_argument_group("workload")
    work.add_argument("--seq-lens", default=None, help="comma-separated sequence lengths (prompt + output), e.g. 4096,2048")
    work.add_argument("--trace", default=None, help="JSONL trace: one {\"prompt_len\": N, \"output_len\": M} per line")
    work.add_argument("--block-size", type=int, default=16, help="tokens per KV block (page rounding)")
    work.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a prefix shared by several sequences")
    work.add_argument("--shared-prefix-seqs", type=int, default=0, help="how many of the sequences share that prefix")
    mem = parser.add_argument_group("memory budget")
    mem.add_argument("--memory-gib", type=float, default=None, help="device memory for weights + KV + workspace")
    mem.add_argument("--weights-gib", type=float, default=None, help="weights; default: computed from --model at --dtype")
    mem.add_argument("--dtype", default="bfloat16", choices=list(_DTYPE_BYTES), help="weight dtype when weights come from --model")
    mem.add_argument("--headroom-gib", type=float, default=0.5, help="workspace kept free (activations, logits)")
    rep = parser.add_argument_group("replay (runs the real scheduler and block manager, no model)")
    rep.add_argument("--replay", default=None, metavar="TRACE", help="JSONL trace to replay through the scheduler")
    rep.add_argument("--kv-cache-memory", type=float, default=None, help="replay: GiB of KV pool (default: the planned budget, else 2)")
    rep.add_argument("--num-kv-blocks", type=int, default=None, help="replay: exact number of KV blocks")
    rep.add_argument("--max-num-seqs", type=int, default=64, help="replay: sequences per step")
    rep.add_argument("--max-num-batched-tokens", type=int, default=2048, help="replay: token budget per step")
    rep.add_argument("--max-model-len", type=int, default=None, help="replay: longest sequence")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def load_model_config(model: str) -> ModelConfig:
    from kvserve.model.loader import read_gguf_metadata
    from kvserve.model.registry import resolve_model_path

    path = Path(model)
    if path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"model config {model!r} does not exist")
        return ModelConfig.from_hf_file(path)
    path = resolve_model_path(model)
    if path.is_file():
        meta, shapes = read_gguf_metadata(path)
        return ModelConfig.from_gguf_metadata(meta, shapes)
    return ModelConfig.from_hf_file(path)


def _shape(args: argparse.Namespace) -> tuple[KVShape, ModelConfig | None]:
    if args.model:
        config = load_model_config(args.model)
        return KVShape.from_model(config), config
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "kv_heads", "head_dim") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"give --model or all of --layers --kv-heads --head-dim (missing {' '.join(missing)})")
    return KVShape(args.layers, args.kv_heads, args.head_dim), None


def _seq_lens(args: argparse.Namespace) -> tuple[int, ...]:
    if args.trace:
        return tuple(r.prompt_len + r.output_len for r in read_trace(args.trace))
    if args.seq_lens is None:
        raise ValueError("give --seq-lens or --trace")
    try:
        lens = tuple(int(x) for x in args.seq_lens.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"seq-lens must be comma-separated integers, got {args.seq_lens!r}") from exc
    if not lens:
        raise ValueError("seq-lens is empty: give at least one sequence length")
    return lens


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{int(n)} B"


def _print_tables(result: dict) -> None:
    console = Console()
    s = result["shape"]
    console.print(
        f"[bold]KV plan[/bold]: {s['layers']} layers x {s['kv_heads']} KV heads x head_dim {s['head_dim']}"
        + (f", {s['sliding_layers']} sliding-window layers" if s["sliding_layers"] else "")
        + f", block size {s['block_size']}, {result['num_seqs']} sequences / {result['num_tokens']} tokens"
    )
    table = Table(show_header=True)
    for col in ("kv dtype", "bytes/token", "logical", "physical (paged)", "with prefix sharing", "max concurrent seqs", "token capacity"):
        table.add_column(col, justify="right")
    for name, row in result["by_dtype"].items():
        table.add_row(
            name + (" *" if name == result["kv_dtype"] else ""),
            f"{row['bytes_per_token']:,}",
            _fmt_bytes(row["logical_bytes"]),
            _fmt_bytes(row["physical_bytes"]),
            _fmt_bytes(row["shared_bytes"]),
            f"{row.get('max_concurrent_seqs', '-')}",
            f"{row.get('token_capacity', '-'):,}" if "token_capacity" in row else "-",
        )
    console.print(table)
    if "recommended" in result:
        r = result["recommended"]
        console.print(
            f"KV budget {_fmt_bytes(result['kv_budget_bytes'])} ({'fits' if result['fits'] else 'does NOT fit'} the workload). "
            f"Set: --kv-cache-memory {r['kv_cache_memory']} --max-num-seqs {r['max_num_seqs']} "
            f"--max-num-batched-tokens {r['max_num_batched_tokens']} --max-model-len {r['max_model_len']}"
        )
    if "replay" in result:
        rp = result["replay"]
        qd = rp["queue_delay_steps"]
        console.print(
            f"[bold]replay[/bold]: {rp['num_requests']} requests in {rp['num_steps']} steps; peak KV "
            f"{rp['peak_num_blocks_used']}/{rp['num_blocks']} blocks ({rp['peak_kv_usage'] * 100:.1f}%, "
            f"{_fmt_bytes(rp['peak_kv_bytes'])}); {rp['num_preemptions']} preemptions; queue delay "
            f"mean {qd['mean']:.1f} / p50 {qd['p50']:.0f} / p95 {qd['p95']:.0f} / max {qd['max']} steps"
        )


def run_plan(args: argparse.Namespace) -> int:
    kv_dtype = normalize_kv_dtype(args.kv_dtype)
    shape, model_config = _shape(args)
    if args.replay and not (args.seq_lens or args.trace):
        args.trace = args.replay
    workload = Workload(_seq_lens(args), args.block_size, args.shared_prefix_len, args.shared_prefix_seqs)
    budget = None
    if args.memory_gib is not None:
        weights = args.weights_gib
        if weights is None:
            if model_config is None:
                raise ValueError("give --weights-gib (or --model, to compute the weights' size)")
            weights = model_weight_bytes(model_config, _DTYPE_BYTES[args.dtype]) / GIB
        budget = Budget(args.memory_gib, weights, args.headroom_gib)
    result = plan(shape, kv_dtype, workload, budget)
    if args.replay:
        result["replay"] = _replay(args, kv_dtype, shape, model_config, budget)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_tables(result)
    return 0


def _replay(args, kv_dtype: str, shape: KVShape, model_config: ModelConfig | None, budget: Budget | None) -> dict:
    from kvserve.config import EngineConfig
    from kvserve.model.config import FULL_ATTENTION, RopeConfig

    trace = read_trace(args.replay)
    if model_config is None:
        model_config = ModelConfig(
            architecture="llama", vocab_size=32000, hidden_size=shape.num_kv_heads * shape.head_dim,
            intermediate_size=1, num_layers=shape.num_layers, num_heads=shape.num_kv_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, rms_norm_eps=1e-6,
            max_position_embeddings=1 << 30, rope=RopeConfig(10000.0), layer_types=(FULL_ATTENTION,) * shape.num_layers,
        )
    memory = args.kv_cache_memory or (budget.kv_bytes / GIB if budget else 2.0)
    pool_dtype = kv_dtype if kv_dtype in ("float32", "bfloat16", "float16") else "float16"
    config = EngineConfig(
        model="(replay)", dtype=pool_dtype, kv_cache_dtype=kv_dtype, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, kv_cache_memory=memory, num_kv_blocks=args.num_kv_blocks,
    )
    return replay(config, model_config, trace, progress=not args.json)
