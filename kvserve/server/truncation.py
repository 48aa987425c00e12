"""History truncation that keeps the prefix cache: `truncation: "auto"`.

A conversation longer than the context loses whole items from its start (never the instructions or
leading system messages, never the last user turn or what follows it). Dropping one turn per turn
would change the prompt's first tokens every turn, so every turn would miss the cache. Here the
points where a conversation may be cut are fixed by the items themselves: the first item at which
the running size of the items before it reaches each multiple of a quantum (a quarter of the
context). A conversation only grows at its end, so these points never move; the cut stays at the
same point for the turns that follow, whose prompts then share everything up to their new turn,
and moves by a quantum or more only when the kept part no longer fits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

MESSAGE_OVERHEAD_TOKENS = 8  # a message's template tokens (role header, end of turn), roughly


@dataclass(frozen=True)
class Truncation:
    dropped_items: int = 0
    dropped_tokens: int = 0


def cut_points(sizes: list[int], quantum: int, last_droppable: int) -> list[int]:
    """The counts of leading items a conversation may drop, smallest first: for each multiple of
    `quantum`, the first item index where the sizes of the items before it reach it (at most
    `last_droppable`). Depends only on the items up to each point: fixed as the conversation grows."""
    points, total, goal = [], 0, quantum
    for index, size in enumerate(sizes[:last_droppable]):
        total += size
        while total >= goal:
            if not points or points[-1] != index + 1:
                points.append(index + 1)
            goal += quantum
    if last_droppable and (not points or points[-1] != last_droppable):
        points.append(last_droppable)  # the most that can go, whatever the quanta say
    return points


def first_worth_trying(points: list[int], sizes: list[int], fixed: int, budget: int) -> int:
    """The index in `points` of the first cut whose kept items may fit `budget` by their rough sizes
    (earlier ones surely do not): a long history needs few renders, not one per point."""
    total = sum(sizes)
    for i, point in enumerate(points):
        if fixed + total - sum(sizes[:point]) <= budget * 5 // 4:
            return i
    return len(points)


def last_user_turn(roles: list[str]) -> int:
    """How many leading items may go at most: all before the last user message (its index)."""
    for index in range(len(roles) - 1, -1, -1):
        if roles[index] == "user":
            return index
    return max(len(roles) - 1, 0)


def drop_orphans(roles: list[str], start: int, end: int) -> int:
    """A cut must not leave a tool result (or an assistant turn) first: move it past them."""
    while start < end and roles[start] in ("tool", "assistant"):
        start += 1
    return start


@dataclass(frozen=True)
class Room:
    """What a prompt may take of max_model_len: the cut points' quantum (a quarter of the context), the
    output reserved (max tokens asked; without, a quarter when truncating, else one) and the prompt's budget."""

    quantum: int
    reserve: int
    budget: int

    @classmethod
    def of(cls, limit: int, max_tokens: int | None, truncating: bool) -> Room:
        quantum = max(limit // 4, 1)
        reserve = max_tokens if max_tokens is not None else (quantum if truncating else 1)
        return cls(quantum, reserve, limit - min(reserve, limit - 1))


class DoesNotFit(ValueError):
    """Even with every droppable item gone, the conversation is longer than the context."""


async def fit_conversation(render: Callable[[list], Awaitable[list[int]]], messages: list, fixed: int, budget: int, quantum: int,
                           token_count: Callable[[str], int], previous_cut: int = 0) -> tuple[list[int], Truncation]:  # fmt: skip
    """The prompt of `messages` (chat messages with .role and .text(); the first `fixed` and the
    leading system ones always kept) within `budget` tokens, cutting at fixed points (cut_points),
    the cut chosen leaving a quarter of the context (`quantum`) free. `previous_cut`: the items the
    conversation's previous turn dropped, kept while they still fit. DoesNotFit when nothing does."""
    head, items = list(messages[:fixed]), list(messages[fixed:])
    while len(items) > 1 and items[0].role in ("system", "developer"):
        head, items = head + [items[0]], items[1:]
    roles = [m.role for m in items]
    droppable = last_user_turn(roles)

    def sizes_of(chosen) -> list[int]:  # rough token counts: the text's and a template's overhead
        return [token_count(m.text()) + MESSAGE_OVERHEAD_TOKENS for m in chosen]

    first = drop_orphans(roles, min(previous_cut, droppable), droppable) if previous_cut else 0
    ids = await render(head + items[first:])
    if len(ids) <= budget:
        return ids, Truncation(first, sum(await asyncio.to_thread(sizes_of, items[:first])) if first else 0)
    sizes = await asyncio.to_thread(sizes_of, items)
    points = [p for p in cut_points(sizes, quantum, droppable) if p > first]
    fitting = None
    for point in points[first_worth_trying(points, sizes, sum(len(m.text()) for m in head) // 4, budget - quantum) :]:
        start = drop_orphans(roles, point, droppable)
        kept = await render(head + items[start:])
        if len(kept) <= budget and fitting is None:
            fitting = (kept, start)
        if len(kept) <= budget - quantum:  # room for the next turns to grow by a quarter of the context before the next cut
            fitting = (kept, start)
            break
    if fitting is None:
        raise DoesNotFit("the last user turn and what follows it do not fit the context even with every earlier item dropped")
    kept, start = fitting
    return kept, Truncation(start, sum(sizes[:start]))
