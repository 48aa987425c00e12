"""Continuous batching: which sequences run this step, and how many tokens each.

Running sequences go first (one decode token, or the next prefill chunk); waiting ones are
admitted while the token budget, the sequence limit and the free blocks allow. A step whose
prompt tokens have reached prefill_step_tokens takes no more prompts once one of them is
complete, so first tokens come out a few prompts at a time rather than a whole budget's worth at
once. When a running sequence needs a block and none is free, the newest running sequence is
preempted by recompute.
"""

from __future__ import annotations

import time

from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix import PrefixHit
from kvserve.kv.tiers.offload import LoadJob


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_step_tokens: int = 0  # 0: prompts fill the budget

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefill_step_tokens < 0:
            raise ValueError(f"prefill_step_tokens must be 0 or more, got {self.prefill_step_tokens}")


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class StepPrompts:
    """The prompt tokens of the step being built, and whether it still takes prompts: it stops once its
    prompt tokens reach `target` and a prompt completes in it (its request gets its first token)."""

    target: int
    tokens: int = 0
    closed: bool = False

    def add(self, seq: Sequence, n: int) -> None:
        if not is_prefill(seq):
            return
        self.tokens += n
        # a chunk that takes SnapKV's generic question on (its rows scored, then dropped) completes a prompt that ends before it
        completes = seq.num_computed_tokens + n >= seq.num_tokens and (seq.probe is None or seq.probe_from >= len(seq.token_ids))
        self.closed = self.closed or (0 < self.target <= self.tokens and completes)


def is_prefill(seq: Sequence) -> bool:
    """Whether its next tokens are a prompt's (or a preempted sequence's recompute), not a decode: a prompt
    with one token left (the rest cached) is a prompt too."""
    return len(seq.token_ids) - seq.num_computed_tokens > 1 or seq.num_output_tokens == 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.migrated_hit_tokens = 0  # imported requests' tokens found cached here (migrated KV, or the tiers')
        self.loading: dict[str, LoadJob] = {}  # waiting requests whose prefix is being read from the KV tiers
        self.orphaned_loads: list[LoadJob] = []  # loads of requests that finished meanwhile

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        prompts = StepPrompts(self.config.prefill_step_tokens)
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            if seq.held or (prompts.closed and is_prefill(seq)):  # a beam waiting for its group to choose; a prompt for the next step
                idx += 1
                continue
            n = seq.next_chunk(budget)
            if seq.draft_token_ids and n < seq.num_uncomputed_tokens:  # the budget verifies only the guesses that fit
                del seq.draft_token_ids[max(n - 1, 0) :]
            while not self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens, seq.num_computed_tokens + n,
                                             seq.compaction_reserve(self.kv.block_size, seq.num_computed_tokens + n)):  # fmt: skip
                if seq.draft_token_ids:  # guesses never preempt anyone: the sequence decodes one token instead
                    seq.draft_token_ids = []
                    n = seq.next_chunk(budget)
                    continue
                victims = self._preempt_group(self.running[-1])
                batch.preempted.extend(victims)
                batch.entries = [(s, k) for s, k in batch.entries if not any(v is s for v in victims)]  # a beam's siblings go too
                if any(v is seq for v in victims):
                    break
                idx = self.running.index(seq)
            else:
                batch.entries.append((seq, n))
                budget -= n
                prompts.add(seq, n)
                idx += 1
        if batch.preempted:
            return batch
        self._finish_loads()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or prompts.closed:
                break
            if seq.request_id in self.loading:
                break  # its prefix is on its way from a tier: the requests behind it wait, so none takes the blocks it needs
            if seq.held:
                continue  # a beam its group holds; the others go on
            # admit only when the whole remaining prompt has blocks, so admission does not thrash
            hit = self.kv.lookup(seq.request_id, seq.token_ids, seq.prefix_salt, self._hit_limit(seq))
            reserve = seq.compaction_reserve(self.kv.block_size, seq.num_tokens)
            fits = self.kv.can_admit(seq.request_id, seq.num_tokens_to_admit, self.config.max_num_batched_tokens, hit, reserve)
            if fits and self.kv.offloader is not None:
                # a load starts only for a request the pool can admit (loaded or computed, its prefix takes the same
                # blocks): loads started for requests that must wait would evict each other's blocks before admission
                job = self.kv.start_tier_load(seq.request_id, seq.token_ids, hit, self._hit_limit(seq))
                if job is not None and not job.future.done():
                    self.loading[seq.request_id] = job
                    break
                if job is not None:  # read at once (the host tier): admitted in this step, from its longer hit
                    self.kv.finish_tier_load(job, seq.request_id)
                    hit = self.kv.lookup(seq.request_id, seq.token_ids, seq.prefix_salt, self._hit_limit(seq))
                    fits = self.kv.can_admit(seq.request_id, seq.num_tokens_to_admit, self.config.max_num_batched_tokens, hit, reserve)
            if not fits:
                # with nothing running the pool will not get freer: computing the prefix again takes
                # no more than the request alone, which fits (a hit must never fail a request)
                cold = PrefixHit(blocks=[[] for _ in self.kv.groups])
                chunk = self.config.max_num_batched_tokens
                if self.running or not hit.num_tokens or not self.kv.can_admit(seq.request_id, seq.num_tokens_to_admit, chunk, cold, reserve):
                    break
                hit = cold
            self.kv.take_hit(seq.request_id, hit)
            seq.num_computed_tokens = hit.num_tokens
            if seq.migrated and seq.num_preemptions == 0:
                self.migrated_hit_tokens += hit.num_tokens
            elif seq.num_preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
                self.kv.record_hit(hit, seq.prompt_len, seq.prefix_salt)
            n = seq.next_chunk(budget)
            end = seq.num_computed_tokens + n
            if not self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens, end, seq.compaction_reserve(self.kv.block_size, end)):
                raise RuntimeError(f"{seq.request_id} was admitted and its first {n} tokens find no free blocks: can_admit counted short")
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.entries.append((seq, n))
            budget -= n
            prompts.add(seq, n)
        if not batch.entries and self.waiting and any(s.held for s in self.running):
            # beams that have drawn hold blocks while their group waits for a beam the pool has no room for: they
            # give way (their tokens are drawn; they compute them again once their group has chosen)
            batch.preempted.extend(self._preempt_group(next(s for s in reversed(self.running) if s.held)))
        return batch

    def _finish_loads(self) -> None:
        """Loads that are done put their blocks in the prefix cache, where the next lookup finds them;
        an overdue one is cut, so its request takes the prefix loaded so far (a partial hit)."""
        now = time.monotonic()
        for request_id, job in list(self.loading.items()):
            if not job.future.done() and job.overdue(now):
                self.kv.cut_tier_load(request_id, job)
            if job.future.done():
                del self.loading[request_id]
                self.kv.finish_tier_load(job, request_id)
        for job in [j for j in self.orphaned_loads if j.future.done()]:
            self.orphaned_loads.remove(job)
            self.kv.finish_tier_load(job)

    def pending_loads(self) -> list:
        """The futures of the loads not yet finished (an engine with nothing else to run waits on them)."""
        return [job.future for job in (*self.loading.values(), *self.orphaned_loads)]

    def _hit_limit(self, seq: Sequence) -> int | None:
        """A compressing request reads from the prefix cache up to its SnapKV window, whose queries it
        computes, and only what its compaction never writes (kv/eviction.py CompressionRegion.hit_end)."""
        limit = None
        if seq.prompt_scores_pending:  # row i scores prompt token i + 1: a hit may only cover rows already scored
            limit = len(seq.prompt_logprobs) - 1
        if seq.eviction is None:
            return limit
        end = seq.compression_region(self.kv.block_size).hit_end
        return end if limit is None else min(end, limit)

    def _preempt_group(self, seq: Sequence) -> list[Sequence]:
        """Preempt seq, with every running beam of its beam group (a group is preempted all or nothing)."""
        group = [seq] + [s for s in self.running if s is not seq and seq.beam_group is not None and s.beam_group == seq.beam_group]
        for victim in group:
            self.running.remove(victim)
            self._preempt(victim)
        return group

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.request_id, seq.token_ids, seq.num_computed_tokens, publish=seq.eviction is None)
        seq.num_computed_tokens = 0
        seq.reset_compression()
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, pin: bool = False) -> None:
        """Remove a finished or aborted sequence and return its blocks (`pin`: kept for the conversation's next turn)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            job = self.loading.pop(seq.request_id, None)
            if job is not None:  # its blocks still join the cache when the load ends
                self.orphaned_loads.append(job)
        elif seq.status is SequenceStatus.FORKING:
            seq.fork_parent.forks.remove(seq)
        for fork in seq.forks:  # the prompt will not be computed here: they compute it themselves
            fork.fork_parent = None
            _share_prompt_scores(seq, fork)
            self.add(fork)
        seq.forks = []
        self.kv.free(seq.request_id, seq.token_ids, seq.num_computed_tokens, publish=seq.eviction is None, pin=pin)
        seq.status = SequenceStatus.FINISHED

    def add_fork(self, parent: Sequence, fork: Sequence) -> None:
        """`fork` waits for `parent`'s prompt, then shares its blocks (n > 1 prefills once)."""
        fork.status = SequenceStatus.FORKING
        fork.fork_parent = parent
        parent.forks.append(fork)

    def start_fork(self, fork: Sequence) -> None:
        """The parent's prompt is computed: the fork takes its blocks and runs from there (or, with
        no free block for its copy of the partly filled last one, waits to compute the prompt itself)."""
        parent = fork.fork_parent
        parent.forks.remove(fork)
        fork.fork_parent = None
        _share_prompt_scores(parent, fork)
        if parent.num_computed_tokens % self.kv.block_size and self.kv.num_free_fresh_blocks < len(self.kv.groups):
            self.add(fork)
            return
        self.kv.fork(parent.request_id, fork.request_id, parent.num_computed_tokens)
        fork.num_computed_tokens = parent.num_computed_tokens
        fork.num_cached_tokens = parent.num_cached_tokens
        fork.first_scheduled_time = parent.first_scheduled_time  # its prompt was computed (and counted) once
        fork.status = SequenceStatus.RUNNING
        self.running.append(fork)


def _share_prompt_scores(parent: Sequence, fork: Sequence) -> None:
    """A fork of a prompt whose scores are complete takes them: the prompt is scored once, as it is computed once."""
    if parent.prompt_logprobs is not None and not parent.prompt_scores_pending:
        fork.prompt_logprobs = parent.prompt_logprobs
