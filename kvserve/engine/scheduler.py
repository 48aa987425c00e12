"""Continuous batching: which sequences run this step, and how many tokens each.

Running sequences go first (one decode token, or the next prefill chunk); waiting ones are
admitted while the token budget, the sequence limit and the free blocks allow. When a running
sequence needs a block and none is free, the newest running sequence is preempted by recompute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.kv.manager import KVCacheManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.entries.append((seq, n))
                budget -= n
                idx += 1
        if batch.preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # admit only when the whole remaining prompt has blocks, so admission does not thrash
            if not self.kv.can_admit(seq.request_id, seq.num_tokens, self.config.max_num_batched_tokens):
                break
            n = min(seq.num_uncomputed_tokens, budget)
            self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.entries.append((seq, n))
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
