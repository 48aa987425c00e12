"""`kvserve serve | generate | plan | eval | top | pd-proxy | cluster`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.llm import LLM
    from kvserve.engine_args import engine_config_from_args
    from kvserve.model.tokenizer import read_chat_template
    from kvserve.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    if args.chat_template is not None and not args.chat:
        raise ValueError("--chat-template formats --chat prompts; without --chat the prompts go to the model as they are")
    chat_template = read_chat_template(args.chat_template)
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(config)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], chat_template=chat_template,
                                                       add_generation_prompt=True) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(f"--- prompt: {prompt!r}")
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    generated = sum(len(o.token_ids) for o in outputs)
    stats = llm.stats()
    print(
        f"\n{generated} tokens in {elapsed:.2f}s: {generated / elapsed:.1f} tokens/s "
        f"(dtype {config.dtype}, weights {llm.engine.weights_description()}, {stats['num_blocks']} KV blocks of {stats['block_size']}, "
        f"{stats['bytes_per_token']} B/token, {stats['num_preemptions']} preemptions)",
        file=sys.stderr,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvserve.server.app import run_server

    return run_server(args)


def _plan(args: argparse.Namespace) -> int:
    from kvserve.plan.cli import run_plan

    return run_plan(args)


def _eval(args: argparse.Namespace) -> int:
    from kvserve.eval.cli import run_eval

    return run_eval(args)


def _pd_proxy(args: argparse.Namespace) -> int:
    from kvserve.server.pd_proxy import run_pd_proxy

    return run_pd_proxy(args)


def _cluster(args: argparse.Namespace) -> int:
    from kvserve.server.cluster import run_cluster

    return run_cluster(args)


def _top(args: argparse.Namespace) -> int:
    from kvserve.server.top import run_top

    return run_top(args)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="level of kvserve's own log lines (stderr); other libraries log only warnings and worse")


def configure_logging(level: str) -> None:
    """Keep a command's output its own: kvserve logs at `level`, other libraries (httpx logs every
    request at INFO) at WARNING or above."""
    kvserve_level = getattr(logging, level.upper())
    logging.basicConfig(level=max(kvserve_level, logging.WARNING), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(kvserve_level)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help once: not when the help already says its default, nor for a
    default of None or False (an unset option, an off switch), which would print "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help or action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or not action.option_strings:  # (not `in (None, False)`: 0 == False, and a default of 0 is shown)
            return help
        return help + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from kvserve.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog="kvserve", description="An LLM inference engine and server built around the KV cache.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print tokens/s",
                         formatter_class=HelpFormatter)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--chat-template", default=None, help="with --chat: Jinja chat template, inline or a file path; overrides the model's own")
    _add_log_level(gen)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    from kvserve.server.args import add_server_args

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    add_server_args(serve)
    add_engine_args(serve)
    _add_log_level(serve)
    serve.set_defaults(func=_serve)

    from kvserve.plan.cli import add_plan_args

    plan = sub.add_parser("plan", help="KV capacity planner: bytes per token, capacity, limits, trace replay",
                          formatter_class=HelpFormatter)
    add_plan_args(plan)
    _add_log_level(plan)
    plan.set_defaults(func=_plan)

    from kvserve.eval.cli import add_eval_args

    ev = sub.add_parser("eval", help="quality of KV configurations (quantization, eviction, ...) against the lossless run: "
                        "perplexity, KL, top-1, greedy agreement, needle in a haystack",
                        formatter_class=HelpFormatter)  # fmt: skip
    add_eval_args(ev)
    _add_log_level(ev)
    ev.set_defaults(func=_eval)

    top = sub.add_parser("top", help="live terminal view of a running server's KV metrics", formatter_class=HelpFormatter)
    top.add_argument("url", nargs="?", default="http://127.0.0.1:8000", type=_base_url,
                     help="server base URL (host:port alone means http://host:port)")  # fmt: skip
    top.add_argument("--interval", type=_seconds, default=1.0, help="seconds between refreshes (a positive number, at most 3600)")
    top.add_argument("--once", action="store_true", help="print one snapshot (two samples --interval apart, for the rates) and exit")
    _add_log_level(top)
    top.set_defaults(func=_top)

    from kvserve.server.pd_proxy import add_pd_proxy_args

    pd = sub.add_parser("pd-proxy", help="one OpenAI endpoint in front of a prefill (--kv-role producer) and a decode "
                        "(--kv-role consumer) instance sharing a --kv-remote-url", formatter_class=HelpFormatter)  # fmt: skip
    add_pd_proxy_args(pd)
    _add_log_level(pd)
    pd.set_defaults(func=_pd_proxy)

    from kvserve.server.cluster import ROUTER_SERVER_FLAGS, add_cluster_args

    cluster = sub.add_parser("cluster", help="several `kvserve serve` replicas on this machine behind smg, a cache-aware router "
                             "(pip install 'kvserve[cluster]')", formatter_class=HelpFormatter)  # fmt: skip
    add_cluster_args(cluster)
    add_server_args(cluster, skip=ROUTER_SERVER_FLAGS)
    add_engine_args(cluster)
    _add_log_level(cluster)
    cluster.set_defaults(func=_cluster)
    return parser


def _base_url(value: str) -> str:
    """A server's base URL; host:port without a scheme is taken as http://host:port."""
    return (value if "://" in value else "http://" + value).rstrip("/")


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not 0 < seconds <= 3600:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds up to 3600, got {value!r}")
    return seconds


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the parser and its subcommands."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _flags(sub)
    return found


def _named_by_flag(message: str, parser: argparse.ArgumentParser) -> str:
    """A config error that opens with a field's name ("kv_keep_ratio must ...") names its flag too."""
    field = message.split(" ", 1)[0]
    flag = "--" + field.replace("_", "-")
    if field.isidentifier() and "_" in field and flag in _flags(parser):
        return f"{flag} ({field}){message[len(field):]}"
    return message


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:
        from kvserve.eval.cli import attach_config_values

        argv = attach_config_values(argv)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"kvserve: error: {_named_by_flag(str(exc), parser)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
