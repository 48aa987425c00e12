"""Bad input raises ValueError naming the field or path."""

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir("qwen2")), dtype="float32", kv_cache_memory=0.01, max_model_len=64)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], use_tqdm=False)


def test_prompt_over_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 64], use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["num_running"] == 0


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 100000]], use_tqdm=False)


@pytest.mark.parametrize(
    "field,value",
    [("max_tokens", 0), ("max_tokens", -3), ("top_p", 0.0), ("top_p", 1.5), ("temperature", -0.1), ("top_k", -2), ("min_p", 2.0)],
)
def test_bad_sampling_params(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_model_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        LLM("/no/such/model")


@pytest.mark.parametrize(
    "field,value", [("block_size", 0), ("max_num_seqs", -1), ("kv_cache_memory", 0), ("dtype", "int3"), ("max_model_len", 0)]
)
def test_bad_engine_config(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_max_model_len_beyond_capacity(tiny_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_dir("qwen2")), dtype="float32", num_kv_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len must be at least 2"):
        LLM(str(tiny_dir("qwen2")), dtype="float32", kv_cache_memory=0.01, max_model_len=1)


def test_unknown_engine_argument(tiny_dir):
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLM(str(tiny_dir("qwen2")), max_num_seq=4)


@pytest.mark.parametrize("salt", ["\ud800", 5, b"x", "", "s" * 1025])
def test_bad_cache_salts_are_refused_before_anything_is_queued(llm, salt):
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, cache_salt=salt)
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["num_running"] == 0
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, cache_salt="ok")[0].token_ids) == 2


def test_a_prompt_that_is_not_unicode_is_refused(llm):
    with pytest.raises(ValueError, match="unpaired surrogate"):
        llm.generate("hi \ud800 there", SamplingParams(max_tokens=2), use_tqdm=False)
