"""A compressing chat request (kv_compression, or the server's --kv-compression) leaves its system
prompt and earlier turns whole and shared unless it sends its own kv_compress_from
(engine/conversation_prefix.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvserve.engine.conversation_prefix import earlier_turns, shared_length
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.server.serving_engine import OpenAIServing


async def sparing_earlier_turns(serving: OpenAIServing, params: list[SamplingParams], messages: list, ids: list[int],
                                template: str | None, tools) -> list[SamplingParams]:  # fmt: skip
    if params[0].kv_compress_from is not None or serving.engine.eviction_policy(params[0]) is None:
        return params
    earlier = earlier_turns(messages)
    if not earlier:
        return [dataclasses.replace(p, kv_compress_from=0) for p in params]
    rendered = await serving.render_messages(earlier, template, add_generation_prompt=False, tools=tools)
    shared = shared_length(rendered, ids)
    return [dataclasses.replace(p, kv_compress_from=shared) for p in params]
