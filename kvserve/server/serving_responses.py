"""OpenAI's Responses API: POST /v1/responses (streamed with typed events, or not), GET and DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel.

A response continues a stored one with previous_response_id: the conversation so far (kept in the
store as chat messages) plus the new input items, rendered by the chat template after this turn's
instructions (as OpenAI's, instructions are not carried over). A stored turn's blocks stay pinned
in the KV pool for the follow-up (kv/conversation_pins.py), which then computes only its new turn.
`truncation: "auto"` drops whole items from the conversation's start at fixed points (truncation.py)
so the kept prefix stays cached across turns."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import reprlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvserve.server.async_engine import PromptGroup, RequestAborted, Submission
from kvserve.server.compression_prefix import sparing_earlier_turns
from kvserve.server.errors import APIError
from kvserve.server.protocol import FieldError
from kvserve.server.responses_output import OutputBuilder
from kvserve.server.responses_protocol import ResponsesRequest, check_call_outputs, input_messages
from kvserve.server.responses_store import MemoryResponseStore, RedisResponseStore, StoredResponse, new_response_id, owner_of
from kvserve.server.serving_engine import OpenAIServing, SubmissionStream
from kvserve.server.tool_calls import call_grammar
from kvserve.server.truncation import DoesNotFit, Room, Truncation, fit_conversation
from kvserve.structured.spec import GrammarError

MAX_RUNNING_TRACKED = 4096


def _not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"no response {reprlib.repr(response_id)} is stored here (or it is another key's or cache_salt's)",
                    param, "not_found_error", "response_not_found")  # fmt: skip


class ServingResponses:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        config, engine = serving.config, serving.engine.config
        if engine.kv_remote_url is not None:
            self.store = RedisResponseStore(engine.kv_remote_url, engine.kv_remote_ttl, config.responses_store_max_mib << 20,
                                            ca_file=engine.kv_remote_ca_file)  # fmt: skip
        else:
            self.store = MemoryResponseStore(config.responses_store_max, config.responses_store_max_mib << 20)
        self._running: dict[str, tuple[str, Submission, dict]] = {}  # response id -> (owner, submission, shell): what cancel finds

    def owner(self, cache_salt: str | None) -> str:
        return owner_of(self.serving.config.api_key, cache_salt)

    # ------------------------------------------------------------------ create
    async def create(self, body: ResponsesRequest, request: Request):
        serving = self.serving
        lora = serving.check_model(body.model)
        model_name = lora.lora_name if lora is not None else serving.model_name
        serving.note_unknown_fields(body)
        owner = self.owner(body.cache_salt)
        history: list[dict] = []
        previous_cut = 0
        if body.previous_response_id is not None:
            previous = await asyncio.to_thread(self.store.get, body.previous_response_id, owner)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            if previous.response.get("status") in ("cancelled", "failed"):
                raise APIError(400, f"previous_response_id: response {reprlib.repr(body.previous_response_id)} was "
                               f"{previous.response['status']} and cannot be continued", "previous_response_id")  # fmt: skip
            history, previous_cut = previous.history, previous.truncated_items
        try:
            conversation = history + input_messages(body.input)
            check_call_outputs(conversation)
            head = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
            chat = body.chat_request(head + conversation)
        except FieldError as exc:
            raise APIError(400, str(exc), exc.param) from None
        tools, tool_choice = serving.request_tools(chat)
        calling = tool_choice.mode != "none"
        ids, truncation = await self._render(chat, len(head), body, tools if calling else None, previous_cut)
        serving.validate_prompt(ids, "input")
        max_tokens = serving.max_tokens(body.max_output_tokens, len(ids), "max_output_tokens")
        params = [serving.sampling_params(chat, max_tokens, None, 0)]
        params = await sparing_earlier_turns(serving, params, chat.messages, ids, None, tools if calling else None)
        if calling:
            try:
                spec = await asyncio.to_thread(call_grammar, tools, tool_choice, chat.parallel_tool_calls is not False)
            except GrammarError as exc:
                raise APIError(400, f"tools: {exc}", "tools") from None
            await serving.compile_grammar(spec, "tools", request)
            if tool_choice.mode == "required":
                params = [dataclasses.replace(params[0], structured_outputs=spec)]
        if tool_choice.mode != "required":
            await serving.compile_grammar(params[0].structured_outputs, "text", request)
        sub = serving.submit(request, [PromptGroup(ids, params, keep_kv=body.store)], body.cache_salt, body.stream, lora_request=lora)
        response_id = new_response_id()
        shell = self._shell(response_id, body, model_name, chat, tools if calling else [])
        self._track(response_id, owner, sub, shell)
        builder = OutputBuilder([t.name for t in tools] if calling else None)

        async def finish(out) -> dict:
            response = self._finished(shell, builder, out, len(ids), truncation)
            await self._keep(body, response, conversation + [builder.assistant_message()], owner, truncation, sub.ids[0][0])
            return response

        async def cancelled(exc: RequestAborted) -> dict:
            builder.cut_short()
            response = {**shell, "status": "cancelled" if exc.reason == "cancelled" else "failed", "output": list(builder.items),
                        "error": {"code": exc.reason, "message": exc.message}}  # fmt: skip
            if exc.reason == "cancelled":  # kept, as OpenAI keeps a cancelled response (it is not continued from)
                await self._keep(body, response, None, owner, truncation, None)
            return response

        if body.stream:
            return SubmissionStream(self._events(sub, shell, builder, finish, cancelled, response_id), sub)
        try:
            outs = await serving.collect(sub, request)
        except RequestAborted as exc:
            await cancelled(exc)
            raise
        finally:
            self._running.pop(response_id, None)
        out = outs[(0, 0)]
        builder.feed(out.text, last=True, cut=out.finish_reason == "length")
        return JSONResponse(await finish(out))

    async def _keep(self, body: ResponsesRequest, response: dict, history: list[dict] | None, owner: str, truncation: Truncation,
                    engine_request_id: str | None) -> None:  # fmt: skip
        """Store a response (store: true); `history` None: it cannot be continued (a cancelled one)."""
        if body.store:
            stored = StoredResponse(response["id"], owner, response, history if history is not None else [], body.cache_salt,
                                    truncation.dropped_items, engine_request_id)  # fmt: skip
            await asyncio.to_thread(self.store.put, stored)

    async def _render(self, chat, fixed: int, body: ResponsesRequest, tools, previous_cut: int) -> tuple[list[int], Truncation]:
        """The prompt's tokens, truncated when asked (truncation.py; the previous turn's cut kept while
        it fits, so the turns between two cuts share their whole prefix); a 400 naming the lengths when
        it cannot fit."""
        serving = self.serving
        limit = serving.engine.max_model_len
        room = Room.of(limit, body.max_output_tokens, truncating=body.truncation == "auto")
        reserve, budget = room.reserve, room.budget

        async def render(messages: list) -> list[int]:
            try:
                return await serving.render_messages(messages, None, True, tools=tools)
            except APIError as exc:  # the chat path's refusals name its field: here the conversation is `input`
                if exc.param == "messages":
                    exc.param = "input"
                    exc.message = exc.message.replace("messages carry tool_calls", "input carries function_call items", 1)
                raise

        if reserve >= limit:
            raise APIError(400, f"max_output_tokens={reserve} leaves no room for the input in max_model_len={limit}", "max_output_tokens")
        if body.truncation != "auto":
            ids = await render(chat.messages)
            if len(ids) > budget:
                hint = "; send truncation: \"auto\" to drop its oldest items" if len(chat.messages) - fixed > 1 else ""
                raise APIError(400, f"the input is {len(ids)} tokens and max_output_tokens {reserve}: more than max_model_len={limit}"
                               + hint, "input")  # fmt: skip
            return ids, Truncation()
        try:
            return await fit_conversation(render, chat.messages, fixed, budget, room.quantum, serving.token_count, previous_cut)
        except DoesNotFit:
            head = await render(chat.messages[:fixed]) if fixed else []
            if fixed and len(head) + reserve > limit:
                raise APIError(400, f"instructions are {len(head)} tokens: with max_output_tokens {reserve}, more than max_model_len="
                               f"{limit}", "instructions") from None  # fmt: skip
            raise APIError(400, f"the last user turn and what follows it do not fit max_model_len={limit} with max_output_tokens "
                           f"{reserve}, even with every earlier item dropped", "input") from None  # fmt: skip

    # ------------------------------------------------------------------ the response object
    def _track(self, response_id: str, owner: str, sub: Submission, shell: dict) -> None:
        """Remember a response in progress for cancel (those finished or never streamed leave the table here)."""
        if len(self._running) >= MAX_RUNNING_TRACKED:
            for done in [rid for rid, (_, s, _) in self._running.items() if s.closed]:
                del self._running[done]
        if len(self._running) < MAX_RUNNING_TRACKED:
            self._running[response_id] = (owner, sub, shell)

    def _shell(self, response_id: str, body: ResponsesRequest, model: str, chat, tools: list) -> dict:
        text_format = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
            "output": [], "parallel_tool_calls": chat.parallel_tool_calls is not False, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store, "temperature": chat.temperature, "text": {"format": text_format},
            "tool_choice": body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none"),
            "tools": body.tools or [], "top_p": chat.top_p, "truncation": body.truncation or "disabled", "usage": None,
            "metadata": body.metadata or {}, "user": body.user,
        }  # fmt: skip

    @staticmethod
    def _finished(shell: dict, builder: OutputBuilder, out, prompt_tokens: int, truncation: Truncation) -> dict:
        incomplete = out.finish_reason == "length"
        usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens": out.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt_tokens + out.num_output_tokens}  # fmt: skip
        if truncation.dropped_items:
            usage["truncation"] = {"dropped_items": truncation.dropped_items, "dropped_tokens_estimate": truncation.dropped_tokens}
        return {**shell, "status": "incomplete" if incomplete else "completed", "output": list(builder.items), "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "output_text": builder.output_text()}  # fmt: skip

    # ------------------------------------------------------------------ streaming
    async def _events(self, sub: Submission, shell: dict, builder: OutputBuilder, finish, cancelled, response_id: str) -> AsyncIterator[str]:
        number = 0

        def event(kind: str, **fields) -> str:
            nonlocal number
            number += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number - 1, **fields})}\n\n"

        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        final = None
        try:
            async for _, _, out in sub.outputs():
                for kind, fields in builder.feed(out.text, last=out.finished, cut=out.finish_reason == "length"):
                    yield event(kind, **fields)
                if out.finished:
                    final = out
        except RequestAborted as exc:
            yield event("response.failed", response=await cancelled(exc))
            return
        finally:
            self._running.pop(response_id, None)
        # response.completed even when the status is incomplete (max_output_tokens): what the openai client's stream waits for, as vLLM
        yield event("response.completed", response=await finish(final))

    # ------------------------------------------------------------------ the others
    async def retrieve(self, response_id: str, cache_salt: str | None) -> dict:
        stored = await asyncio.to_thread(self.store.get, response_id, self.owner(cache_salt))
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    async def delete(self, response_id: str, cache_salt: str | None) -> dict:
        owner = self.owner(cache_salt)
        stored = await asyncio.to_thread(self.store.get, response_id, owner)
        if stored is None or not await asyncio.to_thread(self.store.delete, response_id, owner):
            raise _not_found(response_id)
        if stored.engine_request_id is not None:  # nothing continues it now: its pinned blocks go back to the cache
            kv = self.serving.engine.kv
            await self.serving.async_engine.call(lambda: kv.release_pin(stored.engine_request_id))
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str, cache_salt: str | None) -> dict:
        running = self._running.get(response_id)
        if running is None or running[0] != self.owner(cache_salt) or running[1].closed:
            if await asyncio.to_thread(self.store.get, response_id, self.owner(cache_salt)) is not None:
                raise APIError(400, f"response {reprlib.repr(response_id)} has finished: only a response in progress can be cancelled",
                               "response_id")  # fmt: skip
            raise _not_found(response_id)
        running[1].fail(RequestAborted("cancelled", "the response was cancelled", 499))
        return {**running[2], "status": "cancelled"}


def register_routes(app: FastAPI, serving: OpenAIServing) -> None:
    endpoint = ServingResponses(serving)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await endpoint.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, cache_salt: str | None = None):
        return await endpoint.retrieve(response_id, cache_salt)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, cache_salt: str | None = None):
        return await endpoint.delete(response_id, cache_salt)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, cache_salt: str | None = None):
        return await endpoint.cancel(response_id, cache_salt)
