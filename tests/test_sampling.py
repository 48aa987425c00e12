"""Sampling controls, stop conditions and logprobs on a tiny model."""

import math

import pytest

from conftest import random_prompts
from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02, seed=5)


PROMPT = random_prompts(1, 12, 12, seed=11)[0]


def gen(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0]


def test_seed_makes_sampling_reproducible_regardless_of_batch(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids
    others = random_prompts(5, 5, 20, seed=1)
    batched = llm.generate([PROMPT, *others], [params] + [SamplingParams(max_tokens=30, temperature=1.0)] * 5, use_tqdm=False)
    assert batched[0].token_ids == alone
    different = gen(llm, max_tokens=24, temperature=1.0, seed=43, ignore_eos=True).token_ids
    assert different != alone


def test_top_k_one_and_tiny_top_p_equal_greedy(llm):
    greedy = gen(llm, max_tokens=16, temperature=0, ignore_eos=True).token_ids
    assert gen(llm, max_tokens=16, temperature=1.5, top_k=1, seed=1, ignore_eos=True).token_ids == greedy
    assert gen(llm, max_tokens=16, temperature=1.5, top_p=1e-6, seed=1, ignore_eos=True).token_ids == greedy
    assert gen(llm, max_tokens=16, temperature=1.5, min_p=1.0, seed=1, ignore_eos=True).token_ids == greedy


def test_penalties_change_the_greedy_path(llm):
    greedy = gen(llm, max_tokens=32, temperature=0, ignore_eos=True).token_ids
    assert gen(llm, max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=3.0).token_ids != greedy
    penalized = gen(llm, max_tokens=32, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0).token_ids
    assert penalized != greedy
    assert len(set(penalized)) >= len(set(greedy))


def test_stop_token_ids_and_max_tokens(llm):
    greedy = gen(llm, max_tokens=20, temperature=0, ignore_eos=True)
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 20
    stop_id = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_id)
    out = gen(llm, max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == greedy.token_ids[: first + 1]


def test_stop_string_truncates_text(llm):
    full = gen(llm, max_tokens=30, temperature=0, ignore_eos=True)
    stop = full.text[10:14]
    assert stop.strip(), "pick a visible stop string"
    out = gen(llm, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    kept = gen(llm, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_logprobs_are_normalized_and_include_the_sampled_token(llm):
    out = gen(llm, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token
        assert len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy picks the top token
        assert sum(math.exp(v) for v in lp.top.values()) <= 1.0 + 1e-5


def test_eos_stops_unless_ignored(llm):
    assert llm.engine.tokenizer.eos_token_id in llm.engine.eos_token_ids
    greedy = gen(llm, max_tokens=20, temperature=0, ignore_eos=True).token_ids
    pretend_eos = greedy[4]
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = frozenset({pretend_eos})
    try:
        stopped = gen(llm, max_tokens=20, temperature=0)
        ignored = gen(llm, max_tokens=20, temperature=0, ignore_eos=True)
    finally:
        llm.engine.eos_token_ids = saved
    assert stopped.token_ids == greedy[: greedy.index(pretend_eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"
