"""Token selection: penalties, temperature, top-k/top-p/min-p, seeded sampling, logprobs.

Greedy rows take one batched argmax. Random rows draw with their own generator (seeded per
request when asked), so a request's samples do not depend on what it was batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.sequence import Sequence, TokenLogprobs


@dataclass
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    params = seq.params
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # drop a token when the mass before it already reaches top_p; the top token always stays
        drop = (cumulative - sorted_probs) >= top_p * cumulative[-1]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def _logprobs(row_logprobs: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    top: dict[int, float] = {}
    if top_n:
        values, ids = torch.topk(row_logprobs, top_n)
        top = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist())}
    return TokenLogprobs(token_id, float(row_logprobs[token_id]), top)


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        logits = logits.float()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        needs_processing = [i for i, s in enumerate(seqs) if s.params.uses_penalties]
        if needs_processing:
            logits = logits.clone()
            for i in needs_processing:
                logits[i] = apply_penalties(logits[i], seqs[i])
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                continue
            probs = filtered_probs(logits[i], p.temperature, p.top_k, p.top_p, p.min_p)
            generator = seq.generator or self.generator
            # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
            noise = torch.empty_like(probs).exponential_(generator=generator)
            tokens[i] = int(torch.argmax(probs / noise))
        results = []
        for i, seq in enumerate(seqs):
            lp = None
            if raw_logprobs is not None and seq.params.logprobs is not None:
                lp = _logprobs(raw_logprobs[i], tokens[i], seq.params.logprobs)
            results.append(SampleResult(tokens[i], lp))
        return results
