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


SEEDED = [
    SamplingParams(max_tokens=24, temperature=1.0, seed=42, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=9, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.2, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, seed=11,
                   ignore_eos=True, logprobs=2),
]


@pytest.fixture(scope="module")
def seeded_alone(llm):
    prompts = random_prompts(len(SEEDED), 8, 40, seed=21)
    return prompts, [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, SEEDED)]


def test_seeded_requests_sample_the_same_batched_with_31_others(llm, seeded_alone):
    prompts, alone = seeded_alone
    others = random_prompts(31, 5, 60, seed=1)
    noise = [SamplingParams(max_tokens=30, temperature=1.0), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=25, temperature=0.9, top_k=5, repetition_penalty=1.3)]  # fmt: skip
    outs = llm.generate([*prompts, *others], [*SEEDED, *(noise[i % 3] for i in range(31))], use_tqdm=False)
    assert [o.token_ids for o in outs[: len(SEEDED)]] == alone
    assert len({tuple(t) for t in alone}) == len(alone)
    different = llm.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=1.0, seed=43, ignore_eos=True), use_tqdm=False)
    assert different[0].token_ids != alone[0]


def test_seeded_requests_sample_the_same_after_preemption(tiny_dir, seeded_alone):
    prompts, alone = seeded_alone
    small = LLM(str(tiny_dir("llama")), dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96, seed=5)
    others = random_prompts(12, 30, 60, seed=2)
    outs = small.generate([*prompts, *others], [*SEEDED, *[SamplingParams(max_tokens=30, temperature=1.0)] * 12], use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs[: len(SEEDED)]] == alone


def test_seeded_requests_sample_the_same_with_the_native_kernels_off(tiny_dir, seeded_alone):
    prompts, alone = seeded_alone
    torch_only = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02, seed=5, attention_backend="torch_sdpa")
    assert not torch_only.engine.runner.sampler.native
    outs = torch_only.generate(prompts, SEEDED, use_tqdm=False)
    assert [o.token_ids for o in outs] == alone


def test_unseeded_requests_follow_the_engine_seed(tiny_dir):
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    runs = []
    for seed in (5, 5, 6):
        engine = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02, seed=seed)
        runs.append([o.token_ids for o in engine.generate(random_prompts(3, 8, 20, seed=4), params, use_tqdm=False)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len({tuple(t) for t in runs[0]}) == 3  # each request draws its own stream


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


def test_sampled_logprobs_are_log_softmax_of_the_raw_logits(llm):
    import torch

    engine = llm.engine
    seq = engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, repetition_penalty=1.5, logprobs=5))
    captured = {}
    compute = engine.model.compute_logits

    def spy(hidden):
        logits = compute(hidden)
        captured["raw"] = logits.clone()
        return logits

    engine.model.compute_logits = spy
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.model.compute_logits
    lp = seq.logprobs[0]
    expected = torch.log_softmax(captured["raw"][0].double(), dim=0)
    assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=1e-5)
    values, ids = torch.topk(expected, 5)
    assert sorted(lp.top) == sorted(ids.tolist())
    for token, value in zip(ids.tolist(), values.tolist()):
        assert lp.top[token] == pytest.approx(value, abs=1e-5)


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
