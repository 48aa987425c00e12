"""The Responses API (/v1/responses) through the `openai` client against a real server: plain,
instructions, 5-turn previous_response_id chains whose text equals chat completions given the same
history, streaming with the typed events, text.format json_schema, function tools with
function_call_output round trips, retrieve / delete / cancel, the store's scoping, and refusals."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from server_process import launch_server, stop_server
from test_tool_calls import ADD, TOOLS_TEMPLATE

KEY = "responses-test-key-0123456789"
GREEDY = dict(model="tiny", temperature=0, max_output_tokens=8)


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--dtype", "float32", "--port", "0", "--kv-cache-memory", "0.02",
                               "--chat-template", TOOLS_TEMPLATE, "--served-model-name", "tiny", "--api-key", KEY,
                               "--prefix-cache", "radix"])  # fmt: skip
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def chat_text(client, messages: list[dict], **kwargs) -> str:
    out = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8, **kwargs)
    return out.choices[0].message.content


def test_a_five_turn_chain_answers_as_chat_completions_of_the_same_history(client):
    history: list[dict] = [{"role": "system", "content": "Be brief."}]
    previous = None
    for turn in range(5):
        ask = f"Question number {turn}: what comes next?"
        response = client.responses.create(input=ask, instructions="Be brief.", previous_response_id=previous, **GREEDY)
        history.append({"role": "user", "content": ask})
        assert response.object == "response" and response.id.startswith("resp_") and len(response.id) > 40
        assert response.output_text == chat_text(client, history), f"turn {turn}"
        assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        if previous is not None:  # the previous prompt came from the pool, to the token (radix); the random model's text
            # does not tokenize back to its tokens (bytes cut mid-character), so its output's are test_conversation_kv.py's
            assert response.usage.input_tokens_details.cached_tokens >= last.usage.input_tokens
        history.append({"role": "assistant", "content": response.output_text})
        previous, last = response.id, response
    assert client.responses.retrieve(previous).output_text == last.output_text


def test_plain_input_items_and_instructions_render_as_chat_messages(client):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "!"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]}, {"role": "user", "content": "Again"}]  # fmt: skip
    response = client.responses.create(input=items, instructions="Be brief.", store=False, **GREEDY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "Again"}]  # fmt: skip
    assert response.output_text == chat_text(client, messages)
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(response.id)


def test_streaming_sends_the_typed_events_and_the_same_text(client):
    whole = client.responses.create(input="Tell me a story", store=False, **GREEDY)
    with client.responses.stream(input="Tell me a story", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text == final.output_text
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_text_format_json_schema_gives_valid_json(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    response = client.responses.create(model="tiny", input="Give a", temperature=1.0, max_output_tokens=40, store=False,
                                       text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})  # fmt: skip
    value = json.loads(response.output_text)
    assert set(value) == {"a"} and 0 <= value["a"] <= 9


def test_function_calls_round_trip_through_function_call_output(client):
    tools = [{"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD}]
    first = client.responses.create(model="tiny", input="What is 2 + 3?", tools=tools, tool_choice="required", temperature=1.0,
                                    max_output_tokens=300, extra_body={"seed": 4})  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "add" and set(json.loads(c.arguments)) == {"a", "b"} for c in calls)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "5"} for c in calls]
    second = client.responses.create(input=outputs, previous_response_id=first.id, tools=tools, tool_choice="none", **GREEDY)
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    history = [{"role": "user", "content": "What is 2 + 3?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": c.call_id, "type": "function",
                                                                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
               *[{"role": "tool", "tool_call_id": c.call_id, "content": "5"} for c in calls]]  # fmt: skip
    assert second.output_text == chat_text(client, history, tools=[{"type": "function", "function": t | {}} for t in
                                                                    [{k: v for k, v in tools[0].items() if k != "type"}]], tool_choice="none")


def test_retrieve_and_delete_are_scoped_to_the_key_and_the_cache_salt(client, server):
    made = client.responses.create(input="Hi", extra_body={"cache_salt": "tenant-a"}, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)  # without its salt: not found, as an id that never was
    got = httpx.get(f"{server}/v1/responses/{made.id}", params={"cache_salt": "tenant-a"}, headers={"Authorization": f"Bearer {KEY}"})
    assert got.status_code == 200 and got.json()["output_text"] == made.output_text
    with pytest.raises(openai.NotFoundError):  # a follow-up under another salt cannot continue it
        client.responses.create(input="More", previous_response_id=made.id, **GREEDY)
    assert httpx.get(f"{server}/v1/responses/{made.id}", params={"cache_salt": "tenant-a"}).status_code == 401
    pinned = lambda: httpx.get(f"{server}/v1/kv/snapshot", headers={"Authorization": f"Bearer {KEY}"}).json()["conversations"]  # noqa: E731
    before = pinned()
    deleted = httpx.delete(f"{server}/v1/responses/{made.id}", params={"cache_salt": "tenant-a"}, headers={"Authorization": f"Bearer {KEY}"})
    assert deleted.json() == {"id": made.id, "object": "response", "deleted": True}
    assert pinned()["pinned"] == before["pinned"] - 1  # nothing continues it: its blocks are let go
    assert httpx.get(f"{server}/v1/responses/{made.id}", params={"cache_salt": "tenant-a"},
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 404  # fmt: skip


def test_a_running_stream_is_cancelled(client, server):
    events: list = []
    started = threading.Event()

    def run() -> None:
        with client.responses.stream(model="tiny", input="Go on", max_output_tokens=400, extra_body={"ignore_eos": True}) as stream:
            for event in stream:
                events.append(event)
                if event.type == "response.output_text.delta":
                    started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    response_id = events[0].response.id
    cancelled = httpx.post(f"{server}/v1/responses/{response_id}/cancel", headers={"Authorization": f"Bearer {KEY}"})
    thread.join(60)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert events[-1].type == "response.failed" and events[-1].response.status == "cancelled"
    again = httpx.post(f"{server}/v1/responses/{response_id}/cancel", headers={"Authorization": f"Bearer {KEY}"})
    assert again.status_code == 400 and "has finished" in again.json()["error"]["message"]
    kept = client.responses.retrieve(response_id)  # kept as cancelled, as OpenAI keeps it
    assert kept.status == "cancelled" and kept.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    with pytest.raises(openai.BadRequestError, match="was cancelled and cannot be continued"):
        client.responses.create(input="More", previous_response_id=response_id, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="function_call_output"):  # unrelated, cheap here: an output answering no call
        client.responses.create(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}], **GREEDY)


@pytest.mark.parametrize("body,field", [
    ({"input": "x", "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "metadata": {"k": 5}}, "metadata"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x" * 5000}, "input"),
    ({"input": "x", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": "not json at all"}}}, "text"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{not json"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}]}, "input"),
])  # fmt: skip
def test_what_is_not_supported_is_a_400_naming_the_field(server, body, field):
    got = httpx.post(f"{server}/v1/responses", json={"model": "tiny", **body}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == field, got.text
    assert not got.json()["error"]["message"].startswith("input: response_format"), got.text
    missing = httpx.post(f"{server}/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": "resp_nope"},
                         headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"


def test_a_metadata_key_that_is_not_unicode_is_refused_before_anything_runs_or_is_stored(server):
    pinned = lambda: httpx.get(f"{server}/v1/kv/snapshot", headers={"Authorization": f"Bearer {KEY}"}).json()["conversations"]  # noqa: E731
    before = pinned()["pinned"]
    body = '{"model": "tiny", "input": "hi", "metadata": {"\\ud800": "x"}, "max_output_tokens": 4, "stream": true}'
    got = httpx.post(f"{server}/v1/responses", content=body, headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert got.status_code == 400 and got.json()["error"]["param"] == "metadata", got.text
    assert pinned()["pinned"] == before


def test_an_answer_cut_at_max_output_tokens_leaves_its_message_incomplete(client):
    made = client.responses.create(input="Go on", extra_body={"ignore_eos": True}, **GREEDY)
    assert made.status == "incomplete" and made.output[-1].status == "incomplete"
    with client.responses.stream(input="Go on", extra_body={"ignore_eos": True}, **GREEDY) as stream:
        done = [e.item for e in stream if e.type == "response.output_item.done"]
    assert done[-1].status == "incomplete"


def test_offline_chat_and_get_tokenizer_take_vllm_and_transformers_arguments(tiny_dir):
    """LLM.chat (one conversation or several) and LLM.get_tokenizer().apply_chat_template with
    transformers' arguments, against transformers' own apply_chat_template of the same template."""
    from kvserve import LLM, SamplingParams

    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02)
    tokenizer, hf = llm.get_tokenizer(), llm.get_tokenizer().hf_tokenizer
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False}, {"tools": [{"type": "function", "function": {"name": "add"}}]}):
        text = tokenizer.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, tokenize=False, **kwargs)
        assert text == hf.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, tokenize=False, **kwargs)
    ids = tokenizer.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True, return_dict=True) == {
        "input_ids": ids, "attention_mask": [1] * len(ids)}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    chats = llm.chat([messages, messages + [{"role": "assistant", "content": "Five"}]], params, use_tqdm=False, chat_template=TOOLS_TEMPLATE)
    assert chats[0].token_ids == llm.generate([ids], params, use_tqdm=False)[0].token_ids and len(chats) == 2
    continued = llm.chat(messages + [{"role": "assistant", "content": "Five"}], params, use_tqdm=False, chat_template=TOOLS_TEMPLATE,
                         add_generation_prompt=False, continue_final_message=True)[0]  # fmt: skip
    assert tokenizer.decode(continued.prompt_token_ids).endswith("assistant: Five")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(messages, params, chat_template=TOOLS_TEMPLATE, continue_final_message=True)
    with pytest.raises(ValueError, match="unpaired surrogate"):
        llm.chat([{"role": "user", "content": "\ud800"}], params, chat_template=TOOLS_TEMPLATE)


def test_chat_and_completions_truncate_as_asked(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    long_ids = [5 + i % 300 for i in range(700)]
    got = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": long_ids, "max_tokens": 2, "truncate_prompt_tokens": 100},
                     headers=auth)  # fmt: skip
    assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == 100
    whole = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": long_ids[-100:], "max_tokens": 2, "temperature": 0},
                       headers=auth).json()  # fmt: skip
    cut = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": long_ids, "max_tokens": 2, "temperature": 0,
                                                       "truncate_prompt_tokens": 100}, headers=auth).json()  # fmt: skip
    assert cut["choices"][0]["text"] == whole["choices"][0]["text"]
    assert httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": long_ids, "max_tokens": 1, "truncate_prompt_tokens": -1},
                      headers=auth).json()["usage"]["prompt_tokens"] == 511  # fmt: skip
    bad = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": long_ids, "truncate_prompt_tokens": 9999}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    messages = [{"role": "system", "content": "Be brief."}]
    for turn in range(30):
        messages += [{"role": "user", "content": f"turn {turn} " + "word " * 20}, {"role": "assistant", "content": "ok " * 5}]
    messages.append({"role": "user", "content": "last question"})
    over = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 8}, headers=auth)
    assert over.status_code == 400 and "max_model_len" in over.json()["error"]["message"]
    fitted = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 8, "truncation": "auto"},
                        headers=auth)  # fmt: skip
    assert fitted.status_code == 200, fitted.text
    assert 128 <= fitted.json()["usage"]["prompt_tokens"] <= 512 - 8 - 128  # cut at a fixed point, a quarter of the context left free


def test_replicas_behind_smg_share_stored_responses_through_redis(tiny_dir):
    """`kvserve cluster` (two replicas behind the real smg router) with --kv-remote-url: a response made
    on one replica is continued, read and deleted on the other; follow-ups through the router answer."""
    import os
    import re
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from redis_server import RedisServer

    with RedisServer() as redis:
        log = Path(tempfile.mkstemp(prefix="kvserve-cluster-", suffix=".log")[1])
        command = [sys.executable, "-m", "kvserve.cli", "cluster", "--replicas", "2", "--port", "0", "--model", str(tiny_dir("llama")),
                   "--dtype", "float32", "--kv-cache-memory", "0.05", "--served-model-name", "tiny", "--chat-template", TOOLS_TEMPLATE,
                   "--kv-remote-url", redis.url]  # fmt: skip
        with open(log, "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            deadline = time.monotonic() + 180
            while "kvserve cluster: serving" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            text = log.read_text()
            router = re.search(r"behind smg \(\S+, pid \d+\) on (\S+)", text).group(1)
            one, two = re.findall(r"kvserve cluster: replica \d+ on (\S+) \(pid", text)
            body = {"model": "tiny", "temperature": 0, "max_output_tokens": 6}
            made = httpx.post(one + "/v1/responses", json={**body, "input": "Hello"}, timeout=60).json()
            follow = httpx.post(two + "/v1/responses", json={**body, "input": "More", "previous_response_id": made["id"]}, timeout=60)
            assert follow.status_code == 200, follow.text
            assert follow.json()["usage"]["input_tokens"] > made["usage"]["input_tokens"] + made["usage"]["output_tokens"]
            assert httpx.get(f"{two}/v1/responses/{made['id']}").json()["output_text"] == made["output_text"]
            assert httpx.delete(f"{two}/v1/responses/{made['id']}").json()["deleted"] is True
            assert httpx.get(f"{one}/v1/responses/{made['id']}").status_code == 404
            previous = httpx.post(router + "/v1/responses", json={**body, "input": "Start"}, timeout=60).json()["id"]
            for turn in range(3):
                routed = httpx.post(router + "/v1/responses", json={**body, "input": f"Turn {turn}", "previous_response_id": previous}, timeout=60)
                assert routed.status_code == 200, routed.text
                previous = routed.json()["id"]
        finally:
            proc.terminate()
            proc.wait(60)
