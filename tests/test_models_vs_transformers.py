"""Our model code against transformers on the same tiny random checkpoints."""

import pytest
import torch

from conftest import random_prompts
from tiny_models import FAMILIES, hf_model
from kvserve import LLM, SamplingParams
from kvserve.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def engine_last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    engine = llm.engine
    seq: Sequence = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    batch = engine.scheduler.schedule()
    samplers, logits = engine.runner.forward(batch)
    assert samplers == [seq]
    engine.abort_request(seq.request_id)
    return logits[0]


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logits_match_transformers(tiny_dir, family, backend):
    path = tiny_dir(family)
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, attention_backend=backend)
    # 20-token prompts: longer than Gemma's 12-token sliding window
    for prompt in random_prompts(3, 20, 30, seed=7):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt) :].tolist()
            ref_logits = hf(torch.tensor([prompt])).logits[0, -1]
        assert len(set(ref)) >= 8, "degenerate reference: the random model is too flat to test against"
        got = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
        assert got == ref
        ours = engine_last_logits(llm, prompt)
        rel = (ours - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel < 1e-4, f"{family}: last-position logits differ by {rel:.2e} relative"
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_text_prompt_uses_the_checkpoint_tokenizer(tiny_dir):
    path = tiny_dir("llama")
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01)
    out = llm.generate("This License applies to any program", GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("This License applies to any program")
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert out.finish_reason == "length" and len(out.token_ids) == 64


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_backends_agree(tiny_dir, family):
    """bf16 end to end on both attention backends (native fused ops and kernels vs torch ops)."""
    path = tiny_dir(family)
    prompt = random_prompts(1, 20, 20, seed=11)[0]
    logits = {}
    for backend in ("cpu_paged", "torch_sdpa"):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=0.01, attention_backend=backend)
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.token_ids) == 8
        logits[backend] = engine_last_logits(llm, prompt)
    ref = logits["torch_sdpa"]
    rel = (logits["cpu_paged"] - ref).abs().max() / ref.abs().max()
    assert rel < 3e-2, f"{family}: bf16 backends differ by {rel:.2e} relative"


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_greedy_is_the_same_with_and_without_the_int8_screened_lm_head(tiny_dir, family):
    """The screened greedy argmax (where the CPU has AVX512-VNNI/BF16) is exact: the same tokens
    as the full bf16 lm_head product, for a batch mixing decodes and prefills."""
    from kvserve.kernels import sampling

    if not sampling.int8_screen_available():
        pytest.skip("this CPU has no AVX512-VNNI/BF16")
    # no prefix cache: the second run would start from the first one's blocks, and in bf16 a prefill
    # split differently rounds differently
    llm = LLM(str(tiny_dir(family)), dtype="bfloat16", kv_cache_memory=0.02, attention_backend="cpu_paged", enable_prefix_caching=False)
    model = llm.engine.model
    assert model.screened_lm_head is not None
    prompts = random_prompts(12, 5, 40, seed=21)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    screened = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model.screened_lm_head = None
    full = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert screened == full
