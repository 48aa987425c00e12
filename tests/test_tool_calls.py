"""Tool calls in chat: tools reach the chat template, `<tool_call>` blocks (and bare JSON calls) become
message.tool_calls and stream as delta.tool_calls that reassemble into the same message; `required`
and named functions are enforced by a grammar; a model whose template takes no tools gets a 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import xgrammar as xgr

from kvserve.server.tool_calls import ToolCallParser, message_with_calls
from server_process import launch_server, stop_server
from test_server import CHAT_TEMPLATE

# the Hermes format (Qwen2.5's), cut down to the tiny model's 512 positions: tool names in the system turn, calls and
# tool results in the history
TOOLS_TEMPLATE = (
    "{% if tools %}<s>system: tools{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0,
       "maximum": 99}}, "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def assert_calls_valid(message, one_of=("get_weather", "add")) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in one_of
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassemble(stream) -> dict[int, dict]:
    """Each choice's message from its streamed deltas, as a client assembles it."""
    messages: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            m = messages.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            m["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                m["calls"][call.index] = (call.function.name, call.function.arguments)
            m["finish"] = c.finish_reason or m["finish"]
    return messages


def as_streamed(choice) -> dict:
    calls = {i: (c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls or [])}
    return {"content": choice.message.content or "", "calls": calls, "finish": choice.finish_reason}


TEXTS = [
    "Sure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n",
    "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1}}</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{}\"}</tool_call>",
    "{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n{\"name\": \"add\", \"arguments\": {}}",  # bare calls (small models)
    "```json\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n```",  # bare, in a code fence (Qwen2.5-Coder-0.5B)
    "```python\nprint(1)\n```",  # a code answer: content
    "``",
    "{\"name\": \"unknown\", \"arguments\": {}}",  # not one of the tools: content
    "{\"a\": 1} is JSON",
    "plain answer with a < sign and <tool but no call  \n",
    "text <tool_call>{not json}</tool_call> more",
    "cut off <tool_call>{\"name\": \"add\", \"argu",
    "<tool_c",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_parse_into_the_message_the_whole_text_gives(text):
    names = ("add", "get_weather")
    whole_content, whole_calls = message_with_calls(text, names)
    strip = [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]
    for size in (1, 2, 3, 7, 100):
        parser = ToolCallParser(names)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        parts = [parser.parse(piece, last=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert ("".join(p[0] for p in parts) or None) == whole_content
        assert [(c["function"]["name"], c["function"]["arguments"]) for p in parts for c in p[1]] == strip
    if "<tool_call>" not in text and '{"name": "add"' not in text:
        assert whole_content == text and not whole_calls  # text with no call is the content, unchanged


def test_parsed_calls():
    content, calls = message_with_calls(TEXTS[0], ("add",))
    assert content == "Sure." and [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert len(message_with_calls(TEXTS[2], ("add",))[1]) == 2
    assert [c["function"]["name"] for c in message_with_calls(TEXTS[3], ("add",))[1]] == ["add"]  # fenced
    assert message_with_calls(TEXTS[6], ("add",)) == (TEXTS[6], [])  # not one of the tools
    assert message_with_calls(TEXTS[4], ("add",)) == (TEXTS[4], [])  # a code answer


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--dtype", "float32", "--port", "0", "--kv-cache-memory", "0.02",
                               "--chat-template", TOOLS_TEMPLATE, "--served-model-name", "tiny"])  # fmt: skip
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def tiny_client(tiny_server):
    return openai.OpenAI(base_url=tiny_server + "/v1", api_key="unused", max_retries=0)


def test_required_and_named_calls_follow_the_function_schemas_on_a_random_model(tiny_client):
    for tool_choice, names in [("required", ("get_weather", "add")), ({"type": "function", "function": {"name": "add"}}, ("add",))]:
        for parallel in (True, False):
            out = tiny_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=4, seed=3,
                                                      temperature=1.0, max_tokens=300, parallel_tool_calls=parallel)  # fmt: skip
            for choice in out.choices:
                assert choice.finish_reason == "tool_calls" and choice.message.content is None
                assert_calls_valid(choice.message, names)
                if not parallel or isinstance(tool_choice, dict):
                    assert len(choice.message.tool_calls) == 1


def test_streamed_tool_calls_reassemble_into_the_message(tiny_client):
    for tool_choice in ("required", "auto"):
        kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=3, seed=9, temperature=1.0, max_tokens=200)
        whole = tiny_client.chat.completions.create(**kwargs)
        chunks = list(tiny_client.chat.completions.create(**kwargs, stream=True))
        assert reassemble(chunks) == {c.index: as_streamed(c) for c in whole.choices}
        # held text sends nothing: every chunk but each choice's first carries content, calls or the finish
        assert all(c.delta.content or c.delta.tool_calls or c.finish_reason or c.delta.role for ch in chunks for c in ch.choices)


def test_tools_reach_the_template_and_calls_in_the_history_render(tiny_server):
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "5"}]  # fmt: skip
    resp = httpx.post(tiny_server + "/tokenize", json={"messages": history, "return_token_strs": False}, timeout=30)
    ids = resp.json()["tokens"]
    text = httpx.post(tiny_server + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text and "tool: 5" in text
    out = httpx.post(tiny_server + "/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 8}, timeout=60)
    assert out.status_code == 200, out.text
    # /tokenize counts a tool-using prompt as the chat request renders it (found by QA: tools were a 400 there)
    counted = httpx.post(tiny_server + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30).json()["count"]
    assert counted == out.json()["usage"]["prompt_tokens"] > len(ids)


def test_continue_final_message_ends_the_prompt_right_after_the_message(tiny_server):
    # found by QA: the text was found by its last occurrence, which may lie in what the template writes after it
    history = ASK + [{"role": "assistant", "content": "tool", "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": "{}"}}]}]  # fmt: skip
    body = {"messages": history, "add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(tiny_server + "/tokenize", json=body, timeout=30).json()["tokens"]
    text = httpx.post(tiny_server + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text.endswith("<s>assistant: tool"), text
    # /tokenize takes tool_choice as chat does: "none" renders no tools
    counts = [httpx.post(tiny_server + "/tokenize", json={"messages": ASK, "tools": TOOLS, **extra}, timeout=30).json()["count"]
              for extra in ({}, {"tool_choice": "none"})]  # fmt: skip
    plain = httpx.post(tiny_server + "/tokenize", json={"messages": ASK}, timeout=30).json()["count"]
    assert counts[0] > counts[1] == plain


def test_a_tools_refs_resolve_within_its_own_parameters():
    """Found by QA: $refs in parameters (pydantic's $defs for nested models and enums, "#" for recursion)
    resolved against the calls' wrapper schema: a 400, or another schema silently enforced."""
    from xgrammar.testing import _is_grammar_accept_string

    from kvserve.server.tool_calls import ToolChoice, call_grammar, parse_tools
    from kvserve.structured.compiler import grammar_text

    defs = {"$defs": {"A": {"type": "string", "enum": ["x", "y"]}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
            "required": ["a"]}  # fmt: skip
    tree = {"type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["value", "children"]}  # fmt: skip
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": defs}},
                         {"type": "function", "function": {"name": "g", "parameters": tree}}])  # fmt: skip
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'.format
    node = {"$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                               "required": ["v", "kids"]}}, "$ref": "#/$defs/Node"}  # pydantic's recursive model: a $ref at the top
    tools += parse_tools([{"type": "function", "function": {"name": "mk", "parameters": node}}])
    grammar = xgr.Grammar.from_ebnf(grammar_text(call_grammar(tools, ToolChoice("required", "mk"), False)))
    assert _is_grammar_accept_string(grammar, call("mk", '{"v": 1, "kids": [{"v": 2, "kids": []}]}'))
    assert not _is_grammar_accept_string(grammar, call("mk", '{"v": 1, "kids": [{"w": 2}]}'))
    for choice in (ToolChoice("required"), ToolChoice("required", "g")):
        grammar = xgr.Grammar.from_ebnf(grammar_text(call_grammar(tools, choice, False)))
        assert _is_grammar_accept_string(grammar, call("f", '{"a": "x"}')) == (choice.name is None)
        assert not _is_grammar_accept_string(grammar, call("f", '{"a": "z"}'))
        assert _is_grammar_accept_string(grammar, call("g", '{"value": 1, "children": [{"value": 2, "children": []}]}'))
        assert not _is_grammar_accept_string(grammar, call("g", '{"value": 1, "children": [{"name": "g", "arguments": {}}]}'))


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "type"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "two tools are named"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
     "tools", "got type 'nonsense'"),
    # found by QA: arguments that are no object passed the grammar, then failed the parser (no tool_calls under "required")
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tool_choice": "required"},
     "tools", "of type object"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools", "at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": [1]}}}]}, "tools",
     "cannot compile"),  # auto compiles the calls' grammar too
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "cannot as well"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(tiny_server, body, param, message):
    resp = httpx.post(tiny_server + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and message in resp.json()["error"]["message"], resp.json()


def test_a_model_whose_template_takes_no_tools_refuses_them(tiny_dir):
    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--dtype", "float32", "--port", "0", "--kv-cache-memory", "0.02",
                               "--chat-template", CHAT_TEMPLATE])  # fmt: skip
    try:
        resp = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 4}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools" and "does not take tools" in resp.text
        calls = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add",
                  "arguments": "{}"}}]}]  # fmt: skip
        resp = httpx.post(url + "/v1/chat/completions", json={"messages": ASK + calls, "max_tokens": 4}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
        for plain in ({"tools": [], "tool_choice": "auto"}, {"tools": TOOLS, "tool_choice": "none"}):
            assert httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **plain}, timeout=30).status_code == 200
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------- Qwen2.5-Coder-0.5B-Instruct, whose template takes tools
QWEN = "qwen2.5-coder-0.5b-instruct"
QWEN_ASKS = ["What's the weather like in Paris today, in celsius?", "Add 20 and 5 for me.", "Is it raining in Tokyo?"]


@pytest.fixture(scope="module")
def qwen():
    proc, url = launch_server(["--model", QWEN, "--port", "0", "--kv-cache-memory", "0.25"], timeout=300)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stop_server(proc)


def test_qwen_required_always_calls_with_valid_arguments(qwen):
    for ask in QWEN_ASKS[1:]:
        out = qwen.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": ask}], tools=TOOLS, tool_choice="required",
                                           n=2, temperature=1.0, seed=1, max_tokens=120)  # fmt: skip
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls"
            assert_calls_valid(choice.message)


def test_qwen_auto_calls_or_answers_and_streams_the_same(qwen):
    made_calls = 0
    for ask in QWEN_ASKS[:2] + ["Say hello."]:
        kwargs = dict(model=QWEN, messages=[{"role": "user", "content": ask}], tools=TOOLS, tool_choice="auto", temperature=0,
                      max_tokens=100)  # fmt: skip
        whole = qwen.chat.completions.create(**kwargs)
        choice = whole.choices[0]
        assert choice.message.tool_calls or choice.message.content
        if choice.message.tool_calls:
            made_calls += 1
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)
        streamed = reassemble(qwen.chat.completions.create(**kwargs, stream=True))
        assert {0: as_streamed(choice)} == streamed
    assert made_calls >= 2  # the weather and the sum are asks for a tool
