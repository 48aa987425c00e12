"""Prefix caching: reused prefixes change no token, salts isolate tenants, nothing leaks under
eviction, and hits are counted honestly."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from kvserve.kv.hashing import CacheIdentity, block_hash, chain_hashes, root_hash

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "gemma3-w8")


def engines(tiny_dir, family: str, mode: str = "hash", **kw) -> tuple[LLM, LLM]:
    path = str(tiny_dir(family))
    on = LLM(path, dtype="float32", kv_cache_memory=0.02, prefix_cache=mode, **kw)
    off = LLM(path, dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False, **kw)
    return on, off


def run_each(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    """One request at a time, so later ones can hit what earlier ones cached."""
    return [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], "a block leaked"
    assert all(b.ref_count == 0 for b in llm.engine.kv.pool.blocks)


def conversation(rng: random.Random, turns: int, llm: LLM) -> list[list[int]]:
    """Each turn's prompt: the previous prompt, the model's answer, and a new user message."""
    history = [1] + [rng.randrange(3, 500) for _ in range(30)]
    prompts = []
    for _ in range(turns):
        prompts.append(list(history))
        answer = llm.generate([history], GREEDY, use_tqdm=False)[0].token_ids
        history = history + answer + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 25))]
    return prompts


@pytest.mark.parametrize("mode", ["hash", "radix"])
@pytest.mark.parametrize("family", FAMILIES)
def test_caching_changes_no_token(tiny_dir, family, mode):
    on, off = engines(tiny_dir, family, mode)
    rng = random.Random(7)
    system = [1] + [rng.randrange(3, 500) for _ in range(70)]
    shared = [system + q for q in random_prompts(5, 3, 30, seed=2)]
    turns = conversation(random.Random(3), 4, off)
    for prompts in (shared, turns):
        assert run_each(on, prompts) == run_each(off, prompts)
    stats = on.stats()
    assert stats["prefix_cache_hits_total"] >= 4 * 64  # the system prompt's whole blocks, four times at least
    assert stats["prefix_cache_requests_hit_total"] >= 7
    assert_all_free(on)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_prompt_trees_match_the_uncached_run(tiny_dir, data):
    """Prompts that branch off a shared trunk at random depths, run in random order."""
    family = data.draw(st.sampled_from(["llama", "gemma3-w8"]))
    mode = data.draw(st.sampled_from(["hash", "radix"]))
    on, off = _tree_engines(tiny_dir, family, mode)
    trunk = data.draw(st.lists(st.integers(3, 499), min_size=1, max_size=60))
    prompts = []
    for _ in range(data.draw(st.integers(2, 6))):
        cut = data.draw(st.integers(0, len(trunk)))
        prompts.append(trunk[:cut] + data.draw(st.lists(st.integers(3, 499), min_size=1, max_size=30)))
    prompts = data.draw(st.permutations(prompts))
    assert run_each(on, prompts) == run_each(off, prompts)
    assert_all_free(on)


_TREE_ENGINES: dict = {}


def _tree_engines(tiny_dir, family: str, mode: str) -> tuple[LLM, LLM]:
    """Reused across examples: the cache keeps whatever earlier examples left in it."""
    if (family, mode) not in _TREE_ENGINES:
        _TREE_ENGINES[family, mode] = engines(tiny_dir, family, mode, block_size=4)
    return _TREE_ENGINES[family, mode]


@pytest.mark.parametrize("exposed", [False, True], ids=["default", "expose-salt-stats"])
def test_salts_never_share_a_block(tiny_dir, exposed):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02, expose_salt_stats=exposed)
    engine = llm.engine
    prompt = random_prompts(1, 80, 80, seed=4)[0]

    def blocks_of(salt):
        seq = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), cache_salt=salt)
        engine.step()
        held = set(engine.kv.block_table(seq.request_id))
        while engine.has_unfinished_requests():
            engine.step()
        return held, seq.num_cached_tokens

    first_a, cached = blocks_of("tenant-a")
    assert cached == 0
    again_a, cached_a = blocks_of("tenant-a")
    b, cached_b = blocks_of("tenant-b")
    plain, cached_plain = blocks_of(None)
    assert cached_a == 64 and len(first_a & again_a) == 4  # the same salt reuses its four whole blocks
    assert cached_b == cached_plain == 0
    assert not (b & first_a) and not (plain & first_a) and not (plain & b)
    misses = llm.stats()["prefix_cache_misses_total"]
    # only an operator who opts in learns that a miss met another salt's blocks: a tenant reading /metrics
    # must not learn whether another tenant's prompts begin like theirs
    assert (misses["other_salt"], misses["no_shared_prefix"]) == ((2, 1) if exposed else (0, 3))
    assert llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt="tenant-b")[0].num_cached_tokens == 64


def test_eviction_pressure_keeps_tokens_and_blocks_right(tiny_dir):
    """A pool far smaller than the prompts' blocks: cached prefixes are evicted and revived all
    the time; outputs stay those of the uncached engine and no block leaks, checked every step."""
    path = str(tiny_dir("gemma3-w8"))
    kw = dict(dtype="float32", block_size=4, num_kv_blocks=100, max_model_len=160, max_num_batched_tokens=32)
    on = LLM(path, **kw, seed=1)
    off = LLM(path, **kw, enable_prefix_caching=False, seed=1)
    rng = random.Random(9)
    trunks = [[1] + [rng.randrange(3, 500) for _ in range(rng.randrange(20, 90))] for _ in range(4)]
    prompts = [rng.choice(trunks)[: rng.randrange(10, 90)] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))] for _ in range(40)]
    params = [SamplingParams(max_tokens=rng.randrange(4, 30), temperature=0, ignore_eos=True) for _ in prompts]
    expected = [o.token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    engine, kv = on.engine, on.engine.kv
    seqs = []
    for prompt, sp in zip(prompts, params):
        seqs.append(engine.add_request(prompt, sp))
        for _ in range(rng.randrange(0, 4)):
            engine.step()
            _check_accounting(engine, kv)
    while engine.has_unfinished_requests():
        engine.step()
        _check_accounting(engine, kv)
    assert [s.output_token_ids for s in seqs] == expected
    stats = on.stats()
    assert stats["prefix_cache_evictions_total"] > 0 and stats["prefix_cache_hits_total"] > 0 and stats["num_preemptions"] > 0
    assert_all_free(on)


def _check_accounting(engine, kv) -> None:
    held: list[set[int]] = [set() for _ in kv.groups]
    refs: dict[int, int] = {}
    for rid in engine.requests:
        for g in range(len(kv.groups)):
            for block_id in kv.block_table(rid, g):
                if block_id is not None:
                    held[g].add(block_id)
                    refs[block_id] = refs.get(block_id, 0) + 1
    assert [len(h) for h in held] == kv.num_used_blocks
    for block in kv.pool.blocks:
        assert block.ref_count == refs.get(block.block_id, 0) >= 0
    in_use = sum(1 for b in kv.pool.blocks if b.ref_count > 0)
    assert in_use + kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("mode,reused", [("radix", 23), ("hash", 16)])
def test_radix_reuses_the_partial_block(tiny_dir, mode, reused):
    on, off = engines(tiny_dir, "llama", mode)
    shared = random_prompts(1, 23, 23, seed=6)[0]
    first, second = shared + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], shared + [20, 21, 22]
    assert run_each(on, [first]) == run_each(off, [first])
    out = on.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == reused
    assert out.token_ids == off.generate([second], GREEDY, use_tqdm=False)[0].token_ids
    assert_all_free(on)


def test_a_request_hit_reuses_at_least_a_block(tiny_dir):
    """Found by QA: radix matched the shared first (BOS) token of unrelated prompts and counted every
    request a hit. One token is reused, and said; a request hit is a block's worth or more."""
    on, _ = engines(tiny_dir, "llama", "radix")
    first, second = random_prompts(2, 40, 40, seed=31)
    on.generate([[2] + first], GREEDY, use_tqdm=False)
    assert on.generate([[2] + second], GREEDY, use_tqdm=False)[0].num_cached_tokens == 1
    stats = on.stats()
    assert stats["prefix_cache_requests_total"] == 2 and stats["prefix_cache_requests_hit_total"] == 0
    block = on.engine.kv.block_size
    assert on.generate([[2] + first[:block] + second], GREEDY, use_tqdm=False)[0].num_cached_tokens == block + 1
    assert on.stats()["prefix_cache_requests_hit_total"] == 1


def test_radix_keeps_a_finished_requests_partial_block(tiny_dir):
    on, off = engines(tiny_dir, "gemma3-w8", "radix")
    prompt = random_prompts(1, 40, 40, seed=12)[0]
    on.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)  # 44 computed
    follow = prompt + [9, 9, 9]
    out = on.generate([follow], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40  # 32 in whole blocks, 8 copied from the partial one
    assert out.token_ids == off.generate([follow], GREEDY, use_tqdm=False)[0].token_ids


def test_a_preempted_requests_own_prefix_is_not_a_hit(tiny_dir):
    path = str(tiny_dir("llama"))
    llm = LLM(path, dtype="float32", block_size=8, num_kv_blocks=24, max_model_len=120)
    prompts = random_prompts(6, 50, 60, seed=13)
    llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_requests_total"] == 6 and stats["prefix_cache_hits_total"] == 0


def test_reset_forgets_every_prefix(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02)
    prompt = random_prompts(1, 50, 50, seed=14)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 48
    assert llm.reset_prefix_cache() > 0
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.stats()["prefix_cache_misses_total"]["no_shared_prefix"] >= 2


def test_miss_reasons(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", block_size=8, num_kv_blocks=12, max_model_len=90)
    short = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert short.num_cached_tokens == 0 and llm.stats()["prefix_cache_misses_total"]["shorter_than_a_block"] == 1
    first = random_prompts(1, 40, 40, seed=15)[0]
    llm.generate([first], GREEDY, use_tqdm=False)
    llm.generate(random_prompts(2, 70, 70, seed=16), GREEDY, use_tqdm=False)  # evicts the first prompt's blocks
    assert llm.generate([first], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.stats()["prefix_cache_misses_total"]["evicted"] >= 1


def test_identity_and_hashes_are_stable():
    identity = CacheIdentity(model="abc", tokenizer="def", dtype="bfloat16", kv_cache_dtype="bfloat16", attention="cpu_paged/block 16")
    other = CacheIdentity(model="abc", tokenizer="def", dtype="bfloat16", kv_cache_dtype="float16", attention="cpu_paged/block 16")
    assert root_hash(identity) != root_hash(other)
    hashes = chain_hashes(root_hash(identity), list(range(40)), 16, "salt")
    assert len(hashes) == 2 and hashes[1] == block_hash(hashes[0], range(16, 32))
    assert chain_hashes(root_hash(identity), list(range(40)), 16, None) != hashes
    code = ("from kvserve.kv.hashing import *; i = CacheIdentity(model='abc', tokenizer='def', dtype='bfloat16', "
            "kv_cache_dtype='bfloat16', attention='cpu_paged/block 16'); print(chain_hashes(root_hash(i), list(range(40)), 16, 'salt'))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == str(hashes)  # the same in another process
    # pinned: a change to the encoding would orphan every block keyed by it elsewhere (tiers, other processes)
    assert hashes[1] == 0x4234A32003D7175D4285DF25E941D9FD


@pytest.mark.parametrize("family", ["llama", "gemma3-w8"])
def test_n_samples_hold_the_prompt_once_and_equal_separate_requests(tiny_dir, family):
    llm = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.02, block_size=8)
    engine = llm.engine
    prompt = random_prompts(1, 45, 45, seed=17)[0]  # 5 whole blocks of 8 and 5 tokens
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=100, ignore_eos=True, n=4)
    seqs = engine.add_request_group(prompt, params.samples())
    while not all(s.num_output_tokens for s in seqs):
        engine.step()
    full = engine.kv.groups[0].window is None
    tables = [engine.kv.block_table(s.request_id, 0) for s in seqs]
    assert len({tuple(t[:5]) for t in tables}) == 1, "the prompt's whole blocks are held once, by all four"
    assert len({t[5] for t in tables}) == 4, "each sample has its own copy of the partly filled block"
    if full:
        assert engine.kv.num_used_blocks[0] == 5 + 4
    computed = engine.prompt_tokens_total
    while engine.has_unfinished_requests():
        engine.step()
    together = [s.output_token_ids for s in seqs]
    separate = LLM(str(tiny_dir(family)), dtype="float32", kv_cache_memory=0.02, block_size=8, enable_prefix_caching=False)
    alone = [separate.generate([prompt], sp, use_tqdm=False)[0].token_ids for sp in params.samples()]
    assert together == alone and len({tuple(t) for t in together}) == 4
    assert computed == len(prompt)  # counted once: the forks computed no prompt token
    assert [o.token_ids for o in llm.generate([prompt], params, use_tqdm=False)] == alone
    assert_all_free(llm)
