"""Sampling from the int8-screened lm_head (sampling.screened_sample): every token it draws is the
token the full-logits sampler draws from the exact bf16 product, and the engine gives a seeded
request the same tokens whichever path its rows take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from kvserve.kernels import library, products, sampling
from kvserve.engine import runner as runner_module
from test_sampler import CONFIGS, sampler_rows

needs_screen = pytest.mark.skipif(
    not (library.cpu_kernels_available() and sampling.int8_screen_available()),
    reason="the int8 screen needs AVX512-VNNI and BF16",
)

N, K = 5000, 128  # a vocabulary that does not fill its last tile of 16


@pytest.fixture(scope="module", params=["gaussian-packed", "outliers-packed", "gaussian-amx", "outliers-amx"])
def lm_head(request):
    """(kind, screened weight, the weight the full logits are computed with): packed_matmul's layout,
    or AMX tiles (what the engine holds on a CPU with them; the rescoring then runs on tiles too)."""
    kind, layout = request.param.split("-")
    if layout == "amx" and not products.amx_ready():
        pytest.skip("no AMX tiles on this CPU (the packed cases cover the screen)")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(N, K, generator=g) * 0.05
    weight[7] *= 4  # a few rows with larger norms: tokens that lead
    weight[4321] *= 3
    if kind == "outliers":
        # one large weight per row (in a dim the hidden rows barely use) makes its int8 step coarse:
        # the screen's approximations are then off by as much as the logits differ, and only its
        # proven bounds keep the draw exact
        weight[:, 5] = 2.0
    weight = weight.bfloat16()
    packed = products.amx_pack_weight(weight) if layout == "amx" else products.pack_weight(weight)
    return kind, sampling.screen_weight(packed, weight), packed


def full_logits(x, packed) -> torch.Tensor:
    if isinstance(packed, products.AmxWeight):
        return products.amx_matmul(x, packed, out_dtype=torch.float32)[0]
    return products.packed_matmul(x, packed, out_dtype=torch.float32)[0]


def hidden_rows(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 2.0, 6.0, 20.0]).repeat(count)[:count, None]  # flat to peaked distributions
    x = torch.randn(count, K, generator=g) * scale
    x[:, 5] *= 0.01
    return x.bfloat16()


def full_draw(x, packed, rows, ids, counts):
    logits = full_logits(x, packed)
    return sampling.sample(logits.contiguous(), rows, ids, counts).tokens


def penalties_on_top_tokens(x, packed, count: int, per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """Penalize each row's top tokens (where a penalty decides the draw) and a few random ones."""
    logits = full_logits(x, packed)
    rng = np.random.default_rng(1)
    ids, counts = [], []
    for r in range(count):
        top = logits[r].topk(per_row // 2).indices.numpy()
        rest = rng.choice(N, per_row - len(top), replace=False)
        row_ids = np.unique(np.concatenate([top, rest]))[:per_row]
        row_ids = np.concatenate([row_ids, rng.choice(N, per_row - len(row_ids), replace=False)])[:per_row]
        ids.append(row_ids)
        counts.append(rng.integers(0, 3, per_row))
    return np.concatenate(ids).astype(np.int64), np.concatenate(counts).astype(np.int32)


@needs_screen
@pytest.mark.parametrize("config", CONFIGS + [
    dict(temperature=1.0, top_k=4000), dict(temperature=0.05), dict(temperature=1.0, min_p=0.5),
    dict(temperature=1.0, repetition=1.3, presence=0.4, frequency=0.2),
    dict(temperature=0.7, top_k=40, top_p=0.9, repetition=1.1),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))  # fmt: skip
def test_every_screened_draw_is_the_full_logits_draw(lm_head, config):
    kind, screened, packed = lm_head
    rows_per_call, decided, total, partial = 4, 0, 0, 0
    penalties = 8 if {"repetition", "presence", "frequency"} & config.keys() else 0
    for call in range(40):
        x = hidden_rows(rows_per_call, seed=call)
        rows = sampler_rows(rows_per_call, seed=call, first_position=call * 10, penalties=penalties, **config)
        if penalties:
            ids, counts = penalties_on_top_tokens(x, packed, rows_per_call, penalties)
        else:
            ids, counts = np.empty(0, np.int64), np.empty(0, np.int32)
        tokens, rescored = sampling.screened_sample(x, screened, rows, ids, counts)
        expected = full_draw(x, packed, rows, ids, counts)
        drawn = tokens >= 0
        assert torch.equal(tokens[drawn], expected[drawn]), (call, tokens, expected)
        partial += int((rescored < -(-N // 16) // 2).sum())
        decided += int(drawn.sum())
        total += rows_per_call
    # rows are left to the full logits only where top-p needs the total mass (about 1 - top_p of them)
    least = 0.5 if config.get("top_p", 1.0) < 1.0 and not config.get("top_k") and not config.get("min_p") else 0.95
    assert decided >= least * total, decided
    if kind == "gaussian":
        assert partial >= total // 4  # the peaked rows at least computed under half the product exactly


@needs_screen
def test_one_row_and_many_rows_draw_alike(lm_head):
    """A lone row runs its vocabulary loops on every thread; rows of a batch take a thread each."""
    _, screened, packed = lm_head
    x = hidden_rows(6, seed=99)
    rows = sampler_rows(6, seed=3, temperature=0.9, top_p=0.95)
    no_penalty = np.empty(0, np.int64), np.empty(0, np.int32)
    together, _ = sampling.screened_sample(x, screened, rows, *no_penalty)
    alone = [int(sampling.screened_sample(x[i : i + 1], screened, rows[i : i + 1], *no_penalty)[0][0]) for i in range(6)]
    assert together.tolist() == alone


@needs_screen
def test_bad_rows_are_refused(lm_head):
    _, screened, _ = lm_head
    x = hidden_rows(1, seed=0)
    for bad in (dict(temperature=0.0), dict(temperature=1.0, logprobs=2)):
        with pytest.raises(ValueError):
            sampling.screened_sample(x, screened, sampler_rows(1, **bad), np.empty(0, np.int64), np.empty(0, np.int32))


@pytest.fixture(scope="module")
def bf16_llm(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="bfloat16", kv_cache_memory=0.02, seed=5)
    if llm.engine.model.screened_lm_head is None:
        pytest.skip("no int8 screen on this CPU")
    return llm


SEEDED = [
    SamplingParams(max_tokens=24, temperature=1.0, seed=42, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=9, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.2, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, seed=11, ignore_eos=True),
]


def test_seeded_requests_sample_the_same_screened_or_not(bf16_llm, monkeypatch):
    """Alone, a request's rows draw from the screen; batched with 31 others, or with the screen
    off, from the full logits: the same tokens every way."""
    screened_calls = []
    real = sampling.screened_sample

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        screened_calls.append(int((out[0] >= 0).sum()))
        return out

    monkeypatch.setattr(sampling, "screened_sample", spy)
    prompts = random_prompts(len(SEEDED), 8, 40, seed=21)
    alone = [bf16_llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, SEEDED)]
    assert sum(screened_calls) >= 0.5 * len(SEEDED) * 24  # most tokens came from the screen
    screened_calls.clear()
    others = random_prompts(31, 5, 60, seed=1)
    batched = bf16_llm.generate(prompts + others, SEEDED + [SamplingParams(max_tokens=24, temperature=1.0)] * 31, use_tqdm=False)
    assert [o.token_ids for o in batched[: len(SEEDED)]] == alone
    monkeypatch.setattr(runner_module, "SCREENED_SAMPLE_MAX_ROWS", 0)
    screened_calls.clear()
    unscreened = [bf16_llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, SEEDED)]
    assert not screened_calls and unscreened == alone
