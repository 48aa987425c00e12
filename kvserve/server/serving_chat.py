"""POST /v1/chat/completions: chat messages rendered by the chat template, with tools (their calls
parsed out of the text, or forced by a grammar) and vLLM's additions (echo, continue_final_message,
prompt_logprobs, stop_reason)."""

from __future__ import annotations

import asyncio
import dataclasses
import reprlib
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvserve.engine.sequence import TokenLogprobs
from kvserve.outputs import RequestOutput
from kvserve.server.async_engine import PromptGroup
from kvserve.server.errors import APIError
from kvserve.server.compression_prefix import sparing_earlier_turns
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.serving_engine import OpenAIServing, stop_reason
from kvserve.server.tool_calls import ToolCallParser, call_grammar, message_with_calls
from kvserve.structured.spec import GrammarError


class ServingChat:
    """The chat endpoint: a conversation's tokens, its tools, and its choices as messages (or their deltas)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: ChatCompletionRequest, request: Request) -> dict | StreamingResponse:
        serving = self.serving
        lora = serving.check_model(body.model)
        model_name = lora.lora_name if lora is not None else serving.model_name  # what responses name
        serving.note_unknown_fields(body)
        serving.check_choices(1, body.n)
        tools, tool_choice = serving.request_tools(body)
        calling = tool_choice.mode != "none"
        if body.truncation == "auto":
            ids = await serving.render_truncated(body.messages, body.chat_template, body.max_completion_tokens or body.max_tokens,
                                                 tools if calling else None)  # fmt: skip
        else:
            ids = await serving.render_messages(body.messages, body.chat_template, body.add_generation_prompt,
                                                tools=tools if calling else None,
                                                continue_final_message=body.continue_final_message)  # fmt: skip
        ids = serving.truncate_prompt(ids, body.truncate_prompt_tokens)
        serving.validate_prompt(ids, "messages")
        # vLLM's echo: the last message's text before the new text when it is the assistant's (the one continued)
        echoed = body.messages[-1].text() if body.echo and body.messages[-1].role == "assistant" else ""
        if echoed and calling:
            raise APIError(400, "echo with tools is not supported by this server (the echoed text would be read as a call)", "echo")
        if body.max_completion_tokens is not None:
            max_tokens = serving.max_tokens(body.max_completion_tokens, len(ids), "max_completion_tokens")
        else:
            max_tokens = serving.max_tokens(body.max_tokens, len(ids))
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        if top is not None and not 0 <= top <= 20:
            raise APIError(400, f"top_logprobs must be an integer in [0, 20], got {reprlib.repr(top)}", "top_logprobs")
        params = [serving.sampling_params(body, max_tokens, top, i, body.prompt_logprobs) for i in range(body.n)]
        params = await sparing_earlier_turns(serving, params, body.messages, ids, body.chat_template, tools if calling else None)
        if calling:  # the calls' grammar is compiled under auto too: a tool whose parameters are no schema is a 400 either way
            try:  # the calls' schema (bounded, but a deep copy and walks of every tool's): off the event loop; its grammar is written where it compiles
                spec = await asyncio.to_thread(call_grammar, tools, tool_choice, body.parallel_tool_calls is not False)
            except GrammarError as exc:
                raise APIError(400, f"tools: {exc}", "tools") from None
            await serving.compile_grammar(spec, "tools", request)
            if tool_choice.mode == "required":
                params = [dataclasses.replace(p, structured_outputs=spec) for p in params]
        if tool_choice.mode != "required":
            await serving.compile_grammar(params[0].structured_outputs, body.structured_field, request)
        beam = serving.beam_params(body, max_tokens, len(ids))
        if beam is not None and (calling or body.echo):
            raise APIError(400, f"{'tools' if calling else 'echo'} is not supported with use_beam_search by this server",
                           "tools" if calling else "echo")  # fmt: skip
        groups = [PromptGroup(ids, params, beam)]
        sub = serving.submit(request, groups, body.cache_salt, body.stream, lora_request=lora)
        request_id = f"chatcmpl-{sub.request_id}"
        created = int(time.time())

        def envelope(choices: list[dict], obj: str = "chat.completion.chunk") -> dict:
            return {"id": request_id, "object": obj, "created": created, "model": model_name, "choices": choices}

        started: set[int] = set()  # choices whose first chunk (the one that names the role, as OpenAI's) went out
        parsers: dict[int, ToolCallParser] = {}  # with tools: each choice's text split into content and tool calls

        def chunk(index: int, out: RequestOutput, delta: str, lps) -> dict | None:
            first = index not in started
            started.add(index)
            message: dict = {"content": delta}
            finish = out.finish_reason if out.finished else None
            if calling:
                parser = parsers.setdefault(index, ToolCallParser(t.name for t in tools))
                made = parser.num_calls
                content, calls = parser.parse(delta, last=out.finished)
                message = {"content": content or (None if calls else "")}
                if calls:
                    message["tool_calls"] = [{"index": made + k, **call} for k, call in enumerate(calls)]
                elif not content and not first and finish is None and not (body.logprobs and lps):
                    return None  # the text is held (it may be a call): nothing to send yet
                if finish == "stop" and parser.num_calls:
                    finish = "tool_calls"
            if first and echoed:
                message["content"] = echoed + message["content"]
            c = envelope([{
                "index": index,
                "delta": {"role": "assistant", **message} if first else message,
                "logprobs": self._chat_logprobs(lps) if body.logprobs else None,
                "finish_reason": finish,
                "stop_reason": stop_reason(out),
            }])
            if body.prompt_logprobs is not None and first:
                c["prompt_logprobs"] = serving.prompt_logprobs(ids, out.prompt_logprobs, body.prompt_logprobs)
            return c

        if body.stream:
            return serving.stream(sub, body.n, chunk, envelope, body.stream_options, splice=not calling,
                                  heavy_first=body.prompt_logprobs is not None)
        outs = await serving.collect(sub, request)

        def message(out: RequestOutput) -> tuple[dict, str | None]:
            if not calling:
                return {"role": "assistant", "content": echoed + out.text}, out.finish_reason
            content, calls = message_with_calls(out.text, (t.name for t in tools))
            if not calls:
                return {"role": "assistant", "content": content or ""}, out.finish_reason
            finish = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
            return {"role": "assistant", "content": content, "tool_calls": calls}, finish

        def answer() -> dict:
            choices = []
            for (_, i), out in sorted(outs.items()):
                msg, finish = message(out)
                choices.append({"index": i, "message": msg, "logprobs": self._chat_logprobs(out.logprobs or []) if body.logprobs else None,
                                "finish_reason": finish, "stop_reason": stop_reason(out)})  # fmt: skip
            response = {**envelope(choices, "chat.completion"), "usage": serving.usage(groups, outs)}
            if body.prompt_logprobs is not None:  # vLLM's place for them: the response's, the prompt being one for every choice
                response["prompt_logprobs"] = serving.prompt_logprobs(ids, outs[(0, 0)].prompt_logprobs, body.prompt_logprobs)
            return response

        return await serving.answer(answer)

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        tokenizer = self.serving.tokenizer

        def entry(token_id: int, value: float) -> dict:
            raw = tokenizer.token_bytes(token_id) if tokenizer is not None else str(token_id).encode()
            return {"token": self.serving.token_text(token_id), "logprob": value, "bytes": list(raw)}

        content = []
        for lp in lps:
            top = sorted(lp.top.items(), key=lambda item: -item[1])
            content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in top]})
        return {"content": content}


def register_routes(app: FastAPI, serving: OpenAIServing) -> None:
    endpoint = ServingChat(serving)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await endpoint.create(body, request)
