"""A stored conversation's KV kept between turns (kv/conversation_pins.py): pins bounded by their share
of the pool and their TTL, never in a request's way (a pool full of pins still admits and runs a
request, same tokens as alone), and, through a real server on SmolLM2-135M-Instruct with other
traffic between turns, every follow-up of a 5-turn Responses chain finds its whole conversation
cached, where with --conversation-kv-share 0 it does not."""

from __future__ import annotations

import httpx
import pytest

from conftest import random_prompts
from server_process import launch_server, stop_server
from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.conversation_pins import ConversationKVConfig, ConversationPins

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_pins_keep_to_their_share_and_their_ttl():
    pool = BlockPool(40)
    now = [0.0]
    pins = ConversationPins(20, ConversationKVConfig(share=0.5, ttl_s=10), pool.free, clock=lambda: now[0])
    a, b, c = pool.allocate(4), pool.allocate(4), pool.allocate(4)
    assert pins.pin("a", a, pool.touch) and pins.pin("b", b, pool.touch) and pins.num_blocks == 8
    assert pins.pin("c", c, pool.touch)  # 12 > 10: the oldest (a) goes
    assert pins.num_blocks == 8 and all(blk.ref_count == 1 for blk in a) and all(blk.ref_count == 2 for blk in c)
    assert not pins.pin("d", pool.allocate(11), pool.touch)  # more than the share alone: not pinned
    assert pins.release("b") and not pins.release("b") and all(blk.ref_count == 1 for blk in b)
    now[0] = 10.0
    assert pins.expire() == 1 and pins.num_blocks == 0 and all(blk.ref_count == 1 for blk in b + c)
    with pytest.raises(ValueError):
        ConversationKVConfig(share=1.5)
    with pytest.raises(ValueError):
        ConversationKVConfig(ttl_s=float("nan"))


def run(engine: LLMEngine, prompt: list[int], keep: bool = False) -> object:
    seq = engine.add_request_group(prompt, [GREEDY], keep_kv=keep)[0]
    while not seq.is_finished:
        engine.step()
    return seq


def test_a_pool_full_of_pinned_conversations_still_runs_a_request(tiny_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir("llama")), dtype="float32", num_kv_blocks=30, conversation_kv_share=1.0))
    conversations = random_prompts(3, 120, 120, seed=1)
    for prompt in conversations:
        run(engine, prompt, keep=True)
    assert engine.kv.pins.num_blocks >= 21 and engine.stats()["kv_conversation_pinned_blocks"] == engine.kv.pins.num_blocks
    follow_up = run(engine, conversations[-1] + [7, 8, 9])  # a follow-up finds its conversation pinned
    assert follow_up.num_cached_tokens >= 112
    big = random_prompts(1, 420, 420, seed=2)[0]  # 27 blocks of 30: only if pins give way
    got = run(engine, big)
    alone = LLMEngine(EngineConfig(model=str(tiny_dir("llama")), dtype="float32", num_kv_blocks=30))
    assert got.finish_reason == "length" and got.output_token_ids == run(alone, big).output_token_ids
    assert engine.kv.pins.num_released_early >= 2 and engine.scheduler.num_preemptions == 0


def chain(url: str, turns: int, between: list[str]) -> list[dict]:
    """A Responses chain of `turns` turns with the `between` prompts sent as other traffic before each follow-up."""
    usages, previous = [], None
    for turn in range(turns):
        body = {"input": f"Turn {turn}: name a colour and a fruit.", "instructions": "You are terse.", "max_output_tokens": 12,
                "temperature": 0, "previous_response_id": previous}  # fmt: skip
        got = httpx.post(url + "/v1/responses", json=body, timeout=120)
        assert got.status_code == 200, got.text
        usages.append(got.json()["usage"])
        previous = got.json()["id"]
        for text in between:
            assert httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=120).status_code == 200
    return usages


@pytest.fixture(scope="module")
def traffic() -> list[str]:
    with open("/usr/share/common-licenses/GPL-3") as f:
        words = f.read().split()
    return [" ".join(words[i * 150 : (i + 1) * 150]) for i in range(20)]


@pytest.mark.parametrize("share", ["0.5", "0"])
def test_follow_ups_find_their_whole_conversation_after_other_traffic(traffic, share):
    proc, url = launch_server(["--port", "0", "--num-kv-blocks", "64", "--prefix-cache", "radix", "--conversation-kv-share", share])
    try:
        usages = chain(url, 5, traffic[:8])
    finally:
        stop_server(proc)
    for before, after in zip(usages, usages[1:]):
        conversation = before["input_tokens"] + before["output_tokens"] - 1  # the last token drawn was never computed
        if share == "0":  # 8 requests of ~200 tokens through a 1,024-token pool: nothing of it survives
            assert after["input_tokens_details"]["cached_tokens"] < before["input_tokens"] // 2
        else:
            assert after["input_tokens_details"]["cached_tokens"] >= conversation


def test_auto_truncation_keeps_the_cache_over_a_long_conversation(traffic):
    """A 30-turn conversation through a 512-token context: every turn answers; with truncation auto
    (cuts at fixed points, kept until the next is needed) most prompt tokens of turns 10-30 come from
    the cache, where a client dropping its oldest turn each time one does not fit misses almost all."""
    proc, url = launch_server(["--port", "0", "--max-model-len", "512", "--prefix-cache", "radix", "--num-kv-blocks", "256"])
    asks = ([" ".join(text.split()[:22]) + "?" for text in traffic] * 2)[:30]
    try:
        auto, previous = [], None
        for ask in asks:
            got = httpx.post(url + "/v1/responses", json={"input": ask, "instructions": "Answer briefly.", "max_output_tokens": 12,
                                                          "temperature": 0, "truncation": "auto", "previous_response_id": previous},
                             timeout=120)  # fmt: skip
            assert got.status_code == 200, got.text
            assert got.json()["output_text"] and got.json()["usage"]["input_tokens"] + 12 <= 512
            auto.append(got.json()["usage"])
            previous = got.json()["id"]
        assert sum("truncation" in u for u in auto) >= 15  # the conversation outgrew the context
        one_by_one, history = [], []
        for ask in asks:
            history.append({"role": "user", "content": ask})
            while True:  # the drop-one-turn policy: the oldest exchange goes until the conversation fits
                messages = [{"role": "system", "content": "Answer briefly."}, *history]
                count = httpx.post(url + "/tokenize", json={"messages": messages}).json()["count"]
                if count + 12 <= 512:
                    break
                history = history[2:]
            got = httpx.post(url + "/v1/responses", json={"input": history, "instructions": "Answer briefly.", "max_output_tokens": 12,
                                                          "temperature": 0, "store": False}, timeout=120)  # fmt: skip
            assert got.status_code == 200, got.text
            one_by_one.append(got.json()["usage"])
            history.append({"role": "assistant", "content": got.json()["output_text"]})
    finally:
        stop_server(proc)

    def reused(usages: list[dict]) -> float:
        return sum(u["input_tokens_details"]["cached_tokens"] for u in usages[9:]) / sum(u["input_tokens"] for u in usages[9:])

    print(f"prompt tokens of turns 10-30 from the cache: auto {reused(auto):.3f}, drop-one-turn {reused(one_by_one):.3f}")
    assert reused(auto) >= 0.7, reused(auto)
    assert reused(one_by_one) < 0.4, reused(one_by_one)
