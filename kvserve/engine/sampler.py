"""Token selection for the rows of a step that need full logits: one batched call.

Penalties, temperature, top-k / top-p / min-p, the draw and raw top-N logprobs run for every row
at once, in the native kernel on CPU (kernels/sampler.cpp) or in torch ops elsewhere
(torch_sampler.py); both follow one definition. Each draw takes its randomness from the
request's seed and the token's position alone, so a seeded request samples the same tokens
whatever it is batched with, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kernels import sampling
from kvserve.engine.sequence import Sequence, TokenLogprobs
from kvserve.engine.torch_sampler import sample_torch
from kvserve.sampling_params import MIN_TOP_P
from kvserve.structured.mask import GrammarMask


@dataclass
class SampleResult:
    token_id: int | None  # None: the request's grammar allows no token
    logprobs: TokenLogprobs | None


class Sampler:
    def __init__(self, native: bool) -> None:
        self.native = native
        self.grammar_mask = GrammarMask()

    @staticmethod
    def rows(seqs: list[Sequence], vocab: int, positions: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kernels' per-row parameters (SAMPLER_ROW_DTYPE) and the flat penalty ids and counts. A row's
        draw is seeded by its request's seed and the position of the token it draws (default: the next one)."""
        rows = np.zeros(len(seqs), dtype=sampling.SAMPLER_ROW_DTYPE)
        id_parts: list[np.ndarray] = []
        count_parts: list[np.ndarray] = []
        begin = 0
        fields = []
        for i, seq in enumerate(seqs):
            p = seq.params
            end = begin
            if seq.penalty_counts is not None:
                ids, counts = seq.penalty_arrays()
                id_parts.append(ids)
                count_parts.append(counts)
                end += len(ids)
            fields.append((
                # top_p below float32's range keeps the top token as a tiny top_p does; top_k past the vocabulary is off
                0.0 if p.greedy else p.temperature, max(p.top_p, MIN_TOP_P), p.min_p, p.repetition_penalty, p.presence_penalty,
                p.frequency_penalty, min(max(p.top_k, 0), vocab), -1 if p.logprobs is None else p.logprobs, seq.seed,
                seq.num_tokens if positions is None else positions[i],
                begin, end,
            ))  # fmt: skip
            begin = end
        rows[:] = fields
        penalty_ids = np.concatenate(id_parts) if id_parts else np.empty(0, dtype=np.int64)
        penalty_counts = np.concatenate(count_parts) if count_parts else np.empty(0, dtype=np.int32)
        return rows, penalty_ids, penalty_counts

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int] | None = None) -> list[SampleResult]:
        """One token per row of logits [S, V] (float32; modified in place) for seqs; a row with a grammar
        draws among the tokens it allows (its logprobs too are over those)."""
        rows, penalty_ids, penalty_counts = self.rows(seqs, logits.shape[-1], positions)
        logits = logits.float()
        constrained = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        exhausted = set(self.grammar_mask.apply(logits, constrained, [seqs[i].grammar for i in constrained])) if constrained else set()
        if self.native and logits.device.type == "cpu":
            out = sampling.sample(logits.contiguous(), rows, penalty_ids, penalty_counts)
        else:
            out = sample_torch(logits, rows, penalty_ids, penalty_counts)
        tokens = out.tokens.tolist()
        results = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if i in exhausted:
                results.append(SampleResult(None, None))
                continue
            lp = None
            if seq.params.logprobs is not None:
                n = seq.params.logprobs
                top = dict(zip(out.top_ids[i, :n].tolist(), out.top_logprobs[i, :n].tolist()))
                if seq.grammar is not None:  # fewer tokens than n may be allowed: the rest are not alternatives
                    top = {t: v for t, v in top.items() if logits[i, t] != float("-inf")}
                lp = TokenLogprobs(token, float(out.token_logprobs[i]), top)
            results.append(SampleResult(token, lp))
        return results
