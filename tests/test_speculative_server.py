"""`serve --speculative-config`: the same answers as a server without it, through the real openai client,
on SmolLM2 asked to copy a text (so its n-gram guesses are mostly right), streamed and not, n > 1,
logprobs, stop strings and a JSON schema; the spec_decode counters in /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from server_process import launch_server, stop_server

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
TEXT = ("The KV cache keeps the keys and values of every token a model has read, so that each new token "
        "attends to them without computing them again. Its size grows with the batch and the context.")  # fmt: skip
COPY = [{"role": "user", "content": f"Repeat this text exactly, then repeat it again:\n\n{TEXT}"}]
SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture(scope="module")
def servers():
    common = ["--port", "0", "--kv-cache-memory", "0.25", "--max-model-len", "1024"]
    plain = launch_server(common)
    try:
        spec = launch_server([*common, "--speculative-config", SPEC])
    except BaseException:
        stop_server(plain[0])
        raise
    yield {"plain": plain[1], "spec": spec[1]}
    stop_server(spec[0])
    stop_server(plain[0])


def both(servers, **kwargs) -> tuple:
    """The same request to each server: (plain's answer, speculating one's)."""
    answers = []
    for name in ("plain", "spec"):
        client = openai.OpenAI(base_url=servers[name] + "/v1", api_key="none")
        if kwargs.get("stream"):
            chunks = list(client.chat.completions.create(model=MODEL, **kwargs))
            by_choice: dict[int, list] = {}
            for chunk in chunks:
                for choice in chunk.choices:
                    lp = [(t.token, t.logprob) for t in choice.logprobs.content] if choice.logprobs and choice.logprobs.content else []
                    by_choice.setdefault(choice.index, []).append((choice.delta.content or "", lp, choice.finish_reason))
            answers.append({i: ("".join(t for t, _, _ in parts), [x for _, lp, _ in parts for x in lp],
                                [f for _, _, f in parts if f]) for i, parts in by_choice.items()})  # fmt: skip
        else:
            r = client.chat.completions.create(model=MODEL, **kwargs)
            answers.append([(c.message.content, c.finish_reason, [(t.token, t.logprob) for t in c.logprobs.content] if c.logprobs else None)
                            for c in r.choices])  # fmt: skip
    return tuple(answers)


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvserve:spec_decode_num_") and "_per_pos" not in line and not line.startswith("#")}  # fmt: skip


def test_speculating_server_answers_as_the_plain_one(servers):
    before = spec_counters(servers["spec"])
    plain, spec = both(servers, messages=COPY, max_tokens=160, temperature=0)
    assert plain == spec and len(plain[0][0]) > 150
    plain, spec = both(servers, messages=COPY, max_tokens=160, temperature=0, stream=True, logprobs=True, top_logprobs=2)
    assert plain == spec
    plain, spec = both(servers, messages=COPY, max_tokens=120, temperature=0.8, seed=5, n=3, logprobs=True)
    assert plain == spec and len({c for c, _, _ in plain}) > 1
    plain, spec = both(servers, messages=COPY, max_tokens=160, temperature=0, stop=["values of every"])
    assert plain == spec and plain[0][1] == "stop"
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 300}}, "required": ["text"]}
    plain, spec = both(servers, messages=COPY, max_tokens=200, temperature=0,
                       response_format={"type": "json_schema", "json_schema": {"name": "copy", "schema": schema}})  # fmt: skip
    assert plain == spec and "text" in json.loads(plain[0][0])
    after = spec_counters(servers["spec"])
    drafted = after["kvserve:spec_decode_num_draft_tokens_total"] - before["kvserve:spec_decode_num_draft_tokens_total"]
    accepted = after["kvserve:spec_decode_num_accepted_tokens_total"] - before["kvserve:spec_decode_num_accepted_tokens_total"]
    assert drafted > 100 and accepted > 0.5 * drafted, (drafted, accepted)
    assert spec_counters(servers["plain"])["kvserve:spec_decode_num_draft_tokens_total"] == 0


def test_a_bad_speculative_config_stops_the_server_with_its_reason():
    with pytest.raises(RuntimeError, match="num_speculative_tokens must be an integer"):
        launch_server(["--port", "0", "--kv-cache-memory", "0.05", "--speculative-config", '{"num_speculative_tokens": 99}'])
