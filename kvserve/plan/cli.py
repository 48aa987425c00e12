"""`kvserve plan`: how many sequences of what length fit, per KV dtype, and which limits to set."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvserve.config import WEIGHT_DTYPES
from kvserve.kv.spec import DEFAULT_QUANT_RESIDUAL, GIB, KV_DTYPES, block_size_for, normalize_kv_dtype
from kvserve.model.config import ModelConfig
from kvserve.plan.capacity import MAX_GIB, NO_LIMIT, Budget, KVShape, Workload, model_weight_bytes, plan, tier_tokens
from kvserve.plan.replay import read_trace, replay

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("model shape (from --model, or from the three flags)")
    shape.add_argument("--model", default=None, help="alias, GGUF file, HF directory or config.json to read the shape from")
    shape.add_argument("--layers", type=int, default=None, help="transformer layers")
    shape.add_argument("--kv-heads", type=int, default=None, help="key/value heads per layer (GQA groups)")
    shape.add_argument("--head-dim", type=int, default=None, help="dimension of one head")
    shape.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="plan as the engine runs with this flag: sliding-window layers hold every block, as full layers do")
    shape.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="auto",
                       help=f"KV element type: {', '.join(KV_DTYPES)} (aliases fp16, bf16, fp32); auto (the default): "
                       "--dtype, as the engine's --kv-cache-dtype auto stores K/V in the model's dtype")
    shape.add_argument("--kv-quant-residual", type=int, default=DEFAULT_QUANT_RESIDUAL,
                       help="int4/int2: recent tokens each sequence keeps in full-precision residual blocks, as the engine's flag (default: %(default)s)")
    shape.add_argument("--kv-quant-sink-block", action=argparse.BooleanOptionalAction, default=True,
                       help="int4/int2: each sequence's first block kept in full precision, as the engine's flag")
    work = parser.add_argument_group("workload")
    work.add_argument("--seq-lens", default=None, help="comma-separated sequence lengths (prompt + output), e.g. 4096,2048")
    work.add_argument("--trace", default=None, help="JSONL trace: one {\"prompt_len\": N, \"output_len\": M} per line")
    work.add_argument("--block-size", type=int, default=16, help="tokens per KV block (page rounding)")
    work.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a prefix shared by several sequences")
    work.add_argument("--shared-prefix-seqs", type=int, default=0, help="how many of the sequences share that prefix")
    work.add_argument("--num-speculative-tokens", type=int, default=0,
                      help="speculative decoding (--speculative-config's num_speculative_tokens): the guessed slots every "
                      "sequence holds during a verification step (default: %(default)s)")
    work.add_argument("--beam-width", type=int, default=1,
                      help="beam search: beams per sequence; they share the prompt's whole blocks and each holds its own "
                      "output (needs --trace's output_len or --output-len) (default: %(default)s)")
    work.add_argument("--output-len", type=int, default=None,
                      help="with --seq-lens: the generated part of every sequence (beam search branches it)")
    mem = parser.add_argument_group("memory budget")
    mem.add_argument("--memory-gib", type=float, default=None, help="device memory for weights + KV + workspace")
    mem.add_argument("--weights-gib", type=float, default=None, help="weights; default: computed from --model at --dtype")
    mem.add_argument("--dtype", default="bfloat16", choices=list(_DTYPE_BYTES), help="the model's dtype (the engine's --dtype auto takes bfloat16 on CPUs with AVX512-BF16 or AMX, float32 on other "
                     "x86 CPUs): its weights when they come from --model, the KV dtype with --kv-dtype auto, and int4/int2's "
                     "full-precision residual blocks (default: %(default)s)")
    mem.add_argument("--weight-dtype", default="auto", choices=list(WEIGHT_DTYPES),
                     help="how the engine holds the weights, as its flag: gguf, a GGUF file's quantized blocks (its tensor bytes); "
                     "int8, the projections, embedding and lm_head in Q8_0 blocks (34 bytes per 32 weights) and the norms in float32; "
                     "int4, the q, k, o, gate and up projections in Q4_1 blocks (20 bytes per 32), v, down, the embedding and lm_head in Q8_0; "
                     "float32 / bfloat16, every parameter at that size, the lm_head once in its packed copy (a tied embedding reads its "
                     "rows there) and, with bf16 on CPUs with the int8 screen (AVX512-VNNI), the screen: vocab x hidden bytes more; "
                     "auto: gguf for a GGUF --model with --dtype float32, else --dtype (default: %(default)s)")
    mem.add_argument("--headroom-gib", type=float, default=0.5, help="workspace kept free (activations, logits)")
    mem.add_argument("--max-loras", type=int, default=0,
                     help="LoRA adapters resident (the engine's --enable-lora --max-loras), each counted at --max-lora-rank on all "
                     "seven projections in --dtype beside the weights (default: %(default)s, none)")
    mem.add_argument("--max-lora-rank", type=int, default=16, help="the adapters' rank, as the engine's flag (default: %(default)s)")
    mem.add_argument("--kv-offload-host-gib", type=float, default=None,
                     help="a host-memory KV tier's budget, as the engine's flag: how many tokens it holds (besides the pool)")
    mem.add_argument("--kv-offload-disk-gib", type=float, default=None,
                     help="a disk KV tier's budget, as the engine's flag: how many tokens it holds")
    rep = parser.add_argument_group("replay (runs the real scheduler and block manager, no model)")
    rep.add_argument("--replay", default=None, metavar="TRACE", help="JSONL trace to replay through the scheduler")
    rep.add_argument("--kv-cache-memory", type=float, default=None, help="replay: GiB of KV pool (default: the planned budget, else 2)")
    rep.add_argument("--num-kv-blocks", type=int, default=None, help="replay: exact number of KV blocks")
    rep.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (replay)")
    rep.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="token budget per step: the prefill chunk a sliding-window layer holds with its window (and replay's)")
    rep.add_argument("--prefill-step-tokens", type=int, default=1024,
                     help="replay: the engine's flag (a step whose prompt tokens reach it takes no more prompts once one "
                          "completes; 0: none) (default: %(default)s)")
    rep.add_argument("--max-model-len", type=int, default=None, help="replay: longest sequence")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def load_model_config(model: str) -> ModelConfig:
    from kvserve.model.loader import gguf_index, model_config_from_index
    from kvserve.model.registry import resolve_model_path

    path = Path(model)
    if path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"model config {model!r} does not exist")
        return ModelConfig.from_hf_file(path)
    path = resolve_model_path(model)
    if path.is_file():
        return model_config_from_index(gguf_index(path))
    return ModelConfig.from_hf_file(path)


def planned_weight_bytes(model: str, config: ModelConfig, weight_dtype: str, dtype: str) -> tuple[int, str]:
    """The bytes of weights the engine holds for --model under --weight-dtype, and how it holds them."""
    from kvserve.model.loader import gguf_index
    from kvserve.model.registry import resolve_model_path

    path = resolve_model_path(model) if Path(model).suffix != ".json" else Path(model)
    is_gguf = path.is_file() and path.suffix != ".json"
    if weight_dtype == "gguf" and not is_gguf:
        raise ValueError(f"--weight-dtype gguf keeps a GGUF file's blocks; {model} is not a GGUF model")
    if weight_dtype == "gguf" or (weight_dtype == "auto" and is_gguf and dtype == "float32"):
        return sum(t["bytes"] for t in gguf_index(path)["tensors"]), "GGUF blocks"
    if weight_dtype in ("int8", "int4"):
        return quantized_weight_bytes(config, dtype, weight_dtype), "int8 (Q8_0 blocks)" if weight_dtype == "int8" else "int4 (Q4_1 blocks)"
    held = dtype if weight_dtype == "auto" else weight_dtype
    # the lm_head is held once, in the native kernels' packed copy (a tied embedding reads its rows
    # there); in bf16, where the CPU screens greedy rows, its int8 screen beside it
    screen = lm_head_screen_bytes(config) if held == "bfloat16" else 0
    saved = _embedding_saved(path, config, held) if is_gguf else 0
    padding = amx_padding_bytes(config) if held == "bfloat16" else 0
    return model_weight_bytes(config, _DTYPE_BYTES[held]) + screen + padding - saved, held


def amx_padding_bytes(config: ModelConfig) -> int:
    """The zeros AMX B tiles add to bf16 weights where this CPU packs them so (products.amx_ready):
    each matrix [n, k] held as [n rounded up to 16, k rounded up to 32] (kernels/amx_matmul.cpp)."""
    from kvserve.kernels import products

    if not products.amx_ready():
        return 0
    h, q, kv, i = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]  # qkv_proj, o_proj, gate_up_proj, down_proj
    padded = sum((-(-n // 16) * 16) * (-(-k // 32) * 32) - n * k for n, k in layer) * config.num_layers
    padded += (-(-config.vocab_size // 16) * 16) * (-(-h // 32) * 32) - config.vocab_size * h  # the lm_head, once
    return padded * 2


def _embedding_saved(path: Path, config: ModelConfig, held: str) -> int:
    """Bytes an untied GGUF model's embedding saves held in its file blocks (model/loader.py
    _embedding_blocks) rather than in `held`: 0 where the engine dequantizes it."""
    from kvserve.model.loader import gguf_index, untied_embedding_tensor

    tensor = untied_embedding_tensor(gguf_index(path), config)
    if tensor is None:
        return 0
    blocks = -(-config.vocab_size // 16) * 16 * tensor["bytes"] // config.vocab_size  # the kernels' tiles of 16 rows
    return config.vocab_size * config.hidden_size * _DTYPE_BYTES[held] - blocks


def lm_head_screen_bytes(config: ModelConfig) -> int:
    """The int8 screen of a bf16 lm_head (kernels/sampling.py screen_weight) where this CPU runs one:
    a byte per weight in tiles of 16 rows, each row's scale and error, each group's bound."""
    from kvserve.kernels import sampling

    group = sampling.screen_group(config.hidden_size)
    if group is None or not sampling.int8_screen_available():
        return 0
    rows, groups = -(-config.vocab_size // 16) * 16, config.hidden_size // group
    return rows * config.hidden_size + rows * 4 * (2 + groups) + rows // 16 * 4 * (groups + 1)


def quantized_weight_bytes(config: ModelConfig, dtype: str, weight_dtype: str = "int8") -> int:
    """--weight-dtype int8: the projections, embedding and lm_head in Q8_0 blocks (34 bytes per 32
    weights; a matrix whose rows are no whole number of blocks in --dtype), the norms in float32;
    int4: the q, k, o, gate and up projections in Q4_1 blocks (20 bytes per 32), the rest in Q8_0."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    vocab = [(config.vocab_size, h)] * (1 if config.tie_word_embeddings else 2)
    four_bit = weight_dtype == "int4"
    # int4 keeps v_proj and down_proj in Q8_0 (model/loader.py)
    projections = [(q + kv, h), (h, q), (2 * i, h)] * layers
    eight_bit = [(kv, h), (h, i)] * layers
    block_bytes = 20 if four_bit else 34

    def held_bytes(n: int, k: int, block: int) -> int:
        return n * k * block // 32 if k % 32 == 0 else n * k * _DTYPE_BYTES[dtype]

    matrices = vocab + projections + eight_bit
    held = sum(held_bytes(n, k, 34) for n, k in vocab + eight_bit) + sum(held_bytes(n, k, block_bytes) for n, k in projections)
    if h % 32:  # a float lm_head: the native kernels' packed copy beside it, as for float weights
        held += config.vocab_size * h * _DTYPE_BYTES[dtype]
    return held + (model_weight_bytes(config, 1) - sum(n * k for n, k in matrices)) * 4


def _shape(args: argparse.Namespace) -> tuple[KVShape, ModelConfig | None]:
    if args.model:
        config = load_model_config(args.model)
        return KVShape.from_model(config, hybrid=not args.disable_hybrid_kv_cache_manager, residual_dtype=args.dtype,
                                  quant_residual=args.kv_quant_residual, sink_block=args.kv_quant_sink_block), config  # fmt: skip
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "kv_heads", "head_dim") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"give --model or all of --layers --kv-heads --head-dim (missing {' '.join(missing)})")
    return KVShape(args.layers, args.kv_heads, args.head_dim, residual_dtype=args.dtype, quant_residual=args.kv_quant_residual,
                   sink_block=args.kv_quant_sink_block), None  # fmt: skip


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


def _output_lens(args: argparse.Namespace) -> tuple[int, ...]:
    """Each sequence's output length, where known (a trace, or --output-len for every --seq-lens entry)."""
    if args.trace:
        return tuple(r.output_len for r in read_trace(args.trace))
    if args.output_len is not None:
        return (args.output_len,) * len(_seq_lens(args))
    return ()


def _fmt_bytes(n: float) -> str:
    for unit, size, digits in (("GiB", GIB, 2), ("MiB", 1024**2, 1), ("KiB", 1024, 1)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _columns(result: dict) -> list[tuple[str, Callable[[dict], str]]]:
    columns = [
        ("B/token", lambda r: f"{r['bytes_per_token']:,}"),
        ("logical", lambda r: _fmt_bytes(r["logical_bytes"])),
        ("paged", lambda r: _fmt_bytes(r["physical_bytes"])),
    ]
    if result["shared_bytes"] != result["physical_bytes"]:
        columns.append(("shared", lambda r: _fmt_bytes(r["shared_bytes"])))
    if "kv_budget_bytes" in result:
        columns += [
            ("max seqs", lambda r: f"{r['max_concurrent_seqs']:,}"),
            ("max len", lambda r: f"{r['max_admitted_len']:,}"),
            ("fits", lambda r: "yes" if r["fits"] else "no"),
        ]
    return columns


def _dtype_table(result: dict, console: Console) -> Table | Text:
    """One row per KV dtype; a paragraph per dtype when the table is wider than the terminal."""
    columns = _columns(result)
    names = {name: name + (" *" if name == result["kv_dtype"] else "") for name in result["by_dtype"]}
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    table.add_column("kv dtype")
    for title, _ in columns:
        table.add_column(title, justify="right")
    for name, row in result["by_dtype"].items():
        table.add_row(names[name], *(cell(row) for _, cell in columns))
    if console.measure(table, options=console.options.update_width(1 << 16)).maximum <= console.width:
        return table
    lines = [f"{names[name]}: " + ", ".join(f"{title} {cell(row)}" for title, cell in columns) for name, row in result["by_dtype"].items()]
    return Text("\n".join(lines))


def _gib(value: float) -> str:
    """A GiB figure as a flag takes it: three decimals at most, never an exponent."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


MAX_LEN_NOTE = "max len: the longest sequence the budget admits, the engine's default maximum model length"
SUGGESTED_LEN_NOTE = "; the suggested --max-model-len below is the workload's longest sequence."


def _advice(result: dict, budget: Budget, longest: int) -> list[str]:
    kv_dtype, required = result["kv_dtype"], result["required_kv_bytes"]
    lines = [
        f"KV budget {_fmt_bytes(result['kv_budget_bytes'])} = --memory-gib {budget.memory_gib:g} - "
        f"{budget.weights_gib:.3f} GiB weights ({result.get('weights_held_as', '--weights-gib')}) - {budget.headroom_gib:g} GiB headroom."
    ]
    need = f"{_fmt_bytes(required)} of {kv_dtype} KV"
    parts = []
    if required > result["shared_bytes"]:
        parts.append(f"{_fmt_bytes(required - result['shared_bytes'])} more than its blocks between steps "
                     "while one prefill chunk runs: the chunk and the window before it in each sliding-window group "
                     f"(or a whole sequence of --max-model-len {longest} at its peak)")  # fmt: skip
    if result["residual_bytes"]:
        sink = result.get("shape", {}).get("kv_quant_sink_block", True)
        parts.append(f"{_fmt_bytes(result['residual_bytes'])} of it between steps in full-precision blocks for each sequence's recent tokens"
                     f"{' and first block' if sink else ''}, taken from the pool as they are needed")  # fmt: skip
    if parts:
        need += " (" + "; ".join(parts) + ")"
    if result["fits"]:
        lines.append(f"It holds the workload, which needs {need}.")
    else:
        lines.append(f"It does NOT hold the workload, which needs {need}: that takes --memory-gib {result['required_memory_gib']:g}.")
        stored = [name for name, row in result["by_dtype"].items() if row["fits"]]
        if stored:
            lines.append(f"It fits at once with --kv-cache-dtype {' or '.join(stored)}.")
        smallest = min(result["by_dtype"].values(), key=lambda r: r["required_kv_bytes"])
        if not stored and smallest["required_kv_bytes"] < required:
            lines.append(f"With --kv-cache-dtype {smallest['kv_dtype']} it takes --memory-gib {smallest['required_memory_gib']:g}.")
        if result["recommended"] is not None:
            k = result["recommended"]["max_num_seqs"]
            lines.append(f"{k:,} of its {result['num_seqs']:,} sequences fit at a time: --max-num-seqs {k} (the rest wait).")
    r = result["recommended"]
    if r is None:
        lines.append(f"Not even its longest sequence ({longest:,} tokens) fits, so there are no engine flags to suggest.")
    else:
        dtype = f" {result['weight_flags']}" if "weight_flags" in result else ""
        dtype += "" if result["kv_dtype"] in ("float16", "bfloat16", "float32") else f" --kv-cache-dtype {result['kv_dtype']}"
        s = result["shape"]
        if result["kv_dtype"] in ("int4", "int2"):  # KIVI settings the residual blocks were counted with
            dtype += f" --kv-quant-residual {s['kv_quant_residual']}" if s["kv_quant_residual"] != DEFAULT_QUANT_RESIDUAL else ""
            dtype += "" if s["kv_quant_sink_block"] else " --no-kv-quant-sink-block"
        lines.append(
            f"{FLAGS_LABEL}{dtype} --kv-cache-memory {_gib(r['kv_cache_memory'])} --max-num-seqs {r['max_num_seqs']} \\\n"
            f"  --max-num-batched-tokens {r['max_num_batched_tokens']} --max-model-len {r['max_model_len']}"
        )
    return lines


FLAGS_LABEL = "Engine flags:"


def _shell_lines(command: str, width: int) -> list[str]:
    """A command's words (a flag with its value kept together) in lines of at most width characters,
    each but the last ending in a backslash, the later ones indented."""
    words, parts = [], command.split()
    for part in parts:
        if words and not part.startswith("--") and words[-1].startswith("--") and " " not in words[-1]:
            words[-1] += " " + part
        else:
            words.append(part)
    lines, line = [], ""
    for word in words:
        candidate = f"{line} {word}" if line else word
        if line and len(candidate) + 2 > width:
            lines.append(line + " \\")
            line = "  " + word
        else:
            line = candidate
    return lines + [line]


def _print_plan(result: dict, budget: Budget | None, longest: int) -> None:
    console = Console()
    s = result["shape"]
    console.print(
        f"[bold]KV plan[/bold]: {_plural(s['layers'], 'layer')} x {_plural(s['kv_heads'], 'KV head')} x head_dim {s['head_dim']}"
        + (f" ({s['sliding_layers']} sliding-window)" if s["sliding_layers"] else "")
        + f", block size {s['block_size']}\nworkload: {_plural(result['num_seqs'], 'sequence')}, {_plural(result['num_tokens'], 'token')}",
        highlight=False,
    )
    groups = result["kv_cache_groups"]
    if len(groups) > 1:
        kinds: dict[str, int] = {}
        for g in groups:
            kinds[g["attention"]] = kinds.get(g["attention"], 0) + 1
        console.print(
            f"hybrid KV cache: {' + '.join(f'{n} {kind}' for kind, n in kinds.items())} groups of {len(groups[0]['layers'])} layers; "
            f"a block is {s['block_size']} tokens of one group ({_fmt_bytes(result['bytes_per_block'])}); sliding-window groups "
            "hold only their window's blocks",
            highlight=False,
        )
    console.print(_dtype_table(result, console))
    for tier, t in result.get("kv_tiers", {}).items():
        console.print(f"{tier} tier: {t['gib']:g} GiB holds {t['tokens']:,} tokens of {result['kv_dtype']} KV "
                      f"({t['sequences']:,} sequences of the workload's mean length) besides the pool", highlight=False)
    if budget is not None:
        suggests = result.get("recommended") is not None
        console.print(MAX_LEN_NOTE + (SUGGESTED_LEN_NOTE if suggests else "."), highlight=False, markup=False)
        for line in _advice(result, budget, longest):
            shell = line.startswith(FLAGS_LABEL)  # pasted into a shell: every break a backslash, none of rich's
            if shell:
                line = "\n".join(_shell_lines(line.replace("\\\n", ""), console.width))
            console.print(line, highlight=False, markup=False, soft_wrap=shell)
    if "replay" in result:
        rp = result["replay"]
        qd = rp["queue_delay_steps"]
        console.print(
            f"[bold]replay[/bold]: {rp['num_requests']} requests in {rp['num_steps']} steps; peak KV "
            f"{rp['peak_num_blocks_used']}/{rp['num_blocks']} blocks ({rp['peak_kv_usage'] * 100:.1f}%, "
            f"{_fmt_bytes(rp['peak_kv_bytes'])}); {rp['num_preemptions']} preemptions; queue delay "
            f"mean {qd['mean']:.1f} / p50 {qd['p50']:.0f} / p95 {qd['p95']:.0f} / max {qd['max']} steps"
        )


def _lora_bytes(args: argparse.Namespace, config: ModelConfig) -> int:
    from kvserve.lora.adapter import adapter_bytes

    if not 0 <= args.max_loras <= 256 or not 1 <= args.max_lora_rank <= 512:
        raise ValueError("--max-loras must be in [0, 256] and --max-lora-rank in [1, 512]")
    return args.max_loras * adapter_bytes(config, args.max_lora_rank, _DTYPE_BYTES[args.dtype])


def _check_weight_dtype(weight_dtype: str, dtype: str) -> None:
    """The engine's rules for --weight-dtype against --dtype, so a plan never suggests what it refuses."""
    if weight_dtype in _DTYPE_BYTES and weight_dtype != dtype:
        raise ValueError(f"--weight-dtype {weight_dtype} holds the weights in the activations' dtype: it needs --dtype {weight_dtype} "
                         f"(--dtype is {dtype})")  # fmt: skip
    if weight_dtype in ("gguf", "int8", "int4") and dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--weight-dtype {weight_dtype} takes float32 or bfloat16 activations; --dtype is {dtype}")


def run_plan(args: argparse.Namespace) -> int:
    """Exit status 1 when a memory budget is given and the workload does not fit in it at once."""
    _check_weight_dtype(args.weight_dtype, args.dtype)
    kv_dtype = normalize_kv_dtype(args.dtype if args.kv_dtype == "auto" else args.kv_dtype)
    shape, model_config = _shape(args)
    if args.replay and not (args.seq_lens or args.trace):
        args.trace = args.replay
    workload = Workload(
        _seq_lens(args), args.block_size, args.shared_prefix_len, args.shared_prefix_seqs, args.max_num_batched_tokens,
        model_config.max_position_embeddings if model_config is not None else NO_LIMIT, args.max_num_seqs,
        args.num_speculative_tokens, args.beam_width, _output_lens(args),
    )  # fmt: skip
    budget = None
    held_as = "--weights-gib"
    if args.memory_gib is not None:
        weights = args.weights_gib
        if weights is None:
            if model_config is None:
                raise ValueError("give --weights-gib (or --model, to compute the weights' size)")
            weight_bytes, held_as = planned_weight_bytes(args.model, model_config, args.weight_dtype, args.dtype)
            weights = (weight_bytes + _lora_bytes(args, model_config)) / GIB
            if args.max_loras:
                held_as += f" + {args.max_loras} LoRA adapters of rank {args.max_lora_rank}"
            if args.memory_gib - weights - args.headroom_gib <= 0:
                raise ValueError(_needs_by_weight_form(args, model_config, shape, kv_dtype, workload, weights, held_as))
        budget = Budget(args.memory_gib, weights, args.headroom_gib)
    result = plan(shape, kv_dtype, workload, budget)
    if args.max_loras and model_config is not None:
        result["lora_bytes_per_adapter"] = _lora_bytes(args, model_config) // args.max_loras
        result["lora_bytes"] = _lora_bytes(args, model_config)
    if budget is not None:
        result["weights_held_as"] = held_as
        result["weights_bytes"] = int(budget.weights_gib * GIB)
        if held_as != "--weights-gib":  # the weights were counted as these flags hold them
            result["weight_flags"] = f"--dtype {args.dtype}" + (f" --weight-dtype {args.weight_dtype}" if args.weight_dtype != "auto" else "")
    tiers = {}
    for tier, gib in (("host", args.kv_offload_host_gib), ("disk", args.kv_offload_disk_gib)):
        if gib is not None:
            if not 0 < gib <= MAX_GIB:
                raise ValueError(f"--kv-offload-{tier}-gib must be a positive number of GiB up to {MAX_GIB:,}, got {gib}")
            tokens = tier_tokens(shape.spec(kv_dtype, args.block_size), gib * GIB, host=tier == "host")
            tiers[tier] = {"gib": gib, "tokens": tokens, "sequences": tokens // max(1, round(statistics.fmean(workload.seq_lens)))}
    if tiers:
        result["kv_tiers"] = tiers
    if args.replay:
        result["replay"] = _replay(args, kv_dtype, shape, model_config, budget)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_plan(result, budget, max(workload.seq_lens))
    return 1 if budget is not None and not result["fits"] else 0


def _needs_by_weight_form(args, config: ModelConfig, shape: KVShape, kv_dtype: str, workload: Workload, weights_gib: float, held_as: str) -> str:
    """Why a --memory-gib that the weights fill is refused, and what the workload needs with each form
    the model's weights can be held in (the weights, the KV cache at the workload's peak, the headroom)."""
    from kvserve.model.registry import resolve_model_path

    path = resolve_model_path(args.model) if Path(args.model).suffix != ".json" else Path(args.model)
    forms = [("gguf", args.dtype)] if path.is_file() and path.suffix != ".json" else []
    forms += [("int4", args.dtype), ("int8", args.dtype), ("bfloat16", "bfloat16"), ("float32", "float32")]
    needs = []
    for weight_dtype, dtype in forms:
        weight_bytes, held = planned_weight_bytes(args.model, config, weight_dtype, dtype)
        fit = plan(shape, kv_dtype, workload, Budget(MAX_GIB, weight_bytes / GIB, args.headroom_gib))
        flags = f"--weight-dtype {weight_dtype}" + (f" --dtype {dtype}" if dtype != args.dtype else "")
        needs.append(f"{held} ({flags}): {weight_bytes / GIB:.3f} GiB of weights, {fit['required_memory_gib']:.3f} GiB in all")
    return (f"memory-gib {args.memory_gib} leaves nothing for the KV cache after {weights_gib:.3f} GiB of weights ({held_as}) and "
            f"{args.headroom_gib:g} GiB of headroom. This workload needs, with the weights held as: " + "; ".join(needs))


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
    memory = args.kv_cache_memory if args.kv_cache_memory is not None else budget.kv_bytes / GIB if budget else 2.0
    pool_dtype = kv_dtype if kv_dtype in ("float32", "bfloat16", "float16") else "float16"
    config = EngineConfig(
        model="(replay)", dtype=pool_dtype, kv_cache_dtype=kv_dtype, block_size=block_size_for(kv_dtype, args.block_size),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_step_tokens=args.prefill_step_tokens, max_model_len=args.max_model_len, kv_cache_memory=memory, num_kv_blocks=args.num_kv_blocks,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager, kv_quant_residual=shape.quant_residual,
        kv_quant_sink_block=shape.sink_block,
    )
    return replay(config, model_config, trace, progress=not args.json)
