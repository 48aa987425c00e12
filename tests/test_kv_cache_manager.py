"""Block pool, block tables and the scheduler, without a model."""

import pytest

from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.sequence import Sequence
from kvserve.kv.block_pool import BlockPool, NoFreeBlocksError
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.spec import KVCacheSpec
from kvserve.sampling_params import SamplingParams


def manager(num_blocks: int, block_size: int, windows: tuple = (), layers: int = 1) -> KVCacheManager:
    spec = KVCacheSpec(len(windows) or layers, 1, 8, "float32", block_size, tuple(windows))
    return KVCacheManager(spec, num_blocks, max_blocks_per_seq=256)


def test_pool_ref_counts_and_lru_order():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.num_free_blocks == 2 and a.ref_count == 1
    pool.touch(a)
    pool.free([a])
    assert a.ref_count == 1 and pool.num_free_blocks == 2
    pool.free([b, a])  # b freed first: it is reused after the blocks that were never taken
    assert pool.num_free_blocks == 4
    assert [blk.block_id for blk in pool.allocate(4)] == [2, 3, b.block_id, a.block_id]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_parked_blocks_go_after_the_lru_queue_and_rejoin_it_when_refreshed():
    """A running request's parked blocks (a sliding window's before its prompt's end) are evicted
    after every other free block; refreshed when it is done, they take their place in the LRU order."""
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        block.block_hash = 100 + i  # published
    evicted = []
    pool.on_evict = evicted.append
    a, b, c, d, e = blocks
    pool.free([a, b])
    pool.park(a)
    pool.park(b)
    pool.free([c, d])
    assert pool.num_free_blocks == 4
    assert pool.allocate(2) == [c, d] and evicted == [c, d]  # the LRU queue first, parked ones kept
    pool.free([e])
    pool.refresh(a)  # its request finished: a joins the LRU queue's tail, b stays parked
    assert pool.allocate(3) == [e, a, b]
    b.block_hash = 200
    pool.free([b])
    pool.park(b)
    pool.touch(b)  # a parked block revives like any free one
    assert b.ref_count == 1 and pool.num_free_blocks == 0


def test_touch_revives_a_free_block():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    pool.touch(a)
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        pool.free([a, a])


def test_manager_grows_tables_on_demand_and_frees():
    kv = manager(num_blocks=5, block_size=4)
    assert kv.allocate_slots("r", 0, 5)  # 2 blocks
    assert len(kv.block_table("r")) == 2
    assert kv.allocate_slots("r", 5, 8)  # still 2
    assert len(kv.block_table("r")) == 2
    assert kv.allocate_slots("r", 8, 9)
    table = kv.block_table("r")
    assert kv.block_id_rows(["r"], 3)[0].tolist() == [table]
    assert not kv.allocate_slots("s", 0, 13)  # needs 4, 2 free: nothing taken
    assert kv.num_free_blocks == 2
    kv.free("r")
    assert kv.num_free_blocks == 5


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams(max_tokens=8))


def test_scheduler_chunks_prefill_within_budget():
    kv = manager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7, max_model_len=64), kv)
    sched.add(_seq("a", 10))
    sched.add(_seq("b", 3))
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.entries] == [("a", 7)]
    for s, n in batch.entries:
        s.num_computed_tokens += n
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.entries] == [("a", 3), ("b", 3)]


def _run(batch) -> list[tuple[str, int]]:
    """The batch's (request, tokens), then its tokens computed and a token sampled for every completed prompt."""
    for s, n in batch.entries:
        s.num_computed_tokens += n
        if s.num_computed_tokens == len(s.token_ids):
            s.token_ids.append(1)
    return [(s.request_id, n) for s, n in batch.entries]


@pytest.mark.parametrize("target", [0, 8])
def test_a_step_takes_no_more_prompts_once_one_completes_at_prefill_step_tokens(target):
    kv = manager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=64, prefill_step_tokens=target), kv)
    p, x, q, r = _seq("p", 20), _seq("x", 20), _seq("q", 2), _seq("r", 3)
    p.max_chunk, x.max_chunk = 12, 5  # prompts computed over several steps
    for seq in (p, x, q):
        sched.add(seq)
    assert _run(sched.schedule()) == [("p", 12), ("x", 5), ("q", 2)]  # 19 prompt tokens when q completes
    sched.add(r)
    if target:  # p completes at 8: x's next chunk and r wait for the next step, q's decode does not
        assert _run(sched.schedule()) == [("p", 8), ("q", 1)]
        assert _run(sched.schedule()) == [("p", 1), ("x", 5), ("q", 1), ("r", 3)]
    else:
        assert _run(sched.schedule()) == [("p", 8), ("x", 5), ("q", 1), ("r", 3)]


def test_scheduler_preempts_newest_when_blocks_run_out():
    kv = manager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16), kv)
    a, b = _seq("a", 8), _seq("b", 8)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert len(batch.entries) == 2 and kv.num_free_blocks == 0
    for s, n in batch.entries:
        s.num_computed_tokens += n
        s.token_ids.append(1)  # sampled token: each now needs a third block
    batch = sched.schedule()
    assert batch.preempted == [b] and sched.num_preemptions == 1
    assert [s.request_id for s, _ in batch.entries] == ["a"]
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0
    sched.finish(a)
    assert kv.num_free_blocks == 4


def test_scheduler_respects_max_num_seqs():
    kv = manager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64), kv)
    for i in range(3):
        sched.add(_seq(str(i), 4))
    assert len(sched.schedule().entries) == 2
    assert len(sched.waiting) == 1
