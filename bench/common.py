"""Seeded workloads cut from real prose on this machine (GPL-3, GFDL-1.3, the stdlib)."""

from __future__ import annotations

import random
import time
from pathlib import Path

PROSE_FILES = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GFDL-1.3"]


def prose_token_ids(tokenizer) -> list[int]:
    text = "\n".join(Path(p).read_text() for p in PROSE_FILES if Path(p).exists())
    if len(text) < 10000:
        import inspect
        import textwrap

        text += textwrap.dedent(inspect.getsource(random))
    return tokenizer.encode(text, add_special_tokens=False)


def make_prompts(tokenizer, count: int, low: int, high: int, seed: int = 0, bos: int | None = None) -> list[list[int]]:
    ids = prose_token_ids(tokenizer)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        n = rng.randint(low, high)
        start = rng.randrange(0, len(ids) - n)
        body = ids[start : start + n - (1 if bos is not None else 0)]
        prompts.append(([bos] if bos is not None else []) + body)
    return prompts


def best_call_seconds(fn, repeat: int, rounds: int = 3) -> float:
    """Seconds per call of fn: the best of `rounds` means over `repeat` calls, after a warm-up call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (nan for no values)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")
