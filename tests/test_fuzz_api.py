"""Property-based fuzz of the HTTP API: requests generated from the server's own OpenAPI schema
(schemathesis strategies, conforming and violating it) and from the request models' fields with
hostile values (NaN, infinities, huge integers, wrong types, bad content parts, templates) get
no 5xx, every 4xx carries an OpenAI-style error body, every 200 stream ends with [DONE], and a
normal request succeeds afterwards."""

import json
import re

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from server_process import launch_server, stop_server

schemathesis = pytest.importorskip("schemathesis")

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCHEMA_EXAMPLES = 300
MODEL_EXAMPLES = 300
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"


@pytest.fixture(scope="module")
def server(tiny_dir):
    # a short max_model_len keeps every generation the fuzzer asks for short
    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.02",
                               "--max-model-len", "48", "--api-key", KEY, "--chat-template", CHAT_TEMPLATE,
                               "--max-request-bytes", str(2**20), "--trust-request-chat-template"])  # fmt: skip
    yield proc, url
    stop_server(proc)


def check_response(resp: httpx.Response, body) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], body)
    if resp.status_code == 200 and isinstance(body, dict) and not body.get("stream") and isinstance(body.get("guided_regex"), str):
        for choice in resp.json()["choices"]:  # a 200 means the constraint held
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            if choice["finish_reason"] == "stop" and not body.get("echo"):
                assert re.fullmatch(body["guided_regex"], text), (body["guided_regex"], text)
    if 400 <= resp.status_code < 500:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"] and error["code"], resp.text
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        # SSE lines end at "\n" only (str.splitlines would also cut generated text at U+2028, U+0085...)
        events = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
        assert events, (resp.text[-500:], body)
        if events[-1] == "[DONE]":
            events = events[:-1]
        else:  # the Responses API ends with its terminal event, as OpenAI's and vLLM's do, not with [DONE]
            assert json.loads(events[-1]).get("type") in ("response.completed", "response.failed", "response.incomplete"), (resp.text[-500:], body)
        for event in events:
            assert "error" not in json.loads(event), event


def test_fuzz_the_openapi_schema(server):
    from schemathesis import GenerationMode

    proc, url = server
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=AUTH)  # behind the API key, as the endpoints
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    seen: dict[int, int] = {}

    with httpx.Client(base_url=url, timeout=120) as http:

        @settings(max_examples=SCHEMA_EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=cases)
        def fuzz(case) -> None:
            kwargs = case.as_transport_kwargs(base_url=url, headers=AUTH)
            body = kwargs.get("json", kwargs.get("data", kwargs.get("content")))
            request = {k: v for k, v in kwargs.items() if k in ("method", "headers", "params", "json")}
            if "data" in kwargs or "content" in kwargs:
                request["content"] = kwargs.get("data", kwargs.get("content"))
            resp = http.request(url=kwargs["url"], **request)
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            check_response(resp, body)

        fuzz()
    assert sum(seen.values()) >= SCHEMA_EXAMPLES, seen
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen
    ok = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, headers=AUTH, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(url + "/health").status_code == 200
    log = proc.log_path.read_text()
    assert "Traceback" not in log and "internal error" not in log


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 1e-300, 5e-324, 2**31, 2**63, 2**64, 1e308, 10**400]),
)
TEXT = st.text(max_size=24)
HOSTILE = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT, st.lists(st.integers(), max_size=3), st.dictionaries(TEXT, TEXT, max_size=2),
                    st.lists(st.lists(st.integers(min_value=-3, max_value=600), max_size=3), max_size=2))  # fmt: skip
PROMPT = st.one_of(st.text(min_size=1, max_size=24), st.lists(st.integers(min_value=0, max_value=511), min_size=1, max_size=12))
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"])}, optional={"text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
    optional={"content": st.one_of(TEXT, st.none(), st.lists(PART, max_size=3))},
)
TEMPLATES = st.sampled_from([CHAT_TEMPLATE, "{{ 'ab' * 100000000 }}", "{% for %}", "{{ raise_exception('no') }}", "{{ messages }}",
                             "{{ 10 ** 100000000 }}", "{% for i in range(30000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}"])  # fmt: skip
# constraints QA found to stall the server, answer 500s or break their constraint: each must be a 400, or a 200 that holds
SCHEMAS = st.sampled_from([
    {"type": "integer", "multipleOf": 7, "minimum": 1}, {"type": "integer", "multipleOf": 1021}, {"type": "integer", "multipleOf": 5},
    {"type": "object", "properties": {f"p{i}": {"type": "integer", "multipleOf": 1021} for i in range(35)}},
    {"type": "array", "minItems": -5}, {"type": "string", "maxLength": -1}, {"type": "string", "minLength": -3},
    {"type": "object", "properties": {f"p{i}": {} for i in range(40_000)}}, {"type": "string", "maxLength": 3},
])  # fmt: skip
REGEXES = st.sampled_from(["a$b", "a\\Z", "\\x41BC", "a[\\x00]b", "[a-c]{1,3}", "(ab|c)d?", "a\\01", ".{2}"])
GRAMMARS = st.sampled_from(['root ::= "a" [\\0] "b"', 'root ::= [a-z]+ (="x")', 'root ::= "ok" | "no"'])
TOOLS = st.sampled_from([
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "integer", "multipleOf": 1021} for i in range(35)}}}}],
    [{"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}],
])  # fmt: skip
SAMPLING = {  # values a client may well send; test_fuzz_the_request_models swaps some for HOSTILE ones
    "model": st.sampled_from(["tiny", "gpt-4"]),
    "n": st.integers(min_value=1, max_value=3),
    "max_tokens": st.one_of(st.none(), st.integers(min_value=1, max_value=16)),
    "temperature": st.one_of(st.just(0), st.floats(min_value=0, max_value=2)),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=50),
    "min_p": st.floats(min_value=0, max_value=1),
    "seed": st.integers(min_value=0, max_value=2**63 - 1),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=4), max_size=4)),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=511), max_size=4),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "ignore_eos": st.booleans(),
    "cache_salt": TEXT,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": TEXT,
    "guided_json": SCHEMAS,
    "guided_regex": REGEXES,
    "guided_grammar": GRAMMARS,
}
COMPLETION = {"prompt": st.one_of(PROMPT, st.lists(PROMPT, min_size=1, max_size=3)), **SAMPLING,
              "logprobs": st.one_of(st.none(), st.integers(min_value=0, max_value=5)), "echo": st.booleans(),
              "prompt_logprobs": st.one_of(st.none(), st.integers(min_value=0, max_value=5))}  # fmt: skip
CHAT = {"messages": st.lists(MESSAGE, min_size=1, max_size=3), **SAMPLING, "logprobs": st.booleans(),
        "top_logprobs": st.integers(min_value=0, max_value=5), "max_completion_tokens": st.integers(min_value=1, max_value=16),
        "chat_template": TEMPLATES, "tools": TOOLS}  # fmt: skip


@st.composite
def requests(draw) -> tuple[str, dict]:
    """A request with some of its fields, a few of them (maybe none) swapped for hostile values."""
    path, fields = draw(st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]))
    required = "prompt" if "prompt" in fields else "messages"
    names = [required] + draw(st.lists(st.sampled_from(sorted(set(fields) - {required})), max_size=6, unique=True))
    body = {name: draw(fields[name]) for name in names}
    for name in draw(st.lists(st.sampled_from(names + ["extra_field"]), max_size=2, unique=True)):
        body[name] = draw(HOSTILE)
    return path, body


def test_fuzz_the_request_models(server):
    proc, url = server
    seen: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=120, headers=AUTH) as http:

        @settings(max_examples=MODEL_EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(request=requests())
        def fuzz(request) -> None:
            path, body = request
            content = json.dumps(body, allow_nan=True)  # NaN and Infinity as the literals Python's json accepts
            resp = http.post(path, content=content, headers={"content-type": "application/json"})
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            check_response(resp, body)

        fuzz()
    assert sum(seen.values()) >= MODEL_EXAMPLES and seen.get(200, 0) > 0, seen
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                    headers=AUTH, timeout=60)  # fmt: skip
    assert ok.status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert 'kvserve:kv_cache_blocks_free{model_name=' in metrics
    assert "Traceback" not in proc.log_path.read_text()
