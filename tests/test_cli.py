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
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=TEMPLATE)
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
