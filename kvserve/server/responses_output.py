"""A response's output items (a message with its output_text, function_call items) built from the
generated text as it arrives, with the typed stream events that announce each piece in order:
output_item.added, content_part.added, output_text.delta ..., output_text.done, content_part.done,
output_item.done; a call: output_item.added, function_call_arguments.delta/.done, output_item.done."""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from kvserve.server.tool_calls import ToolCallParser

Event = tuple[str, dict]  # (type, fields)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputBuilder:
    def __init__(self, tool_names: Iterable[str] | None) -> None:
        self.parser = ToolCallParser(tool_names) if tool_names is not None else None
        self.items: list[dict] = []
        self._open: dict | None = None  # the message being written
        self._text: list[str] = []

    @property
    def calls(self) -> list[dict]:
        return [item for item in self.items if item["type"] == "function_call"]

    def feed(self, delta: str, last: bool, cut: bool = False) -> list[Event]:
        """Events for new generated text (`last`: the generation ended; `cut`: at max_output_tokens, so
        the message it leaves open is incomplete)."""
        if self.parser is not None:
            content, calls = self.parser.parse(delta, last=last)
        else:
            content, calls = delta, []
        events: list[Event] = []
        if content:
            events += self._write(content)
        for call in calls:
            events += self._close()
            events += self._call(call)
        if last:
            if not self.items and self._open is None:
                events += self._write("")
            events += self._close("incomplete" if cut else "completed")
        return events

    def _write(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None:
            self._open = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            self._text = []
            index = len(self.items)
            self.items.append(self._open)
            events.append(("response.output_item.added", {"output_index": index, "item": dict(self._open, content=[])}))
            events.append(("response.content_part.added", {"item_id": self._open["id"], "output_index": index, "content_index": 0,
                                                           "part": {"type": "output_text", "text": "", "annotations": []}}))  # fmt: skip
        self._text.append(text)
        if text:
            events.append(("response.output_text.delta", {"item_id": self._open["id"], "output_index": self.items.index(self._open),
                                                          "content_index": 0, "delta": text, "logprobs": []}))  # fmt: skip
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        if self._open is None:
            return []
        item, index, text = self._open, self.items.index(self._open), "".join(self._text)
        part = {"type": "output_text", "text": text, "annotations": []}
        item["content"], item["status"] = [part], status
        self._open = None
        return [("response.output_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                ("response.content_part.done", {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part}),
                ("response.output_item.done", {"output_index": index, "item": item})]  # fmt: skip

    def _call(self, call: dict) -> list[Event]:
        function = call["function"]
        item = {"id": _item_id("fc"), "type": "function_call", "status": "completed", "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"]}  # fmt: skip
        index = len(self.items)
        self.items.append(item)
        return [("response.output_item.added", {"output_index": index, "item": dict(item, arguments="", status="in_progress")}),
                ("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index, "delta": item["arguments"]}),
                ("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": index, "item": item})]  # fmt: skip

    def cut_short(self) -> None:
        """The generation stopped early (cancelled, failed): the open message keeps its text, status incomplete."""
        self._close("incomplete")

    def assistant_message(self) -> dict:
        """The output as the chat message a follow-up's history holds (content and tool calls)."""
        text = "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])
        calls = [{"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
        message: dict = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message

    def output_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])
