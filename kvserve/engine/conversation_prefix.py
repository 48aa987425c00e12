"""What a conversation shares with its other turns: the system prompt and the turns before its last
user message. Compression (kv/eviction.py) leaves those tokens whole (kv_compress_from) so that they
stay shared in the prefix cache, and compresses the last turn on; chat (LLM.chat, the chat and
Responses endpoints) sets it when a request compresses and does not give its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def role_of(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def earlier_turns(messages: Sequence[Any]) -> list[Any]:
    """The messages before the last user message (empty when it is the first)."""
    last = max((i for i, m in enumerate(messages) if role_of(m) == "user"), default=0)
    return list(messages[:last])


def shared_length(earlier_ids: Sequence[int], ids: Sequence[int]) -> int:
    """How many of the prompt's tokens render the earlier turns: their common prefix (a template may
    render the last turn's boundary differently, and those tokens then count as the last turn's)."""
    n = 0
    for a, b in zip(earlier_ids, ids):
        if a != b:
            break
        n += 1
    return n
