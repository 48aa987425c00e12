"""Per-request block tables, one per KV cache group, on top of one shared block pool.

A table maps a sequence's block index (position // block_size) to a block. A sliding-window
group frees the blocks that no future query can read, leaving None in their place, so it holds
about window / block_size blocks whatever the sequence's length. Block ids are mirrored in one
numpy array per group, a row per request, from which the runner slices a step's tables.

With a prefix cache, a request's full blocks are published as they are computed (they keep their
hash in the free queue after the request ends), and an admitted request starts from the longest
cached prefix: it takes references to those blocks and computes only the rest.

A request that evicts tokens (kv/eviction.py) holds fewer slots than it has positions in its
full-attention groups: their tables are indexed by slot // block_size, and `num_evicted` is the
difference. Sliding-window groups evict nothing (they free what leaves their window), so their
slots stay positions. Callers speak in positions; the manager converts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from kvserve.kv.arena import BlockArena
from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.hashing import block_hash, chain_hashes
from kvserve.kv.kivi_hits import exact_hit, full_precision_key, read_in_full_precision
from kvserve.kv.prefix import PrefixCache, PrefixHit
from kvserve.kv.conversation_pins import ConversationKVConfig, ConversationPins
from kvserve.kv.prefix_stats import PrefixCacheStats
from kvserve.kv.spec import KVCacheSpec, blocks_for_tokens
from kvserve.kv.tiers.offload import KVOffloader, LoadJob
from kvserve.kv.tiers.record import record_key

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, max_blocks_per_seq: int, prefix_cache: PrefixCache | None = None) -> None:
        self.spec = spec
        self.groups = spec.groups
        self.block_size = spec.block_size
        # KIVI formats: new tokens go to full-precision blocks (ids from num_blocks on), quantized
        # once full and older than the residual window; both kinds share the pool's bytes (kv/arena.py)
        self.arena = BlockArena(num_blocks, spec.residual_units) if spec.residual_units else None
        self.pool = self.arena.quantized if self.arena is not None else BlockPool(num_blocks)
        self.residual_pool = self.arena.residual if self.arena is not None else None
        self._fresh = self.residual_pool or self.pool
        self.pending_quantization: list[tuple[KVBlock, KVBlock]] = []  # (residual block, quantized block)
        self._quantized: dict[str, list[int]] = {}  # per request and group: leading blocks already considered
        self.max_blocks_per_seq = max_blocks_per_seq
        self._tables: dict[str, list[list[KVBlock | None]]] = {}
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._ids = [np.zeros((0, max_blocks_per_seq), dtype=np.int64) for _ in self.groups]
        self.prefix_cache = prefix_cache
        self.offloader: KVOffloader | None = None  # the tiers under the pool (kv/tiers/), set by the engine
        self._recompute_decided: dict[str, int] = {}  # request -> the tier hit's end it chose to recompute
        self._no_more_loads: set[str] = set()  # requests whose load was cut (overdue) or came back short: no second load
        self._tier_served: dict[str, dict[int, str]] = {}  # request -> block index -> the tier its load read it from, until admitted
        if prefix_cache is not None:
            self.pool.on_evict = self._evicting
            if self.residual_pool is not None:  # sink blocks are published from it
                self.residual_pool.on_evict = self._evicting
        self.prefix_stats = PrefixCacheStats(min_hit_tokens=self.block_size, per_salt=prefix_cache is not None and prefix_cache.tracks_salts)
        self._hashes: dict[str, list[int]] = {}  # chained hashes of each request's full blocks
        self._published: dict[str, int] = {}  # leading blocks already offered to the cache
        self._published_full_precision: dict[str, int] = {}  # KIVI: leading blocks whose full-precision form was offered
        self._salts: dict[str, str | None] = {}
        self.pending_copies: list[tuple[KVBlock, KVBlock, int]] = []  # (source, target, slots) before the next step
        self._evicted: dict[str, int] = {}  # positions a request no longer holds a slot for
        self.pins: ConversationPins | None = None  # stored conversations' blocks kept between turns (set by the engine)
        # sliding groups' blocks a request let go while running that a hit at its prompt's end reads: when it
        # finishes they rejoin the LRU order beside its other blocks (a window is as old as the request that used it)
        self._parked: dict[str, list[KVBlock]] = {}  # cached blocks a running request let go, evicted last until it is done
        self._reserved: dict[str, dict[int, list[KVBlock]]] = {}  # per full-attention group, blocks a compaction will write
        self._num_full_groups = sum(group.window is None for group in self.groups)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_used_blocks(self) -> list[int]:
        """Per group, the blocks some request holds (a block shared by several counts once)."""
        return [self.pool.num_used_blocks(g) for g in range(len(self.groups))]

    def _evicting(self, block: KVBlock) -> None:
        """The pool is about to reuse a cached block: its bytes go down to the tiers first (write-back),
        unless it was one to reuse first (a sliding window's block behind the window every cached
        prompt's last tokens read, an unloaded adapter's): few hits could use it, and each copy costs the step loop."""
        if self.offloader is not None and not getattr(self._pool_of(block), "reusing_first", False):
            self.offloader.offload(block.block_id, block.block_hash, block.group, block.token_ids, adapter=block.adapter)
        self.prefix_cache.evicted(block)

    def _pool_of(self, block: KVBlock) -> BlockPool:
        return self.residual_pool if self.residual_pool is not None and block.block_id >= self.pool.num_blocks else self.pool

    def _units(self, block: KVBlock) -> int:
        """The pool's blocks `block` takes: a KIVI cache's full-precision block takes several."""
        return self.spec.residual_units if self._pool_of(block) is self.residual_pool else 1

    def _side_for(self, index: int) -> BlockPool:
        """Where a published block at this index of a sequence goes: a KIVI cache's sink blocks are
        full-precision ones, every other published block a quantized (or plain) one."""
        return self._fresh if index < self.spec.quant_sink_blocks else self.pool

    def _touch(self, block: KVBlock) -> None:
        self._pool_of(block).touch(block)

    def _release(self, blocks: list[KVBlock], evict_first: bool = False, park: bool = False) -> None:
        """Drop one reference from each block, in order, each in its own pool. `evict_first`: those
        now free go to the head of the free queue (cached still, but reused before any other);
        `park`: they are evicted after every other (a running request's, refreshed when it is done)."""
        for pool in (self.pool, self.residual_pool):
            if pool is not None:
                mine = [b for b in blocks if self._pool_of(b) is pool]
                if mine:
                    pool.free(mine)
                    for block in mine if evict_first or park else ():
                        (pool.reuse_first if evict_first else pool.park)(block)

    # ------------------------------------------------------------------ reading
    def block_table(self, request_id: str, group: int = 0) -> list[int | None]:
        """Block ids of one group's table (None where a sliding group freed the block)."""
        tables = self._tables.get(request_id)
        if tables is None:
            return []
        return [b.block_id if b is not None else None for b in tables[group]]

    def num_held_blocks(self, request_id: str, group: int) -> int:
        return sum(b is not None for b in self._tables.get(request_id, [[]] * len(self.groups))[group])

    def num_evicted(self, request_id: str, group: int | None = None) -> int:
        """Positions the request holds no slot for in its full-attention groups (in `group`: 0 for a sliding one)."""
        if group is not None and self.groups[group].window is not None:
            return 0
        return self._evicted.get(request_id, 0)

    def block_id_rows(self, request_ids: list[str], width: int) -> list[np.ndarray]:
        """Per group, the block ids of these requests' tables [len(request_ids), width] (0 where none)."""
        rows = np.fromiter((self._rows[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        return [ids[rows, :width] for ids in self._ids]

    # ------------------------------------------------------------------ needs
    def _new_blocks(self, request_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """Per group, (first block index to add, one past the last) so positions [start, end) can be computed."""
        tables = self._tables.get(request_id)
        spans = []
        for g, group in enumerate(self.groups):
            evicted = self.num_evicted(request_id, g)
            have = len(tables[g]) if tables is not None else 0
            spans.append((max(have, group.first_block(start - evicted, self.block_size)), blocks_for_tokens(end - evicted, self.block_size)))
        return spans

    def num_blocks_needed(self, request_id: str, start: int, end: int) -> int:
        return sum(max(0, hi - lo) for lo, hi in self._new_blocks(request_id, start, end))

    def keep_conversations(self, config: ConversationKVConfig) -> None:
        """Pin stored conversations' blocks between turns (kv/conversation_pins.py); needs the prefix cache."""
        if self.prefix_cache is not None:
            self.pins = ConversationPins(self.pool.num_blocks, config, self._release)

    def release_pin(self, request_id: str) -> bool:
        """Let go of the blocks a finished request's conversation keeps (its stored response was deleted)."""
        return self.pins is not None and self.pins.release(request_id)

    def expire_pins(self) -> None:
        if self.pins is not None and len(self.pins):
            self.pins.expire()

    def can_admit(self, request_id: str, num_tokens: int, chunk: int, hit: PrefixHit | None = None, reserve: int = 0) -> bool:
        """The request can reach num_tokens, `chunk` tokens per step, with what is free now (a hit's
        blocks need no new ones, but those no request holds leave the free queue when taken), and
        take `reserve` blocks more per full-attention group (a compaction's); pinned conversations
        give way first."""
        while not self._fits(request_id, num_tokens, chunk, hit, reserve):
            if self.pins is None or not self.pins.release_oldest():
                return False
        return True

    def _fits(self, request_id: str, num_tokens: int, chunk: int, hit: PrefixHit | None, reserve: int = 0) -> bool:
        need = sum(
            max(0, group.peak_blocks(num_tokens, self.block_size, chunk) - self.num_held_blocks(request_id, g)
                - (hit.held(g) if hit is not None else 0))
            for g, group in enumerate(self.groups)
        ) + self._reserve_need(request_id, reserve)  # fmt: skip
        taken: dict[int, KVBlock] = {}
        if hit is not None:
            taken = {id(b): b for row in hit.blocks for b in row if b is not None}
            taken.update({id(src): src for _, src, _ in hit.copies})
            need += sum(self._units(b) for b in taken.values() if b.ref_count == 0) + len(hit.copies) * max(self.spec.residual_units, 1)
        if self.residual_pool is not None:
            need += (self.spec.residual_units - 1) * self.spec.residual_peak_blocks(num_tokens, chunk)
            if hit is not None:  # the hit's full-precision (sink) blocks: counted whole above, held or taken
                full_precision = sum(b is not None and self._pool_of(b) is self.residual_pool for row in hit.blocks for b in row)
                need -= (self.spec.residual_units - 1) * full_precision
            # the first step's tokens (and a partial hit's copied block) take full-precision blocks, whole chunks
            start = hit.num_tokens if hit is not None else 0
            first_step = len(self.groups) * (blocks_for_tokens(min(num_tokens, start + chunk), self.block_size) - start // self.block_size)
            # a hit's cached full-precision blocks (a sink block) leave the free ones when taken
            first_step += sum(b.ref_count == 0 and self._pool_of(b) is self.residual_pool for b in taken.values())
            if first_step > self.residual_pool.num_free_blocks:
                return False
        return need <= self.pool.num_free_blocks

    @property
    def num_free_fresh_blocks(self) -> int:
        """Blocks new tokens (and copies of partly filled blocks) can take now: a KIVI cache's full-precision ones."""
        return self._fresh.num_free_blocks

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, request_id: str, token_ids: Sequence[int], salt: str | None, limit: int | None = None) -> PrefixHit:
        """The cached prefix a request could start from (all but its last token, and at most `limit`
        tokens); no side effects."""
        empty = PrefixHit(blocks=[[] for _ in self.groups])
        if self.prefix_cache is None or self._tables.get(request_id):
            return empty
        self._salts[request_id] = salt
        hashes = self._hashes[request_id] = chain_hashes(self.prefix_cache.root, token_ids, self.block_size, salt, self._hashes.get(request_id))
        limit = min(len(token_ids) - 1, len(token_ids) if limit is None else limit)
        hit = self.prefix_cache.lookup(token_ids, hashes, limit, salt)
        if self.residual_pool is None or not hit.num_tokens:
            return hit
        return exact_hit(self.prefix_cache, self.spec, token_ids, hashes, limit)  # kv/kivi_hits.py

    # ------------------------------------------------------------------ tiers
    def start_tier_load(self, request_id: str, token_ids: Sequence[int], hit: PrefixHit, limit: int | None = None) -> LoadJob | None:
        """Where the request's prefix goes on in the tiers past the pool's hit (every full-attention
        group's block, and a sliding group's blocks of the last window), and loading it is measured to
        beat recomputing it: fresh blocks are taken (held until the load ends) and the load starts.
        None when there is nothing to load, it would be slower, or the pool has no room for it."""
        offloader, cache = self.offloader, self.prefix_cache
        if offloader is None or cache is None or request_id not in self._hashes:
            return None
        bs, hashes = self.block_size, self._hashes[request_id]
        start = hit.num_tokens // bs  # a radix hit's partial block (a few shared tokens) is read whole from a tier instead
        whole = min(len(hashes), min(len(token_ids) - 1, len(token_ids) if limit is None else limit) // bs)
        if start >= whole:
            return None
        offloader.query_tokens += (whole - start) * bs
        full = [g for g, spec in enumerate(self.groups) if spec.window is None]
        if not full:
            return None
        kivi = self.residual_pool is not None  # a block's quantized form under its hash, its full-precision one under another
        forms = [[hashes[i]] + ([full_precision_key(hashes[i])] if kivi and i >= self.spec.quant_sink_blocks else []) for i in range(whole)]
        where = dict(zip(*(keys := [record_key(key, g) for i in range(start, whole) for key in forms[i] for g in range(len(self.groups))],
                                offloader.locate(keys))))  # fmt: skip

        def located(i: int, g: int, end: int) -> int | None:
            """The key of block i's record a request resuming at block `end` can read, if a tier has it."""
            usable = forms[i][-1:] if kivi and read_in_full_precision(self.spec, i, end * bs) else forms[i]
            return next((key for key in usable if where[record_key(key, g)] is not None), None)

        def pooled(i: int, g: int) -> KVBlock | None:
            """Block i of group g if the pool still holds it past the hit (a sliding group's block evicted before
            the full groups' leaves a hole only the tier fills: the rest is read where it is)."""
            return None if kivi else cache.cached(g, hashes[i])

        end = start
        while end < whole and all(pooled(end, g) is not None or any(where[record_key(key, g)] is not None for key in forms[end])
                                  for g in full):  # fmt: skip
            end += 1
        entries: list[tuple[int, int, int]] = []  # (block index, group, key), in prefix order
        kept: list[KVBlock] = []
        while end > start:
            needed = [(i, g, pooled(i, g)) for i in range(start, end) for g in range(len(self.groups))
                      if self.groups[g].window is None or i >= self.groups[g].first_block(end * bs, bs)]  # fmt: skip
            kept = [b for _, _, b in needed if b is not None]
            entries = [(i, g, located(i, g, end)) for i, g, b in needed if b is None]
            if all(key is not None for _, _, key in entries):
                break
            end -= 1
        if end == start or not entries or self._recompute_decided.get(request_id) == end:
            return None  # nothing to load, or decided already (a request waiting for room asks again every step)
        if request_id in self._no_more_loads:
            return None  # its last load ran past its patience or met a bad record: it recomputes the rest
        held = list(({id(b): b for row in hit.blocks for b in row if b is not None} | {id(b): b for b in kept}).values())
        for block in held:  # the pool's part of the hit must not be evicted for the load's blocks
            self._touch(block)
        # a KIVI cache's sink blocks and full-precision forms take a whole chunk each: taken first
        full_precision = [k for k, (i, _, key) in enumerate(entries) if self._side_for(i) is not self.pool or key != hashes[i]]
        room = (len(entries) + len(full_precision) * (self.spec.residual_units - 1) <= self.pool.num_free_blocks
                and len(full_precision) <= self._fresh.num_free_blocks)  # fmt: skip
        keys = [record_key(key, g) for _, g, key in entries]
        tiers, sizes = [where[key] for key in keys], [self.spec.bytes_per_block] * len(entries)
        for k in full_precision:
            sizes[k] = self.spec.residual_block_bytes
        if not room or not offloader.worth_loading(tiers, sizes, (end - start) * bs):
            if room:
                self._recompute_decided[request_id] = end
            self._release(list(reversed(held)))
            return None
        targets: list[KVBlock | None] = [None] * len(entries)
        for k in full_precision:
            targets[k] = self._fresh.allocate(1, entries[k][1])[0]
        targets = [t if t is not None else self.pool.allocate(1, g)[0] for t, (_, g, _) in zip(targets, entries)]
        self._release(list(reversed(held)))
        salt = self._salts.get(request_id)
        # a full-precision form is published with its block's hash as parent (kv/kivi_hits.py)
        parents = [hashes[i] if key != hashes[i] else hashes[i - 1] if i else cache.parent_of_first(salt) for i, _, key in entries]
        job = LoadJob(keys, targets, expected_seconds=offloader.load_seconds(tiers, sizes)[0])
        job.entries = [(i, g, key, parent, tuple(token_ids[i * bs : (i + 1) * bs]), salt) for (i, g, key), parent in zip(entries, parents)]
        offloader.load(job, [t.block_id for t in targets])
        return job

    def cut_tier_load(self, request_id: str, job: LoadJob) -> None:
        """An overdue load stops after the record in hand; the request takes what has come (a partial hit)."""
        self.offloader.cut(job)
        self._no_more_loads.add(request_id)

    def finish_tier_load(self, job: LoadJob, request_id: str | None = None) -> int:
        """A finished load's blocks join the prefix cache up to the first block index that failed in
        any group; every target is released (a published one stays cached). A load that came back
        short leaves its request (`request_id`) to recompute the rest: another load would find the
        next bad record, and on a sliding-window model read again what a shorter hit cannot use.
        The tiers are credited only with the blocks the request then takes (take_hit): a load cut on
        a sliding-window model publishes full-attention blocks a shorter hit cannot use without its
        last window, and an orphaned load's request is gone. Returns the tokens published."""
        try:
            tiers = job.future.result()
        except Exception:  # noqa: BLE001 - a failed load is a miss: the prefix is recomputed
            logger.exception("loading KV blocks from a tier failed; the prefix is recomputed")
            tiers = [None] * len(job.keys)
        stop = min((entry[0] for entry, tier in zip(job.entries, tiers) if tier is None), default=None)
        if stop is not None and request_id is not None:
            self._no_more_loads.add(request_id)
        served: dict[int, str] = {}  # block index -> the tier of its first record
        for (i, g, key, parent, tokens, salt), block, tier in zip(job.entries, job.targets, tiers):
            if (stop is None or i < stop) and self.prefix_cache.publish(g, block, key, parent, tokens, salt):
                served.setdefault(i, tier)
        if request_id is not None and served:
            self._tier_served[request_id] = served
        self._release(list(reversed(job.targets)))
        return len(served) * self.block_size

    # ------------------------------------------------------------------ migration
    def published_blocks(self, request_id: str) -> list[KVBlock]:
        """The request's blocks in the prefix cache, in prefix order (every group's; a sliding group's
        dropped ones excepted): what a migration carries."""
        tables = self._tables.get(request_id, [])
        count = max(self._published.get(request_id, 0), self._published_full_precision.get(request_id, 0))  # a KIVI window's full-precision forms too
        return [table[i] for i in range(count) for table in tables if i < len(table) and table[i] is not None and table[i].block_hash is not None]

    def adopt_blocks(self, token_ids: Sequence[int], salt: str | None, records: Sequence, write: Callable[[int, bytes], None]) -> int:
        """Records of the chain of token_ids (BlockRecord, from another engine) written into free
        blocks and published to the prefix cache, where the request's lookup finds them; records of
        another chain are skipped. Stops when the pool has no free block. Returns blocks adopted."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        bs = self.block_size
        hashes = chain_hashes(cache.root, token_ids[: len(token_ids) // bs * bs], bs, salt, None)
        index = {h: i for i, h in enumerate(hashes)}
        if self.residual_pool is not None:  # a KIVI block's full-precision form, parented by its hash (kv/kivi_hits.py)
            index |= {full_precision_key(h): i for i, h in enumerate(hashes) if i >= self.spec.quant_sink_blocks}
        taken, adopted = [], 0
        for record in sorted(records, key=lambda r: (index.get(r.block_hash, -1), r.group)):
            i = index.get(record.block_hash)
            if i is None or not 0 <= record.group < len(self.groups) or record.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                continue
            full_precision = record.block_hash != hashes[i]
            kind = self._fresh if full_precision else self._side_for(i)
            if kind.num_free_blocks == 0:
                break
            block = kind.allocate(1, record.group)[0]
            taken.append(block)
            write(block.block_id, record.payload)
            parent = hashes[i] if full_precision else hashes[i - 1] if i else cache.parent_of_first(salt)
            adopted += cache.publish(record.group, block, record.block_hash, parent, record.token_ids, salt)
        self._release(list(reversed(taken)))
        return adopted

    def record_hit(self, hit: PrefixHit, prompt_len: int, salt: str | None) -> None:
        """Count a request's lookup at its first admission (prefix_stats.py)."""
        root = self.prefix_cache.parent_of_first(salt) if self.prefix_cache is not None else None
        self.prefix_stats.record(hit, prompt_len, salt, root)

    def take_hit(self, request_id: str, hit: PrefixHit) -> None:
        """Start the request's tables from a lookup's blocks; a partial block is copied into a new one.
        The tiers are credited with the blocks of the hit that a load of this request brought back."""
        served = self._tier_served.pop(request_id, None)
        if served:
            used = [tier for i, tier in served.items() if (i + 1) * self.block_size <= hit.num_tokens]
            self.offloader.credit_hits(used, self.block_size)
        if not hit.num_tokens:
            return
        tables = self._tables[request_id] = [[] for _ in self.groups]
        row = self._rows[request_id] = self._take_row()
        for g, blocks in enumerate(hit.blocks):
            for i, block in enumerate(blocks):
                tables[g].append(block)
                if block is not None:
                    self._touch(block)
                    self._ids[g][row, i] = block.block_id
        for g, source, slots in hit.copies:
            self._touch(source)  # until the copy is made
            (target,) = self._fresh.allocate(1, g)
            self._ids[g][row, len(tables[g])] = target.block_id
            tables[g].append(target)
            self.pending_copies.append((source, target, slots))
        whole = hit.num_tokens // self.block_size
        # a KIVI hit's full-precision blocks past the sink are published quantized when this request quantizes them
        quantized = [i < self.spec.quant_sink_blocks or all(b is None or self._pool_of(b) is self.pool for b in (row[i] for row in hit.blocks))
                     for i in range(whole)]  # fmt: skip
        self._published[request_id] = quantized.index(False) if False in quantized else whole
        self._published_full_precision[request_id] = whole

    def fork(self, parent_id: str, child_id: str, num_computed: int) -> None:
        """The child shares the parent's blocks for its first num_computed tokens; the partly filled
        last block, which both will write next, is copied (at the next step) into a fresh one."""
        parent = self._tables[parent_id]
        tables = self._tables[child_id] = [[] for _ in self.groups]
        row = self._rows[child_id] = self._take_row()
        whole = num_computed // self.block_size
        for g, table in enumerate(parent):
            for i, block in enumerate(table[:whole]):
                tables[g].append(block)
                if block is not None:
                    self._touch(block)
                    self._ids[g][row, i] = block.block_id
            if num_computed % self.block_size:
                source = table[whole]
                self._touch(source)
                (target,) = self._fresh.allocate(1, g)
                self._ids[g][row, whole] = target.block_id
                tables[g].append(target)
                self.pending_copies.append((source, target, num_computed % self.block_size))
        self._published[child_id] = self._published.get(parent_id, 0)
        self._published_full_precision[child_id] = whole
        self._salts[child_id] = self._salts.get(parent_id)
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))[:whole]

    def take_copies(self) -> list[tuple[KVBlock, KVBlock, int]]:
        """The slot copies partial hits need before the next step; the caller makes them, then releases the sources."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def release_copy_sources(self, copies: list[tuple[KVBlock, KVBlock, int]]) -> None:
        self._release([source for source, _, _ in copies])

    # ------------------------------------------------------------------ KIVI's residual
    def plan_quantization(self, request_id: str, num_computed: int) -> None:
        """Move the request's residual blocks that are full and older than the residual window, but
        its sink block, to quantized blocks (kv/arena.py picks them; the caller converts them, every
        pair before anything else runs: take_quantization)."""
        tables = self._tables.get(request_id)
        if self.arena is None or tables is None:
            return
        ready = self.spec.blocks_read_quantized(num_computed)  # what the next token reads quantized
        done = self._quantized.setdefault(request_id, [0] * len(self.groups))
        row = self._rows[request_id]
        todo = []
        for g, table in enumerate(tables):
            end = min(ready, len(table))
            todo += [(g, i, table[i]) for i in range(max(done[g], self.spec.quant_sink_blocks), end)
                     if table[i] is not None and table[i].block_id >= self.pool.num_blocks]  # fmt: skip
            done[g] = max(done[g], end)
        targets = self.arena.quantize_targets([(block, g) for g, _, block in todo])
        for (g, i, block), target in zip(todo, targets):
            if target is None:  # shared and no free block: tried again next step
                done[g] = min(done[g], i)
                continue
            tables[g][i] = target
            self._ids[g][row, i] = target.block_id
            self.pending_quantization.append((block, target))

    def take_quantization(self) -> list[tuple[KVBlock, KVBlock]]:
        """(residual, quantized) block pairs to convert now; then release_quantized."""
        pairs, self.pending_quantization = self.pending_quantization, []
        return pairs

    def release_quantized(self, pairs: list[tuple[KVBlock, KVBlock]]) -> None:
        self._release([residual for residual, _ in pairs])

    def publish_full_precision(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """KIVI: offer the request's full-precision blocks that became full under their full-precision
        keys, before any is quantized (kv/kivi_hits.py)."""
        cache, tables = self.prefix_cache, self._tables.get(request_id)
        if cache is None or tables is None or self.residual_pool is None:
            return
        bs = self.block_size
        done = max(self._published_full_precision.get(request_id, 0), self.spec.quant_sink_blocks)
        full = num_computed // bs
        if full <= done:
            return
        salt = self._salts.get(request_id)
        hashes = self._hashes[request_id] = chain_hashes(cache.root, token_ids[: full * bs], bs, salt, self._hashes.get(request_id))
        for i in range(done, full):
            for g, table in enumerate(tables):
                block = table[i] if i < len(table) else None
                if block is not None and self._pool_of(block) is self.residual_pool:
                    published = cache.publish(g, block, full_precision_key(hashes[i]), hashes[i], token_ids[i * bs : (i + 1) * bs], salt)
                    if published and self.offloader is not None and self.offloader.offloads_on_publish:
                        self.offloader.offload(block.block_id, block.block_hash, block.group, block.token_ids, published=True,
                                               adapter=block.adapter)
        self._published_full_precision[request_id] = full

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish the request's blocks that became full of computed tokens."""
        cache, tables = self.prefix_cache, self._tables.get(request_id)
        if cache is None or tables is None:
            return
        bs = self.block_size
        done = self._published.get(request_id, 0)
        full = num_computed // bs
        if full <= done:
            return
        salt = self._salts.get(request_id)
        hashes = self._hashes[request_id] = chain_hashes(cache.root, token_ids[: full * bs], bs, salt, self._hashes.get(request_id))
        for i in range(done, full):
            blocks = [table[i] if i < len(table) else None for table in tables]
            if i >= self.spec.quant_sink_blocks and any(b is not None and self._pool_of(b) is not self.pool for b in blocks):
                full = i  # a residual block: published once quantized (a sink block stays as it is)
                break
            parent = hashes[i - 1] if i else cache.parent_of_first(salt)
            for g, block in enumerate(blocks):
                if block is not None:
                    published = cache.publish(g, block, hashes[i], parent, token_ids[i * bs : (i + 1) * bs], salt)
                    if published and self.offloader is not None and self.offloader.offloads_on_publish:
                        self.offloader.offload(block.block_id, block.block_hash, block.group, block.token_ids, published=True,
                                               adapter=block.adapter)
        self._published[request_id] = full

    def persist_to_tiers(self, timeout: float) -> int:
        """A graceful shutdown: the prefix cache's blocks and the host tier's records go down to the
        disk tier (kv/tiers/offload.py's persist), within timeout seconds. Records queued."""
        if self.offloader is None or self.prefix_cache is None:
            return 0
        cached = [(b.block_id, b.block_hash, b.group, b.token_ids) for b in self.prefix_cache.blocks()]
        return self.offloader.persist(cached, timeout)

    def drop_adapter(self, adapter: str) -> int:
        """An unloaded LoRA adapter's cached blocks leave the pool (reused first) and the local
        tiers; its running requests publish nothing more. Returns the pool blocks dropped."""
        if self.prefix_cache is None:
            return 0
        dropped = self.prefix_cache.drop_adapter(adapter)
        self.prefix_stats.adapters.pop(adapter, None)
        for block in dropped:
            self._pool_of(block).reuse_first(block)
        if self.offloader is not None:
            self.offloader.drop_adapter(adapter)
        return len(dropped)

    def serve_adapter(self, adapter: str) -> None:
        """A request under this adapter arrived (after an unload, the adapter was loaded again)."""
        if self.prefix_cache is not None:
            self.prefix_cache.revive_adapter(adapter)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; requests keep the blocks they hold. Returns how many were forgotten."""
        if self.prefix_cache is None:
            return 0
        if self.pins is not None:
            self.pins.release_all()
        for request_id in self._published:
            self._published[request_id] = 0
        return self.prefix_cache.reset()

    # ------------------------------------------------------------------ changing
    def _reserve_need(self, request_id: str, reserve: int) -> int:
        """Blocks `reserve` per full-attention group takes, none if the request has taken them."""
        return 0 if request_id in self._reserved else reserve * self._num_full_groups

    def fits_alone(self, num_tokens: int, chunk: int, reserve: int) -> bool:
        """One request of num_tokens, with `reserve` blocks per full-attention group more, fits the whole pool."""
        return self.spec.peak_blocks(num_tokens, chunk) + reserve * self._num_full_groups <= self.pool.num_blocks

    def allocate_slots(self, request_id: str, start: int, end: int, reserve: int = 0) -> bool:
        """Give the request blocks to compute tokens [start, end), and once `reserve` blocks per
        full-attention group for its compaction to write into (compaction_targets); False (and
        nothing taken) if short."""
        spans = self._new_blocks(request_id, start, end)
        extra = self._reserve_need(request_id, reserve)
        needed = sum(max(0, hi - lo) for lo, hi in spans) + extra
        while needed > self._fresh.num_free_blocks:
            if self.pins is None or not self.pins.release_oldest():
                return False
        if max(hi for _, hi in spans) > self.max_blocks_per_seq:
            raise ValueError(f"request {request_id} grew past {self.max_blocks_per_seq} blocks")
        tables = self._tables.get(request_id)
        if tables is None:
            tables = self._tables[request_id] = [[] for _ in self.groups]
            self._rows[request_id] = self._take_row()
        row = self._rows[request_id]
        for g, (lo, hi) in enumerate(spans):
            if hi <= lo:
                continue
            table = tables[g]
            table.extend([None] * (lo - len(table)))
            blocks = self._fresh.allocate(hi - lo, g)
            table.extend(blocks)
            self._ids[g][row, lo:hi] = [b.block_id for b in blocks]
        if extra:
            self._reserved[request_id] = {g: self._fresh.allocate(reserve, g) for g, group in enumerate(self.groups) if group.window is None}
        return True

    def free_unreachable(self, request_id: str, num_computed: int, prompt_len: int | None = None, hit_end: int | None = None) -> None:
        """Free each sliding group's blocks that no query at num_computed or later reads. They stay
        cached, but only a hit ending within them reads them again, so they are reused before the LRU
        queue's blocks (a whole cached prompt's), except the window before the prompt's last whole
        blocks (a repeat of the prompt, or a document asked another question, hits there): those
        are parked, evicted after every other cached block while the request runs, and rejoin the
        LRU order when it finishes, as old as its other blocks. `hit_end`: where the earliest hit on
        this prompt ends instead (a compressing request's: its own hits end before its SnapKV window)."""
        tables = self._tables.get(request_id)
        if tables is None:
            return
        row = self._rows[request_id]
        for g, group in enumerate(self.groups):
            if group.window is None:
                continue
            first = min(group.first_block(num_computed, self.block_size), len(tables[g]))
            table = tables[g]
            if prompt_len is None:
                kept = first
            else:  # hits ending up to SHARED_TAIL_TOKENS (at most a window) before the prompt's end, or at `hit_end`
                shared = max(prompt_len - 1 - min(SHARED_TAIL_TOKENS, group.window), 0) if hit_end is None else hit_end
                kept = min(group.first_block(shared // self.block_size * self.block_size, self.block_size), first)
            early = [b for b in table[:kept] if b is not None]
            late = [b for b in table[kept:first] if b is not None]
            if not early and not late:
                continue
            for i in range(first):
                table[i] = None
            self._ids[g][row, :first] = 0
            self._release(list(reversed(early)), evict_first=True)
            self._release(late, park=True)  # lowest positions evicted first: a hit reads the window just before it
            self._parked.setdefault(request_id, []).extend(late)

    def truncate(self, request_id: str, num_computed: int) -> None:
        """Drop the request's slots from position num_computed on (a KVzip probe's), releasing the
        blocks that held only those."""
        tables, row = self._tables[request_id], self._rows[request_id]
        for g, table in enumerate(tables):
            slots = num_computed - self.num_evicted(request_id, g)
            first = blocks_for_tokens(slots, self.block_size)
            gone = [b for b in table[first:] if b is not None]
            del table[first:]
            self._ids[g][row, first:] = 0
            self._release(list(reversed(gone)))

    def compaction_targets(self, request_id: str, group: int, kept: int, first: int = 0) -> list[KVBlock]:
        """The blocks a compaction of a full-attention group's table from block `first` on to `kept`
        slots writes: those taken for it (allocate_slots' reserve), or else the request's own blocks
        nearest the region's end, so the blocks before them (a prefix hit, or published whole:
        kv/eviction.py CompressionRegion) are never written. The scheduler takes no more from the
        cache than leaves enough of them."""
        need = blocks_for_tokens(kept, self.block_size)
        reserved = self._reserved.get(request_id)
        if reserved is not None:
            targets = reserved.pop(group)
            if not reserved:
                del self._reserved[request_id]
            if len(targets) != need:
                raise RuntimeError(f"request {request_id}: {len(targets)} blocks taken to compact {need} into")
            return targets
        region = self._tables[request_id][group][first:]
        targets = [b for b in reversed(region) if b is not None and _private(b)][:need]
        if len(targets) < need:
            raise RuntimeError(f"request {request_id}: {len(targets)} blocks of its own to compact {need} into")
        return targets[::-1]

    def evict(self, request_id: str, num_computed: int, kept: int, targets: dict[int, list[KVBlock]], first: int = 0) -> int:
        """The request's full-attention groups now hold only their first `kept` slots: their blocks
        before `first` as they were, then the blocks `targets` names per group (from
        compaction_targets; the caller compacted them there): every other block is released at once,
        a published one staying cached, parked until the request is done (a prompt asked again hits
        it). Returns how many blocks the request let go."""
        tables, row = self._tables[request_id], self._rows[request_id]
        held = num_computed - self.num_evicted(request_id)
        if kept >= held:
            return 0
        released = 0
        for g, table in enumerate(tables):
            if self.groups[g].window is not None:
                continue
            keep = {id(b) for b in targets[g]}
            gone = [b for b in table[first:] if b is not None and id(b) not in keep]
            table[first:] = targets[g]
            self._ids[g][row, first:] = 0
            self._ids[g][row, first : len(table)] = [b.block_id for b in table[first:]]
            gone.reverse()  # tail first: a hit reads from the prefix's start
            published = [b for b in gone if b.block_hash is not None]
            self._release([b for b in gone if b.block_hash is None])
            self._release(published, park=True)
            self._parked.setdefault(request_id, []).extend(published)
            released += len(gone)
        self._evicted[request_id] = self.num_evicted(request_id) + held - kept
        return released

    def free(self, request_id: str, token_ids: Sequence[int] = (), num_computed: int = 0, publish: bool = True, pin: bool = False) -> None:
        """Return the request's blocks. A radix cache keeps its last, partly filled block too (unless not `publish`).
        `pin`: its cached blocks stay for the conversation's next turn (kv/conversation_pins.py)."""
        tables = self._tables.pop(request_id, None)
        num_computed -= self._evicted.pop(request_id, 0)
        hashes = self._hashes.pop(request_id, None)
        salt = self._salts.pop(request_id, None)
        self._published.pop(request_id, None)
        self._published_full_precision.pop(request_id, None)
        self._quantized.pop(request_id, None)
        self._recompute_decided.pop(request_id, None)
        self._no_more_loads.discard(request_id)
        self._tier_served.pop(request_id, None)
        for block in self._parked.pop(request_id, ()):
            self._pool_of(block).refresh(block)
        for blocks in self._reserved.pop(request_id, {}).values():
            self._release(blocks)
        if tables is None:
            return
        partial = self.prefix_cache is not None and self.prefix_cache.name == "radix" and self.residual_pool is None
        if partial and publish and num_computed % self.block_size:
            self._publish_partial(tables, token_ids, num_computed, hashes or [], salt)
        if pin and self.pins is not None:  # what it published whole (a compressed block never is)
            width = max(len(t) for t in tables)
            cached = [t[i] for i in range(width) for t in tables if i < len(t) and t[i] is not None and t[i].block_hash is not None]
            self.pins.pin(request_id, cached, self._touch)
        row = self._rows.pop(request_id)
        for g, table in enumerate(tables):
            held = [b for b in table if b is not None]
            self._release(list(reversed(held)))
            self._ids[g][row, : len(table)] = 0
        self._free_rows.append(row)

    def _publish_partial(self, tables, token_ids: Sequence[int], num_computed: int, hashes: list[int], salt: str | None) -> None:
        cache, bs = self.prefix_cache, self.block_size
        k = num_computed // bs
        if len(hashes) < k or any(len(t) <= k or t[k] is None for t in tables):
            return
        parent = hashes[k - 1] if k else cache.parent_of_first(salt)
        tokens = token_ids[k * bs : num_computed]
        key = block_hash(parent, tokens)
        for g, table in enumerate(tables):
            cache.publish(g, table[k], key, parent, tokens, salt)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._ids[0].shape[0]
            grown = max(16, 2 * old)
            self._ids = [np.concatenate([ids, np.zeros((grown - old, self.max_blocks_per_seq), dtype=np.int64)]) for ids in self._ids]
            self._free_rows = list(range(grown - 1, old - 1, -1))
        return self._free_rows.pop()


SHARED_TAIL_TOKENS = 128  # a prompt's last tokens another request may not share (a question, a new turn)


def _private(block: KVBlock) -> bool:
    """Only its holder reads it: no other request holds it and the prefix cache does not know it."""
    return block.ref_count == 1 and block.block_hash is None
