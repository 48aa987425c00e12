"""An exception inside one engine step fails exactly that step's requests; the engine goes on."""

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine


@pytest.fixture
def llm(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.01, max_num_seqs=2, max_model_len=128)
    yield llm
    llm.engine.step_fault_hook = None


def test_a_failing_step_fails_only_its_requests(llm):
    engine: LLMEngine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16]}
    expected = {rid: llm.generate([p], params, use_tqdm=False)[0].token_ids for rid, p in prompts.items()}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params, request_id=rid)
    for _ in range(3):  # a and b run (max_num_seqs=2); c waits
        assert engine.step() == []
    failing: list[set[str]] = []

    def hook(batch):
        failing.append({seq.request_id for seq, _ in batch.entries})
        raise RuntimeError("injected")

    engine.step_fault_hook = hook
    outputs = engine.step()
    engine.step_fault_hook = None
    assert failing == [{"a", "b"}]
    assert {o.request_id for o in outputs} == {"a", "b"}
    assert all(o.finished and o.finish_reason == "error" and o.error == "RuntimeError: injected" for o in outputs)
    assert set(engine.requests) == {"c"}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert list(finished) == ["c"] and finished["c"].token_ids == expected["c"]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    again = llm.generate([prompts["a"]], params, use_tqdm=False)[0]
    assert again.token_ids == expected["a"]


def test_offline_generate_reports_a_failed_step(llm):
    calls = []

    def hook(batch):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("second step")

    llm.engine.step_fault_hook = hook
    outs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert outs[0].finish_reason == "error" and "second step" in outs[0].error and len(outs[0].token_ids) == 1
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_a_request_an_empty_pool_never_admits_fails_instead_of_spinning(llm):
    """The backstop behind --max-model-len's sizing: should admission refuse a request even with the
    whole pool free (a sizing bug, as int4's chunks once were), that request fails with a reason and
    the requests behind it run; the engine does not step forever."""
    engine: LLMEngine = llm.engine
    admit = engine.kv.can_admit
    engine.kv.can_admit = lambda request_id, num_tokens, chunk, hit=None, reserve=0: num_tokens < 40 and admit(request_id, num_tokens, chunk, hit, reserve)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request(list(range(5, 55)), params, request_id="big")
    engine.add_request([5, 6, 7], params, request_id="small")
    outputs = {}
    for _ in range(50):
        for out in engine.step():
            outputs[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert outputs["big"].finish_reason == "error" and "cannot hold" in outputs["big"].error
    assert outputs["small"].finish_reason == "length" and not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
