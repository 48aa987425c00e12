"""The batched sampler: exact distributions (checked statistically), native kernel = torch ops,
Philox known answers, raw logprobs."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from scipy.stats import chi2, chisquare, kstest

from kvserve.kernels import library, sampling
from kvserve.engine.torch_sampler import gumbel_noise, philox4x32, sample_torch, token_uniforms

needs_kernels = pytest.mark.skipif(not library.cpu_kernels_available(), reason="the native CPU kernels are not built here")

# Each check fails a correct sampler with probability below 1e-7; with ~70 checks a run of this
# file fails by chance less than once in 10^5 runs.
FALSE_FAIL = 1e-7
DRAWS = 20_000
VOCAB = 1000
NO_PENALTY = (np.empty(0, np.int64), np.empty(0, np.int32))


def sampler_rows(count: int, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition=1.0, presence=0.0, frequency=0.0,
                 logprobs=-1, seed=1234, first_position=0, penalties: int = 0) -> np.ndarray:  # fmt: skip
    rows = np.zeros(count, dtype=sampling.SAMPLER_ROW_DTYPE)
    rows["temperature"], rows["top_p"], rows["top_k"], rows["min_p"] = temperature, top_p, top_k, min_p
    rows["repetition_penalty"], rows["presence_penalty"], rows["frequency_penalty"] = repetition, presence, frequency
    rows["num_logprobs"], rows["seed"] = logprobs, seed
    rows["position"] = np.arange(first_position, first_position + count)
    rows["penalty_begin"] = np.arange(count) * penalties
    rows["penalty_end"] = rows["penalty_begin"] + penalties
    return rows


def penalized(logits: np.ndarray, ids: np.ndarray, counts: np.ndarray, repetition: float, presence: float, frequency: float) -> np.ndarray:
    """The penalties in float32, as the samplers apply them."""
    out = logits.astype(np.float32).copy()
    for token, count in zip(ids, counts):
        x = out[token]
        if repetition != 1.0:
            x = np.float32(x / np.float32(repetition)) if x > 0 else np.float32(x * np.float32(repetition))
        if count > 0:
            x = np.float32(x - (np.float32(frequency) * np.float32(count) + np.float32(presence)))
        out[token] = x
    return out


def reference(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, top_p_shift=0) -> np.ndarray:
    """The sampling distribution by definition, in float64. top_p_shift moves the top-p boundary by
    that many tokens (a deliberately wrong reference, to show the check catches it)."""
    scores = (logits.astype(np.float64) - np.max(logits)) / temperature
    order = np.lexsort((np.arange(len(scores)), -scores))
    ordered = scores[order]
    mass = np.where(ordered > -88, np.exp(ordered), 0.0)
    threshold = -np.inf
    if 0 < top_k < len(scores):
        threshold = ordered[top_k - 1]
    if min_p > 0:
        threshold = max(threshold, np.log(min_p))
    mass = mass * (ordered >= threshold)
    if top_p < 1:
        before = np.cumsum(mass) - mass
        kept = int(np.sum(before < top_p * mass.sum())) + top_p_shift
        mass[max(kept, 1) :] = 0.0
    probs = np.zeros(len(scores))
    probs[order] = mass / mass.sum()
    return probs


def draw_counts(row: np.ndarray, draws: int, sample=None, rows_per_call: int | None = None, penalty=NO_PENALTY, **params) -> np.ndarray:
    """Token counts of `draws` draws from one row of logits, each draw at its own position."""
    sample = sample or sampling.sample
    vocab = len(row)
    rows_per_call = rows_per_call or max(1, min(draws, (64 << 20) // (4 * vocab)))
    ids, counts = penalty
    counts_out = np.zeros(vocab, dtype=np.int64)
    for start in range(0, draws, rows_per_call):
        n = min(rows_per_call, draws - start)
        logits = torch.from_numpy(np.ascontiguousarray(row, dtype=np.float32)).repeat(n, 1)
        rows = sampler_rows(n, first_position=start, penalties=len(ids), **params)
        out = sample(logits, rows, np.tile(ids, n), np.tile(counts, n))
        counts_out += np.bincount(out.tokens.numpy(), minlength=vocab)
    return counts_out


def chi_square(observed: np.ndarray, probs: np.ndarray) -> tuple[float, float, int]:
    """(statistic, threshold, tokens drawn that the distribution excludes): Pearson's chi-square over
    the tokens expected at least 5 times, the rest pooled; the threshold is the (1 - FALSE_FAIL) quantile."""
    draws = observed.sum()
    excluded = int(observed[probs == 0].sum())
    expected = probs * draws
    big = expected >= 5
    obs = list(observed[big])
    exp = list(expected[big])
    rest_exp = expected[~big & (probs > 0)].sum()
    if rest_exp > 0:
        obs.append(observed[~big & (probs > 0)].sum())
        exp.append(rest_exp)
    obs, exp = np.array(obs, dtype=np.float64), np.array(exp)
    if len(exp) < 2:
        return 0.0, 0.0, excluded
    statistic = float(np.sum((obs - exp) ** 2 / exp))
    return statistic, float(chi2.isf(FALSE_FAIL, len(exp) - 1)), excluded


def logits_of(kind: str, vocab: int = VOCAB) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    if kind == "random":
        return (rng.standard_normal(vocab) * 2).astype(np.float32)
    if kind == "peaked":
        row = rng.standard_normal(vocab).astype(np.float32)
        row[rng.integers(vocab)] += 9.0
        return row
    if kind == "flat":
        return np.zeros(vocab, dtype=np.float32)
    if kind == "ties":
        return rng.choice(np.array([0.0, -0.5, -1.0, -2.0, -6.0], dtype=np.float32), vocab)
    if kind == "with_inf":
        row = (rng.standard_normal(vocab) * 2).astype(np.float32)
        row[rng.random(vocab) < 0.3] = -np.inf
        return row
    raise ValueError(kind)


KINDS = ("random", "peaked", "flat", "ties", "with_inf")
CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_k=25),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.8, top_p=0.5),
    dict(temperature=1.2, min_p=0.05),
    dict(temperature=0.8, top_k=50, top_p=0.95),
    dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02),
]


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_native_draws_follow_the_reference_distribution(kind, config):
    row = logits_of(kind)
    counts = draw_counts(row, DRAWS, **config)
    statistic, threshold, excluded = chi_square(counts, reference(row, **config))
    assert excluded == 0, f"{excluded} draws of tokens the filters exclude"
    assert statistic <= threshold, f"chi-square {statistic:.1f} above {threshold:.1f}"


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[5], CONFIGS[9]], ids=["temperature", "top_p", "combined"])
def test_torch_draws_follow_the_reference_distribution(config):
    """The torch fallback draws fewer times (it is the slower sampler; its draws also equal the
    native kernel's token for token, below)."""
    row = logits_of("random")
    counts = draw_counts(row, DRAWS // 3, sample=sample_torch, **config)
    statistic, threshold, excluded = chi_square(counts, reference(row, **config))
    assert excluded == 0 and statistic <= threshold


@needs_kernels
def test_penalties_change_the_distribution_as_defined():
    row = logits_of("random")
    ids = np.array([3, 17, 42, 99, 500], dtype=np.int64)
    counts = np.array([0, 1, 4, 0, 2], dtype=np.int32)  # 3 and 99 only in the prompt
    row[ids] = np.abs(row[ids]) + 2.0  # make them likely, so the penalty shows
    row[99] = -abs(row[99])  # negative logits are multiplied by the repetition penalty
    params = dict(temperature=0.9, top_p=0.95, repetition=1.3, presence=0.4, frequency=0.25)
    observed = draw_counts(row, DRAWS, penalty=(ids, counts), **params)
    expected = reference(penalized(row, ids, counts, 1.3, 0.4, 0.25), temperature=0.9, top_p=0.95)
    statistic, threshold, excluded = chi_square(observed, expected)
    assert excluded == 0 and statistic <= threshold
    statistic, threshold, excluded = chi_square(observed, reference(row, temperature=0.9, top_p=0.95))
    assert excluded > 0 or statistic > threshold  # the penalties did something


@needs_kernels
def test_the_check_catches_a_top_p_off_by_one_and_a_wrong_temperature():
    row = logits_of("random")
    row[:6] = np.log([0.3, 0.2, 0.15, 0.1, 0.05, 0.04]) + 10  # the top-p 0.8 boundary lies among the steps
    config = dict(temperature=1.0, top_p=0.8)
    counts = draw_counts(row, DRAWS, **config)
    statistic, threshold, excluded = chi_square(counts, reference(row, **config))
    assert excluded == 0 and statistic <= threshold
    for wrong in (reference(row, top_p_shift=1, **config), reference(row, top_p_shift=-1, **config),
                  reference(row, temperature=1.05, top_p=0.8)):  # fmt: skip
        statistic, threshold, excluded = chi_square(counts, wrong)
        assert excluded > 0 or statistic > threshold
    counts = draw_counts(logits_of("random"), DRAWS, temperature=1.0)
    statistic, threshold, _ = chi_square(counts, reference(logits_of("random"), temperature=1.1))
    assert statistic > threshold


@needs_kernels
def test_full_vocabulary_with_mass_below_the_band():
    """262,144 tokens with ~2% of the mass more than 16 nats below the top: draws and a top-k
    threshold there go through the deeper bins."""
    vocab = 262_144
    rng = np.random.default_rng(7)
    row = np.full(vocab, -16.5, dtype=np.float32) + rng.uniform(-0.4, 0.0, vocab).astype(np.float32)
    row[:40] = rng.uniform(-6.0, 0.0, 40).astype(np.float32)
    row[7] = 0.0
    for config in (dict(temperature=1.0), dict(temperature=1.0, top_k=200), dict(temperature=1.0, top_p=0.999)):
        probs = reference(row, **config)
        counts = draw_counts(row, 1500, rows_per_call=64, **config)  # ~30 expected in the pooled deep bin
        deep = probs * 0
        deep[40:] = 1  # pool the deep tokens: each is far too rare to count alone
        observed = np.array([*counts[:40], counts[40:].sum()])
        expected = np.array([*probs[:40], probs[40:].sum()])
        statistic, threshold, excluded = chi_square(observed, expected)
        assert excluded == 0 and statistic <= threshold, config
        assert counts[40:].sum() > 0 or config.get("top_k")


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_native_and_torch_draw_the_same_tokens(kind):
    row = logits_of(kind)
    ids = np.array([1, 5, 9], dtype=np.int64)
    counts = np.array([0, 3, 1], dtype=np.int32)
    for config in CONFIGS + [dict(temperature=0.0), dict(temperature=0.9, repetition=1.2, presence=0.3, frequency=0.2)]:
        n = 200
        logits = torch.from_numpy(row).repeat(n, 1)
        rows = sampler_rows(n, penalties=3, **config)
        pen_ids, pen_counts = np.tile(ids, n), np.tile(counts, n)
        native = sampling.sample(logits.clone(), rows, pen_ids, pen_counts)
        fallback = sample_torch(logits.clone(), rows, pen_ids, pen_counts)
        assert torch.equal(native.tokens, fallback.tokens), config


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_logprobs_are_log_softmax_of_the_raw_logits(backend):
    if backend == "native" and not library.cpu_kernels_available():
        pytest.skip("no native kernels")
    sample = sampling.sample if backend == "native" else sample_torch
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=g) * 3
    logits[2, ::7] = float("-inf")
    ids = np.array([10, 11, 12], dtype=np.int64)
    counts = np.array([1, 0, 2], dtype=np.int32)
    for config in (dict(temperature=1.0, logprobs=5), dict(temperature=0.7, top_p=0.8, logprobs=20, repetition=1.5, presence=1.0),
                   dict(temperature=0.0, logprobs=0, frequency=2.0)):  # fmt: skip
        rows = sampler_rows(6, penalties=3, **config)
        out = sample(logits.clone(), rows, np.tile(ids, 6), np.tile(counts, 6))
        expected = torch.log_softmax(logits.double(), dim=1)
        n = config["logprobs"]
        for r in range(6):
            token = int(out.tokens[r])
            assert float(out.token_logprobs[r]) == pytest.approx(float(expected[r, token]), abs=1e-5)
            top_values, top_ids = torch.topk(expected[r], n)
            assert torch.allclose(out.top_logprobs[r, :n].double(), top_values, atol=1e-5)
            assert set(out.top_ids[r, :n].tolist()) == set(top_ids.tolist())


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox-4x32-10."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in cases:
        assert tuple(int(w) for w in philox4x32(counter, key)) == expected
    # token 70 is lane 6 of chunk 1: V and its lane from block (1, 1), its word (6 >> 4) & 3 = 0 of block 1 * 16 + 6
    seed, position = 0x0123456789ABCDEF, 0x1122334455
    key = (seed & 0xFFFFFFFF, seed >> 32)
    head = philox4x32((position & 0xFFFFFFFF, position >> 32, 1, 1), key)
    block = philox4x32((position & 0xFFFFFFFF, position >> 32, 22, 0), key)
    largest = ((int(head[0]) + 0.5) * 2.0**-32) ** (1 / 64)
    expected = largest if int(head[1]) & 63 == 6 else largest * (int(block[0]) + 0.5) * 2.0**-32
    assert token_uniforms(seed, position, 71)[70] == pytest.approx(expected, rel=1e-15)
    u = token_uniforms(seed, position, 64 * 4096)
    assert len(set(u.tolist())) == len(u) and u.min() > 0 and u.max() < 1
    # independent uniforms: Kolmogorov-Smirnov against U(0, 1), and each chunk's largest where its header put it
    assert kstest(u, "uniform").pvalue > 1e-7
    chunk_max_lane = u.reshape(4096, 64).argmax(1)
    assert chisquare(np.bincount(chunk_max_lane, minlength=64)).pvalue > 1e-7
    noise = gumbel_noise(seed, position, 4096)
    assert np.all(np.isfinite(noise)) and abs(noise.mean() - 0.5772) < 0.06  # Gumbel(0, 1) has mean Euler's gamma


@needs_kernels
@pytest.mark.parametrize("n", [1, 63, 64, 200, 4096])
def test_native_token_uniforms_equal_torch_samplers(n):
    """Whole chunks (16 Philox blocks side by side) and single tokens both give torch_sampler's uniforms."""
    for seed, position in [(0, 0), (1234, 7), (2**64 - 1, 2**40 + 3)]:
        assert np.array_equal(sampling.token_uniforms(seed, position, n), token_uniforms(seed, position, n))


@needs_kernels
def test_bad_rows_are_refused():
    logits = torch.zeros(2, 10)
    rows = sampler_rows(2)
    rows["top_p"] = 0.0
    with pytest.raises(ValueError):
        sampling.sample(logits, rows, *NO_PENALTY)
    rows = sampler_rows(2, penalties=1)
    with pytest.raises(ValueError):
        sampling.sample(logits, rows, np.array([10, 3], dtype=np.int64), np.array([1, 1], dtype=np.int32))
