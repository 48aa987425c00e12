"""KV cache groups: sliding-window layers hold only their window's blocks, and nothing changes a token.

Tiny Gemma 3 checkpoints with windows of 4 and 8 tokens (4 sliding and 2 full layers: KV groups
of two layers) run 100+ token prompts against transformers, with chunked prefill, batching and
preemption; a randomized run checks the block accounting after every step.
"""

import math
import random

import pytest
import torch

from conftest import random_prompts
from tiny_models import hf_model
from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma3-w4", "gemma3-w8"])
def windowed(request, tiny_dir):
    path = tiny_dir(request.param)
    hf = hf_model(path)
    prompts = random_prompts(16, 100, 140, seed=5)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    return path, prompts, expected


def _check_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert all(g["num_used_blocks"] == 0 for g in stats["kv_cache_groups"])


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
def test_windowed_gemma_matches_transformers_alone_batched_and_chunked(windowed, backend):
    path, prompts, expected = windowed
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, attention_backend=backend)
    groups = llm.stats()["kv_cache_groups"]
    assert [g["attention"] for g in groups].count("full") == 1 and len(groups) == 3 and all(len(g["layers"]) == 2 for g in groups)
    assert [o.token_ids for o in llm.generate(prompts[:2], GREEDY, use_tqdm=False)] == expected[:2]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected  # 16 mixed lengths at once
    chunked = LLM(str(path), dtype="float32", kv_cache_memory=0.02, attention_backend=backend, max_num_batched_tokens=7)
    assert [o.token_ids for o in chunked.generate(prompts[:4], GREEDY, use_tqdm=False)] == expected[:4]
    _check_free(llm)
    _check_free(chunked)


@pytest.mark.parametrize("family", ["gemma3-w4", "gemma3-w8"])
def test_windowed_gemma_survives_preemption(tiny_dir, family):
    path = tiny_dir(family)
    prompts = random_prompts(6, 100, 110, seed=8)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    with torch.no_grad():
        hf = hf_model(path)
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=120, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    # 40 blocks: three prompts get in, their outputs outgrow the pool, and the newest is preempted
    probe = LLM(str(path), dtype="float32", kv_cache_memory=0.001)
    memory = 40 * probe.engine.kv_spec.bytes_per_block / 1024**3
    llm = LLM(str(path), dtype="float32", kv_cache_memory=memory, max_model_len=240, max_num_batched_tokens=32)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == expected
    _check_free(llm)


def test_sliding_groups_hold_their_window_in_a_randomized_run(tiny_dir):
    """Random lengths, arrivals and aborts on a small pool; after every step: each sequence's sliding
    group holds at most ceil(W / block_size) + 1 blocks, every group's used blocks add up with the
    free ones to the pool, no block is referenced by a sequence that does not hold it."""
    window, block_size = 8, 4
    llm = LLM(str(tiny_dir("gemma3-w8")), dtype="float32", block_size=block_size, num_kv_blocks=120, max_num_batched_tokens=16,
              max_model_len=160, seed=3)  # fmt: skip
    engine, kv = llm.engine, llm.engine.kv
    rng = random.Random(11)
    limit = math.ceil(window / block_size) + 1
    live: list[str] = []
    preempted = 0
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 24:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 100))]
            params = SamplingParams(max_tokens=rng.randrange(1, 50), temperature=rng.choice([0, 1.0]), ignore_eos=True)
            live.append(engine.add_request(prompt, params).request_id)
        if live and rng.random() < 0.05:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        held: list[set[int]] = [set() for _ in kv.groups]
        references = 0
        for rid in engine.requests:
            for g, group in enumerate(kv.groups):
                table = [b for b in kv.block_table(rid, g) if b is not None]
                held[g].update(table)
                references += len(table)
                if group.window is not None:
                    assert len(table) <= limit, f"step {step}: {rid} holds {len(table)} blocks of a window-{window} group"
        assert [len(h) for h in held] == kv.num_used_blocks
        assert sum(map(len, held)) + kv.num_free_blocks == kv.num_blocks
        assert all(b.ref_count >= 0 for b in kv.pool.blocks)
        assert sum(b.ref_count for b in kv.pool.blocks) == references
    preempted = engine.scheduler.num_preemptions
    while engine.has_unfinished_requests():
        engine.step()
    assert preempted > 0, "the pool should have been small enough to preempt"
    _check_free(llm)


def test_a_whole_block_round_trips_bit_for_bit(tiny_dir):
    llm = LLM(str(tiny_dir("gemma3-w4")), dtype="float32", kv_cache_memory=0.01)
    pool = llm.engine.pool
    g = torch.Generator().manual_seed(0)
    data = torch.randn(pool.read_block(3).shape, generator=g)
    pool.write_block(3, data)
    assert torch.equal(pool.read_block(3), data)
    assert pool.read_block(3).shape == (2, 2, pool.block_size, 2, 32)  # layers of the group, K/V, tokens, heads, dim
    before = pool.read_block(4).clone()
    pool.write_block(3, torch.zeros_like(data))
    assert torch.equal(pool.read_block(4), before)  # only its own block
    layer = pool.layers[0]
    assert torch.equal(pool.read_block(3)[0, 0], layer.key[3 * pool.block_size : 4 * pool.block_size])


def test_hybrid_holds_the_window_where_full_allocation_holds_everything(tiny_dir):
    path = str(tiny_dir("gemma3-w8"))
    prompt = random_prompts(1, 150, 150, seed=1)[0]
    used = {}
    for hybrid in (True, False):
        llm = LLM(path, dtype="float32", kv_cache_memory=0.01, block_size=4, disable_hybrid_kv_cache_manager=not hybrid)
        engine = llm.engine
        seq = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        while not seq.is_finished and seq.num_output_tokens < 10:
            engine.step()
        used[hybrid] = engine.kv.num_blocks - engine.kv.num_free_blocks, engine.kv_spec.bytes_per_block, seq.num_computed_tokens
        while engine.has_unfinished_requests():
            engine.step()
    (hybrid_blocks, hybrid_bytes, n), (full_blocks, full_bytes, _) = used[True], used[False]
    assert full_blocks == math.ceil(n / 4) and full_bytes == 3 * hybrid_bytes  # one group of all six layers
    window_blocks = math.ceil(n / 4) - (n - 8 + 1) // 4  # blocks holding positions n - 7 .. n - 1
    assert window_blocks <= math.ceil(8 / 4) + 1
    assert hybrid_blocks == math.ceil(n / 4) + 2 * window_blocks  # the full group, and two sliding groups


def _repeat_hits(path: str, memory_gib: float, hybrid: bool, prompts, others, **settings) -> tuple[list[int], list[int]]:
    """The prompts, other traffic of the same size, the prompts again: their cached tokens, and the tokens they gave."""
    llm = LLM(path, kv_cache_memory=memory_gib, disable_hybrid_kv_cache_manager=not hybrid, **settings)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    for p in others:
        llm.generate([p], params, use_tqdm=False)
    again = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in again] == first
    return [o.num_cached_tokens for o in again]


@pytest.mark.parametrize("memory_gib", [0.0069, 0.0045])
def test_window_groups_keep_the_prefix_caches_hits(tiny_dir, memory_gib):
    """Window groups hold a sliding layer's window only, yet the same prompts after as much other
    traffic find as much cached as with every layer holding every block (the same bytes): the
    blocks a window leaves behind go first, the window before the prompt's last block stays."""
    path = str(tiny_dir("gemma3-w4"))
    prompts, others = random_prompts(6, 150, 200, seed=1), random_prompts(6, 150, 200, seed=2)
    grouped = _repeat_hits(path, memory_gib, True, prompts, others, dtype="float32")
    every_layer = _repeat_hits(path, memory_gib, False, prompts, others, dtype="float32")
    whole = [(len(p) - 1) // 16 * 16 for p in prompts]
    assert grouped == whole  # fits: the groups' blocks of 12 prompts take less than every layer's
    assert all(g >= e for g, e in zip(grouped, every_layer))


def test_window_groups_keep_gemma3s_hits():
    """Gemma 3 270M (windows of 512 of its 18 layers but 3): 4 prompts of 700 tokens, 4 others,
    the 4 again, in a pool of 12 such prompts' K/V with every layer holding every block."""
    from kvserve.model.registry import resolve_model_path

    words = open("/usr/share/common-licenses/GPL-3").read().split()
    llm = LLM("gemma-3-270m", kv_cache_memory=0.01)
    token_ids = llm.tokenizer.encode(" ".join(words[:5000]))
    del llm
    prompts = [token_ids[i * 700 : (i + 1) * 700] for i in range(4)]
    others = [token_ids[(4 + i) * 700 : (5 + i) * 700] for i in range(4)]
    memory = 0.17 * 8 / 12  # GiB: 8 prompts of 700 tokens of every layer's K/V is 0.17 GiB
    grouped = _repeat_hits(str(resolve_model_path("gemma-3-270m")), memory, True, prompts, others)
    every_layer = _repeat_hits(str(resolve_model_path("gemma-3-270m")), memory, False, prompts, others)
    assert grouped == [688] * 4 and all(g >= e for g, e in zip(grouped, every_layer))
