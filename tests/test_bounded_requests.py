"""No request can stall or crash the server through what its JSON holds (found by QA): one nesting
limit for every body and for JSON text inside it, checked before anything else; a 400 naming the
limit, never a 500 or a traceback."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.server.json_limits import MAX_JSON_DEPTH, TooDeep, first_unpaired_surrogate, loads_bounded
from server_process import launch_server, server_log, stop_server

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.02",
                               "--chat-template", CHAT_TEMPLATE])  # fmt: skip
    yield proc, url
    stop_server(proc)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_the_walk_is_iterative_and_stops_at_the_limit():
    assert first_unpaired_surrogate(json.loads(nested(MAX_JSON_DEPTH))) is None
    with pytest.raises(TooDeep):
        first_unpaired_surrogate(json.loads(nested(MAX_JSON_DEPTH + 1)))
    with pytest.raises(TooDeep):
        loads_bounded(nested(100_000))  # past the parser's own recursion: TooDeep, not RecursionError
    assert first_unpaired_surrogate({"a": [1, "ok", {"b": "\ud800"}]}) == "a.2.b"


BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 958, 960, 961, 2000, 100_000])
def test_a_body_nested_past_the_limit_is_a_400_naming_it(server, path, depth):
    proc, url = server
    body = json.dumps(BODIES[path])[:-1] + f', "x": {nested(depth)}}}'  # an ignored field, nested
    response = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert str(MAX_JSON_DEPTH) in response.text or "nest" in response.text
    assert "Traceback" not in server_log(proc)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])  # the two that ignore unknown fields
def test_a_body_nested_within_the_limit_is_served(server, path):
    _, url = server
    body = json.dumps(BODIES[path])[:-1] + f', "x": {nested(MAX_JSON_DEPTH - 1)}}}'
    response = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 3000])
def test_tool_call_arguments_nested_past_the_limit_are_a_400(server, path, depth):
    proc, url = server
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": nested(depth)}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}, {"role": "user", "content": "and?"}]  # fmt: skip
    body = {"messages": messages} | ({"max_tokens": 1} if path != "/tokenize" else {})
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "arguments" in response.text and str(MAX_JSON_DEPTH) in response.text
    assert "Traceback" not in server_log(proc)


def test_an_answer_amplified_by_prompt_logprobs_is_refused_before_any_work(server):
    """Found by QA: 8,000 prompt ids with echo, logprobs 20, prompt_logprobs 20 and n 16 (48 KB) built a 249 MB
    answer in 74 s and held /health 30 s. Bounded: prompt tokens x n x (1 + alternatives), before admission."""
    from kvserve.server.serving_completions import MAX_PROMPT_LOGPROB_ENTRIES

    proc, url = server
    prompts = [[5 + (i * 7 + j) % 400 for j in range(400)] for i in range(4)]
    body = {"prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 20, "prompt_logprobs": 20, "n": 16}
    assert 4 * 400 * 16 * 42 > MAX_PROMPT_LOGPROB_ENTRIES
    refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs", refused.text
    assert f"{MAX_PROMPT_LOGPROB_ENTRIES:,}" in refused.json()["error"]["message"]
    served = httpx.post(url + "/v1/completions", json=body | {"n": 1, "prompt": prompts[:1]}, timeout=60)
    assert served.status_code == 200 and len(served.json()["choices"][0]["prompt_logprobs"]) == 400
    assert "Traceback" not in server_log(proc)


def test_the_hostile_corpus_is_never_a_5xx(server):
    from hostile_bodies import try_every_shape

    proc, url = server
    statuses = try_every_shape(url)
    assert all(s == 400 for s in statuses), statuses
    assert "Traceback" not in server_log(proc)


def test_a_large_answer_is_built_off_the_event_loop(server):
    """QA: an answer of 340,000 logprob entries (16 MB) was built and serialized on the event loop, and
    /health waited 8.7 s for it; it is built in a thread and serialized a list item at a time."""
    import threading
    import time

    _, url = server
    body = {"prompt": list(range(3, 510)), "echo": True, "logprobs": 20, "prompt_logprobs": 20, "n": 16, "max_tokens": 1}
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(httpx.post(url + "/v1/completions", json=body, timeout=600)))
    sender.start()
    health = []
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        health.append(time.monotonic() - start)
    sender.join()
    assert answer[0].status_code == 200, answer[0].text[:300]
    choices = answer[0].json()["choices"]
    assert len(choices) == 16 and all(len(c["prompt_logprobs"]) == len(body["prompt"]) for c in choices)
    assert max(health) < 2.0, f"/health took {max(health):.2f} s while the answer was built"  # generous: 0.3 s on a busy machine
