"""OpenAI request bodies (validated by pydantic) and their translation to SamplingParams."""

from __future__ import annotations

import json
import reprlib
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
    WrapValidator, field_validator, model_validator,
)
from pydantic_core import PydanticCustomError

from kvserve.engine.beam import BeamSearchParams
from kvserve.kv.hashing import validate_cache_salt
from kvserve.sampling_params import MAX_SEED, SamplingParams
from kvserve.server.json_limits import MAX_JSON_DEPTH, TooDeep, first_unpaired_surrogate, loads_bounded
from kvserve.server.structured_fields import structured_outputs_of
from kvserve.structured.spec import StructuredOutputs


def _one_number_error(value, handler):
    """A JSON number (not a string or a boolean), with one error instead of one per union member."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("number_type", "Input should be a number") from None


Number = Annotated[StrictInt | StrictFloat, WrapValidator(_one_number_error)]


def _integral_float_as_int(value):
    """OpenAI accepts a float with no fractional part (`"max_tokens": 3.0`) where it wants an integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Count = Annotated[StrictInt, BeforeValidator(_integral_float_as_int)]  # an integer; 3.0 too, never 3.5, "3" or true


def _checked_salt(value: str) -> str:
    validate_cache_salt(value)
    return value


CacheSalt = Annotated[StrictStr, AfterValidator(_checked_salt)]  # a request's cache_salt (kv/hashing.py's rules)


def _float(name: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond float's range
        raise ValueError(f"{name} must be a finite number, got an integer of {value.bit_length()} bits") from None


class UnpairedSurrogateError(ValueError):
    """Text JSON can carry but Unicode cannot; `param` is the top-level field that holds it."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} holds an unpaired surrogate (\\ud800-\\udfff): not valid Unicode text")
        self.param = path.split(".")[0]


class FieldError(ValueError):
    """A check across fields that still names the field at fault (`param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class UnicodeBody(BaseModel):
    """A request body nested at most MAX_JSON_DEPTH levels whose every string is valid Unicode
    (checked before its fields, in one iterative walk: server/json_limits.py)."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        try:
            path = first_unpaired_surrogate(data)
        except TooDeep as error:
            raise FieldError(error.path.split(".")[0] or "body", str(error)) from None
        if path is not None:
            raise UnpairedSurrogateError(path)
        return data


def _null_is_false(value):
    return False if value is None else value


def _null_is_true(value):
    return True if value is None else value


Flag = Annotated[StrictBool, BeforeValidator(_null_is_false)]  # a boolean; null (OpenAI's SDKs' "not given") is false
FlagOn = Annotated[StrictBool, BeforeValidator(_null_is_true)]  # likewise, for a boolean that is true by default


class StreamOptions(BaseModel):
    include_usage: Flag = False
    continuous_usage_stats: Flag = False  # vLLM's: with include_usage, every chunk carries the usage so far


# vLLM's request extensions this server does not implement, with the value that means "off": any other
# value would change the answer, so it is a 400 naming the field (other unknown fields are ignored)
VLLM_UNIMPLEMENTED = {"min_tokens": 0, "allowed_token_ids": None, "bad_words": None,
                      "logits_processors": None, "skip_special_tokens": True,
                      "spaces_between_special_tokens": True, "return_tokens_as_token_ids": False, "prompt_embeds": None,
                      "chat_template_kwargs": None, "documents": None, "mm_processor_kwargs": None,
                      "vllm_xargs": None, "thinking_token_budget": None, "priority": 0}  # fmt: skip


class _SamplingFields(UnicodeBody):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _refuse_vllm_extensions(cls, data):
        if isinstance(data, dict) and data.get("use_beam_search") is True and "temperature" in data and data["temperature"] is None:
            data = {k: v for k, v in data.items() if k != "temperature"}  # null is "not given": beam search's 0
        if isinstance(data, dict):
            for name, off in VLLM_UNIMPLEMENTED.items():
                # null is "not given" (OpenAI's SDKs send it), so off as well
                if name in data and data[name] is not None and data[name] != off and not (off is None and data[name] in ([], {})):
                    raise FieldError(name, f"{name} is not implemented by this server; refused rather than ignored")
            # kvserve's own extensions: a field with their prefix that is none of them is a typo or a server flag, not ignored
            for name in data:
                if name.startswith(("kv_", "snapkv_")) and name not in cls.model_fields and data[name] is not None:
                    known = ", ".join(sorted(f for f in cls.model_fields if f.startswith(("kv_", "snapkv_"))))
                    raise FieldError(name, f"{name} is not a request field (a request takes {known}; other KV settings are server "
                                           "flags)")  # fmt: skip
        return data

    model: StrictStr | None = None
    n: Count = Field(1, ge=1, le=16)
    max_tokens: Count | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: Count = 0
    min_p: Number = 0.0
    seed: Count | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Count] | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    ignore_eos: Flag = False
    include_stop_str_in_output: Flag = False  # vLLM's extension: keep the stop string that ended the text
    user: StrictStr | None = None
    cache_salt: CacheSalt | None = None
    kv_compression: StrictStr | None = None  # kvserve extension: none | snapkv | streaming | random for this request
    kv_keep_ratio: Number | None = None  # kvserve extension: with kv_compression, the share of tokens kept
    snapkv_query: StrictStr | None = None  # kvserve extension: window | generic | both, whose attention scores snapkv's positions
    kv_compress_from: Count | None = None  # kvserve extension: compression leaves the first N prompt tokens whole and shared
    stream: Flag = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: Count | None = None  # vLLM's extension: each prompt token's logprob and the top N
    truncate_prompt_tokens: Count | None = None  # vLLM's extension: only the prompt's last N tokens (-1: max_model_len's worth)
    # structured outputs (server/structured_fields.py): OpenAI's response_format, or vLLM's structured_outputs or guided_*
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: Any = None  # a schema (object or true) or its JSON text; StructuredOutputs says what is wrong
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    _structured: tuple[StructuredOutputs, str] | None = PrivateAttr(None)
    # OpenAI fields this server does not implement: refused when they would change the result
    logit_bias: dict | None = None
    # vLLM's beam search (engine/beam.py): n beams (best_of, when given, searched), ordered as transformers orders them
    use_beam_search: Flag = False
    best_of: StrictInt | None = None  # with use_beam_search: the beams searched (n of them returned); otherwise n
    length_penalty: Number = 1.0
    early_stopping: Flag | Literal["never"] = False
    suffix: StrictStr | None = None

    @field_validator("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", mode="before")  # fmt: skip
    @classmethod
    def _null_is_the_default(cls, value, info):
        # OpenAI's SDKs send null for "not given"
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("logit_bias", "suffix")
    @classmethod
    def _refuse_unimplemented(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info):
        n = info.data.get("n", 1)
        if info.data.get("use_beam_search") and value is not None and value < n:
            raise ValueError(f"best_of (the beams searched) must be at least n ({n}), got {value}")
        if not info.data.get("use_beam_search") and value is not None and value != n:
            raise ValueError("best_of other than n is not supported by this server (use n), but with use_beam_search")
        return value

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None:
        """The request's beam search (None without use_beam_search); ValueError naming a field it cannot take."""
        if not self.use_beam_search:
            for name, off in (("length_penalty", 1.0), ("early_stopping", False)):
                if getattr(self, name) != off:
                    raise FieldError(name, f"{name} applies to beam search: it needs use_beam_search: true")
            return None
        given = self.model_fields_set
        if "temperature" in given and self.temperature not in (0, None):
            raise FieldError("temperature", "beam search is deterministic here: temperature must be 0 or left out")
        for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):  # fmt: skip
            if getattr(self, name) != off:
                raise FieldError(name, f"{name} does not apply to beam search (use_beam_search): leave it out")
        for name in ("stop", "stop_token_ids", "prompt_logprobs", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):  # fmt: skip
            if getattr(self, name, None) not in (None, [], ""):
                raise FieldError(name, f"{name} is not supported with use_beam_search by this server")
        width = self.best_of or self.n
        try:
            return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                    length_penalty=_float("length_penalty", self.length_penalty), early_stopping=self.early_stopping,
                                    include_stop_str_in_output=self.include_stop_str_in_output)  # fmt: skip
        except ValueError as exc:
            width_field = "best_of" if self.best_of is not None else "n"
            raise FieldError(width_field if "beam_width" in str(exc) else "length_penalty", str(exc)) from None

    @model_validator(mode="after")
    def _one_constraint(self):
        self._structured = structured_outputs_of(self)
        return self

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        options = self.stream_options
        if not self.stream and options is not None and (options.include_usage or options.continuous_usage_stats):
            raise FieldError("stream_options", "stream_options applies to streamed responses: it needs stream: true")
        return self

    @property
    def structured_field(self) -> str | None:
        """The field that carries the request's output constraint (None: unconstrained)."""
        return self._structured[1] if self._structured is not None else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed_offset: int = 0,
                        prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_float("temperature", self.temperature),
            top_p=_float("top_p", self.top_p),
            top_k=self.top_k,
            min_p=_float("min_p", self.min_p),
            # out of range stays as given, for SamplingParams to reject by name
            seed=self.seed if self.seed is None or not 0 <= self.seed < MAX_SEED else (self.seed + seed_offset) % MAX_SEED,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            presence_penalty=_float("presence_penalty", self.presence_penalty),
            frequency_penalty=_float("frequency_penalty", self.frequency_penalty),
            repetition_penalty=_float("repetition_penalty", self.repetition_penalty),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            kv_compression=self.kv_compression,
            kv_keep_ratio=None if self.kv_keep_ratio is None else _float("kv_keep_ratio", self.kv_keep_ratio),
            snapkv_query=self.snapkv_query,
            kv_compress_from=self.kv_compress_from,
            structured_outputs=self._structured[0] if self._structured is not None else None,
        )


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: Count | None = None
    echo: Flag = False  # the prompt before the completion; with logprobs, the prompt tokens' logprobs too
    tools: list | None = None  # chat's: refused here rather than ignored
    tool_choice: StrictStr | dict | None = None
    truncation: StrictStr | None = None  # chat's and the Responses API's: a prompt is cut with truncate_prompt_tokens

    @field_validator("tools", "tool_choice", "truncation")
    @classmethod
    def _chat_only(cls, value, info):
        if value and not (info.field_name == "truncation" and value == "disabled"):
            hint = " (a prompt is cut with truncate_prompt_tokens)" if info.field_name == "truncation" else ""
            raise ValueError(f"{info.field_name} is taken by /v1/chat/completions, not by completions{hint}")
        return value


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None
    refusal: StrictStr | None = None  # an assistant's refusal, replayed in the history: its text

    @field_validator("type")
    @classmethod
    def _text_only(cls, value):
        if value not in ("text", "refusal"):  # an image or audio part dropped silently would answer another question
            raise ValueError(f"content parts of type {reprlib.repr(value)} are not supported by this server (text only)")
        return value

    @model_validator(mode="after")
    def _carries_its_text(self) -> "ContentPart":
        if getattr(self, self.type) is None:
            raise ValueError(f"a content part of type {self.type!r} needs its {self.type!r} field")
        return self


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _arguments_nest_within_the_limit(cls, value: str) -> str:
        try:
            loads_bounded(value)
        except json.JSONDecodeError:
            pass  # not JSON: templates get the text as it is
        except TooDeep:
            raise ValueError(f"the arguments' JSON nests deeper than {MAX_JSON_DEPTH} levels, the limit of every request") from None
        return value


class ToolCallMessage(BaseModel):
    """One call of an assistant message's tool_calls."""

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def rendered(self) -> dict:
        # templates write the arguments with `| tojson`: they take the object, not its JSON text (as transformers' do)
        try:
            arguments = loads_bounded(self.function.arguments)
        except (json.JSONDecodeError, TooDeep):
            arguments = self.function.arguments
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return {**call, "id": self.id} if self.id is not None else call


def _one_content_error(value, handler):
    """A message's content: one error, the one for what was sent (a list's part), not one per accepted form."""
    try:
        return handler(value)
    except ValidationError as exc:
        if isinstance(value, list):
            for err in exc.errors():
                if err["loc"] and str(err["loc"][0]).startswith("list"):
                    where = ".".join(str(p) for p in err["loc"][1:])
                    raise PydanticCustomError("content_part", "part {where}: {msg}",
                                              {"where": where, "msg": err["msg"].removeprefix("Value error, ")}) from None  # fmt: skip
        raise PydanticCustomError("content_type", "Input should be a string or a list of content parts") from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[StrictStr | list[ContentPart] | None, WrapValidator(_one_content_error)] = None
    name: StrictStr | None = None  # handed to the chat template, which may use it
    tool_call_id: StrictStr | None = None  # likewise (a tool message's)
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls (templates that take tools render them)
    # an assistant's earlier deprecated function call or audio turn: refused rather than dropped from the history
    function_call: dict | None = None
    audio: dict | None = None

    @field_validator("function_call", "audio")
    @classmethod
    def _refuse_unrendered(cls, value, info):
        if value:
            raise ValueError(f"messages with {info.field_name} are not supported by this server (send tool_calls); "
                             "refused rather than dropped from the conversation")  # fmt: skip
        return value

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        # as OpenAI: only an assistant turn may leave its content out (a tool call's)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join((part.text if part.type == "text" else part.refusal) or "" for part in self.content)
        return self.content or ""

    def rendered(self) -> dict:
        """What the chat template sees of this message."""
        out = {"role": self.role, "content": self.text()}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tool_calls:
            out["tool_calls"] = [call.rendered() for call in self.tool_calls]
        return out


def check_ending(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """How a rendered conversation may end: with the assistant header, or inside its last (assistant) message."""
    if continue_final_message and add_generation_prompt:
        raise FieldError("continue_final_message", "continue_final_message continues the last message, so it needs "
                         "add_generation_prompt: false (both were true)")  # fmt: skip
    if continue_final_message and messages[-1].role != "assistant":
        raise FieldError("continue_final_message", f"continue_final_message continues an assistant message; the last message is a "
                         f"{messages[-1].role} message")  # fmt: skip


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: Flag = False
    top_logprobs: Count | None = None
    chat_template: StrictStr | None = None
    # vLLM's: end the prompt with the assistant header (the default), or leave the last (assistant) message open to be
    # continued; echo: a continued message's text comes back before the new text
    add_generation_prompt: FlagOn = True
    continue_final_message: Flag = False
    echo: Flag = False
    # kvserve's extension (the Responses API's field): "auto" drops the conversation's oldest messages at fixed points
    # (server/truncation.py) until it fits, so the kept prefix stays cached across turns
    truncation: Literal["disabled", "auto"] | None = None
    # OpenAI fields that would change the answer and that this server does not implement: a 400 naming the
    # field when set, never ignored (the client would believe it got what it asked for)
    tools: list | None = None  # server/tool_calls.py
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool | None = None  # with tool_choice required: one call, or several (the default)
    functions: list | None = None
    function_call: StrictStr | dict | None = None
    audio: dict | None = None
    modalities: list | None = None
    reasoning_effort: StrictStr | None = None
    verbosity: StrictStr | None = None
    web_search_options: dict | None = None
    moderation: dict | None = None

    @model_validator(mode="after")
    def _one_ending(self):
        check_ending(self.messages, self.add_generation_prompt, self.continue_final_message)
        if self.truncation == "auto" and (self.continue_final_message or not self.add_generation_prompt):
            raise FieldError("truncation", "truncation: auto renders the conversation for a new answer: it needs add_generation_prompt "
                             "and no continue_final_message")  # fmt: skip
        if self.truncation == "auto" and self.truncate_prompt_tokens is not None:
            raise FieldError("truncation", "send one of truncation: auto and truncate_prompt_tokens")
        return self

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value, info):
        if value:
            raise ValueError("functions (deprecated by OpenAI) is not supported by this server; send tools")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value, info):
        if value is not None and value not in ("none", "auto"):  # with no functions, none and auto both mean plain text
            raise ValueError(f"function_call {reprlib.repr(value)} (deprecated by OpenAI) is not supported by this server; send "
                             "tool_choice")  # fmt: skip
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        if value is not None and any(m != "text" for m in value):
            raise ValueError("modalities other than text are not supported by this server")
        return value

    @field_validator("audio", "reasoning_effort", "verbosity", "web_search_options", "moderation")
    @classmethod
    def _refuse_unimplemented_chat(cls, value, info):
        if value is not None:
            raise ValueError(f"{info.field_name} is not implemented by this server; refused rather than ignored")
        return value


class MigrateRequest(UnicodeBody):
    """POST /v1/kv/migrate: move a running request to another server (server/migration.py)."""

    model_config = ConfigDict(extra="forbid")
    request_id: StrictStr = Field(max_length=200)  # the response's id (cmpl-..., chatcmpl-...) or the X-Request-Id
    target: StrictStr = Field(max_length=2000)  # a base URL listed in --migration-targets


class TokenizeRequest(UnicodeBody):
    """POST /tokenize (vLLM's shapes): a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: FlagOn = True
    continue_final_message: Flag = False
    return_token_strs: Flag = False
    chat_template: StrictStr | None = None
    tools: list | None = None  # rendered by templates that take them, as the chat request's
    tool_choice: StrictStr | dict | None = None  # "none": the tools are not rendered, as in chat

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "send exactly one of prompt and messages")
        if self.messages is not None:
            check_ending(self.messages, self.add_generation_prompt, self.continue_final_message)
        elif self.tools:
            raise FieldError("tools", "tools are rendered with messages by the chat template, not with a prompt")
        return self


class DetokenizeRequest(UnicodeBody):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[StrictInt]
