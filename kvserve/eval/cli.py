"""`kvserve eval`: argument parsing, the table and the JSON."""

from __future__ import annotations

import argparse
import copy
import json
import shlex
from pathlib import Path

from kvserve.config import EngineConfig
from kvserve.engine_args import add_engine_args, engine_config_from_args
from kvserve.eval.harness import EvalPlan, Evaluation
from kvserve.eval.text import default_text_path, read_text


def _ints(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _floats(value: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}") from None


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("evaluation")
    group.add_argument("--config", action="append", default=[], metavar="FLAGS",
                       help='engine flags of a configuration to compare with the reference (the engine flags given to this '
                       'command), e.g. --config "--kv-cache-dtype int8"; repeat for several')  # fmt: skip
    group.add_argument("--text", type=Path, default=None,
                       help="text file for perplexity, KL, greedy prompts and needle haystacks (default: argparse.py of Python's "
                       "standard library)")
    group.add_argument("--context", type=int, default=2048, help="tokens per perplexity window")
    group.add_argument("--score-chunk", type=int, default=32,
                       help="tokens of a window computed per step: each step reads the cache of the ones before, so small "
                       "chunks score the text as decoding reads it (int4/int2 quantize what leaves their residual window)")
    group.add_argument("--max-windows", type=int, default=4, help="most perplexity windows taken from the text")
    group.add_argument("--greedy-prompts", type=int, default=8, help="prompts cut from the text for greedy agreement (0: skip)")
    group.add_argument("--greedy-prompt-len", type=int, default=128, help="tokens per greedy prompt")
    group.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens generated per prompt")
    group.add_argument("--needle-lengths", type=_ints, default=(1024, 2048, 4096, 8192),
                       help="context lengths of the needle-in-a-haystack cases (longer than the model allows: skipped; empty: none)")
    group.add_argument("--needle-depths", type=_floats, default=(0.1, 0.3, 0.5, 0.7, 0.9),
                       help="where the needle lies in the haystack, 0 = start, 1 = end")
    group.add_argument("--needle-seed", type=int, default=0, help="seed of the needles' random passkeys")
    group.add_argument("--needle-question", choices=("inside", "outside", "both"), default="inside",
                       help="KV compression (--kv-compression) of a needle case: inside compresses the prompt with the question "
                       "at its end (SnapKV's window reads it); outside compresses the haystack before the question is read "
                       "(question-agnostic: the window is the haystack's last tokens, with --snapkv-query both or generic "
                       "the generic question too); both runs each (default: %(default)s)")
    group.add_argument("--score-from", type=int, default=0,
                       help="score each window's positions from this one on; a configuration with --kv-compression compresses "
                       "the window's first N tokens before it computes the rest, so e.g. --context 2048 --score-from 1536 "
                       "--config \"--kv-compression snapkv --kv-budget 512\" scores the last 511 tokens against a 512-token cache "
                       "(default: %(default)s, every position, nothing compressed)")
    group.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)


def attach_config_values(argv: list[str]) -> list[str]:
    """`--config "--no-kv-key-centering"` as `--config=--no-kv-key-centering`: argparse takes a
    value that starts with a dash for an option of its own and would refuse the flag's value."""
    out: list[str] = []
    values = iter(argv)
    for arg in values:
        if arg == "--config":
            value = next(values, None)
            out.append(arg if value is None else f"--config={value}")
        else:
            out.append(arg)
    return out


def config_args(base: argparse.Namespace, flags: str) -> argparse.Namespace:
    """The reference's engine flags with `flags` on top."""
    parser = argparse.ArgumentParser(prog="--config", add_help=False, exit_on_error=False)
    add_engine_args(parser)
    try:
        args, extra = parser.parse_known_args(shlex.split(flags), namespace=copy.copy(base))
    except (argparse.ArgumentError, ValueError) as exc:
        raise ValueError(f"--config {flags!r}: {exc}") from None
    except SystemExit:
        raise ValueError(f"--config {flags!r}: not engine flags") from None
    if extra:
        raise ValueError(f"--config {flags!r}: not engine flags: {' '.join(extra)}")
    if args.model != base.model:
        raise ValueError(f"--config {flags!r}: a configuration runs the reference's model; give --model to the command")
    return args


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def format_table(report: dict) -> str:
    rows = [report["reference"], *report["configs"]]
    needles = [(kind, n) for kind in ("needle", "needle_outside") for n in report["reference"][kind]]
    lengths = sorted({n for _, n in needles}, key=int)
    header = ["config", "KV", "B/token", "capacity", "ppl", "Δppl", "mean KL", "top-1", "greedy",
              *[f"needle {n}" if kind == "needle" else f"q-out {n}" for kind, n in needles]]  # fmt: skip
    table = [header]
    for r in rows:
        delta = "-" if r["perplexity_delta_pct"] is None else f"{r['perplexity_delta_pct']:+.2f}%"
        kl = "-" if r["mean_kl"] is None else f"{r['mean_kl']:.2e}"
        # the cache as it ran: flags given to the command itself (--no-kv-hadamard, say) apply to every row
        kv = r["kv_cache_dtype"] + (" rotated" if r["kv_hadamard"] else "")
        kv += " no sink" if r["kv_cache_dtype"] in ("int4", "int2") and not r["kv_quant_sink_block"] else ""
        table.append([r["name"], kv, f"{r['bytes_per_token']:,}", f"{r['token_capacity']:,}", f"{r['perplexity']:.3f}", delta, kl,
                      _pct(r["top1_agreement"]), _pct(r["greedy_agreement"]), *[_pct(r[kind][n], 0) for kind, n in needles]])  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in table]
    lines.insert(1, "─" * len(lines[0]))
    head = (f"{report['model']}: {report['windows']} windows of {report['context']} tokens of {report['text']} "
            f"in chunks of {report['score_chunk']} "
            f"({report['scored_tokens']:,} scored" + (f", from position {report['score_from']}" if report["score_from"] else "")
            + f"), {report['greedy_prompts']} greedy prompts x {report['greedy_tokens']} tokens, "
            + (f"needles at depths {', '.join(f'{d:g}' for d in report['needle_depths'])}" if lengths else "no needles")
            + (" (q-out: the haystack compressed before the question)" if any(k == "needle_outside" for k, _ in needles) else ""))  # fmt: skip
    return head + "\n" + "\n".join(lines)


def _naming_config(flags: str, exc: ValueError) -> ValueError:
    """The error, saying which --config it is about."""
    message = str(exc)
    return ValueError(message if message.startswith("--config") else f"--config {flags!r}: {message}")


def _check_before_running(model: str, reference: EngineConfig, configs: list[tuple[str, EngineConfig]]) -> None:
    """The engine's refusals of a pool or lengths (a pool larger than the machine, a max_model_len
    past its capacity) for every configuration, from configs alone: before the reference's minutes of work."""
    from kvserve.engine.kv_setup import kv_cache_spec, kv_capacity
    from kvserve.plan.cli import load_model_config

    model_config = load_model_config(model)
    for flags, config in [(None, reference), *configs]:
        try:
            kv_capacity(config, model_config, kv_cache_spec(config, model_config))
        except ValueError as exc:
            raise exc if flags is None else _naming_config(flags, exc) from None


def run_eval(args: argparse.Namespace) -> int:
    if not args.config:
        raise ValueError('give at least one --config "ENGINE FLAGS" to compare with the reference')
    plan = EvalPlan(
        context=args.context, score_chunk=args.score_chunk, max_windows=args.max_windows, greedy_prompts=args.greedy_prompts,
        greedy_prompt_len=args.greedy_prompt_len, greedy_tokens=args.greedy_tokens,
        needle_lengths=tuple(args.needle_lengths), needle_depths=tuple(args.needle_depths), needle_seed=args.needle_seed,
        needle_questions=("inside", "outside") if args.needle_question == "both" else (args.needle_question,), score_from=args.score_from,
    )  # fmt: skip
    text_path = args.text or default_text_path()
    text = read_text(text_path)
    reference_config = engine_config_from_args(args, strict_kivi_flags=False)
    configs = []
    for flags in args.config:
        try:
            configs.append((flags, engine_config_from_args(config_args(args, flags), strict_kivi_flags=False)))
        except ValueError as exc:  # a combination the engine's config refuses
            raise _naming_config(flags, exc) from None
    _check_before_running(args.model, reference_config, configs)
    evaluation = Evaluation(plan, text, progress=not args.no_progress)
    try:
        reference = evaluation.run("reference", "", reference_config)
        results = []
        for flags, config in configs:
            try:
                results.append(evaluation.run(flags.strip() or "(same flags)", flags, config))
            except ValueError as exc:  # refused by the engine (a combination no flag check catches)
                raise _naming_config(flags, exc) from None
    finally:
        evaluation.close()
    report = {
        "model": args.model, "text": str(text_path), "context": plan.context, "score_chunk": plan.score_chunk, "score_from": plan.score_from, "windows": evaluation.num_windows,
        "scored_tokens": evaluation.scored_tokens, "greedy_prompts": plan.greedy_prompts, "greedy_tokens": plan.greedy_tokens,
        "needle_depths": list(plan.needle_depths), "reference": reference.as_dict(), "configs": [r.as_dict() for r in results],
    }  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
