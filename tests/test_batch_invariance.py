"""In float32 a prompt's greedy tokens and logprobs are the same bits alone and in a batch: every
linear layer and the lm_head run float_matmul, whose result for a row ignores the other rows."""

import pytest

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from kvserve import kernels

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def trace(output) -> list:
    """Token ids with their logprobs and top-2 logprobs, compared exactly."""
    return [(token, lp.logprob, sorted(lp.top.items())) for token, lp in zip(output.token_ids, output.logprobs)]


@pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="needs the native kernels")
def test_a_prompt_gives_the_same_bits_alone_and_batched_with_twenty_others(tiny_dir):
    # separate engines: a prefix cached by the batch would turn the prompt alone into a decode-style
    # step over cached blocks, which is the attention's business, not the products'
    prompts = random_prompts(21, 5, 40, seed=7)
    batch_llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02, max_num_seqs=32)
    batched = [trace(o) for o in batch_llm.generate(prompts, PARAMS, use_tqdm=False)]
    alone_llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02, max_num_seqs=32)
    for i, prompt in enumerate(prompts):
        assert trace(alone_llm.generate([prompt], PARAMS, use_tqdm=False)[0]) == batched[i], f"prompt {i}"
