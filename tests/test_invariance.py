"""The same bits every way a request runs: a request's greedy tokens, and a seeded request's sampled
tokens, with their logprobs, are identical alone, batched with 1, 7, 8 or 63 others, after a prefix
hit (hash or radix, one ending mid-block), prefilled in chunks of 1, 16, 17 or 256 tokens, and
after a forced preemption, in float32 and bf16, on every model family, with the kernels built for
this CPU and for an AVX2-only one (KVSERVE_MARCH=haswell)."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import random_prompts
from kvserve import LLM, SamplingParams
from kvserve.kernels import library, products
from kvserve.kernels.build import load_kernels

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
PLAIN_GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)  # the lm_head's argmax, no logits
PROMPT_COUNT = 3
SHARED = random_prompts(1, 37, 37, seed=41)[0]  # 37 tokens: a prefix hit ends mid-block (block size 16)
PROMPTS = [SHARED + tail for tail in random_prompts(PROMPT_COUNT, 5, 30, seed=42)]
OTHERS = random_prompts(63, 5, 60, seed=43)

pytestmark = pytest.mark.skipif(not library.cpu_kernels_available(), reason="needs the native kernels")


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True, logprobs=2)


def requests() -> list[tuple[list[int], SamplingParams]]:
    """Each prompt greedy with logprobs, plain greedy, and seeded."""
    return [(p, params) for i, p in enumerate(PROMPTS) for params in (GREEDY, PLAIN_GREEDY, seeded(i))]


def trace(output) -> tuple:
    """Token ids with the logprob of each and the top-2 (compared exactly)."""
    return tuple(output.token_ids), tuple((lp.logprob, tuple(sorted(lp.top.items()))) for lp in output.logprobs or ())


def engine(tiny_dir, family: str, dtype: str, **overrides) -> LLM:
    settings = dict(dtype=dtype, kv_cache_memory=0.02, max_num_seqs=64, enable_prefix_caching=False) | overrides
    return LLM(str(tiny_dir(family)), **settings)


def run(llm: LLM, batch: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
    outs = llm.generate([p for p, _ in batch], [params for _, params in batch], use_tqdm=False)
    return [trace(o) for o in outs]


@pytest.fixture(params=["native", "no-amx", "haswell"])
def isa(request, monkeypatch):
    """The kernels built for this CPU; the same without AMX tiles (KVSERVE_DISABLE_AMX=1: the
    AVX512-BF16 products and attention, on a CPU that has them); or built for an AVX2-only one
    (no AVX-512, no bf16 dot products)."""
    if request.param == "haswell":
        monkeypatch.setenv("KVSERVE_MARCH", "haswell")
    if request.param == "no-amx":
        monkeypatch.setenv("KVSERVE_DISABLE_AMX", "1")
    load_kernels.cache_clear()
    products.amx_ready.cache_clear()
    products.amx_ready()
    yield request.param
    monkeypatch.undo()
    load_kernels.cache_clear()
    products.amx_ready.cache_clear()
    products.amx_ready()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_every_way_a_request_runs_gives_the_same_bits(tiny_dir, family, dtype, isa):
    batch = requests()
    alone_llm = engine(tiny_dir, family, dtype)
    alone = [run(alone_llm, [request])[0] for request in batch]
    del alone_llm

    def check(name: str, got: list[tuple]) -> None:
        differ = [i for i, (g, a) in enumerate(zip(got, alone)) if g != a]
        assert not differ, f"{name}: requests {differ} differ from their runs alone"

    for others in (1, 7, 8, 63):
        llm = engine(tiny_dir, family, dtype)
        fillers = [(p, PLAIN_GREEDY) for p in OTHERS[:others]]
        got = [run(llm, [request, *fillers])[0] for request in batch[:3]]  # the first prompt's three requests
        check(f"batched with {others} others", got + alone[3:])
    check("all batched together", run(engine(tiny_dir, family, dtype), batch + [(p, PLAIN_GREEDY) for p in OTHERS])[: len(batch)])
    for cache in ("hash", "radix"):
        llm = engine(tiny_dir, family, dtype, enable_prefix_caching=True, prefix_cache=cache)
        run(llm, [(SHARED + [7, 8, 9], PLAIN_GREEDY)])  # caches the shared prefix
        got = [run(llm, [request])[0] for request in batch]
        assert llm.stats()["prefix_cache_hits_total"] > 0, f"{cache}: no prefix hit"
        check(f"{cache} prefix hit", got)
    for chunk in (1, 16, 17, 256):
        llm = engine(tiny_dir, family, dtype, max_num_batched_tokens=chunk)
        check(f"chunks of {chunk}", [run(llm, [request])[0] for request in batch])
    # the bytes of 128 tokens of every layer: the batch and eight long-running others cannot run at once
    probe = engine(tiny_dir, family, dtype, kv_cache_memory=0.001)
    memory = 128 * probe.stats()["bytes_per_token"] / 1024**3
    llm = engine(tiny_dir, family, dtype, kv_cache_memory=memory, max_model_len=128)
    long_runs = [(p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)) for p in OTHERS[:8]]
    got = run(llm, batch + long_runs)[: len(batch)]
    assert llm.stats()["num_preemptions"] > 0
    check("preempted", got)


def test_the_matrix_catches_a_product_that_depends_on_the_batch(tiny_dir, monkeypatch):
    """The mutation the contract forbids (a row's projections summing over the inner size in another
    order from 8 rows on: two halves added) must fail the comparison above."""
    import torch.nn.functional as F

    from kvserve.model import layers

    def split_inner(self, x):
        weight, half = self.dense_weight(), x.shape[1] // 2
        return F.linear(x[:, :half], weight[:, :half]) + F.linear(x[:, half:], weight[:, half:])

    native = layers.Linear.forward
    monkeypatch.setattr(layers.Linear, "forward", lambda self, x: native(self, x) if x.shape[0] < 8 else split_inner(self, x))
    request = (PROMPTS[0], GREEDY)
    alone = run(engine(tiny_dir, "llama", "float32"), [request])[0]
    batched = run(engine(tiny_dir, "llama", "float32"), [request, *[(p, PLAIN_GREEDY) for p in OTHERS[:7]]])[0]
    assert batched != alone


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_int4_and_int2_give_the_same_bits_every_way(tiny_dir, family, dtype, kv_dtype, isa):
    """KIVI quantizes a block once it leaves the residual window; every row reads quantized exactly
    the blocks a token decoding at its position reads quantized (attention/kivi_reads.py), so a
    request's tokens and logprobs with int4 / int2 KV are the same alone, batched, after a prefix
    hit (hash or radix: the cache keeps blocks' full-precision forms for the window before a hit,
    kv/kivi_hits.py), prefilled in any chunks and after a preemption."""
    kivi = dict(kv_cache_dtype=kv_dtype, kv_quant_group_size=16, kv_quant_residual=16)
    prompts = random_prompts(2 * PROMPT_COUNT, 50, 90, seed=44)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    batch = [(p, greedy if i % 2 else dataclasses.replace(seeded(i), max_tokens=40)) for i, p in enumerate(prompts)]
    alone_llm = engine(tiny_dir, family, dtype, **kivi)
    alone = [run(alone_llm, [request])[0] for request in batch]
    del alone_llm

    def check(name: str, got: list[tuple]) -> None:
        differ = [i for i, (g, a) in enumerate(zip(got, alone)) if g != a]
        assert not differ, f"{kv_dtype} {name}: requests {differ} differ from their runs alone"

    check("batched", run(engine(tiny_dir, family, dtype, **kivi), batch + [(p, PLAIN_GREEDY) for p in OTHERS[:13]])[: len(batch)])
    shared = random_prompts(1, 70, 70, seed=45)[0]
    hit_batch = [(shared + tail, params) for tail, params in zip(random_prompts(PROMPT_COUNT, 5, 30, seed=46), (greedy, seeded(7), greedy))]
    cold = [run(engine(tiny_dir, family, dtype, **kivi), [request])[0] for request in hit_batch]
    for cache in ("hash", "radix"):  # the hit ends past the residual window's start: its full-precision blocks are read
        llm = engine(tiny_dir, family, dtype, enable_prefix_caching=True, prefix_cache=cache, **kivi)
        run(llm, [(shared + [7, 8, 9], PLAIN_GREEDY)])
        outs = llm.generate([p for p, _ in hit_batch], [params for _, params in hit_batch], use_tqdm=False)
        assert min(o.num_cached_tokens for o in outs) == 64, f"{cache}: {[o.num_cached_tokens for o in outs]} tokens cached"
        differ = [i for i, (o, c) in enumerate(zip(outs, cold)) if trace(o) != c]
        assert not differ, f"{kv_dtype} {cache} prefix hit: requests {differ} differ from their cold runs"
    for chunk in (1, 16, 17, 256):
        llm = engine(tiny_dir, family, dtype, max_num_batched_tokens=chunk, **kivi)
        check(f"chunks of {chunk}", [run(llm, [request])[0] for request in batch])
    spec = llm.engine.kv_spec  # the chunks of 256's
    llm = engine(tiny_dir, family, dtype, num_kv_blocks=spec.min_blocks(160, 256), max_model_len=160, max_num_batched_tokens=256,
                 enable_prefix_caching=True, **kivi)  # fmt: skip
    long_runs = [(p, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)) for p in OTHERS[:16]]
    resumed = []
    preempt = llm.engine.scheduler._preempt

    def counted(seq):
        resumed.append(seq.num_computed_tokens)
        preempt(seq)

    llm.engine.scheduler._preempt = counted
    got = run(llm, long_runs + batch)[len(long_runs) :]  # the newest are preempted first: these
    assert max(resumed, default=0) > 3 * 16, "no sequence was preempted past its sink block and residual window"
    check("preempted", got)


def test_an_int4_hit_missing_its_windows_full_precision_form_is_shorter_not_different(tiny_dir):
    """Where the pool has dropped a full-precision form the residual window before a hit's end needs,
    the hit ends earlier (its window is further back) and the rest is computed: fewer cached tokens,
    the same bits."""
    from kvserve.kv.hashing import chain_hashes
    from kvserve.kv.kivi_hits import full_precision_key

    kivi = dict(kv_cache_dtype="int4", kv_quant_group_size=16, kv_quant_residual=16)
    shared = random_prompts(1, 70, 70, seed=45)[0]
    request = (shared + [5, 6, 7, 8], GREEDY)
    cold = run(engine(tiny_dir, "qwen3", "float32", **kivi), [request])[0]
    for dropped, cached in (((), 64), ((3,), 48), ((2, 3), 32)):
        llm = engine(tiny_dir, "qwen3", "float32", enable_prefix_caching=True, **kivi)
        run(llm, [(shared + [7, 8, 9], PLAIN_GREEDY)])
        kv = llm.engine.kv
        hashes = chain_hashes(kv.prefix_cache.root, shared[:64], 16, None)
        for i in dropped:  # the pool reuses these blocks' full-precision forms
            kv.arena._evict(kv.prefix_cache.cached(0, full_precision_key(hashes[i])), kv.arena.residual)
        out = llm.generate([request[0]], request[1], use_tqdm=False)[0]
        assert out.num_cached_tokens == cached and trace(out) == cold, f"forms of {dropped} dropped"


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
def test_int4_sliding_window_rows_read_by_position_in_any_chunk(tiny_dir, kv_dtype):
    """A sliding-window layer's rows read quantized only the blocks of their window older than the
    residual: in a chunk longer than the window, a middle row's range lies between the first row's
    and the last row's, and must be read quantized too (no residual window here, so the windows
    reach quantized blocks)."""
    kivi = dict(kv_cache_dtype=kv_dtype, kv_quant_group_size=16, kv_quant_residual=0)
    batch = [(p, GREEDY) for p in random_prompts(PROMPT_COUNT, 70, 90, seed=47)]
    alone = [run(engine(tiny_dir, "gemma3", "float32", max_num_batched_tokens=16, **kivi), [request])[0] for request in batch]
    for chunk in (17, 256):
        llm = engine(tiny_dir, "gemma3", "float32", max_num_batched_tokens=chunk, **kivi)
        got = [run(llm, [request])[0] for request in batch]
        assert got == alone, f"{kv_dtype} chunks of {chunk} differ from chunks of 16"
