"""bench/conversations.py's workload: every turn of the issue's 20 x 10 run is distinct prose."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench"


def _bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("conversations_bench", BENCH / "conversations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_twenty_conversations_of_ten_turns_each_get_their_own_prose():
    turns = _bench().turns_text(20 * 10, 150)
    assert len(set(turns)) == 200
    assert all(len(turn.split()) == 150 + len("What does this part say?".split()) for turn in turns)


def test_a_workload_longer_than_the_prose_is_refused_up_front():
    bench = _bench()
    try:
        bench.turns_text(10_000, 150)
    except SystemExit as refusal:
        assert "need 1500000 words of prose" in str(refusal)
    else:
        raise AssertionError("a workload longer than the prose was accepted")
