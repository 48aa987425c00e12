"""A KIVI cache's (int4, int2) two kinds of block carved from the same bytes.

New tokens go to full-precision blocks; once older than the residual window they are quantized
into blocks `residual_units` times smaller. Both come from one pool, so memory goes where the
sequences need it instead of a full-precision area set apart for --max-num-seqs sequences at start.

The pool is `num_units` quantized blocks (ids 0..num_units-1). Every run of `residual_units` of them
from a multiple of it on is a chunk, which holds either one full-precision block (id num_units + the
chunk's index) or up to `residual_units` quantized blocks; kv/pool.py lays both over the same bytes.
Units past the last whole chunk only ever hold quantized blocks.

Two facades, each with BlockPool's interface, share the state: `quantized` (a unit per block) and
`residual` (a chunk per block). Quantized blocks fill chunks already in use before a free chunk is
broken, so whole chunks stay for full-precision blocks; but a block the prefix cache still knows is
reused only after the clean units, and after whole chunks while the pool is roomy. Quantizing needs
no free memory: a block only its sequence holds may be quantized over its own bytes
(quantize_targets). A free block keeps its hash for the prefix cache until its bytes are reused by
either kind.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvserve.kv.block_pool import KVBlock, NoFreeBlocksError, forget

# while more than this share of the chunks is whole, a new quantized block opens one rather than
# evict a cached block from a chunk in use (a pool with room keeps its prefix cache)
ROOMY_WHOLE_SHARE = 0.25


class LooseUnits:
    """Free units of chunks something holds (and the tail's), least recently freed first: those the
    prefix cache knows (cached) apart from the others (clean), so that the clean ones go first."""

    def __init__(self, units: list[KVBlock]) -> None:
        self.clean: OrderedDict[int, KVBlock] = OrderedDict()
        self.cached: OrderedDict[int, KVBlock] = OrderedDict()
        for unit in units:
            self.add(unit)

    def add(self, unit: KVBlock) -> None:
        (self.clean if unit.block_hash is None else self.cached)[unit.block_id] = unit

    def discard(self, unit: KVBlock) -> None:
        self.clean.pop(unit.block_id, None)
        self.cached.pop(unit.block_id, None)

    def __len__(self) -> int:
        return len(self.clean) + len(self.cached)

    def __iter__(self):
        yield from self.clean
        yield from self.cached


class BlockArena:
    def __init__(self, num_units: int, residual_units: int) -> None:
        if residual_units < 1 or num_units < residual_units:
            raise ValueError(f"a pool of {num_units} quantized blocks holds no full-precision block of {residual_units}")
        self.residual_units = residual_units
        self.num_units = num_units
        self.num_chunks = num_units // residual_units
        self.units = [KVBlock(i) for i in range(num_units)]
        self.residuals = [KVBlock(num_units + c) for c in range(self.num_chunks)]
        self._held = [0] * (self.num_chunks + 1)  # per chunk: held units, or 1 for a held full-precision block
        self._residual_mode = [False] * self.num_chunks  # holds (or keeps cached) a full-precision block
        self._whole: OrderedDict[int, None] = OrderedDict((c, None) for c in range(self.num_chunks))  # chunks nothing holds
        self._loose = LooseUnits(self.units[self.num_chunks * residual_units :])
        self.units_held = 0
        self.quantized = QuantizedBlocks(self)
        self.residual = ResidualBlocks(self)

    def full_precision_chunks(self) -> list[int]:
        """Chunks whose bytes hold a full-precision block (held, or free and cached)."""
        return [c for c, mode in enumerate(self._residual_mode) if mode]

    def chunks_in_use(self) -> list[bool]:
        """Per chunk: something holds it (a full-precision block, or quantized blocks)."""
        return [held > 0 for held in self._held[: self.num_chunks]]

    def chunk_of(self, unit: int) -> int:
        return min(unit // self.residual_units, self.num_chunks)

    def _chunk_units(self, c: int) -> list[KVBlock]:
        k = self.residual_units
        return self.units[c * k : (c + 1) * k]

    def _evict(self, block: KVBlock, side: "_Side") -> None:
        if block.block_hash is not None:
            if side.on_evict is not None:
                side.on_evict(block)
            side.num_evictions += 1
            forget(block)

    def _open(self, c: int, keep: KVBlock | None = None) -> None:
        """A whole free chunk starts holding quantized blocks: a cached full-precision block there is
        gone, its units other than `keep` become loose (cached ones stay cached)."""
        del self._whole[c]
        if self._residual_mode[c]:
            self._evict(self.residuals[c], self.residual)
            self._residual_mode[c] = False
        for unit in self._chunk_units(c):
            if unit is not keep:
                self._loose.add(unit)

    def _close(self, c: int) -> None:
        """Nothing holds chunk c any more: its free units stop being loose, the chunk is whole."""
        for unit in self._chunk_units(c):
            self._loose.discard(unit)
        self._whole[c] = None

    def take_unit(self, group: int) -> KVBlock:
        """A free quantized block: a clean loose one; else a whole chunk is opened while the pool is
        roomy; else the least recently freed cached loose one; else a whole chunk."""
        loose, whole = self._loose, self._whole
        if loose.clean:
            _, unit = loose.clean.popitem(last=False)
        elif whole and (len(whole) > ROOMY_WHOLE_SHARE * self.num_chunks or not loose.cached):
            c = next(iter(whole))
            units = self._chunk_units(c)
            unit = next((u for u in units if u.block_hash is None), units[0])  # keep cached ones when it can
            self._open(c, keep=unit)
        elif loose.cached:
            _, unit = loose.cached.popitem(last=False)
        else:
            raise NoFreeBlocksError("no free quantized block")
        self._evict(unit, self.quantized)
        self._hold_unit(unit, group)
        return unit

    def _hold_unit(self, unit: KVBlock, group: int) -> None:
        unit.ref_count, unit.group = 1, group
        self._held[self.chunk_of(unit.block_id)] += 1
        self.units_held += 1
        self.quantized.used[group] = self.quantized.used.get(group, 0) + 1

    def quantize_targets(self, residuals: list[tuple[KVBlock, int]]) -> list[KVBlock | None]:
        """The quantized blocks held full-precision blocks (with their groups) are quantized into, in
        order; None for one that has to wait (shared, and no free unit). A block only its caller
        holds may be quantized over its own bytes (the caller converts every pair before anything
        else touches them, reading every source first): the first n // residual_units such blocks'
        chunks take the first n // residual_units * residual_units of them, in order, so a prefill's
        blocks stay contiguous and the other chunks come back whole when released; the rest take a clean loose unit, else
        the first unit of their own chunk (which evicts nothing; a shared block: take_unit, else it waits). A block the
        prefix cache keeps takes a unit like a shared one, else its own chunk's, forgotten first. A chunk
        quantized over stays held by its quantized blocks; its full-precision block is retired and
        its release frees nothing."""
        k = self.residual_units
        # a block the prefix cache keeps (its full-precision form, kv/kivi_hits.py) is quantized
        # elsewhere while a unit is free, over its own bytes (forgotten first) only when none is
        own = [j for j, (block, _) in enumerate(residuals) if block.ref_count == 1 and block.block_hash is None]
        targets: dict[int, KVBlock | None] = {}
        for n, j in enumerate(own[: len(own) // k * k]):
            chunk = residuals[own[n // k]][0].block_id - self.num_units  # read before written: own[n // k] <= own[n]
            if n % k == 0:
                self._retire(chunk)
            unit = self.units[chunk * k + n % k]
            self._hold_unit(unit, residuals[j][1])
            targets[j] = unit
        for j, (block, group) in enumerate(residuals):
            if j in targets:
                continue
            kept = block.ref_count > 1 or block.block_hash is not None
            if self._loose.clean or (kept and (self._loose or self._whole)):
                targets[j] = self.take_unit(group)
            elif block.ref_count == 1:
                self._evict(block, self.residual)
                chunk = block.block_id - self.num_units
                self._retire(chunk)
                unit = self.units[chunk * k]
                for other in self._chunk_units(chunk)[1:]:
                    self._loose.add(other)
                self._hold_unit(unit, group)
                targets[j] = unit
            else:
                targets[j] = None
        return [targets[j] for j in range(len(residuals))]

    def _retire(self, c: int) -> None:
        """Chunk c's held full-precision block is being quantized over: the chunk holds quantized blocks from now."""
        self._residual_mode[c] = False
        self._held[c] = 0
        self.units_held -= self.residual_units


class _Side:
    """BlockPool's interface over one kind of the arena's blocks."""

    def __init__(self, arena: BlockArena) -> None:
        self.arena = arena
        self.on_evict: Callable[[KVBlock], None] | None = None
        self.num_evictions = 0
        self.used: dict[int, int] = {}

    def num_used_blocks(self, group: int) -> int:
        return self.used.get(group, 0)

    @property
    def usage(self) -> float:
        return self.arena.units_held / self.arena.num_units

    def reuse_first(self, block: KVBlock) -> None:
        """The arena keeps its own order (chunks of full-precision units): nothing to move."""

    def park(self, block: KVBlock) -> None:
        """Likewise."""

    def refresh(self, block: KVBlock) -> None:
        """Likewise."""

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; one nothing holds any more gives its bytes back."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_count -= 1
            if not block.ref_count:
                self.used[block.group] -= 1
                self._release(block)

    def _release(self, block: KVBlock) -> None:
        raise NotImplementedError


class QuantizedBlocks(_Side):
    @property
    def blocks(self) -> list[KVBlock]:
        return self.arena.units

    @property
    def num_blocks(self) -> int:
        return self.arena.num_units

    @property
    def num_free_blocks(self) -> int:
        """Units nothing holds (cached ones included): a held full-precision block holds its chunk's."""
        return self.arena.num_units - self.arena.units_held

    def allocate(self, count: int, group: int = 0) -> list[KVBlock]:
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free_blocks} free")
        return [self.arena.take_unit(group) for _ in range(count)]

    def touch(self, block: KVBlock) -> None:
        arena = self.arena
        if block.ref_count:
            block.ref_count += 1
            return
        c = arena.chunk_of(block.block_id)
        if c in arena._whole:
            arena._open(c, keep=block)
        else:
            arena._loose.discard(block)
        arena._hold_unit(block, block.group)

    def _release(self, block: KVBlock) -> None:
        arena = self.arena
        arena.units_held -= 1
        c = arena.chunk_of(block.block_id)
        arena._held[c] -= 1
        if arena._held[c] == 0 and c < arena.num_chunks:
            arena._close(c)
        else:
            arena._loose.add(block)


class ResidualBlocks(_Side):
    @property
    def blocks(self) -> list[KVBlock]:
        return self.arena.residuals

    @property
    def num_blocks(self) -> int:
        return self.arena.num_chunks

    @property
    def num_free_blocks(self) -> int:
        """Whole chunks nothing holds."""
        return len(self.arena._whole)

    def allocate(self, count: int, group: int = 0) -> list[KVBlock]:
        arena = self.arena
        if count > len(arena._whole):
            raise NoFreeBlocksError(f"asked for {count} full-precision blocks, {len(arena._whole)} free")
        taken = []
        for _ in range(count):
            c, _ = arena._whole.popitem(last=False)
            for unit in arena._chunk_units(c):
                arena._evict(unit, arena.quantized)
            block = arena.residuals[c]
            arena._evict(block, self)
            arena._residual_mode[c] = True
            self._hold(c, block, group)
            taken.append(block)
        return taken

    def _hold(self, c: int, block: KVBlock, group: int) -> None:
        arena = self.arena
        block.ref_count, block.group = 1, group
        arena._held[c] = 1
        arena.units_held += arena.residual_units
        self.used[group] = self.used.get(group, 0) + 1

    def touch(self, block: KVBlock) -> None:
        if block.ref_count == 0:
            c = block.block_id - self.arena.num_units
            del self.arena._whole[c]  # a free full-precision block the cache knows keeps its whole chunk
            self._hold(c, block, block.group)
            return
        block.ref_count += 1

    def _release(self, block: KVBlock) -> None:
        arena = self.arena
        c = block.block_id - arena.num_units
        if arena._residual_mode[c]:
            arena._held[c] = 0
            arena.units_held -= arena.residual_units
            arena._close(c)
        # else it was quantized into its own chunk, which its quantized blocks hold now
