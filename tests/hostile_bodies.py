"""The request shapes QA found to stall the server, answer 500s or break a constraint, as one corpus
every front door is tried with (the server, the pd-proxy, the cluster's router): each must be
answered below 500 with an error body, and the front door must answer a plain request afterwards."""

from __future__ import annotations

import json

import httpx


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _slow_tool(steps: int = 35) -> list[dict]:
    parameters = {"type": "object", "properties": {f"p{i}": {"type": "integer", "multipleOf": 1021} for i in range(steps)}}
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def bodies() -> list[tuple[str, str]]:
    """(path, raw JSON body) for each hostile shape."""
    chat = [{"role": "user", "content": "hi"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": _nested(3000)}}
    shapes: list[tuple[str, dict | str]] = [
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "x": ' + _nested(960) + "}"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": ' + _nested(100_000) + "}"),
        ("/v1/chat/completions", {"messages": chat + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                                      {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": chat, "tools": _slow_tool(), "tool_choice": "auto", "max_tokens": 1}),
        ("/v1/completions", {"prompt": list(range(3, 400)) * 4, "echo": True, "logprobs": 20, "prompt_logprobs": 20, "n": 16, "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_json": {"type": "integer", "multipleOf": 7, "minimum": 1}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_json": {"type": "array", "minItems": -5}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_json": {"type": "string", "minLength": -3}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_json": {"type": "object", "properties": {
            f"p{i}": {} for i in range(60_000)}}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_regex": "a$b"}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_regex": "\\x41BC"}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_grammar": 'root ::= "a" [\\0] "b"'}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "guided_grammar": 'root ::= [a-z]+ (="x")'}),
    ]  # fmt: skip
    return [(path, body if isinstance(body, str) else json.dumps(body)) for path, body in shapes]


def try_every_shape(url: str, headers: dict[str, str] | None = None, model: str | None = None) -> list[int]:
    """Sends each shape to url (naming `model` where a router needs one); asserts no 5xx and an
    error body on each 4xx; returns the statuses."""
    statuses = []
    named = {"model": model} if model else {}
    with httpx.Client(base_url=url, timeout=300, headers={"content-type": "application/json", **(headers or {})}) as client:
        for path, body in bodies():
            if model:
                body = "{" + json.dumps(named)[1:-1] + ", " + body[1:]
            response = client.post(path, content=body)
            assert response.status_code < 500, (path, body[:200], response.status_code, response.text[:300])
            if response.status_code >= 400:
                assert response.json()["error"]["message"], response.text
            statuses.append(response.status_code)
        plain = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, **named})
        assert plain.status_code == 200, plain.text
    return statuses
