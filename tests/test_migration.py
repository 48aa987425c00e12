"""Live migration at the engine level (engine/migration.py): a request exported after some tokens
and imported by another engine produces the tokens, logprobs and text it would have produced,
greedy and seeded, with its KV in the state or through the remote tier; bad states are refused."""

from __future__ import annotations

import json

import pytest

from conftest import random_prompts
from redis_server import RedisServer
from kvserve import LLM, SamplingParams
from kvserve.engine.migration import RequestState
from kvserve.structured.spec import StructuredOutputs

GREEDY = SamplingParams(max_tokens=40, temperature=0, logprobs=2)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=7, logprobs=2, stop=("zz",))
PENALIZED = SamplingParams(max_tokens=40, temperature=0.8, seed=3, repetition_penalty=1.3, frequency_penalty=0.5)
# the target's grammar matcher replays the output so far: the rest still follows the schema
STRUCTURED = SamplingParams(max_tokens=200, temperature=0.9, seed=5, structured_outputs=StructuredOutputs(
    json={"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 8, "maxItems": 8}))


def trace(output) -> tuple:
    return tuple(output.token_ids), output.text, tuple((lp.token_id, lp.logprob) for lp in output.logprobs or ())


def run_until(llm: LLM, request_id: str, tokens: int) -> None:
    seq = llm.engine.requests[request_id]
    while seq.num_output_tokens < tokens:
        llm.engine.step()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED, STRUCTURED], ids=["greedy", "seeded", "penalties", "structured"])
def test_a_request_migrated_midway_gives_the_tokens_of_an_unmigrated_run(tiny_dir, family, params):
    path = str(tiny_dir(family))
    prompt = random_prompts(1, 70, 70, seed=30)[0]
    reference = LLM(path, dtype="float32", num_kv_blocks=64)
    want = trace(reference.generate([prompt], params, use_tqdm=False)[0])
    source = LLM(path, dtype="float32", num_kv_blocks=64)
    other = source.engine.add_request(random_prompts(1, 50, 50, seed=31)[0], params)  # company in the batch
    seq = source.engine.add_request(prompt, params)
    run_until(source, seq.request_id, 20)
    state = RequestState.from_bytes(source.export_request(seq.request_id).to_bytes())
    assert len(state.output_token_ids) >= 20 and state.records
    assert seq.request_id not in source.engine.requests and other.request_id in source.engine.requests
    target = LLM(path, dtype="float32", num_kv_blocks=64)
    out = target.import_request(state)
    assert trace(out) == want
    if params.structured_outputs is not None:
        assert len(json.loads(out.text)) == 8 and out.finish_reason == "stop"
    assert target.stats()["kv_migrations_total"]["in"] == 1 and source.stats()["kv_migrations_total"]["out"] == 1
    assert target.stats()["kv_migrations_total"]["hit_tokens"] >= 80  # the records were used, not recomputed


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
def test_an_int4_request_migrated_resumes_as_it_would_from_its_own_prefix_cache(tiny_dir, kv_dtype):
    """KIVI blocks travel as stored (quantized ones, the full-precision sink block, and the residual
    window's full-precision forms, kv/kivi_hits.py), so the target resumes exactly as the source does
    when the request comes back to it (its published blocks a prefix hit there, the rest recomputed)."""
    path = str(tiny_dir("qwen3"))
    prompt = random_prompts(1, 150, 150, seed=35)[0]
    settings = dict(dtype="float32", num_kv_blocks=400, kv_cache_dtype=kv_dtype, kv_quant_residual=32)
    params = SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, seed=7, logprobs=2)

    def exported(llm: LLM, with_records: bool) -> RequestState:
        seq = llm.engine.add_request(prompt, params)
        run_until(llm, seq.request_id, 30)
        return RequestState.from_bytes(llm.export_request(seq.request_id, with_records=with_records).to_bytes())

    home = LLM(path, **settings)
    want = trace(home.import_request(exported(home, with_records=False)))
    state = exported(LLM(path, **settings), with_records=True)
    assert len(state.records) >= 4
    target = LLM(path, **settings)
    assert trace(target.import_request(state)) == want
    assert target.stats()["kv_migrations_total"]["hit_tokens"] >= 4 * 32


def test_a_request_migrated_through_the_remote_tier(tiny_dir):
    path = str(tiny_dir("llama"))
    prompt = random_prompts(1, 90, 90, seed=32)[0]
    want = trace(LLM(path, dtype="float32", num_kv_blocks=64).generate([prompt], SEEDED, use_tqdm=False)[0])
    with RedisServer() as redis_server:
        source = LLM(path, dtype="float32", num_kv_blocks=64, kv_remote_url=redis_server.url)
        seq = source.engine.add_request(prompt, SEEDED)
        run_until(source, seq.request_id, 20)
        state = source.export_request(seq.request_id, with_records=False)
        assert not state.records
        target = LLM(path, dtype="float32", num_kv_blocks=64, kv_remote_url=redis_server.url)
        target.engine.kv.offloader.prefill_rate = 1.0  # loads win over recomputing (a tiny model recomputes fast)
        assert trace(target.import_request(state)) == want
        assert target.stats()["kv_tiers"]["remote"]["hit_tokens"] >= 96


def test_a_request_exported_and_imported_again_resumes_at_the_source(tiny_dir):
    path = str(tiny_dir("llama"))
    prompt = random_prompts(1, 60, 60, seed=33)[0]
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    want = trace(llm.generate([prompt], GREEDY, use_tqdm=False)[0])
    seq = llm.engine.add_request(prompt, GREEDY)
    run_until(llm, seq.request_id, 10)
    state = llm.export_request(seq.request_id, with_records=False)
    assert trace(llm.import_request(state)) == want  # a failed migration's path: the blocks are still cached


def test_bad_states_are_refused(tiny_dir):
    path = str(tiny_dir("llama"))
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    seq = llm.engine.add_request(random_prompts(1, 40, 40, seed=34)[0], GREEDY)
    run_until(llm, seq.request_id, 5)
    state = llm.export_request(seq.request_id)
    data = state.to_bytes()
    for broken in (b"", data[:3], data[:10], b"\x05\x00\x00\x00nojso", data[: len(data) - 5]):
        with pytest.raises(ValueError, match="migration state"):
            RequestState.from_bytes(broken)
    other = LLM(path, dtype="float32", num_kv_blocks=64, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="another model"):
        other.import_request(state)
    import dataclasses

    for change, message in ((dict(output_token_ids=[10**6]), "output token"), (dict(logprobs=[]), "logprobs"),
                            (dict(output_token_ids=list(range(40))), "no tokens left")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            llm.import_request(dataclasses.replace(state, **change))
    damaged = dataclasses.replace(state, records=[r[:-1] + bytes([r[-1] ^ 1]) for r in state.records])
    out = llm.import_request(damaged)  # records that fail their checksum are recomputed
    assert llm.stats()["kv_migrations_total"]["records_rejected"] == len(state.records)
    assert len(out.token_ids) == GREEDY.max_tokens
    with pytest.raises(KeyError):
        llm.export_request("no-such-request")
