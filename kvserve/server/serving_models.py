"""What the server serves: GET /v1/models, and vLLM's tokenizer endpoints (POST /tokenize and
/detokenize, GET /tokenizer_info) with the model's own tokenizer and chat template."""

from __future__ import annotations

import asyncio
import reprlib

from fastapi import FastAPI

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.errors import NO_TOKENIZER, APIError
from kvserve.server.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.server.serving_engine import OpenAIServing


class ServingTokenization:
    """The tokenizer endpoints: a prompt's or a conversation's tokens as chat and completions make them, and back."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _need_tokenizer(self, param: str) -> Tokenizer:
        if self.serving.tokenizer is None:
            raise APIError(400, NO_TOKENIZER.split(": ", 1)[0], param)
        return self.serving.tokenizer

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.serving.check_model(body.model)
        if body.prompt is not None:
            tokenizer = self._need_tokenizer("prompt")
            self.serving.check_text_length(len(body.prompt), "prompt")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add)
        else:
            tools, choice = self.serving.request_tools(body)
            tools = tools if choice.mode != "none" else None  # as chat renders them
            ids = await self.serving.render_messages(body.messages, body.chat_template, body.add_generation_prompt,
                                                     bool(body.add_special_tokens), tools, body.continue_final_message)  # fmt: skip
        strs = await asyncio.to_thread(self.serving.tokenizer.token_strings, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.serving.engine.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.serving.check_model(body.model)
        tokenizer = self._need_tokenizer("tokens")
        vocab = self.serving.engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {reprlib.repr(bad)}", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}

    def tokenizer_info(self) -> dict:
        tokenizer = self._need_tokenizer("tokenizer")
        special = tokenizer.special_tokens
        return {
            "tokenizer_class": tokenizer.class_name,
            **{name: special.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
            "model_max_length": self.serving.engine.max_model_len,
            "vocab_size": tokenizer.vocab_size,
            "chat_template": self.serving.chat_template,
        }


def register_routes(app: FastAPI, serving: OpenAIServing) -> None:
    tokenization = ServingTokenization(serving)

    @app.get("/v1/models")
    async def models():
        base = {"id": serving.model_name, "object": "model", "created": serving.created, "owned_by": "kvserve",
                "max_model_len": serving.engine.max_model_len}  # fmt: skip
        adapters = [{**base, "id": name, "parent": serving.model_name} for name in serving.lora_modules.names]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await tokenization.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenization.tokenizer_info()
