"""Prompt logprobs (SamplingParams.prompt_logprobs; the API's echo and prompt_logprobs): taken from the
prefill the engine runs anyway, equal to transformers' float32 log-softmax, to the logprobs the engine
reports when it generates the same tokens, and the same alone, batched, chunked, preempted, forked
(n > 1) and after the prompt's prefix was cached (a scoring request reads no cached rows)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from tiny_models import hf_model

PROMPT = random_prompts(1, 70, 70, seed=7)[0]  # several blocks of 16, ending mid-block
OTHERS = random_prompts(12, 5, 60, seed=8)


def scores(output) -> list[tuple | None]:
    """(token, logprob, rank, top) per prompt position, compared exactly."""
    return [None if lp is None else (lp.token_id, lp.logprob, lp.rank, tuple(sorted(lp.top.items()))) for lp in output.prompt_logprobs]


def engine(tiny_dir, family: str = "llama", **overrides) -> LLM:
    return LLM(str(tiny_dir(family)), **(dict(dtype="float32", kv_cache_memory=0.02) | overrides))


SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prompt_logprobs_match_transformers(tiny_dir, family):
    out = engine(tiny_dir, family, max_num_batched_tokens=32).generate([PROMPT], SCORE, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(tiny_dir(family))(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    for position in range(1, len(PROMPT)):
        lp, row = out.prompt_logprobs[position], reference[position - 1]
        assert lp.token_id == PROMPT[position]
        assert lp.logprob == pytest.approx(row[PROMPT[position]].item(), abs=1e-4)
        assert lp.rank == int((row > row[PROMPT[position]]).sum()) + 1 or abs(lp.logprob - row.max().item()) < 1e-4
        top_values, top_ids = row.topk(4)
        assert sorted(lp.top.values(), reverse=True) == pytest.approx(top_values.tolist(), abs=1e-4)
        assert set(lp.top) == set(top_ids.tolist())


def test_echoed_generation_scores_as_it_was_generated(tiny_dir):
    """Teacher forcing: generate greedily, then score prompt + generation: each generated token's
    logprob is what the sampler reported, it ranks first, and it equals its row's best (lm-eval's is_greedy)."""
    llm = engine(tiny_dir)
    generated = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=4), use_tqdm=False)[0]
    scored = llm.generate([PROMPT + generated.token_ids], SCORE, use_tqdm=False)[0]
    for j, lp in enumerate(generated.logprobs):
        echo = scored.prompt_logprobs[len(PROMPT) + j]
        assert echo.token_id == lp.token_id
        assert echo.logprob == pytest.approx(lp.logprob, abs=1e-5)  # the sampler sums its log-sum-exp in another order
        assert echo.rank == 1 and max(echo.top.values()) == echo.logprob
        assert echo.top == pytest.approx({t: v for t, v in lp.top.items()}, abs=1e-5)


def test_prompt_logprobs_alone_batched_chunked_forked(tiny_dir):
    alone = scores(engine(tiny_dir).generate([PROMPT], SCORE, use_tqdm=False)[0])
    batch = [PROMPT] + OTHERS
    outs = engine(tiny_dir).generate(batch, [SCORE] + [SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2)] * len(OTHERS),
                                     use_tqdm=False)  # fmt: skip
    assert scores(outs[0]) == alone
    assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, batch))
    for chunk in (1, 16, 17):
        assert scores(engine(tiny_dir, max_num_batched_tokens=chunk).generate([PROMPT], SCORE, use_tqdm=False)[0]) == alone, chunk
    forked = engine(tiny_dir).generate([PROMPT], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=3, prompt_logprobs=4),
                                       use_tqdm=False)  # fmt: skip
    assert len(forked) == 3 and all(scores(o) == alone for o in forked)


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_a_cached_prefix_is_recomputed_for_its_scores(tiny_dir, cache):
    """A request that wants prompt logprobs reads no cached row (each must be scored), so its scores
    equal an uncached engine's; requests after it still hit the cache."""
    uncached = scores(engine(tiny_dir, enable_prefix_caching=False).generate([PROMPT], SCORE, use_tqdm=False)[0])
    llm = engine(tiny_dir, prefix_cache=cache)
    llm.generate([PROMPT[:-3] + [5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # caches the prefix
    out = llm.generate([PROMPT], SCORE, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert scores(out) == uncached
    again = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 64


def test_preempted_prompt_keeps_its_scores(tiny_dir):
    """Preempted halfway through its prompt, a scoring request recomputes from the start and keeps the
    scores it had: every position once, the same values."""
    alone = scores(engine(tiny_dir, block_size=8).generate([PROMPT], SCORE, use_tqdm=False)[0])
    probe = engine(tiny_dir, kv_cache_memory=0.001, block_size=8)
    memory = 120 * probe.stats()["bytes_per_token"] / 1024**3  # four long runs grow into the blocks the scored prompt holds
    llm = engine(tiny_dir, kv_cache_memory=memory, block_size=8, max_model_len=120, max_num_batched_tokens=16)
    preempted = []
    preempt = llm.engine.scheduler._preempt

    def spy(seq):  # the real preemption, its victims noted
        preempted.append((seq.prompt_len, seq.num_computed_tokens))
        preempt(seq)

    llm.engine.scheduler._preempt = spy
    long_runs = [SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)] * 4
    outs = llm.generate([*OTHERS[:4], PROMPT], [*long_runs, SCORE], use_tqdm=False)
    assert any(length == len(PROMPT) and 0 < done < length for length, done in preempted), preempted
    assert scores(outs[-1]) == alone


def test_prompt_logprobs_are_bounded():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
