"""Continuous batching, chunked prefill and preemption must not change a single token."""

import pytest

from conftest import random_prompts
from kvserve import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def alone(tiny_dir, family):
    """Each prompt run by itself: the reference for every batched configuration."""
    llm = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.02)
    prompts = random_prompts(18, 5, 60, seed=3)
    return prompts, [llm.generate([p], PARAMS, use_tqdm=False)[0].token_ids for p in prompts]


def test_batched_equals_alone(tiny_dir, family, alone):
    prompts, expected = alone
    llm = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.02, max_num_seqs=32)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_preemptions"] == 0


def test_preemption_keeps_outputs(tiny_dir, family, alone):
    prompts, expected = alone
    # the bytes of 128 tokens in every layer: one 100-token sequence fits, 18 of them cannot run together
    probe = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.001, block_size=8)
    memory = 128 * probe.stats()["bytes_per_token"] / 1024**3
    llm = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=memory, block_size=8, max_model_len=128)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == expected
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_chunked_prefill_budget_of_seven(tiny_dir, family, alone):
    prompts, expected = alone
    llm = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=7)
    outs = llm.generate(prompts[:6], PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected[:6]
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


@pytest.mark.parametrize("target", [0, 40])
def test_a_step_takes_no_more_prompts_once_one_completes_past_prefill_step_tokens(tiny_dir, family, alone, target):
    prompts, expected = alone
    llm = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.02, max_num_seqs=32, max_num_batched_tokens=256,
              prefill_step_tokens=target)  # fmt: skip
    engine = llm.engine
    ids = [engine.add_request(p, PARAMS).request_id for p in prompts]
    ends = [sum(map(len, prompts[: k + 1])) for k in range(len(prompts))]  # where each prompt ends in the first step
    whole = sum(n <= 256 for n in ends)  # the prompts the budget completes
    reached = next(k + 1 for k, n in enumerate(ends) if n >= 40)  # up to the first to end at or past 40 tokens
    assert 1 < reached < whole  # the prompts are such that the target stops the step early, after more than one prompt
    first_step = reached if target else whole
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        step = engine.step()
        if steps == 0:
            assert sorted(s.request_id for s in engine.scheduler.running if s.num_output_tokens) == sorted(ids[:first_step])
        steps += 1
        outputs.update((o.request_id, o.token_ids) for o in step if o.finished)
    assert [outputs[i] for i in ids] == expected
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
