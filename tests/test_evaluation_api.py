"""What evaluation harnesses ask of the server: echo with prompt logprobs, max_tokens 0, vLLM's
prompt_logprobs, and vLLM's /tokenize, /detokenize and /tokenizer_info, against a real server."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from server_process import launch_server, stop_server
from test_server import CHAT_TEMPLATE

PROMPTS = random_prompts(3, 20, 60, seed=21)


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    proc, url = launch_server(["--model", str(model_dir), "--dtype", "float32", "--port", "0", "--kv-cache-memory", "0.02",
                               "--chat-template", CHAT_TEMPLATE, "--served-model-name", "tiny"])  # fmt: skip
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=0.02)


def complete(url: str, **body) -> dict:
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_echo_scores_every_prompt_token_as_lm_eval_asks(server, reference):
    """lm-eval's local-completions request: prompt ids, max_tokens 1, logprobs 1, echo, temperature 0."""
    body = complete(server, prompt=PROMPTS, max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234)
    expected = reference.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1), use_tqdm=False)
    for choice, prompt, out in zip(sorted(body["choices"], key=lambda c: c["index"]), PROMPTS, expected):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:-1] == pytest.approx([lp.logprob for lp in out.prompt_logprobs[1:]], abs=1e-5)
        assert logprobs["token_logprobs"][-1] == pytest.approx(out.logprobs[0].logprob, abs=1e-5)
        assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
        assert choice["text"] == reference.tokenizer.decode(prompt, skip_special_tokens=False) + out.text
        assert logprobs["text_offset"][0] == 0
    assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))


def test_teacher_forced_echo_is_greedy(server, reference):
    """Generate greedily, then echo prompt + generation with max_tokens 0: every generated token's
    logprob is what generation reported and is its position's best (lm-eval's is_greedy)."""
    prompt = PROMPTS[0]
    greedy = dict(max_tokens=10, temperature=0, ignore_eos=True)
    generated = complete(server, prompt=prompt, logprobs=2, **greedy)["choices"][0]["logprobs"]["token_logprobs"]
    ids = reference.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].token_ids  # the server's tokens (test_server)
    scored = complete(server, prompt=prompt + ids, max_tokens=0, echo=True, logprobs=2)
    choice = scored["choices"][0]
    assert scored["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + len(ids)
    tail = choice["logprobs"]["token_logprobs"][len(prompt) :]
    tops = choice["logprobs"]["top_logprobs"][len(prompt) :]
    assert tail == pytest.approx(generated, abs=1e-5)
    assert all(value == max(top.values()) for value, top in zip(tail, tops))
    assert not all(value == max(top.values()) for value, top in zip(choice["logprobs"]["token_logprobs"][1:len(prompt)],
                                                                    choice["logprobs"]["top_logprobs"][1:len(prompt)]))  # fmt: skip


def test_echo_streams_the_prompt_first_and_counts_no_output_for_max_tokens_zero(server):
    prompt = "The licenses for most software"
    full = complete(server, prompt=prompt, max_tokens=6, temperature=0, echo=True)["choices"][0]["text"]
    assert full.startswith(prompt)
    with httpx.stream("POST", server + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True,
                                                               "stream": True, "logprobs": 1}, timeout=60) as resp:  # fmt: skip
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(e["choices"][0]["text"] for e in events) == full
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    only = complete(server, prompt=prompt, max_tokens=0, echo=True)
    assert only["choices"][0]["text"] == prompt and only["usage"]["completion_tokens"] == 0
    with httpx.stream("POST", server + "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "stream": True,
                                                               "stream_options": {"include_usage": True}}, timeout=60) as resp:  # fmt: skip
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == prompt
    assert events[-1]["usage"]["completion_tokens"] == 0


def test_vllm_prompt_logprobs_in_completions_and_chat(server, reference):
    prompt = PROMPTS[1]
    choice = complete(server, prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=3, n=2)["choices"]
    expected = reference.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
    for c in choice:
        scores = c["prompt_logprobs"]
        assert scores[0] is None and len(scores) == len(prompt)
        for token, entry, lp in zip(prompt[1:], scores[1:], expected.prompt_logprobs[1:]):
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(lp.logprob, abs=1e-5) and mine["rank"] == lp.rank
            ranked = sorted((v for k, v in entry.items() if v["rank"] <= 3), key=lambda v: v["rank"])
            assert [v["rank"] for v in ranked][:3] == [1, 2, 3] or lp.rank <= 3
    chat = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2,
                                                            "prompt_logprobs": 0}, timeout=60).json()  # fmt: skip
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # the prompt's own token, no alternatives


def test_tokenizer_endpoints_in_vllms_shapes(server, reference):
    tokenizer = reference.tokenizer
    text = "Copying and distribution of this file"
    body = httpx.post(server + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert len(body["token_strs"]) == body["count"]
    messages = [{"role": "user", "content": "Hello there"}]
    chat = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    rendered = httpx.post(server + "/tokenize", json={"messages": messages}).json()
    assert rendered["count"] == chat["usage"]["prompt_tokens"]
    without = httpx.post(server + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < rendered["count"]
    back = httpx.post(server + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(body["tokens"], skip_special_tokens=False)
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["chat_template"] == CHAT_TEMPLATE and info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    eos = httpx.post(server + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tokenizer.eos_token_id]  # lm-eval's remote tokenizer finds the EOS id this way


def test_every_fork_carries_the_prompt_scores(server):
    """n > 1 scores the prompt once; every choice echoes it with its logprobs, max_tokens 0 included."""
    for max_tokens in (0, 3):
        body = complete(server, prompt="The KV cache of a transformer", max_tokens=max_tokens, echo=True, logprobs=1, n=3,
                        temperature=0.7, prompt_logprobs=1)  # fmt: skip
        first = body["choices"][0]
        count = len(first["prompt_logprobs"])
        for choice in body["choices"]:
            assert choice["logprobs"]["token_logprobs"][:count] == first["logprobs"]["token_logprobs"][:count], max_tokens
            assert choice["prompt_logprobs"] == first["prompt_logprobs"] and None not in choice["logprobs"]["token_logprobs"][1:]
            if max_tokens == 0:
                assert len(choice["logprobs"]["tokens"]) == count


def test_text_offset_counts_characters_of_the_text(server):
    """A character split across byte tokens counts once: every offset indexes the choice's text."""
    prompt = "h\u00e9llo \U0001f916 w\u00f6rld \u65e5\u672c"
    for stream in (False, True):
        resp = httpx.post(server + "/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3,
                                                            "temperature": 0, "stream": stream}, timeout=60)  # fmt: skip
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")] if stream else [resp.json()]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
        assert text.startswith(prompt) and offsets == sorted(offsets) and offsets[-1] <= len(text), (stream, offsets, len(text))
    assert complete(server, prompt="hi", max_tokens=1, echo=None)["choices"][0]["logprobs"] is None  # null means the default (no echo)
