"""The sampling step in torch ops, for any device: the same definition as kernels/sampler.cpp.

Per row: raw top-N logprobs, then penalties, then s = (logit - max) / T over the vocabulary in
the order (s descending, id ascending); top-k keeps s >= the k-th largest s, min-p keeps
s >= log(min_p), top-p keeps a token while the kept mass before it is below top_p times the kept
mass; the draw is Gumbel-max over the kept tokens: argmax of s + g in double, g = -log(-log(u))
with u from a Philox-4x32-10 word of the token, keyed by (seed, position, token id) as in
kernels/gumbel.h. Tokens with s <= -88 have no mass. Greedy rows (T = 0) take the argmax.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.kernels.sampling import MAX_LOGPROBS, SampledRows

MASS_FLOOR = -88.0
_M32 = np.uint64(0xFFFFFFFF)


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
    """Philox-4x32-10 (Salmon et al., Random123) on arrays of 32-bit words held in uint64."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _M32 for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _M32 for k in key)
    with np.errstate(over="ignore"):
        for round_ in range(10):
            if round_:
                k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
                k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
            p0 = c0 * np.uint64(0xD2511F53)
            p1 = c2 * np.uint64(0xCD9E8D57)
            c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _M32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32
    return c0, c1, c2, c3


def _blocks(seeds: np.ndarray, positions: np.ndarray, c2: np.ndarray, tag: int) -> np.ndarray:
    """Philox words [4, ...] of counters (position, c2, tag) under key seed, broadcast together."""
    seeds, positions, c2 = np.broadcast_arrays(np.asarray(seeds, np.uint64), np.asarray(positions, np.uint64), np.asarray(c2, np.uint64))
    return np.stack(philox4x32((positions, positions >> np.uint64(32), c2, np.full_like(c2, tag)), (seeds, seeds >> np.uint64(32))))


def chunk_heads(seeds: np.ndarray, positions: np.ndarray, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each chunk's largest uniform V^(1/64) (six square roots, correctly rounded everywhere) and
    the lane holding it, from its header block (chunk, 1) (kernels/gumbel.h)."""
    heads = _blocks(seeds, positions, chunks, 1)
    largest = (heads[0].astype(np.float64) + 0.5) * 2.0**-32
    for _ in range(6):
        largest = np.sqrt(largest)
    return largest, (heads[1] & np.uint64(63)).astype(np.int64)


def chunk_uniforms(seed: int, position: int, chunks: np.ndarray) -> np.ndarray:
    """The 64 uniforms [len(chunks), 64] of these chunks, in token order: the header's lane holds
    the largest, every other lane largest * (w + 1/2) / 2^32 with w word (lane >> 4) of block
    chunk * 16 + (lane & 15)."""
    chunks = np.asarray(chunks, dtype=np.uint64)
    largest, at = chunk_heads(np.uint64(seed), np.uint64(position), chunks)
    lanes = np.arange(64, dtype=np.uint64)
    words = _blocks(np.uint64(seed), np.uint64(position), chunks[:, None] * np.uint64(16) + (lanes & np.uint64(15))[None, :], 0)
    word = np.take_along_axis(words, (lanes >> np.uint64(4)).astype(np.int64)[None, None, :].repeat(len(chunks), 1), 0)[0]
    u = largest[:, None] * ((word.astype(np.float64) + 0.5) * 2.0**-32)
    u[np.arange(len(chunks)), at] = largest
    return u


def token_uniforms(seed: int, position: int, vocab: int) -> np.ndarray:
    """Each token's uniform for (seed, position), as kernels/gumbel.h makes them."""
    return chunk_uniforms(seed, position, np.arange(-(-vocab // 64))).reshape(-1)[:vocab]


def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """-log(-log(u)) per token in float64."""
    return -np.log(-np.log(token_uniforms(seed, position, vocab)))


def _column(rows: np.ndarray, name: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rows[name])).to(device)


def sample_torch(logits: torch.Tensor, rows: np.ndarray, penalty_ids: np.ndarray, penalty_counts: np.ndarray) -> SampledRows:
    """kernels.sampling.sample in torch ops: logits float32 [R, V] (modified in place), rows a
    SAMPLER_ROW_DTYPE array, penalties as (begin, end) ranges of the flat id/count arrays."""
    device = logits.device
    count, vocab = logits.shape
    out = SampledRows(
        torch.empty(count, dtype=torch.int64), torch.zeros(count), torch.zeros(count, MAX_LOGPROBS, dtype=torch.int64),
        torch.zeros(count, MAX_LOGPROBS),
    )  # fmt: skip
    num_logprobs = rows["num_logprobs"]
    logprob_rows = np.nonzero(num_logprobs >= 0)[0]
    raw = lse = None
    if logprob_rows.size:
        index = torch.from_numpy(logprob_rows).to(device)
        raw = logits.index_select(0, index)
        lse = torch.logsumexp(raw.double(), dim=1).float()
        widest = min(int(num_logprobs.max()), vocab)
        if widest:
            values, ids = torch.topk(raw, widest, dim=1)
            out.top_ids[logprob_rows, :widest] = ids.cpu()
            out.top_logprobs[logprob_rows, :widest] = (values - lse[:, None]).cpu()

    lengths = rows["penalty_end"] - rows["penalty_begin"]
    if lengths.sum():
        row_of = torch.from_numpy(np.repeat(np.arange(count), lengths)).to(device)
        starts = np.repeat(rows["penalty_begin"], lengths)
        offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        picked = starts + offsets
        ids = torch.from_numpy(penalty_ids[picked].astype(np.int64)).to(device)
        counts = torch.from_numpy(penalty_counts[picked].astype(np.float32)).to(device)
        values = logits[row_of, ids]
        repetition = _column(rows, "repetition_penalty", device)[row_of]
        values = torch.where(repetition != 1, torch.where(values > 0, values / repetition, values * repetition), values)
        additive = _column(rows, "frequency_penalty", device)[row_of] * counts + _column(rows, "presence_penalty", device)[row_of]
        logits[row_of, ids] = torch.where(counts > 0, values - additive, values)

    tokens = logits.argmax(dim=1)
    temperature = _column(rows, "temperature", device)
    sampled = torch.nonzero(temperature > 0).flatten()
    if sampled.numel():
        tokens[sampled] = _draw(logits.index_select(0, sampled), rows[sampled.cpu().numpy()], device)
    out.tokens.copy_(tokens.cpu())
    if logprob_rows.size:
        picked = tokens[torch.from_numpy(logprob_rows).to(device)]
        out.token_logprobs[logprob_rows] = (raw.gather(1, picked[:, None])[:, 0] - lse).cpu()
    return out


def _draw(logits: torch.Tensor, rows: np.ndarray, device: torch.device) -> torch.Tensor:
    vocab = logits.shape[1]
    inverse_t = 1.0 / _column(rows, "temperature", device)
    row_scores = (logits - logits.max(dim=1, keepdim=True).values) * inverse_t[:, None]
    scores, order = torch.sort(row_scores, dim=1, descending=True, stable=True)
    mass = torch.where(scores > MASS_FLOOR, torch.exp(scores), torch.zeros_like(scores)).double()

    top_k = _column(rows, "top_k", device).long()
    kth = scores.gather(1, (top_k - 1).clamp(0, vocab - 1)[:, None])[:, 0]
    threshold = torch.where((top_k > 0) & (top_k < vocab), kth, torch.full_like(kth, float("-inf")))
    min_p = rows["min_p"]
    log_min_p = np.where(min_p > 0, np.log(np.maximum(min_p, 1e-45).astype(np.float64)).astype(np.float32), -np.inf)
    threshold = torch.maximum(threshold, torch.from_numpy(log_min_p).to(device))
    mass = mass * (scores >= threshold[:, None])

    top_p = _column(rows, "top_p", device).double()
    before = mass.cumsum(dim=1) - mass
    keep = (before < top_p[:, None] * mass.sum(dim=1, keepdim=True)) | (top_p[:, None] >= 1)
    mass = mass * keep

    kept = torch.zeros_like(mass, dtype=torch.bool).scatter_(1, order, mass > 0)
    return _gumbel_max(torch.where(kept, row_scores, torch.full_like(row_scores, float("-inf"))), order[:, 0], rows)


def _gumbel_max(scores: torch.Tensor, top: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """argmax of s + g over the kept tokens (scores, -inf elsewhere). The top token (always kept)
    sets the bar; only chunks whose largest uniform can lift their best kept token to it get the
    rest of their uniforms, as in kernels/sampler.cpp."""
    count, vocab = scores.shape
    chunks = -(-vocab // 64)
    padded = torch.full((count, chunks * 64), float("-inf"), dtype=scores.dtype, device=scores.device)
    padded[:, :vocab] = scores
    per_chunk = padded.view(count, chunks, 64).amax(2).double().cpu().numpy()
    largest, _ = chunk_heads(rows["seed"][:, None], rows["position"][:, None], np.arange(chunks)[None, :])
    ceiling = per_chunk - np.log(-np.log(largest))  # the most any token of the chunk can score
    padded = padded.cpu()
    tokens = torch.empty(count, dtype=torch.int64)
    for r in range(count):
        seed, position, t = int(rows["seed"][r]), int(rows["position"][r]), int(top[r])
        bar = float(padded[r, t]) - np.log(-np.log(chunk_uniforms(seed, position, np.array([t >> 6]))[0, t & 63]))
        candidates = np.nonzero(ceiling[r] >= bar)[0]
        u = chunk_uniforms(seed, position, candidates)
        ids = candidates[:, None] * 64 + np.arange(64)[None, :]
        noisy = padded[r].double().numpy()[ids] - np.log(-np.log(u))
        tokens[r] = int(ids.reshape(-1)[np.argmax(noisy.reshape(-1))])
    return tokens.to(scores.device)
