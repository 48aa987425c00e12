"""The CLI's defaults and its errors."""

import subprocess
import sys

import pytest

from kvserve.cli import build_parser
from kvserve.config import EngineConfig
from kvserve.model.tokenizer import NoChatTemplateError, load_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_the_default_model_is_the_instruction_tuned_one():
    for command in (["serve"], ["generate", "--prompt", "x"]):
        assert build_parser().parse_args(command).model == "smollm2-135m-instruct"
    assert EngineConfig().model == "smollm2-135m-instruct"


def test_no_made_up_turn_format_for_a_gemma_without_template(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir("gemma3"), "gemma3")
    assert tokenizer.chat_template is None
    with pytest.raises(NoChatTemplateError, match="--chat-template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=TEMPLATE, add_generation_prompt=True)
    assert tokenizer.decode(ids) == "user: hi\nassistant:"


def test_generate_chat_without_template_exits_2_naming_the_flag(tiny_dir):
    flags = ("--model", str(tiny_dir("llama")), "--dtype", "float32", "--kv-cache-memory", "0.01", "--max-tokens", "3",
             "--prompt", "Name three planets.", "--chat")
    proc = kvserve("generate", *flags)
    assert proc.returncode == 2, proc.stderr
    assert "no chat template" in proc.stderr and "--chat-template" in proc.stderr
    proc = kvserve("generate", *flags, "--chat-template", TEMPLATE)
    assert proc.returncode == 0, proc.stderr
    assert "[3 tokens" in proc.stdout
    # found by QA: a mistyped template file became the prompt's whole text, and without --chat the flag did nothing
    proc = kvserve("generate", *flags, "--chat-template", "/no/such/template.jinja")
    assert proc.returncode == 2 and "no such file" in proc.stderr, proc.stderr
    proc = kvserve("generate", *flags[:-1], "--chat-template", TEMPLATE)
    assert proc.returncode == 2 and "--chat" in proc.stderr, proc.stderr


def _subparsers():
    import argparse

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_help_says_each_default_once_and_never_none():
    for name, sub in _subparsers().items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.help:
                continue
            text = formatter._get_help_string(action) % {**vars(action), "prog": sub.prog}
            assert "(default: None)" not in text and text.count("default:") <= 1, (name, action.option_strings, text)
        assert "(default: None)" not in sub.format_help()
    serve = _subparsers()["serve"].format_help()
    assert "(default: --model) (default" not in " ".join(serve.split())


def test_dtype_auto_help_says_the_cpu_flags_decide():
    help = " ".join(_subparsers()["serve"].format_help().split())
    assert "avx512_bf16" in help and "amx_bf16" in help and "times fp32 against bf16" not in help


def test_plan_defaults_to_the_engines_kv_dtype_and_explains_max_len():
    proc = kvserve("plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "4096",
                   "--memory-gib", "24", "--weights-gib", "16")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "bfloat16 *" in text and "float16 *" not in text.replace("bfloat16 *", "")
    assert "max len: the longest sequence the budget admits" in text and "--max-model-len 4096" in text
    assert build_parser().parse_args(["plan", "--seq-lens", "1"]).kv_dtype == "auto"


def test_top_once_measures_its_rates_from_two_samples(monkeypatch, capsys):
    import argparse

    from kvserve.server import top

    samples = iter([{"kvserve:generation_tokens_total": 100.0, "kvserve:prompt_tokens_total": 10.0},
                    {"kvserve:generation_tokens_total": 150.0, "kvserve:prompt_tokens_total": 10.0}])
    monkeypatch.setattr(top, "scrape", lambda url: next(samples))
    clock = iter([0.0, 0.5])
    monkeypatch.setattr(top.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(top.time, "sleep", lambda s: None)
    assert top.run_top(argparse.Namespace(url="http://x", once=True, interval=0.5)) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "100.0" in out and "idle" in out  # 50 generated tokens in 0.5 s; no request running: says so
    assert top.rates_between({}, {"kvserve:generation_tokens_total": 5.0}, 1.0) == {"gen": 5.0, "prompt": 0.0}
