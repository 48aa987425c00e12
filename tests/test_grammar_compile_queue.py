"""No grammar can hold up the server (found by QA): compiles run in worker processes under a time and
memory limit, clients take turns and one client's compiles leave a worker free for others, requests
without a constraint never wait for a compile, a client that leaves is dropped from the queue, and a
client's queue is bounded (a 429). What is cheap to refuse (a schema past its size, multipleOf steps
past their budget, tools for a template that takes none) is refused before any work."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from kvserve.structured.worker import MAX_PENDING_PER_CLIENT
from server_process import launch_server, server_log, stop_server

TIMEOUT_S = 3  # --grammar-compile-timeout of these servers
TOOLS_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip


def slow_schema(tag: str) -> dict:
    """A schema SmolLM2's vocabulary takes about 15 s to compile (2,000 properties), one per tag."""
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(2000)}}


def completion(schema: dict | None = None) -> dict:
    return {"prompt": "A city:", "max_tokens": 8} | ({"guided_json": schema} if schema is not None else {})


@pytest.fixture(scope="module")
def server():
    proc, url = launch_server(["--port", "0", "--kv-cache-memory", "0.25", "--grammar-compile-timeout", str(TIMEOUT_S)])
    yield proc, url
    stop_server(proc)


def metric(url: str, name: str, outcome: str | None = None) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    label = f'model_name="[^"]*"' + (f',outcome="{outcome}"' if outcome else "")
    found = re.search(rf"^kvserve:{name}\{{{label}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_for(predicate, what: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)


def other_client() -> httpx.Client:
    """A client at another address (127.0.0.2 reaches the server on 127.0.0.1): another client's turn."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=120)


def open_request(url: str, body: dict) -> socket.socket:
    """A completion request sent on a raw socket and left waiting; closing the socket is the client leaving."""
    parsed = urlparse(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parsed.hostname, parsed.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    return sock


def test_slow_grammars_hold_up_no_plain_request_and_no_other_clients_grammar(server):
    proc, url = server
    answers: list[httpx.Response] = []

    def attack(i: int) -> None:
        answers.append(httpx.post(url + "/v1/completions", json=completion(slow_schema(f"a{i}_")), timeout=300))

    with other_client() as client:  # the compile workers' process started (importing xgrammar takes seconds on a busy machine)
        assert client.post(url + "/v1/completions", json=completion({"type": "string", "maxLength": 4})).status_code == 200
    compiled = metric(url, "grammar_compiles_total", "timeout")
    attackers = [threading.Thread(target=attack, args=(i,)) for i in range(MAX_PENDING_PER_CLIENT)]
    for thread in attackers:
        thread.start()
    try:
        _measure_beside_the_attack(proc, url)
    finally:
        for thread in attackers:
            thread.join()
    assert [a.status_code for a in answers] == [400] * MAX_PENDING_PER_CLIENT
    assert all(f"longer than {TIMEOUT_S} s" in a.json()["error"]["message"] for a in answers)
    assert metric(url, "grammar_compiles_total", "timeout") - compiled == MAX_PENDING_PER_CLIENT
    assert "Traceback" not in server_log(proc)
    assert peak_memory_gib(proc) < MEMORY_BOUND_GIB


def _measure_beside_the_attack(proc, url: str) -> None:
    wait_for(lambda: metric(url, "grammar_compiles_pending") == MAX_PENDING_PER_CLIENT, "the attacker's compiles queued")
    start = time.monotonic()
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    assert httpx.post(url + "/v1/completions", json=completion(), timeout=120).status_code == 200
    plain_s = time.monotonic() - start
    with other_client() as client:
        start = time.monotonic()
        response = client.post(url + "/v1/completions", json=completion({"type": "object", "properties": {"city": {"type": "string"}}}))
        other_s = time.monotonic() - start
    assert response.status_code == 200, response.text
    if response.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(response.json()["choices"][0]["text"]), dict)
    # served one after another on one queue, the attacker's compiles would take MAX_PENDING_PER_CLIENT * TIMEOUT_S (24 s)
    assert other_s < MAX_PENDING_PER_CLIENT * TIMEOUT_S / 2, f"another client's grammar waited {other_s:.1f} s"
    assert plain_s < 2 * TIMEOUT_S, f"a plain completion took {plain_s:.1f} s beside the compiles"


MEMORY_BOUND_GIB = 4.0  # the server on SmolLM2 with its compile and template workers (measured: 1.9 GiB)


def peak_memory_gib(proc) -> float:
    """The server's and its children's peak resident memory, summed (shared pages counted in each: an upper bound)."""
    import psutil

    server = psutil.Process(proc.pid)
    total = 0
    for process in [server, *server.children(recursive=True)]:
        try:
            with open(f"/proc/{process.pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            pass
    print(f"peak memory of the server and its workers: {total / 2**30:.2f} GiB")
    return total / 2**30


def test_a_full_queue_is_a_429_and_clients_that_leave_are_dropped(server):
    proc, url = server
    dropped = metric(url, "grammar_compiles_total", "dropped")
    sockets = [open_request(url, completion(slow_schema(f"d{i}_"))) for i in range(MAX_PENDING_PER_CLIENT)]
    try:
        wait_for(lambda: metric(url, "grammar_compiles_pending") == MAX_PENDING_PER_CLIENT, "the compiles queued")
        response = httpx.post(url + "/v1/completions", json=completion(slow_schema("over_")), timeout=120)
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"
        assert str(MAX_PENDING_PER_CLIENT) in response.json()["error"]["message"]
        with other_client() as client:  # the limit is the client's: another is served
            assert client.post(url + "/v1/completions", json=completion({"type": "integer"})).status_code == 200
    finally:
        for sock in sockets:
            sock.close()
    # every one of them dropped: those queued at once, the running one stopped; none is compiled for 3 s more
    wait_for(lambda: metric(url, "grammar_compiles_pending") == 0, "the queue emptied")
    assert metric(url, "grammar_compiles_total", "dropped") - dropped == MAX_PENDING_PER_CLIENT
    response = httpx.post(url + "/v1/completions", json=completion({"type": "boolean"}), timeout=120)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] in ("true", "false"), response.text
    assert "Traceback" not in server_log(proc)


def test_what_is_cheap_to_refuse_is_refused_before_any_work(server):
    proc, url = server
    # a schema given as an object with 540,000 properties (an 8 MB body): refused by a walk that stops at the
    # size limit, while /health answers (the walk alone took 2.7 s before; parsing the body holds the GIL ~0.4 s)
    body = json.dumps(completion())[:-1] + ', "guided_json": {"type": "object", "properties": {' + \
        ",".join(f'"p{i}": {{}}' for i in range(540_000)) + "}}}"  # fmt: skip
    answers: list[httpx.Response] = []
    senders = [threading.Thread(target=lambda: answers.append(httpx.post(url + "/v1/completions", content=body, timeout=120,
                                                                         headers={"content-type": "application/json"})))
               for _ in range(1)]  # fmt: skip
    for sender in senders:
        sender.start()
    health = []
    while any(sender.is_alive() for sender in senders):
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        health.append(time.monotonic() - start)
    for sender in senders:
        sender.join()
    assert max(health) < 2.5, f"/health took {max(health):.2f} s beside an 8 MB schema"  # generous: under 0.5 s on an idle machine
    for response in answers:
        assert response.status_code == 400 and "characters" in response.json()["error"]["message"], response.text
    # a 7 MB tools list to a model whose chat template takes no tools: refused before a tool is parsed
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                                             "description": "x" * 60_000}}  # fmt: skip
    tools = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(120)]
    response = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                              "max_tokens": 4}, timeout=120)  # fmt: skip
    assert response.status_code == 400 and "does not take tools" in response.json()["error"]["message"], response.text
    assert httpx.get(url + "/health", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def small_memory_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    proc, url = launch_server(["--port", "0", "--kv-cache-memory", "0.25", "--grammar-compile-memory-mb", "64",
                               "--chat-template", str(template)])  # fmt: skip
    yield proc, url
    stop_server(proc)


def test_a_compile_past_its_memory_is_a_400_and_the_next_compiles(small_memory_server):
    proc, url = small_memory_server
    response = httpx.post(url + "/v1/completions", json=completion({"type": "integer", "multipleOf": 1021}), timeout=120)
    assert response.status_code == 400, response.text
    assert "64 MiB" in response.json()["error"]["message"]
    assert metric(url, "grammar_compiles_total", "out_of_memory") == 1
    response = httpx.post(url + "/v1/completions", json=completion({"type": "integer", "multipleOf": 7}), timeout=120)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    if response.json()["choices"][0]["finish_reason"] == "stop":
        assert int(text) % 7 == 0
    assert "Traceback" not in server_log(proc)


def test_tools_whose_grammar_would_be_huge_are_refused_at_once(small_memory_server):
    """QA's 1.7 KB request (35 integer properties with multipleOf 1021) froze the server for 90 s: the
    steps' budget refuses it before a grammar is written."""
    _, url = small_memory_server
    parameters = {"type": "object", "properties": {f"p{i}": {"type": "integer", "multipleOf": 1021} for i in range(35)}}
    body = {"messages": [{"role": "user", "content": "call f"}], "tools": [{"type": "function", "function": {"name": "f", "parameters":
            parameters}}], "tool_choice": "auto", "max_tokens": 4}  # fmt: skip
    start = time.monotonic()
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert "multipleOf values add up to more than 1024" in response.json()["error"]["message"]
    assert time.monotonic() - start < 10  # generous: it is refused before any grammar work
    small = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]}
    body["tools"][0]["function"]["parameters"] = small
    body["tool_choice"] = "required"
    body["max_tokens"] = 40
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    if response.json()["choices"][0]["finish_reason"] == "tool_calls":
        assert json.loads(message["tool_calls"][0]["function"]["arguments"])["n"] % 5 == 0
