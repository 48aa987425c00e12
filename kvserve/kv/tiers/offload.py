"""What goes down to the tiers, what comes back, and whether loading beats recomputing.

Down: a cached block's bytes are copied out of the pool at once (on eviction, or as soon as it is
published with write_through), before anything can reuse its memory; encoding and storing happen
on the tiers' worker thread. write_through stores a computed block in every local tier (host and
disk: a crash loses nothing the writer finished); write_back stores an evicted block in the first,
and the host tier hands what it drops for room to the disk tier. At a graceful shutdown `persist`
sends what only the pool or the host tier holds down to the disk tier, so a restart starts warm.

Up: a request whose prefix continues in the tiers gets fresh pool blocks, held (so nothing reuses
them) while the worker reads, checks and copies the records into them (a short read from the host
tier is done at once, on the step loop); the scheduler then publishes them to the prefix cache and
the request takes them as an ordinary prefix hit. A
missing, corrupt or foreign record ends the usable prefix there: the rest is recomputed.

Load or recompute: each tier's read latency and bandwidth are measured on the engine's own loads
(exponential averages, seeded with cautious guesses) and compared, per request, with the
engine's measured prefill rate for that many tokens.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvserve.kv.tiers.record import REJECT_REASONS, BlockRecord, CorruptRecord, decode_record, encode_record, record_key
from kvserve.kv.tiers.signing import RecordSigner
from kvserve.kv.tiers.store import BlockStore

logger = logging.getLogger(__name__)

POLICIES = ("write_back", "write_through")
_SMOOTHING = 0.2  # weight of a new measurement in the running averages
# before a tier's first measured load: (latency s, bytes/s) guesses on the low side of this machine's
_FIRST_GUESS = {"host": (2e-4, 2e9), "disk": (2e-3, 3e8), "remote": (1e-3, 2e8)}
_FIRST_PREFILL_RATE = 2000.0  # tokens/s until a prefill step is measured
_LOADS_TO_MEASURE = 3  # a tier's first loads are taken whatever the guess says, to measure it
REMOTE_BATCH = 64  # records per pipelined read from the shared tier
# a load running past PATIENCE x its estimate (and MIN_PATIENCE_S) is cut: the request takes the
# prefix loaded so far and recomputes the rest, instead of waiting behind a slow medium
PATIENCE = 3.0
MIN_PATIENCE_S = 0.05
MAX_ADAPTER_KEYS = 1 << 18  # records remembered per LoRA adapter, to drop when it is unloaded
MAX_PENDING_BYTES = 256 << 20  # copied out, not yet stored: past this an evicted block is dropped, a computed one waits
# records copied out go to the worker in one job a step (flush) or per this many: one wake-up of the worker,
# and one contention for Python's lock with the step loop, for a step's evictions instead of one per block
OUTBOX_RECORDS = 256
# a load from this process's memory (the host tier) expected to take at most this long is read at once on
# the step loop: its request is admitted in the same step instead of one step later, and several requests
# whose prefixes come back together are admitted together (a worker's read would also contend for the GIL)
INLINE_LOAD_S = 0.02


def _yield_to_the_step_loop() -> None:
    """The tiers' worker runs at a lower priority (Linux nice 10, this thread only): its copies fill
    idle time instead of taking a core from the step's OpenMP team, whose every thread the step waits for."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
        pass


@dataclass
class TierCounters:
    bytes_written: int = 0
    seconds_written: float = 0.0
    bytes_read: int = 0
    seconds_read: float = 0.0
    hit_tokens: int = 0  # prompt tokens a request took from blocks a load from this tier brought back into the pool
    corrupt_records: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))  # corrupt_records by reason
    latency: float = 0.0  # measured per load (seconds), then averaged
    bandwidth: float = 0.0  # bytes per second
    loads: int = 0  # load jobs that read from this tier (its rates are measured ones from the first)
    requests: int = 0  # requests whose prefix a load from this tier served (on a consumer: hand-overs received)


@dataclass
class LoadJob:
    """Blocks of one request being read into the pool: keys[i] into targets[i], in prefix order."""

    keys: list[str]
    targets: list  # KVBlock, held by the job
    future: Future | None = None
    entries: list[tuple] = field(default_factory=list)  # the manager's: (block index, group, hash, parent, tokens, salt) per key
    expected_seconds: float = 0.0  # the load-or-recompute estimate
    started: float = 0.0  # time.monotonic() when it was queued
    cut: threading.Event = field(default_factory=threading.Event)  # set: stop after the record in hand (a partial hit)

    def overdue(self, now: float) -> bool:
        """Running past PATIENCE x its estimate (at least MIN_PATIENCE_S): the request takes what has come."""
        return now - self.started > max(PATIENCE * self.expected_seconds, MIN_PATIENCE_S)


class KVOffloader:
    def __init__(self, stores: Sequence[BlockStore], identity: int, read_block: Callable[[int], bytes],
                 write_block: Callable[[int, bytes], None], policy: str = "write_back", write_remote: bool = True,
                 signer: RecordSigner | None = None) -> None:  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"kv_offload_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not stores:
            raise ValueError("the offloader needs at least one tier")
        self.local = [s for s in stores if not s.shared]
        self.remote = next((s for s in stores if s.shared), None)
        self.stores = self.local + ([self.remote] if self.remote is not None else [])
        self.identity = identity
        self.signer = signer  # every record is signed, and only signed records are read (kv/tiers/signing.py)
        self.policy = policy
        self.writes_remote = self.remote is not None and write_remote  # a consumer (--kv-role) only reads it
        self._read_block, self._write_block = read_block, write_block
        self.counters = {s.name: TierCounters() for s in self.stores}
        for store in self.stores:
            c = self.counters[store.name]
            c.latency, c.bandwidth = _FIRST_GUESS.get(store.name, (1e-3, 1e8))
        self.prefill_rate = _FIRST_PREFILL_RATE
        self.decisions = {"load": 0, "recompute": 0}
        self.query_tokens = 0
        self._pending: dict[str, tuple[BlockRecord, BlockStore]] = {}  # copied out, not yet stored: (record, its first tier)
        self._pending_bytes = 0
        self._outbox: list[tuple[str, BlockRecord, list[BlockStore]]] = []  # copied out on the step loop, not yet handed to the worker
        self.dropped_blocks = 0  # evicted while the worker was MAX_PENDING_BYTES behind
        self.waits_for_writer = 0  # computed blocks that waited for the worker to fall below MAX_PENDING_BYTES
        self.loads_cut = 0  # loads past their patience: their requests took a partial hit
        self._adapter_keys: dict[str, OrderedDict[str, None]] = {}  # LoRA identity -> keys of its records sent down
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tiers", initializer=_yield_to_the_step_loop)
        self._warned_corrupt = False
        # a record a local tier drops for room goes down to the next local tier
        for i, upper in enumerate(self.local[:-1]):
            if hasattr(upper, "on_evict"):
                upper.on_evict = lambda key, data, below=i + 1: self._store_local(below, key, data)

    @property
    def offloads_on_publish(self) -> bool:
        """Blocks go down as soon as they are computed (write_through, or a shared tier to fill)."""
        return self.policy == "write_through" or self.writes_remote

    # ------------------------------------------------------------------ down
    def offload(self, block_id: int, block_hash: int, group: int, token_ids: Sequence[int], published: bool = False,
                adapter: str | None = None) -> None:
        """Copy a cached block out of the pool now (its memory may be reused right after) and store it
        off the step loop. `published`: it was just computed (write-through and the shared tier),
        otherwise it is being evicted (write-back to the local tiers). A block a local tier already
        holds is not stored there again; the worker asks the shared tier before sending it.
        `adapter`: the LoRA adapter it was computed under (drop_adapter removes its records)."""
        key = record_key(block_hash, group)
        if adapter is not None:
            self._note_adapter_key(adapter, key)
        targets: list[BlockStore] = []
        if published == (self.policy == "write_through"):
            if not published:
                targets = self.local[:1] if not any(s.contains(key) for s in self.local) else []
            else:
                targets = [s for s in self.local if not s.contains(key)]
        if published and self.writes_remote:
            targets.append(self.remote)
        self._copy_out(block_id, block_hash, group, token_ids, key, targets, wait=published)

    def _copy_out(self, block_id: int, block_hash: int, group: int, token_ids: Sequence[int], key: str,
                  targets: list[BlockStore], wait: bool) -> bool:  # fmt: skip
        """Copy the block's bytes now and queue its record for targets (nothing if none); past
        MAX_PENDING_BYTES wait for the writer (`wait`) or drop the block. False: dropped."""
        if not targets:
            return True
        with self._lock:
            if key in self._pending:
                return True
            if self._pending_bytes >= MAX_PENDING_BYTES:
                if not wait:  # an eviction burst: the block goes, as it would without tiers
                    self.dropped_blocks += 1
                    return False
                self.waits_for_writer += 1  # a computed block is what write-through and the shared tier are for: wait
                self._hand_over()
                self._room.wait_for(lambda: self._pending_bytes < MAX_PENDING_BYTES)
        record = BlockRecord(block_hash, group, tuple(token_ids), self._read_block(block_id))
        with self._lock:
            self._pending[key] = (record, targets[0])
            self._pending_bytes += len(record.payload)
            self._outbox.append((key, record, targets))
            if len(self._outbox) >= OUTBOX_RECORDS:
                self._hand_over()
        return True

    def flush(self) -> None:
        """Hand the records copied out since the last flush to the worker, as one job (the engine calls
        it once a step; every read, drain and shutdown first)."""
        with self._lock:
            self._hand_over()

    def _hand_over(self) -> None:
        """flush() with the lock held."""
        if self._outbox:
            items, self._outbox = self._outbox, []
            self._worker.submit(self._write_all, items)

    def _write_all(self, items: list[tuple[str, BlockRecord, list[BlockStore]]]) -> None:
        for key, record, targets in items:
            self._write(key, record, targets)

    def _write(self, key: str, record: BlockRecord, targets: list[BlockStore]) -> None:
        try:
            data = encode_record(record, self.identity, self.signer)
            for store in targets:
                if store.shared:
                    if not store.contains(key):  # another engine may have sent it already
                        self._store(store, key, data)
                elif len(targets) > 1 or self.policy == "write_through":
                    self._store(store, key, data)  # each local tier its own copy
                else:
                    self._store_local(self.local.index(store), key, data)
        except Exception:  # noqa: BLE001 - a record that cannot be stored is only a future recompute
            logger.exception("storing KV record %s failed; it will be recomputed when needed", key)
        finally:
            with self._lock:
                if self._pending.pop(key, None) is not None:
                    self._pending_bytes -= len(record.payload)
                    self._room.notify_all()

    def _store(self, store: BlockStore, key: str, data: bytes) -> bool:
        start = time.perf_counter()
        if not store.put(key, data):
            return False
        c = self.counters[store.name]
        c.bytes_written += len(data)
        c.seconds_written += time.perf_counter() - start
        return True

    def _store_local(self, first: int, key: str, data: bytes) -> None:
        """Into the first local tier from self.local[first] down that takes it: a record larger than
        a tier's whole budget (a KIVI cache's full-precision sink block in a small host tier) goes below.
        A tier that holds the key already (write_through put it there too) ends the walk."""
        for store in self.local[first:]:
            if store.contains(key) or self._store(store, key, data):
                return

    def _note_adapter_key(self, adapter: str, key: str) -> None:
        with self._lock:
            keys = self._adapter_keys.setdefault(adapter, OrderedDict())
            keys[key] = None
            keys.move_to_end(key)
            if len(keys) > MAX_ADAPTER_KEYS:  # the oldest records are the ones the tiers dropped first
                keys.popitem(last=False)

    def drop_adapter(self, adapter: str) -> None:
        """An unloaded LoRA adapter's records leave the local tiers (after the writes queued before).
        The shared tier keeps them to its TTL: other replicas may still serve the adapter."""
        with self._lock:
            keys = list(self._adapter_keys.pop(adapter, ()))
        if keys:
            self.flush()  # records of it still on their way down are stored, then deleted
            self._worker.submit(self._delete_local, keys)

    def _delete_local(self, keys: list[str]) -> None:
        for store in self.local:
            store.delete_many(keys)

    # ------------------------------------------------------------------ shutdown
    def persist(self, cached: Sequence[tuple[int, int, int, Sequence[int]]], timeout: float) -> int:
        """A graceful shutdown's last writes: every cached block of the pool (block id, hash, group,
        tokens) and every host-tier record that the durable tier (disk) lacks goes down to it, within
        `timeout` seconds. Call it on the thread that owns the pool, with no step running. Returns
        how many records were queued; what the timeout cuts off is recomputed after the restart."""
        durable = next((s for s in self.local if s.durable), None)
        if durable is None:
            return 0
        deadline = time.monotonic() + timeout
        queued = 0
        for block_id, block_hash, group, token_ids in cached:
            if time.monotonic() >= deadline:
                break
            key = record_key(block_hash, group)
            if not durable.contains(key):
                queued += self._copy_out(block_id, block_hash, group, token_ids, key, [durable], wait=True)
        for upper in self.local[: self.local.index(durable)]:
            if hasattr(upper, "records"):
                for key, data in upper.records():
                    if not durable.contains(key):
                        self._worker.submit(self._store, durable, key, data)
                        queued += 1
        self.flush()
        done = self._worker.submit(lambda: None)
        wait([done], timeout=max(0.0, deadline - time.monotonic()))
        return queued

    def flushed(self) -> Future:
        """Done once every block copied out before this call is stored (a producer answers then)."""
        self.flush()
        return self._worker.submit(lambda: None)

    # ------------------------------------------------------------------ lookups
    def _local_tier_of(self, key: str) -> BlockStore | None:
        return next((store for store in self.local if store.contains(key)), None)

    def locate(self, keys: Sequence[str]) -> list[BlockStore | None]:
        """The tier holding each record (a record on its way down: the tier it goes to first), or
        None; the shared tier is asked about all the others in one round trip."""
        found: list[BlockStore | None] = []
        for key in keys:
            with self._lock:
                pending = self._pending.get(key)
            found.append(pending[1] if pending is not None else self._local_tier_of(key))
        if self.remote is not None:
            ask = [i for i, store in enumerate(found) if store is None]
            for i, held in zip(ask, self.remote.contains_many([keys[i] for i in ask])):
                if held:
                    found[i] = self.remote
        return found

    def load_seconds(self, tiers: Sequence[BlockStore], record_bytes: Sequence[int]) -> tuple[float, bool]:
        """The expected time to read one record of record_bytes[i] bytes from each tiers[i] (a KIVI
        cache's sink records are larger than its quantized ones), and whether a tier among them is
        not measured yet."""
        seconds = 0.0
        by_tier: dict[str, int] = {}
        for store, size in zip(tiers, record_bytes, strict=True):
            by_tier[store.name] = by_tier.get(store.name, 0) + size
        unmeasured = False
        for name, size in by_tier.items():
            c = self.counters[name]
            seconds += c.latency + size / c.bandwidth
            unmeasured |= c.loads < _LOADS_TO_MEASURE
        return seconds, unmeasured

    def worth_loading(self, tiers: Sequence[BlockStore], record_bytes: Sequence[int], tokens: int) -> bool:
        """Loading records from these tiers (one per record, of record_bytes[i] bytes) is expected to
        beat recomputing `tokens` prompt tokens at the measured prefill rate; counted either way."""
        seconds, unmeasured = self.load_seconds(tiers, record_bytes)
        load = unmeasured or seconds < tokens / self.prefill_rate  # a tier never read cannot be measured
        self.decisions["load" if load else "recompute"] += 1
        return load

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill step's rate (the engine reports steps that were mostly prefill)."""
        if tokens > 0 and seconds > 0:
            self.prefill_rate += _SMOOTHING * (tokens / seconds - self.prefill_rate)

    # ------------------------------------------------------------------ up
    def load(self, job: LoadJob, block_ids: Sequence[int]) -> None:
        """Start reading job.keys into the blocks block_ids (held by the caller until it is done). A
        short load from the host tier is done when this returns (job.future.done())."""
        job.started = time.monotonic()
        stores = self._read_at_once(job)
        if stores is None:
            self.flush()  # the worker stores what is on its way down before it reads
            job.future = self._worker.submit(self._read, job.keys, list(block_ids), job.cut)
            return
        job.future = Future()
        try:
            job.future.set_result(self._read(job.keys, list(block_ids), local=stores))
        except Exception as error:  # noqa: BLE001 - handed to finish_tier_load, as the worker's would be
            job.future.set_exception(error)

    def _read_at_once(self, job: LoadJob) -> list[BlockStore] | None:
        """The in-process tier of each record when the load is read on the step loop: every record is
        in one (none still on its way down: the worker stores those first) and the load is expected
        within INLINE_LOAD_S. None: the worker reads it."""
        if job.expected_seconds > INLINE_LOAD_S:
            return None
        with self._lock:
            if any(key in self._pending for key in job.keys):
                return None
        stores = []
        for key in job.keys:
            store = self._local_tier_of(key)
            if store is None or not store.in_process:
                return None
            stores.append(store)
        return stores

    def cut(self, job: LoadJob) -> None:
        """Stop an overdue load after the record in hand: what it loaded is still published."""
        if not job.cut.is_set():
            job.cut.set()
            self.loads_cut += 1

    def _read(self, keys: list[str], block_ids: list[int], cut: threading.Event | None = None,
              local: list[BlockStore | None] | None = None) -> list[str | None]:  # fmt: skip
        """Each record into its block, in prefix order; the first that fails ends the prefix, and so
        does `cut`. `local`: each key's local tier where the caller has just looked them up. Per key:
        the tier it came from, or None."""
        if local is None:
            local = [self._local_tier_of(key) for key in keys]
        fetched = self._fetch_remote([key for key, store in zip(keys, local) if store is None])
        loaded: list[str | None] = []
        touched: set[str] = set()
        for i, (key, block_id, store) in enumerate(zip(keys, block_ids, local)):
            if cut is not None and cut.is_set():
                break
            start = time.perf_counter()
            if store is not None:
                data = store.get(key)
            else:
                data, store = fetched.get(key), self.remote
            if data is None:
                break
            try:
                record = decode_record(data, self.identity, key, self.signer, verify=not store.in_process)
                self._write_block(block_id, record.payload)
            except (CorruptRecord, ValueError) as error:
                counters = self.counters[store.name]
                counters.corrupt_records += 1
                counters.rejected[getattr(error, "reason", "damaged")] += 1
                store.delete(key)
                # the rest of the chain is recomputed and stored again: stale copies (signed with an old key, say) must
                # not stand in its way, since a writer skips a key a tier holds
                for later, where in zip(keys[i + 1 :], local[i + 1 :]):
                    if where is not None:
                        where.delete(later)
                if store.shared:
                    store.delete_many([k for k, where in zip(keys[i + 1 :], local[i + 1 :]) if where is None])
                if not self._warned_corrupt:
                    logger.warning("the %s tier held an unusable KV record (%s); its prefix is recomputed from there", store.name, error)
                    self._warned_corrupt = True
                break
            if not store.shared:  # the shared tier's reads were measured as they were fetched
                self._measure(store, len(data), time.perf_counter() - start, touched)
            loaded.append(store.name)
        return loaded + [None] * (len(keys) - len(loaded))

    def _fetch_remote(self, keys: list[str]) -> dict[str, bytes]:
        """The shared tier's records among keys, REMOTE_BATCH per round trip, up to the first missing one."""
        fetched: dict[str, bytes] = {}
        touched: set[str] = set()
        for first in range(0, len(keys) if self.remote is not None else 0, REMOTE_BATCH):
            batch = keys[first : first + REMOTE_BATCH]
            start = time.perf_counter()
            records = self.remote.get_many(batch)
            got = [(key, data) for key, data in zip(batch, records) if data is not None]
            self._measure(self.remote, sum(len(data) for _, data in got), time.perf_counter() - start, touched)
            fetched.update(got)
            if len(got) < len(batch):
                break
        return fetched

    def _measure(self, store: BlockStore, nbytes: int, seconds: float, touched: set[str]) -> None:
        """A read's bytes and time; the first read of a tier in a job is also a latency sample."""
        c = self.counters[store.name]
        c.bytes_read += nbytes
        c.seconds_read += seconds
        weight = _SMOOTHING
        if store.name not in touched:
            touched.add(store.name)
            c.loads += 1
            weight = 1.0 if c.loads == 1 else _SMOOTHING  # the first measurement replaces the guess
            c.latency += weight * (seconds - c.latency)
        if seconds > 0 and nbytes:
            c.bandwidth += weight * (nbytes / seconds - c.bandwidth)

    def credit_hits(self, tiers: Sequence[str], block_size: int) -> None:
        """The tier each block of a request's hit that a load brought back came from (counted by the
        manager when the request takes its hit: it knows what was used)."""
        for tier in tiers:
            self.counters[tier].hit_tokens += block_size
        for tier in set(tiers):
            self.counters[tier].requests += 1

    def wait(self, futures: Sequence[Future], timeout: float) -> None:
        """Block until one of these loads is done, at most `timeout` seconds (an engine with nothing
        else to run)."""
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def drain(self) -> None:
        """Wait for every queued write and load (tests, shutdown)."""
        self.flushed().result()

    def close(self) -> None:
        self.flush()
        self._worker.shutdown(wait=True)
        for store in self.stores:
            store.close()

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        tiers = {}
        for store in self.stores:
            usage, c = store.usage(), self.counters[store.name]
            tiers[store.name] = {
                "usage_bytes": usage.used_bytes, "capacity_bytes": usage.capacity_bytes, "entries": usage.entries,
                "bytes_written": c.bytes_written, "seconds_written": c.seconds_written, "bytes_read": c.bytes_read,
                "seconds_read": c.seconds_read, "hit_tokens": c.hit_tokens, "requests_served": c.requests, "corrupt_records": c.corrupt_records,
                "records_rejected": dict(c.rejected),
                "write_failures": store.write_failures,
                "read_latency_seconds": c.latency, "read_bandwidth_bytes_per_second": c.bandwidth,
            }  # fmt: skip
        remote = self.remote
        if remote is not None:
            tiers["remote"].update(up=remote.up, outages=remote.outages, timeouts=remote.timeouts, errors=remote.errors)
        return {"kv_offload_policy": self.policy, "kv_tiers": tiers, "kv_tier_query_tokens_total": self.query_tokens,
                "kv_offload_dropped_blocks_total": self.dropped_blocks,
                "kv_offload_writer_waits_total": self.waits_for_writer, "kv_offload_loads_cut_total": self.loads_cut,
                "kv_offload_decisions_total": dict(self.decisions), "kv_offload_prefill_rate": self.prefill_rate}  # fmt: skip
