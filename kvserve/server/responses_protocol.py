"""OpenAI's Responses API request (`POST /v1/responses`) and its translation to what the chat path
takes: input items become chat messages, Responses' flat function tools and `text.format` become
chat's `tools` and `response_format`, and the sampling fields (with the extensions the chat
endpoint takes: seed, top_k, stop, cache_salt, kv_*...) are checked by ChatCompletionRequest
itself, so every field is validated the same way. What the Responses API has and this server does
not do is a 400 naming the field."""

from __future__ import annotations

import json
import reprlib
from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictStr, ValidationError, field_validator, model_validator

from kvserve.server.protocol import CacheSalt, ChatCompletionRequest, Count, FieldError, Flag, FlagOn, Number, UnicodeBody

MAX_INPUT_ITEMS = 4096
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_RESPONSE_ID_CHARS = 128
_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# sampling fields and extensions handed to the chat request as they are (ChatCompletionRequest checks them)
_PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "ignore_eos", "include_stop_str_in_output", "cache_salt", "kv_compression", "kv_keep_ratio",
           "snapkv_query", "kv_compress_from", "user", "parallel_tool_calls")  # fmt: skip
# Responses fields this server does not implement: a 400 naming them when they would change the answer
_REFUSED = {"background": "background responses are not supported by this server (stream, or wait for the answer)",
            "reasoning": "reasoning options are not supported by this server (its models do not reason in a separate channel)",
            "include": "include is not supported by this server (outputs carry no extra data to include)",
            "top_logprobs": "top_logprobs is not supported by the Responses API of this server (use /v1/chat/completions)",
            "max_tool_calls": "max_tool_calls is not supported by this server",
            "prompt": "prompt templates are not supported by this server (send input and instructions)",
            "conversation": "conversation objects are not supported by this server (use previous_response_id)",
            "context_management": "context_management is not supported by this server (use truncation: auto)"}  # fmt: skip


class ResponsesRequest(UnicodeBody):
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    max_output_tokens: Count | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    text: dict | None = None
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    store: FlagOn = True
    previous_response_id: StrictStr | None = Field(None, max_length=MAX_RESPONSE_ID_CHARS)
    truncation: Literal["disabled", "auto"] | None = None
    stream: Flag = False
    metadata: dict | None = None
    user: StrictStr | None = None
    service_tier: StrictStr | None = None  # one tier here: taken and ignored
    prompt_cache_key: StrictStr | None = None  # OpenAI's routing hint: the prefix cache needs none
    safety_identifier: StrictStr | None = None
    cache_salt: CacheSalt | None = None  # kvserve's (and vLLM's) extension: the tenant's prefix-cache scope, and its stored responses'

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data):
        if isinstance(data, dict):
            for name, message in _REFUSED.items():
                value = data.get(name)
                if value not in (None, False, [], {}, 0) and not (name == "reasoning" and value == {"effort": None}):
                    raise FieldError(name, message)
        return data

    @field_validator("input")
    @classmethod
    def _input_items(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("input must be a string or a non-empty list of items")
            if len(value) > MAX_INPUT_ITEMS:
                raise ValueError(f"input holds {len(value)} items; at most {MAX_INPUT_ITEMS} are taken")
            input_messages(value)  # checked here, converted again by the handler
        elif not value:
            raise ValueError("input must not be empty")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value):
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY or not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata keys are strings of at most {MAX_METADATA_KEY} characters and values strings of "
                                 f"at most {MAX_METADATA_VALUE}; {reprlib.repr(key)} is not")  # fmt: skip
        return value

    def chat_request(self, messages: list[dict]) -> ChatCompletionRequest:
        """The chat request these fields make over `messages` (the conversation, instructions first); a
        FieldError names the Responses field at fault."""
        body: dict = {"messages": messages}
        for name in _PASSED:
            if name in self.model_fields_set or name in (self.model_extra or {}):
                value = getattr(self, name, None) if name in self.model_fields else self.model_extra[name]
                if value is not None:
                    body[name] = value
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.text is not None:
            body["response_format"] = response_format(self.text)
        if self.tools:
            body["tools"] = chat_tools(self.tools)
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            cause, message = (err.get("ctx") or {}).get("error"), err["msg"].removeprefix("Value error, ")
            if isinstance(cause, FieldError):
                where = cause.param
            elif err["loc"]:
                where = str(err["loc"][0])
            else:  # a check across fields: its message starts with the field's name
                head = message.split(":", 1)[0]
                where = head if head in ChatCompletionRequest.model_fields else "input"
            param = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}.get(where, where)
            field = "text.format" if param == "text" else param
            raise FieldError(param, f"{field}: {message.removeprefix(f'{where}: ')}") from None


def _text_of(content, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError("input", f"{where}.content must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        field = _TEXT_PARTS.get(kind)
        if field is None:
            raise FieldError("input", f"{where}.content[{j}]: parts of type {reprlib.repr(kind)} are not supported by this "
                             "server (input_text, output_text, refusal)")  # fmt: skip
        text = part.get(field)
        if not isinstance(text, str):
            raise FieldError("input", f"{where}.content[{j}] needs its {field!r} string")
        parts.append({"type": "refusal" if field == "refusal" else "text", field: text})
    return parts


def input_messages(items: str | list) -> list[dict]:
    """Responses input (a string, or items) as chat messages: a message item is a message; function_call
    items join the assistant message before them as its tool_calls (or make one); a function_call_output
    is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise FieldError("input", f"{where} must be an object (a message, function_call or function_call_output item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise FieldError("input", f"{where}.role must be one of {', '.join(_INPUT_ROLES)}, got {reprlib.repr(role)}")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise FieldError("input", f"{where}: a function_call item needs call_id, name and arguments strings")
            if call_id in call_ids:
                raise FieldError("input", f"{where}: call_id {reprlib.repr(call_id)} is used by an earlier function_call")
            call_ids.add(call_id)
            try:
                json.loads(arguments)
            except ValueError:
                raise FieldError("input", f"{where}.arguments must be a JSON object's text, got {reprlib.repr(arguments)}") from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise FieldError("input", f"{where}: a function_call_output item needs its call_id string")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, where)})
        else:
            raise FieldError("input", f"{where}: items of type {reprlib.repr(kind)} are not supported by this server "
                             "(message, function_call, function_call_output)")  # fmt: skip
    return messages


def response_format(text: dict) -> dict:
    """Responses' text.format as chat's response_format."""
    unknown = [k for k in text if k not in ("format", "verbosity")]
    if unknown:
        raise FieldError("text", f"text.{unknown[0]} is not supported by this server (text.format)")
    if text.get("verbosity") not in (None, "medium"):
        raise FieldError("text", "text.verbosity is not supported by this server")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise FieldError("text", "text.format must be an object: {type: text | json_object | json_schema, ...}")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        if "schema" not in spec:
            raise FieldError("text", "text.format of type json_schema needs its schema")
        return {"type": "json_schema", "json_schema": spec}
    return fmt


def chat_tools(tools: list) -> list:
    """Responses' function tools ({type, name, description, parameters, strict}) as chat's."""
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise FieldError("tools", f"tools[{i}]: tools of type {reprlib.repr(kind)} are not supported by this server (function)")
        if "function" in tool:  # chat's shape sent here: taken as it is
            out.append(tool)
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") in ("allowed_tools", "mcp", "custom"):
        raise FieldError("tool_choice", f"tool_choice of type {choice['type']!r} is not supported by this server")
    if choice not in ("none", "auto", "required") and not (isinstance(choice, dict) and "function" in choice):  # chat's shape: taken
        raise FieldError("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}, "
                         f"got {reprlib.repr(choice)}")  # fmt: skip
    return choice


def check_call_outputs(messages: list[dict]) -> None:
    """Every function_call_output answers a function_call made before it in the conversation."""
    calls: set[str] = set()
    for message in messages:
        for call in message.get("tool_calls") or ():
            calls.add(call["id"])
        if message["role"] == "tool" and message.get("tool_call_id") not in calls:
            raise FieldError("input", f"function_call_output call_id {reprlib.repr(message.get('tool_call_id'))} answers no function_call "
                             "of this conversation")  # fmt: skip
