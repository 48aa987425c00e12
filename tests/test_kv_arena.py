"""kv/arena.py: a KIVI cache's quantized and full-precision blocks carved from the same bytes."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kv.arena import BlockArena
from kvserve.kv.block_pool import NoFreeBlocksError
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.spec import KVCacheSpec
from conftest import random_prompts


def spans(arena: BlockArena) -> dict[int, list[str]]:
    """Which live blocks (held, or free but cached) lie on each unit."""
    k, on = arena.residual_units, {}
    for unit in arena.units:
        if unit.ref_count or unit.block_hash is not None:
            on.setdefault(unit.block_id, []).append(f"q{unit.block_id}")
    for c, block in enumerate(arena.residuals):
        if (block.ref_count and arena._residual_mode[c]) or block.block_hash is not None:
            for u in range(c * k, (c + 1) * k):
                on.setdefault(u, []).append(f"r{c}")
    return on


def check(arena: BlockArena, settled: bool = True) -> None:
    """settled: no quantization is half done, so every held full-precision block still owns its bytes."""
    k = arena.residual_units
    if settled:
        assert all(arena._residual_mode[c] for c, r in enumerate(arena.residuals) if r.ref_count), "a held block was quantized over"
    for unit, live in spans(arena).items():
        assert len(live) == 1, f"unit {unit} holds {live}"
    held_units = {u.block_id for u in arena.units if u.ref_count}
    held_chunks = {c for c, r in enumerate(arena.residuals) if r.ref_count and arena._residual_mode[c]}
    assert arena.units_held == len(held_units) + k * len(held_chunks)
    assert arena.quantized.num_free_blocks == arena.num_units - arena.units_held
    whole = [c for c in range(arena.num_chunks) if c not in held_chunks and not any(u in held_units for u in range(c * k, (c + 1) * k))]
    assert sorted(arena._whole) == whole and arena.residual.num_free_blocks == len(whole)
    loose = {u.block_id for u in arena.units if not u.ref_count and arena.chunk_of(u.block_id) not in arena._whole
             and arena.chunk_of(u.block_id) not in held_chunks}  # fmt: skip
    assert set(arena._loose) == loose


@pytest.mark.parametrize(("units", "k"), [(24, 4), (27, 8), (13, 3)])
def test_random_use_never_lets_two_blocks_share_bytes(units, k):
    """Quantized and full-precision blocks allocated, revived, quantized and freed at random (a prefix
    cache publishing some): no two live blocks ever lie on the same unit, a cached block is forgotten
    (on_evict) before its bytes are reused, and the free counts are what the blocks say."""
    arena = BlockArena(units, k)
    rng = random.Random(units * k)
    evicted: list[int] = []
    arena.quantized.on_evict = arena.residual.on_evict = lambda block: evicted.append(block.block_id)
    held: list = []  # one entry per reference
    in_place = 0
    for step in range(3000):
        op = rng.random()
        try:
            if op < 0.15:
                held += arena.quantized.allocate(rng.randint(1, 2), group=rng.randint(0, 1))
            elif op < 0.45:
                held += arena.residual.allocate(rng.randint(1, 3), group=0)
            elif op < 0.5 and held:
                full = [b for b in held if b.block_id >= units]
                block = rng.choice(full if full and rng.random() < 0.8 else held)  # a fork: one more holder
                (arena.residual if block.block_id >= units else arena.quantized).touch(block)
                held.append(block)
            elif op < 0.65:
                # a request quantizes some of its full-precision blocks (distinct ones), then releases them
                live = list({id(b): b for b in held if b.block_id >= units and arena._residual_mode[b.block_id - units]}.values())
                chosen = rng.sample(live, min(len(live), rng.randint(1, 2 * k + 1)))
                forked = [b for b in live if b.ref_count > 1 and b not in chosen]
                if forked and rng.random() < 0.7:  # forks' blocks are the ones to get wrong
                    chosen.insert(0, forked[0])
                targets = arena.quantize_targets([(b, 0) for b in chosen])
                check(arena, settled=False)  # retired blocks are still held here, their bytes their chunk's units
                for block, target in zip(chosen, targets):
                    assert target is not None or block.ref_count > 1
                    if target is not None:
                        in_place += arena.chunk_of(target.block_id) in {b.block_id - units for b in chosen}
                        held.remove(block)
                        arena.residual.free([block])
                        held.append(target)
            elif op < 0.72:
                cached = [b for b in arena.units + arena.residuals if b.ref_count == 0 and b.block_hash is not None]
                if cached:
                    block = rng.choice(cached)
                    side = arena.residual if block.block_id >= units else arena.quantized
                    side.touch(block)
                    held.append(block)
            elif held:
                block = held.pop(rng.randrange(len(held)))
                if rng.random() < 0.5 and block.ref_count == 1 and (block.block_id < units or arena._residual_mode[block.block_id - units]):
                    block.block_hash = step  # published: stays cached while free
                side = arena.residual if block.block_id >= units else arena.quantized
                side.free([block])
        except NoFreeBlocksError:
            pass
        check(arena)
    assert evicted and in_place, "the test never filled the pool or never quantized over a block"
    for block in list(held):
        (arena.residual if block.block_id >= units else arena.quantized).free([block])
    check(arena)
    assert arena.quantized.num_free_blocks == units and arena.residual.num_free_blocks == units // k


def test_a_roomy_pool_keeps_its_cached_blocks_and_a_tight_one_evicts_them_before_breaking_a_chunk():
    """A decode's blocks quantized one at a time take clean units (the tail's, else their own chunk's),
    never one a cached block lies on while chunks are free: six requests' published blocks all stay
    cached in a pool of 40 chunks. With a quarter of the chunks whole or fewer, a new quantized block
    takes the least recently freed cached unit before it breaks a whole chunk."""
    arena = BlockArena(40 * 4 + 2, 4)  # 40 chunks and a tail of 2 units
    evicted: list[int] = []
    arena.quantized.on_evict = arena.residual.on_evict = lambda block: evicted.append(block.block_id)
    published = []
    for request in range(6):
        for n, block in enumerate(arena.residual.allocate(3)):
            (target,) = arena.quantize_targets([(block, 0)])
            arena.residual.free([block])
            target.block_hash = request * 10 + n
            published.append(target)
            arena.quantized.free([target])
            check(arena)
    assert not evicted and all(b.block_hash is not None for b in published)

    arena = BlockArena(8 * 4, 4)
    arena.quantized.on_evict = arena.residual.on_evict = lambda block: evicted.append(block.block_id)
    arena.residual.allocate(6)  # two chunks whole: not roomy
    units = arena.quantized.allocate(4)  # nothing loose or cached: a whole chunk is opened, its other units taken next
    assert {arena.chunk_of(u.block_id) for u in units} == {arena.chunk_of(units[0].block_id)} and len(arena._whole) == 1
    for i, unit in enumerate(units[:2]):
        unit.block_hash = 100 + i
        arena.quantized.free([unit])
    (taken,) = arena.quantized.allocate(1)
    assert taken is units[0] and evicted == [units[0].block_id] and len(arena._whole) == 1
    check(arena)


@pytest.mark.parametrize("k", [2, 4, 7])
def test_random_batches_of_private_and_shared_blocks_quantize_without_overwriting_a_held_one(k):
    """A batch of full-precision blocks, some also held by a fork, quantized with some quantized
    blocks and loose units about: every block gets a target or (shared, nothing free) waits, no
    target lies on a block still held after the batch is released, and the counts stay right."""
    rng = random.Random(k)
    for trial in range(300):
        arena = BlockArena(rng.randint(k, 12 * k), k)
        blocks = arena.residual.allocate(rng.randint(1, arena.num_chunks))
        others = arena.quantized.allocate(rng.randint(0, arena.quantized.num_free_blocks))
        arena.quantized.free(rng.sample(others, len(others) // 2))  # loose units, some
        forked = rng.sample(blocks, rng.randint(0, len(blocks)))
        for block in forked:
            arena.residual.touch(block)
        batch = rng.sample(blocks, rng.randint(1, len(blocks)))
        targets = arena.quantize_targets([(b, 0) for b in batch])
        check(arena, settled=False)
        for block, target in zip(batch, targets):
            assert target is not None or block in forked
            if target is not None:
                arena.residual.free([block])
        check(arena)
        assert len({t.block_id for t in targets if t is not None}) == sum(t is not None for t in targets)


def test_quantizing_needs_no_free_memory_and_fills_used_chunks_first():
    arena = BlockArena(8, 4)
    a, b = arena.residual.allocate(2)
    assert arena.quantized.num_free_blocks == 0 and arena.residual.num_free_blocks == 0
    # nothing free: block a is quantized into the first unit of its own chunk, which keeps 3 units loose
    (target,) = arena.quantize_targets([(a, 0)])
    assert target.block_id == 0 and arena.quantized.num_free_blocks == 3
    arena.residual.free([a])
    assert arena.quantized.num_free_blocks == 3 and arena.residual.num_free_blocks == 0
    # then b goes into a loose unit of that chunk, and its own chunk is whole again
    (target_b,) = arena.quantize_targets([(b, 0)])
    assert target_b.block_id in (1, 2, 3)
    arena.residual.free([b])
    assert arena.residual.num_free_blocks == 1 and arena.quantized.num_free_blocks == 6
    # quantized blocks fill the used chunk before a whole one is broken
    more = arena.quantized.allocate(2)
    assert {x.block_id for x in more} < {1, 2, 3} and arena.residual.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        arena.residual.allocate(2)


def test_a_run_of_blocks_is_packed_into_the_first_chunk_and_a_shared_block_is_never_overwritten():
    arena = BlockArena(40, 4)
    blocks = arena.residual.allocate(10)  # chunks 0..9, as a prefill's blocks are
    shared = blocks[9]
    arena.residual.touch(shared)  # a fork holds it too
    targets = arena.quantize_targets([(b, 0) for b in blocks])
    # the 9 blocks only this request holds: 8 fill chunks 0 and 1 in order, the 9th its own chunk
    assert [t.block_id for t in targets[:8]] == list(range(8))
    assert targets[8].block_id == 32
    assert targets[9] is not None and arena.chunk_of(targets[9].block_id) != 9  # never over the shared block
    arena.residual.free(blocks)
    assert shared.ref_count == 1 and arena._residual_mode[9]
    assert arena.residual.num_free_blocks == 10 - 2 - 1 - 1 - (arena.chunk_of(targets[9].block_id) != 8)
    # nothing free at all: a shared block waits, a private one is quantized over
    arena.residual.touch(shared)  # two holders again
    rest = arena.residual.allocate(arena.residual.num_free_blocks)
    arena.quantized.allocate(arena.quantized.num_free_blocks)
    assert arena.quantized.num_free_blocks == 0
    assert arena.quantize_targets([(shared, 0)]) == [None]
    assert arena.quantize_targets([(rest[0], 0)])[0] is not None


def test_a_cached_block_is_offered_to_the_cache_before_its_chunk_is_reused():
    arena = BlockArena(8, 4)
    gone = []
    arena.quantized.on_evict = lambda block: gone.append(("quantized", block.block_id))
    arena.residual.on_evict = lambda block: gone.append(("residual", block.block_id))
    (q,) = arena.quantized.allocate(1)
    q.block_hash = 1
    arena.quantized.free([q])
    (sink,) = arena.residual.allocate(1)  # the other chunk: a whole one, least recently freed first
    assert arena.chunk_of(q.block_id) != sink.block_id - 8 and not gone
    sink.block_hash = 2
    arena.residual.free([sink])
    arena.quantized.touch(q)  # a hit revives the cached quantized block
    assert q.ref_count == 1 and arena.residual.num_free_blocks == 1
    arena.quantized.free([q])
    arena.residual.allocate(2)  # both chunks: the cached blocks go first
    assert sorted(gone) == [("quantized", q.block_id), ("residual", sink.block_id)]
    assert q.block_hash is None and sink.block_hash is None


@pytest.mark.parametrize(("kv_dtype", "residual_dtype"), [("int4", "float32"), ("int2", "bfloat16"), ("int4", "bfloat16")])
def test_full_precision_blocks_lie_over_their_chunk_and_quantize_in_place_exactly(kv_dtype, residual_dtype):
    """A full-precision block's bytes are its chunk's quantized blocks' bytes (no other unit is
    touched), and quantizing it into its own chunk's first unit writes the records quantizing it
    into a separate unit does."""
    spec = KVCacheSpec(2, 2, 64, kv_dtype, 32, residual_dtype=residual_dtype)
    k = spec.residual_units
    assert k == -(-spec.residual_block_bytes // spec.bytes_per_block)
    pool = PagedKVPool(spec, 3 * k + 1, torch.device("cpu"))
    assert pool.num_residual_blocks == 3 and pool.first_residual == 3 * k + 1
    assert pool.nbytes == (3 * k + 1) * spec.bytes_per_block
    g = torch.Generator().manual_seed(1)
    before = pool.records.clone()
    keys, values = torch.randn(32, 2, 64, generator=g), torch.randn(32, 2, 64, generator=g)
    block = pool.first_residual + 1
    for layer in pool.layers:
        layer.store(torch.arange(block * 32, block * 32 + 32), keys, values)
    changed = (pool.records != before).any(dim=-1).any(dim=0).any(dim=0).nonzero().flatten().tolist()
    assert changed and set(changed) <= set(range(k, 2 * k))
    stored = pool.layers[0].gather(torch.tensor([[block]]))[0][0]
    torch.testing.assert_close(stored, keys.to(spec.torch_dtype).float(), rtol=0, atol=0)
    pool.quantize([(block, 0)])  # into another chunk's unit
    apart = pool.records[:, :, 0].clone()
    pool.quantize([(block, k)])  # in place: the first unit of its own chunk
    assert torch.equal(pool.records[:, :, k], apart)


def test_int4_under_pressure_gives_the_tokens_of_a_large_pool(tiny_dir):
    """Sequences whose full-precision blocks compete with other sequences' quantized ones for a small
    pool (admissions wait, blocks are quantized into loose units and into their own chunks, the
    newest sequence is preempted when a step finds no whole chunk) give the tokens and logprobs of
    the same requests with room to spare, bit for bit: a preempted one too, whose recomputed rows
    read quantized what its decode steps read quantized (attention/kivi_reads.py)."""
    path = str(tiny_dir("qwen3"))
    kw = dict(dtype="float32", kv_cache_dtype="int4", kv_quant_residual=32, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompts = random_prompts(10, 20, 90, seed=21)
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True, logprobs=1)
    expected = LLM(path, num_kv_blocks=4000, **kw).generate(prompts, params, use_tqdm=False)
    tight = LLM(path, num_kv_blocks=72, max_model_len=200, **kw)
    engine = tight.engine
    arena = engine.kv.arena
    running, in_place, preempted = [], [0], set()
    quantize_targets, step = arena.quantize_targets, engine.step

    def counted_targets(residuals):
        targets = quantize_targets(residuals)
        chunks = {block.block_id - arena.num_units for block, _ in residuals}
        in_place[0] += sum(t is not None and arena.chunk_of(t.block_id) in chunks for t in targets)
        return targets

    def counted_step():
        outputs = step()
        running.append(len(engine.scheduler.running))
        preempted.update(seq.request_id for seq in engine.scheduler.running + list(engine.scheduler.waiting) if seq.num_preemptions)
        return outputs

    arena.quantize_targets, engine.step = counted_targets, counted_step
    got = tight.generate(prompts, params, use_tqdm=False)
    assert max(running) < len(prompts) and in_place[0] > 0
    assert [a.token_ids for a in got] == [b.token_ids for b in expected]
    assert 0 < len(preempted) < len(got)
    assert [a.logprobs for a in got] == [b.logprobs for b in expected]
    assert tight.stats()["num_free_blocks"] == tight.stats()["num_blocks"]


def test_the_snapshot_shows_a_full_precision_block_over_its_units():
    """GET /v1/kv/snapshot's grid of the pool: units under a held full-precision block are held
    (their bytes are its), under a free cached one cached; the counts match the pool's free count."""
    from kvserve.server.kv_snapshot import STATES, block_states

    arena = BlockArena(10, 4)
    held, cached = arena.residual.allocate(2)
    cached.block_hash = 7
    arena.residual.free([cached])
    (unit,) = arena.quantized.allocate(1)
    states = [STATES[s] for s in block_states(arena.quantized)]
    c, d = held.block_id - 10, cached.block_id - 10
    assert states[c * 4 : c * 4 + 4] == ["owned"] * 4 and states[d * 4 : d * 4 + 4] == ["cached"] * 4
    assert states[unit.block_id] == "owned" and unit.block_id >= 8  # the tail, not a whole chunk
    assert states.count("free") + states.count("cached") == arena.quantized.num_free_blocks
    # the residual pool's grid: a chunk its quantized blocks hold is not free for a full-precision block
    arena.quantized.allocate(1)  # the tail's last loose unit
    (q,) = arena.quantize_targets([(held, 0)])  # over its own bytes: its chunk now holds a quantized block
    arena.residual.free([held])
    chunks = [STATES[s] for s in block_states(arena.residual)]
    assert chunks[c] == "owned" and chunks[d] == "cached" and q.block_id == c * 4
    assert chunks.count("free") + chunks.count("cached") == arena.residual.num_free_blocks


def test_samples_sharing_a_prompt_quantize_their_shared_blocks_apart(tiny_dir):
    """n > 1 samples share the prompt's last full-precision blocks; each quantizes them into a block
    of its own, never over the shared bytes: three greedy samples give the tokens of one, in a
    roomy pool and in a small one (80 blocks, without a preemption)."""
    path = str(tiny_dir("qwen3"))
    kw = dict(dtype="float32", kv_cache_dtype="int4", kv_quant_residual=32, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompt = random_prompts(1, 150, 150, seed=8)[0]
    one = LLM(path, num_kv_blocks=4000, **kw).generate([prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                                                       use_tqdm=False)[0].token_ids  # fmt: skip
    for blocks in (4000, 80):
        llm = LLM(path, num_kv_blocks=blocks, max_model_len=220, **kw)
        arena, shared = llm.engine.kv.arena, []
        quantize_targets = arena.quantize_targets

        def counted(residuals):
            shared.extend(block.block_id for block, _ in residuals if block.ref_count > 1)
            return quantize_targets(residuals)

        arena.quantize_targets = counted
        out = llm.generate([prompt], SamplingParams(n=3, max_tokens=60, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.token_ids for o in out] == [one] * 3, blocks
        assert shared and llm.stats()["num_preemptions"] == 0
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


@pytest.mark.parametrize(("kv_dtype", "dtype"), [("int4", "bfloat16"), ("int4", "float32"), ("int2", "bfloat16")])
def test_every_request_a_small_pool_accepts_runs(tiny_dir, kv_dtype, dtype):
    """A pool of a few chunks: --max-model-len counts whole chunks for a sequence's full-precision
    blocks (a prompt just under it used to be accepted and never admitted, the engine spinning), and
    a preempted fork comes back. Every request within max_model_len finishes, alone and as n=2."""
    path = str(tiny_dir("qwen3"))
    for blocks in (8, 10, 16, 25, 40, 70):
        try:
            llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_dtype, num_kv_blocks=blocks, enable_prefix_caching=False)
        except ValueError as e:  # too small for a sequence of two tokens: said at start, naming the flag to raise
            assert "cannot hold a sequence of two tokens; raise num_kv_blocks" in str(e)
            continue
        engine = llm.engine
        longest = engine.max_model_len
        for prompt_len, n in ((longest - 4, 1), (max(1, longest // 2 - 4), 2), (5, 2)):
            engine.add_request(random_prompts(1, prompt_len, prompt_len, seed=blocks)[0],
                               SamplingParams(n=n, max_tokens=longest - prompt_len, temperature=0, ignore_eos=True))  # fmt: skip
        for _ in range(5000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert not engine.has_unfinished_requests(), (blocks, longest)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


@pytest.mark.parametrize(("kv_dtype", "dtype"), [("int4", "bfloat16"), ("int4", "float32"), ("int2", "bfloat16")])
def test_a_prompt_that_fits_cold_is_admitted_with_its_cached_prefix(tiny_dir, kv_dtype, dtype):
    """A prompt just under max_model_len runs again from its cached blocks: the hit's full-precision
    sink block is counted once (it was counted twice, and an idle pool refused the request)."""
    path = str(tiny_dir("qwen3"))
    for blocks in (40, 48, 64, 84):
        llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_dtype, num_kv_blocks=blocks, max_num_seqs=4)
        longest = llm.engine.max_model_len
        for prompt_len in (longest - 2, longest - 8):
            prompt = random_prompts(1, prompt_len, prompt_len, seed=prompt_len)[0]
            params = SamplingParams(max_tokens=1, temperature=0)
            cold, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
            assert (cold.finish_reason, again.finish_reason) == ("length", "length"), (blocks, prompt_len)
            assert again.num_cached_tokens > 0, (blocks, prompt_len)  # taken, not recomputed (the scheduler's fallback)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_an_idle_pool_that_refuses_a_hit_computes_the_prefix_again(tiny_dir, monkeypatch):
    """The scheduler's backstop: where admission with the cached prefix fails and nothing runs that
    could free memory, the request is admitted as if nothing were cached, never failed."""
    llm = LLM(str(tiny_dir("llama")), dtype="float32", num_kv_blocks=64)
    prompt = random_prompts(1, 100, 100, seed=9)[0]
    params = SamplingParams(max_tokens=6, temperature=0)
    cold = llm.generate([prompt], params, use_tqdm=False)[0]
    kv = llm.engine.kv
    admit = kv.can_admit
    monkeypatch.setattr(kv, "can_admit", lambda rid, n, chunk, hit=None, reserve=0: admit(rid, n, chunk, hit, reserve) and not (hit is not None and hit.num_tokens))
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.finish_reason == "length" and again.num_cached_tokens == 0 and again.token_ids == cold.token_ids
