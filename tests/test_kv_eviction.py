"""KV eviction (--kv-compression): SnapKV, sinks + window, random.

Keep ratio 1 changes nothing; sinks + window decodes exactly as transformers does with the evicted
positions masked out; SnapKV's window scores equal transformers' attention weights however the
prompt is chunked, pick known positions on a hand-built pattern, differ per head, and compaction
moves the kept K/V bit for bit; freed blocks go back to the pool; batching, chunked prefill,
preemption and n > 1 work with compression on.
"""

import dataclasses
import math

import pytest
import torch

from conftest import random_prompts
from tiny_models import hf_model
from kvserve import LLM, SamplingParams
from kvserve.attention.backend import create_backend
from kvserve.attention.metadata import AttentionMetadata, PrefillSpan, WindowScoreSpan
from kvserve.config import EngineConfig
from kvserve.engine import eviction as engine_eviction
from kvserve.kv.eviction import GENERIC_QUESTION, CompressionRegion, EvictionPolicy, sink_and_recent, top_positions
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.spec import KVCacheSpec
from kvserve.server.protocol import CompletionRequest

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BACKENDS = ["cpu_paged", "torch_sdpa"]


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("num_kv_blocks", 200)
    return LLM(str(path), **kwargs)


def _method_flags(method: str) -> dict:
    """"snapkv/generic" is SnapKV scored by its generic question ("snapkv/both": and its window)."""
    name, _, query = method.partition("/")
    return dict(kv_compression=name, snapkv_query=query) if query else dict(kv_compression=name)


def _check_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_compression="snapkv"), "needs a budget"),
        (dict(kv_compression="bogus", kv_budget=8), "kv_compression must be one of"),
        (dict(kv_compression="snapkv", kv_keep_ratio=0.5, kv_budget=8), "not both"),
        (dict(kv_compression="snapkv", kv_keep_ratio=0.0), "kv_keep_ratio"),
        (dict(kv_compression="snapkv", kv_budget=0), "kv_budget"),
        (dict(kv_compression="snapkv", kv_budget=8, snapkv_kernel=6), "odd"),
        (dict(kv_compression="snapkv", kv_budget=8, snapkv_window=0), "snapkv_window"),
        (dict(kv_compression="streaming", kv_budget=8, sink_tokens=-1), "sink_tokens"),
        (dict(kv_compression="snapkv", kv_budget=8, snapkv_query="question"), "snapkv_query must be one of"),
        (dict(kv_compression="snapkv", kv_budget=8, kv_cache_dtype="int4"), "KIVI"),
    ],
)
def test_engine_config_validates_compression(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_request_override_is_validated_and_refused_with_a_400_field():
    with pytest.raises(ValueError, match="kv_compression"):
        SamplingParams(kv_compression="snap")
    with pytest.raises(ValueError, match="kv_keep_ratio"):
        SamplingParams(kv_keep_ratio=1.5)
    body = CompletionRequest(prompt="hi", kv_compression="streaming", kv_keep_ratio=0.5)
    assert body.sampling_params(4, None).kv_compression == "streaming"
    with pytest.raises(ValueError, match="kv_compression"):
        CompletionRequest(prompt="hi", kv_compression="nope").sampling_params(4, None)


def test_a_request_asks_for_compression_with_the_fields_it_has(tiny_dir):
    engine = _llm(tiny_dir("llama")).engine  # --kv-compression none
    with pytest.raises(ValueError, match="needs kv_keep_ratio"):  # not kv_budget: a request cannot send one
        engine.eviction_policy(SamplingParams(kv_compression="snapkv"))
    with pytest.raises(ValueError, match="kv_keep_ratio needs kv_compression"):  # not silently ignored
        engine.eviction_policy(SamplingParams(kv_keep_ratio=0.5))
    assert engine.eviction_policy(SamplingParams(kv_compression="snapkv", kv_keep_ratio=0.5)).keep_ratio == 0.5
    assert _llm(tiny_dir("llama"), kv_compression="streaming", kv_budget=40).engine.eviction_policy(
        SamplingParams(kv_compression="snapkv")).budget == 40  # the engine's budget serves
    with pytest.raises(ValueError, match="compress_at"):
        engine.score([5, 6, 7, 8], compress_at="x")


def test_budget_counts_every_kept_token():
    assert EvictionPolicy("snapkv", keep_ratio=0.25).tokens_kept(1000) == 250
    assert EvictionPolicy("snapkv", budget=300).tokens_kept(1000) == 300
    assert EvictionPolicy("snapkv", budget=300).tokens_kept(100) == 100
    assert sink_and_recent(10, 6, 2).tolist() == [0, 1, 6, 7, 8, 9]
    scores = torch.arange(20.0).view(1, 1, 20) * 1e-3
    scores[0, 0, 3], scores[0, 0, 7] = 1.0, 0.5
    assert top_positions(scores, 6, 3, 1)[0, 0].tolist() == [3, 7, 16, 17, 18, 19]
    assert top_positions(scores, 4, 4, 1)[0, 0].tolist() == [3, 7, 18, 19]  # the window takes at most half the budget
    assert set(top_positions(scores, 4, 4, 3)[0, 0, :2].tolist()) <= {2, 3, 4}  # max-pooled: 3's neighbours score as 3 does


def test_a_model_of_sliding_window_layers_only_is_refused(tiny_dir):
    path = tiny_dir("gemma3-sliding")
    with pytest.raises(ValueError, match="every layer"):
        _llm(path, kv_compression="snapkv", kv_keep_ratio=0.5)
    llm = _llm(path)
    with pytest.raises(ValueError, match="every layer"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, kv_compression="streaming", kv_keep_ratio=0.5), use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0


# ---------------------------------------------------------------------- nothing changes at ratio 1
@pytest.mark.parametrize("backend", BACKENDS)
def test_keep_ratio_one_is_identical_to_no_compression(tiny_dir, backend):
    path = tiny_dir("llama")
    prompts = random_prompts(4, 40, 90, seed=3)
    expected = [o.token_ids for o in _llm(path, attention_backend=backend).generate(prompts, GREEDY, use_tqdm=False)]
    for method in ("snapkv", "streaming", "random"):
        llm = _llm(path, attention_backend=backend, kv_compression=method, kv_keep_ratio=1.0, max_num_batched_tokens=37)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected, method
        assert llm.stats()["kv_evicted_tokens_total"] == 0
        _check_free(llm)


# ---------------------------------------------------------------------- sinks + window, against transformers
def _masked_reference(hf, prompt: list[int], steps: int, budget: int, sinks: int, block_size: int) -> list[int]:
    """Greedy decoding in transformers with the positions sinks + window evicted masked out."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        tokens, n = [token], len(prompt)
        held = list(range(sinks)) + list(range(n - (budget - sinks), n))
        for _ in range(steps - 1):
            mask = torch.zeros(1, n + 1, dtype=torch.long)
            mask[0, held + [n]] = 1
            out = hf(torch.tensor([[token]]), past_key_values=past, attention_mask=mask, position_ids=torch.tensor([[n]]), use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
            tokens.append(token)
            held, n = held + [n], n + 1
            if len(held) >= budget + block_size:
                held = held[:sinks] + held[len(held) - (budget - sinks) :]
    return tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_decodes_as_transformers_with_evicted_positions_masked(tiny_dir, backend):
    path = tiny_dir("llama")
    hf = hf_model(path)
    prompts = random_prompts(3, 90, 110, seed=11)
    steps, budget, sinks = 40, 40, 4
    expected = [_masked_reference(hf, p, steps, budget, sinks, 16) for p in prompts]
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    # together and chunked: streaming keeps the same positions however the batch is cut
    llm = _llm(path, attention_backend=backend, kv_compression="streaming", kv_budget=budget, sink_tokens=sinks, max_num_batched_tokens=50)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.stats()["kv_compactions_total"] == 3 * 3  # after each prompt, then every 16 decoded tokens
    _check_free(llm)


# ---------------------------------------------------------------------- SnapKV scores
def _hf_window_scores(path, prompt: list[int], window: int, kv_heads: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = hf(torch.tensor([prompt]), output_attentions=True).attentions
    return torch.stack([a[0, :, -window:].sum(1).view(kv_heads, -1, len(prompt)).sum(1) for a in attentions])


@pytest.mark.parametrize("backend", BACKENDS)
# 60, 59: the window's 8 queries span two chunks, the last chunk one token (a decode row); 69: 5 queries from the block boundary at 64
@pytest.mark.parametrize("length", [60, 59, 69])
def test_snapkv_scores_are_the_window_attention_of_transformers(tiny_dir, monkeypatch, backend, length):
    path = tiny_dir("llama")
    prompt = random_prompts(1, length, length, seed=length)[0]
    seen = []
    real = engine_eviction.top_positions
    monkeypatch.setattr(engine_eviction, "top_positions", lambda scores, *a: seen.append(scores.clone()) or real(scores, *a))
    llm = _llm(path, attention_backend=backend, kv_compression="snapkv", kv_budget=20, snapkv_window=8, max_num_batched_tokens=29,
               snapkv_query="window")  # fmt: skip
    kept = _record_compactions(llm)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    expected = _hf_window_scores(path, prompt, length - 64 if length == 69 else 8, 2)
    torch.testing.assert_close(seen[0], expected, atol=1e-4, rtol=1e-4)
    (keep,) = kept
    assert keep.shape == (3, 2, 20) and (keep[..., -8:] == torch.arange(length - 8, length)).all()
    # per-head selection: the two KV heads of some layer keep different positions
    assert any(not torch.equal(keep[layer, 0], keep[layer, 1]) for layer in range(3))
    _check_free(llm)


def _hand_built(kv_dtype: str):
    """A 48-token prompt whose window queries (the last 4) attend, for KV head 0, to positions 5,
    17 and 30 and, for KV head 1, to 2, 11 and 40; the blocks are scattered through the pool."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, kv_dtype=kv_dtype, block_size=4)
    pool = PagedKVPool(spec, 32, torch.device("cpu"))
    n, window, heads = 48, 4, 4
    table = torch.tensor([9, 3, 17, 30, 1, 22, 5, 14, 28, 11, 2, 19])
    positions = torch.arange(n)
    slots = table[positions // 4] * 4 + positions % 4
    g = torch.Generator().manual_seed(0)
    k = torch.randn(n, 2, 8, generator=g) * 0.1
    v = torch.randn(n, 2, 8, generator=g)
    q = torch.randn(n, heads, 8, generator=g) * 0.1
    targets = {0: [5, 17, 30], 1: [2, 11, 40]}
    for head, places in targets.items():
        k[places, head] = 0
        k[places, head, head] = 4.0
        q[n - window :, 2 * head : 2 * head + 2] = 0
        q[n - window :, 2 * head : 2 * head + 2, head] = 4.0
    out = torch.zeros(1, 2, n)
    meta = AttentionMetadata(positions=positions, slot_mappings=[slots], prefills=[PrefillSpan(0, n, [0], [table])],
                             window_scores=[WindowScoreSpan(n - window, n, n - window, [table], out)])  # fmt: skip
    return pool, table, q, k, v, meta, out, targets


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_snapkv_keeps_known_positions_and_compaction_moves_them_bit_for_bit(kv_dtype):
    pool, table, q, k, v, meta, out, targets = _hand_built(kv_dtype)
    backend = create_backend("torch_sdpa", pool)
    dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
    backend.forward(0, q.to(dtype), k.to(dtype), v.to(dtype), meta, 8**-0.5, None)
    keep = top_positions(out, 6, 3, 1)
    for head, places in targets.items():
        assert keep[0, head].tolist() == places + [45, 46, 47]
    layer = pool.layers[0]
    before = layer.gather(table)
    pool.compact(table.tolist(), [0], keep)
    after = layer.gather(table)
    for which in range(2):
        for head in range(2):
            assert torch.equal(after[which][:6, head], before[which][keep[0, head], head])  # keys carry their RoPE'd positions


# ---------------------------------------------------------------------- blocks freed
def test_compressing_a_1000_token_prompt_frees_its_blocks(tiny_dir):
    path = tiny_dir("llama-long")
    llm = _llm(path, kv_compression="snapkv", kv_keep_ratio=0.25, num_kv_blocks=100, block_size=16)
    engine = llm.engine
    seq = engine.add_request(random_prompts(1, 1000, 1000, seed=2)[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while not seq.eviction_started:
        engine.step()
    held = engine.kv.num_held_blocks(seq.request_id, 0)
    assert held <= math.ceil(0.25 * 1000 / 16) + 2
    assert llm.stats()["num_free_blocks"] == 100 - held
    assert llm.stats()["kv_evicted_tokens_total"] == 750
    while engine.has_unfinished_requests():
        engine.step()
    _check_free(llm)


# ---------------------------------------------------------------------- batching, chunking, preemption, n > 1, prefix cache
@pytest.mark.parametrize("method", ["snapkv", "random", "snapkv/generic", "snapkv/both"])
def test_batched_and_chunked_prefill_compress_as_alone(tiny_dir, method):
    path = tiny_dir("qwen2")
    prompts = random_prompts(5, 60, 120, seed=4)
    flags = dict(_method_flags(method), kv_keep_ratio=0.4, snapkv_window=8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, seed=7)  # random draws its positions with the seed
    alone = [_llm(path, **flags).generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    chunked = _llm(path, max_num_batched_tokens=45, **flags)
    assert [o.token_ids for o in chunked.generate(prompts, params, use_tqdm=False)] == alone
    _check_free(chunked)


@pytest.mark.parametrize("method", ["snapkv", "streaming", "snapkv/generic", "snapkv/both"])
def test_preemption_with_compression_finishes_every_request(tiny_dir, method):
    path = tiny_dir("llama")
    prompts = random_prompts(6, 100, 110, seed=8)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    # 40 blocks of 16: the six sequences keep 80% of 160-170 tokens, 54 blocks or more
    llm = _llm(path, num_kv_blocks=40, **_method_flags(method), kv_keep_ratio=0.8, snapkv_window=8, max_num_batched_tokens=256)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [60] * 6
    assert llm.stats()["num_preemptions"] > 0
    _check_free(llm)


@pytest.mark.parametrize("method", ["snapkv", "streaming"])
def test_compressing_requests_read_prefix_hits_write_no_shared_block_and_publish_only_whole_blocks(tiny_dir, method):
    path = tiny_dir("llama")
    prompt = random_prompts(1, 80, 80, seed=9)[0]
    llm = _llm(path)
    squeezed = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, kv_compression=method, kv_keep_ratio=0.5)
    first = llm.generate([prompt], squeezed, use_tqdm=False)[0]
    # 80 tokens, 40 kept: snapkv writes them into 3 blocks taken for them, so none of the prompt's 5 is
    # written: its 4 full ones are published whole (a plain request reads them); a compressing request
    # reads all but its window's (its queries are computed). streaming writes into its last 3 blocks:
    # the first 2 are published, and all a compressing request reads
    whole, read = (64, 48) if method == "snapkv" else (32, 32)  # snapkv's window: 32 tokens
    plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert plain.num_cached_tokens == whole
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 64
    # the kept tokens found in them are moved into blocks of the request's own, and the tokens are those computed alone
    hit = llm.generate([prompt], squeezed, use_tqdm=False)[0]
    assert hit.num_cached_tokens == read and hit.token_ids == first.token_ids
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]  # the shared blocks still hold the prompt's K/V
    assert again.num_cached_tokens == 64 and again.token_ids == plain.token_ids
    assert llm.stats()["prefix_cache_requests_total"] == 5  # every request looked up
    samples = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True, kv_compression=method,
                                                    kv_keep_ratio=0.5), use_tqdm=False)  # fmt: skip
    assert [o.token_ids for o in samples] == [first.token_ids] * 3
    _check_free(llm)


@pytest.mark.parametrize("query", ["window", "both"])
def test_a_document_asked_another_question_computes_only_from_its_windows_first_block_boundary(tiny_dir, query):
    """An 80-token document and an 8-token question: SnapKV's 32-query window begins at the block
    boundary 64 (24 queries), so the same document asked another question reads 64 tokens from the
    cache (the window's first 32 positions would pull it back to 48) and gives the tokens it gives uncached."""
    path = tiny_dir("llama")
    document = random_prompts(1, 80, 80, seed=12)[0]
    first, second = (document + q for q in random_prompts(2, 8, 8, seed=13))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, kv_compression="snapkv", kv_keep_ratio=0.5, snapkv_query=query)
    uncached = _llm(path, enable_prefix_caching=False).generate([second], params, use_tqdm=False)[0]
    llm = _llm(path)
    assert llm.generate([first], params, use_tqdm=False)[0].num_cached_tokens == 0
    hit = llm.generate([second], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 64 and hit.token_ids == uncached.token_ids
    _check_free(llm)


def test_compressing_requests_with_hits_batched_and_chunked_decode_as_alone(tiny_dir):
    path = tiny_dir("llama")
    shared = random_prompts(1, 64, 64, seed=30)[0]
    prompts = [shared + p for p in random_prompts(6, 30, 60, seed=31)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, kv_compression="snapkv", kv_keep_ratio=0.5)
    alone = [_llm(path, snapkv_window=8, enable_prefix_caching=False).generate([p], params, use_tqdm=False)[0].token_ids
             for p in prompts]  # fmt: skip
    llm = _llm(path, snapkv_window=8, max_num_batched_tokens=40)
    llm.generate([shared + [5]], GREEDY, use_tqdm=False)  # the shared part in the cache
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in outs)
    assert [o.token_ids for o in outs] == alone
    _check_free(llm)


def _cached_contents(llm: LLM) -> dict[tuple[int, int], torch.Tensor]:
    """Every block in the prefix cache by (group, hash): its K/V as the pool holds them."""
    cache, pool = llm.engine.kv.prefix_cache, llm.engine.pool
    return {(b.group, b.block_hash): pool.read_block(b.block_id) for b in cache.blocks()}


@pytest.mark.parametrize("method", ["snapkv", "snapkv/both", "streaming", "random"])
def test_compression_spares_a_shared_prefix_and_never_publishes_a_compressed_block(tiny_dir, tmp_path, method):
    """Two requests share a 64-token prefix (kv_compress_from=64): the second reads all of it from the
    cache and compresses only its own 60 tokens; its tokens are those it gives first in a fresh
    engine; every block in the cache holds the K/V an engine without compression computes for it,
    and so does every block the host tier gives back."""
    path = tiny_dir("llama")
    shared = random_prompts(1, 64, 64, seed=40)[0]
    first, second = (shared + p for p in random_prompts(2, 60, 60, seed=41))
    flags = dict(_method_flags(method), kv_keep_ratio=0.5, snapkv_window=8)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, kv_compress_from=64, logprobs=2, seed=3)
    alone = _llm(path, **flags).generate([second], params, use_tqdm=False)[0]
    llm = _llm(path, **flags, kv_offload_host_gib=0.01, num_kv_blocks=60)
    llm.generate([first], params, use_tqdm=False)
    evicted = llm.engine.num_evicted_tokens
    out = llm.generate([second], params, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 64
    assert out.token_ids == alone.token_ids and [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in alone.logprobs]
    if method != "streaming":  # streaming evicts again as it decodes
        assert llm.engine.num_evicted_tokens - evicted == 30  # 60 own tokens, half kept; the shared 64 whole
    reference = _llm(path)  # no compression
    for prompt in (first, second):
        reference.generate([prompt], GREEDY, use_tqdm=False)
    expected, cached = _cached_contents(reference), _cached_contents(llm)
    assert len(cached) >= 4  # the shared prefix's 4 blocks at least
    assert all(torch.equal(block, expected[key]) for key, block in cached.items())
    # what left the pool for the host tier comes back whole: a plain request reads it as computed
    llm.engine.kv.offloader.drain()
    llm.engine.kv.offloader.prefill_rate = 1.0  # a tiny model recomputes faster than a tier reads: load anyway
    llm.engine.kv.offloader.observe_prefill = lambda tokens, seconds: None
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, kv_compression="none")
    llm.generate(random_prompts(12, 100, 100, seed=42), plain, use_tqdm=False)  # 84 blocks: push the prefixes out
    llm.engine.kv.offloader.drain()
    for prompt in (first, second):
        got, want = llm.generate([prompt], plain, use_tqdm=False)[0], _llm(path).generate([prompt], plain, use_tqdm=False)[0]
        assert got.num_cached_tokens >= 64
        assert got.token_ids == want.token_ids and [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]
    assert sum(t["hit_tokens"] for t in llm.stats()["kv_tiers"].values()) >= 64
    _check_free(llm)


def test_a_request_with_too_little_of_its_own_to_compress_runs_as_a_plain_one(tiny_dir):
    """snapkv with 16 own tokens after a 64-token shared prefix (window 8: no more than two windows):
    no question, no compaction; it reads and publishes the cache as a plain request, same tokens."""
    path = tiny_dir("llama")
    shared = random_prompts(1, 64, 64, seed=43)[0]
    own = random_prompts(1, 16, 16, seed=44)[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, kv_compress_from=64)
    llm = _llm(path, kv_compression="snapkv", kv_keep_ratio=0.5, snapkv_window=8)
    seq = llm.engine.add_request(shared + own, params)
    assert seq.eviction is None and seq.question is None
    while not seq.is_finished:
        llm.engine.step()
    assert llm.stats()["kv_compactions_total"] == 0 and llm.stats()["kv_probe_tokens_total"] == 0
    plain = _llm(path).generate([shared + own], GREEDY, use_tqdm=False)[0]
    assert seq.output_token_ids == plain.token_ids[:8]
    uncompressed = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, kv_compression="none")
    assert llm.generate([shared + own + [5]], uncompressed, use_tqdm=False)[0].num_cached_tokens == 80  # its own block was published
    longer = llm.engine.add_request(shared + own + [5], params)  # 17 own tokens: compressed
    assert longer.eviction is not None and longer.question is not None
    llm.engine.abort_request(longer.request_id)
    _check_free(llm)


def test_the_snapkv_window_begins_at_a_block_boundary_when_half_of_it_follows_one():
    window32, window8 = EvictionPolicy("snapkv", keep_ratio=0.5, window=32), EvictionPolicy("snapkv", keep_ratio=0.5, window=8)
    # a 32-query window keeps 17 to 32 queries, from the first boundary of its last 32 positions
    assert [window32.window_start(n, 16) for n in (785, 784, 800, 801, 769, 770)] == [768, 752, 768, 784, 752, 752]
    # an 8-query window moves to a boundary only when 4 or more of its queries follow it
    assert [window8.window_start(n, 16) for n in (68, 72, 67, 73, 80)] == [64, 64, 59, 65, 72]
    assert window32.window_start(20, 16) == 0 and window8.window_start(5, 16) == 0  # a prompt shorter than the window


def test_the_compressed_region_leaves_whole_what_its_compaction_never_writes():
    snapkv = EvictionPolicy("snapkv", keep_ratio=0.5, window=8)
    # a region no longer than two windows is kept whole (random has no window to pay for)
    assert not CompressionRegion.of(snapkv, 80, 64, 16).compresses(80) and CompressionRegion.of(snapkv, 81, 64, 16).compresses(81)
    assert CompressionRegion.of(snapkv, 80, 64, 16) == CompressionRegion(64, 80, 16, 80)
    assert CompressionRegion.of(EvictionPolicy("random", keep_ratio=0.5, window=8), 80, 64, 16).compresses(80)
    # 80 tokens from 0: 40 kept in 3 blocks taken for them, nothing written before 80; hits end before the window
    assert CompressionRegion.of(snapkv, 80, 0, 16) == CompressionRegion(0, 80, 40, 64)
    assert CompressionRegion.of(snapkv, 80, 0, 16).reserve(80, 16) == 3
    # in place: 40 kept in the last 3 of 5 blocks, the first 2 never written
    assert CompressionRegion.of(snapkv, 80, 0, 16, in_place=True) == CompressionRegion(0, 32, 40, 32, True)
    assert CompressionRegion.of(snapkv, 80, 0, 16, in_place=True).reserve(80, 16) == 0
    # 124 tokens, the first 64 shared (70 rounds down to a block): 30 of the last 60 kept, 2 blocks of 4 in place
    assert CompressionRegion.of(snapkv, 124, 70, 16, in_place=True) == CompressionRegion(64, 96, 30, 96, True)
    assert CompressionRegion.of(snapkv, 124, 70, 16) == CompressionRegion(64, 124, 30, 112)
    # the window's queries are computed: a budget of 8 leaves 7 of 8 blocks untouched, a hit reads up to the window's
    # first block boundary (its last 16 queries), or the block before the window where fewer than half would follow one
    assert CompressionRegion.of(EvictionPolicy("snapkv", budget=8, window=24), 128, 0, 16, in_place=True).hit_end == 112
    assert CompressionRegion.of(EvictionPolicy("snapkv", budget=8, window=24), 126, 0, 16, in_place=True).hit_end == 112
    assert CompressionRegion.of(EvictionPolicy("snapkv", budget=8, window=24), 122, 0, 16, in_place=True).hit_end == 96
    assert CompressionRegion.of(EvictionPolicy("snapkv", budget=8, window=24), 128, 0, 16).whole == 128
    # random scores no window: a hit reads everything before the compression point's block
    assert CompressionRegion.of(EvictionPolicy("random", keep_ratio=0.5), 80, 0, 16).hit_end == 80
    # nothing to compress: all whole (streaming keeps evicting as it decodes: its own blocks stay its own)
    assert CompressionRegion.of(EvictionPolicy("snapkv", budget=64), 60, 0, 16) == CompressionRegion(0, 60, 60, 60)
    assert CompressionRegion.of(EvictionPolicy("snapkv", budget=64), 60, 0, 16).reserve(60, 16) == 0
    streaming = CompressionRegion.of(EvictionPolicy("streaming", budget=64), 60, 0, 16)
    assert streaming.whole == 0 and streaming.in_place and streaming.reserve(60, 16) == 0
    assert not CompressionRegion.of(snapkv, 50, 64, 16).compresses(50)


def test_a_prompt_whose_compaction_blocks_could_never_fit_compacts_in_place(tiny_dir):
    """The blocks a SnapKV compaction writes into are taken beside the prompt's; a prompt near what
    the pool holds alone could never have both, so it writes into its own last blocks instead: it
    runs, with the tokens of an engine with room, and publishes only what it leaves whole."""
    path = tiny_dir("llama")
    # the window's queries alone: the generic question would be cut to the room left before max_model_len
    flags = dict(kv_compression="snapkv", kv_keep_ratio=0.5, snapkv_window=8, snapkv_query="window")
    prompt = random_prompts(1, 300, 300, seed=50)[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    roomy = _llm(path, **flags)
    want = roomy.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert roomy.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 288  # every whole block published
    tight = _llm(path, num_kv_blocks=20, **flags)
    seqs = []
    for tokens in (prompt, prompt[:150]):
        seqs.append(tight.engine.add_request(tokens, params))
        while tight.engine.has_unfinished_requests():
            tight.engine.step()
    assert [s.compacts_in_place for s in seqs] == [True, False] and seqs[0].output_token_ids == want
    # 150 tokens kept in the last 10 of 19 blocks: the first 9 published
    assert tight.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 144
    _check_free(tight)


def test_kv_compress_from_is_validated_and_needs_compression(tiny_dir):
    for bad in (-1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="kv_compress_from"):
            SamplingParams(kv_compress_from=bad)
    with pytest.raises(ValueError, match=r"an integer from 0 to 2147483647\), got 2147483648"):  # the bound is named (QA)
        SamplingParams(kv_compress_from=2**31)
    assert SamplingParams(kv_compress_from=2**31 - 1).kv_compress_from == 2**31 - 1
    llm = _llm(tiny_dir("llama"))
    with pytest.raises(ValueError, match="kv_compress_from needs kv_compression"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=2, kv_compress_from=16), use_tqdm=False)
    # past the prompt: nothing is compressed, every block is published
    squeezed = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, kv_compression="snapkv", kv_keep_ratio=0.5,
                              kv_compress_from=10_000)  # fmt: skip
    llm.generate([[7] * 70], squeezed, use_tqdm=False)
    assert llm.engine.num_evicted_tokens == 0
    assert llm.generate([[7] * 70], GREEDY, use_tqdm=False)[0].num_cached_tokens == 64
    # streaming's budget still bounds the output: kv_compress_from counts prompt tokens only
    streaming = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, kv_compression="streaming", kv_keep_ratio=0.25)
    runs = []
    for n in (16, 20, 10_000):
        engine = _llm(tiny_dir("llama"))
        out = engine.generate([[9] * 20], dataclasses.replace(streaming, kv_compress_from=n), use_tqdm=False)[0]
        runs.append((out.token_ids, engine.engine.num_evicted_tokens))
    assert runs[0] == runs[1] == runs[2] and runs[0][1] > 30  # 16 whole, then a quarter of what follows


def test_int8_cache_compresses(tiny_dir):
    path = tiny_dir("llama")
    llm = _llm(path, kv_cache_dtype="int8", kv_compression="snapkv", kv_keep_ratio=0.3, snapkv_window=8)
    outs = llm.generate(random_prompts(3, 60, 90, seed=6), GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 12 for o in outs) and llm.stats()["kv_evicted_tokens_total"] > 0
    _check_free(llm)


# ---------------------------------------------------------------------- compressing before the rest of the prompt
def _record_compactions(llm: LLM) -> list[torch.Tensor]:
    """The `keep` tensor of every compaction the engine makes from now on."""
    kept, compact = [], llm.engine.pool.compact
    llm.engine.pool.compact = lambda ids, slices, keep, *rest: kept.append(keep.clone()) or compact(ids, slices, keep, *rest)
    return kept


def _compressed_at(path, backend: str, seed: int, k: int) -> tuple[LLM, torch.Tensor, list[torch.Tensor], torch.Tensor, list[int]]:
    """A 100-token text scored with its first k tokens compressed to 24 by `random` (the same positions in
    every layer and head): the engine, its hidden states, its compactions, the attention transformers
    must reproduce in the compressed layers (query i may read key j), and the text."""
    tokens = random_prompts(1, 100, 100, seed=seed)[0]
    llm = _llm(path, attention_backend=backend, kv_compression="random", kv_budget=24, snapkv_window=8, max_num_batched_tokens=40)
    kept = _record_compactions(llm)
    hidden = llm.engine.score(tokens, chunk=24, compress_at=k)  # a chunk ends at k, not at 72
    allowed = torch.ones(100, 100).tril().bool()
    evicted = torch.ones(100, dtype=torch.bool)
    evicted[kept[0][0, 0]] = False
    evicted[k:] = False
    allowed[k:, evicted] = False
    return llm, hidden, kept, allowed, tokens


def _hf_logits_with_mask(hf, tokens: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """transformers' logits when query i may attend to key j only where allowed[i, j]."""
    mask = torch.zeros(1, 1, len(tokens), len(tokens))
    mask[0, 0][~allowed] = torch.finfo(torch.float32).min
    with torch.no_grad():
        return hf(torch.tensor([tokens]), attention_mask=mask).logits[0].float()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compress_at_computes_the_rest_against_the_kept_positions_as_transformers_masks_them(tiny_dir, backend):
    """score(compress_at=k): positions before k see everything; k and after see the kept ones and their own."""
    path, k = tiny_dir("llama"), 64
    llm, hidden, kept, allowed, tokens = _compressed_at(path, backend, 21, k)
    (keep,) = kept  # random keeps the same positions in every layer and head
    positions = keep[0, 0]
    assert (keep == positions).all() and positions.numel() == 24 and (positions[-8:] == torch.arange(k - 8, k)).all()
    expected = _hf_logits_with_mask(hf_model(path), tokens, allowed)
    with torch.inference_mode():
        logits = llm.engine.model.compute_logits(hidden).float()
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)
    # and the cache really holds only the kept positions plus the rest of the prompt
    assert llm.stats()["kv_evicted_tokens_total"] == k - 24
    _check_free(llm)


# ---------------------------------------------------------------------- SnapKV scored by a generic question
def _generic(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(GENERIC_QUESTION, add_special_tokens=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [40, 9])  # 9: the question (28 tokens here) ends in a one-token chunk, a decode row
def test_a_generic_question_scores_the_compressed_tokens_and_leaves_no_trace(tiny_dir, monkeypatch, backend, chunk):
    """--snapkv-query generic: the scores are transformers' attention of the generic question appended
    after the first k tokens; the question's K/V is dropped, so the rest of the text is computed
    exactly as when the same positions are kept by a prompt-window SnapKV (the question never ran)."""
    path, k = tiny_dir("llama"), 64
    tokens = random_prompts(1, 100, 100, seed=23)[0]
    seen = []
    real = engine_eviction.top_positions
    monkeypatch.setattr(engine_eviction, "top_positions", lambda scores, *a: seen.append(scores.clone()) or real(scores, *a))
    flags = dict(attention_backend=backend, kv_compression="snapkv", kv_budget=24, snapkv_window=8, max_num_batched_tokens=40)
    llm = _llm(path, snapkv_query="generic", **flags)
    kept = _record_compactions(llm)
    hidden = llm.engine.score(tokens, chunk=chunk, compress_at=k)
    question = _generic(llm)
    assert len(question) == 28 and llm.stats()["kv_probe_tokens_total"] == len(question)
    assert seen[0].shape == (3, 2, k)
    torch.testing.assert_close(seen[0], _hf_window_scores(path, tokens[:k] + question, len(question), 2)[..., :k], atol=1e-4, rtol=1e-4)
    (keep,) = kept
    assert any(not torch.equal(keep[layer, 0], keep[layer, 1]) for layer in range(3))  # chosen per head
    _check_free(llm)
    # the same positions kept by a window-scored SnapKV whose selection is replaced by this one
    monkeypatch.setattr(engine_eviction, "top_positions", lambda *a: keep)
    plain = _llm(path, snapkv_query="window", **flags)
    torch.testing.assert_close(plain.engine.score(tokens, chunk=chunk, compress_at=k), hidden, atol=0, rtol=0)
    assert plain.stats()["kv_probe_tokens_total"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_adds_the_windows_scores_and_the_generic_questions(tiny_dir, monkeypatch, backend):
    """--snapkv-query both: the scores are transformers' attention of the window's last 8 queries
    over the first k tokens plus that of the generic question appended after them, each question
    query weighing --snapkv-question-weight x 8 / len(question) (the two means in that ratio)."""
    path, k = tiny_dir("llama"), 64
    tokens = random_prompts(1, 100, 100, seed=23)[0]
    window = _hf_window_scores(path, tokens[:k], 8, 2)
    for weight in (3.0, 0.5):
        seen = []
        real = engine_eviction.top_positions
        monkeypatch.setattr(engine_eviction, "top_positions", lambda scores, *a: seen.append(scores.clone()) or real(scores, *a))
        llm = _llm(path, attention_backend=backend, kv_compression="snapkv", kv_budget=24, snapkv_window=8, max_num_batched_tokens=40,
                   snapkv_query="both", snapkv_question_weight=weight)  # fmt: skip
        llm.engine.score(tokens, chunk=40, compress_at=k)
        monkeypatch.setattr(engine_eviction, "top_positions", real)
        question = _generic(llm)
        assert llm.stats()["kv_probe_tokens_total"] == len(question)
        asked = _hf_window_scores(path, tokens[:k] + question, len(question), 2)[..., :k]
        torch.testing.assert_close(seen[0], window + asked * (weight * 8 / len(question)), atol=1e-4, rtol=1e-4)
        _check_free(llm)


def test_the_question_weight_is_validated():
    for bad in (0, -1.0, float("nan"), float("inf"), 1e300, True, "3"):
        with pytest.raises(ValueError, match=r"snapkv_question_weight must be a number in \(0, 1e\+06\]"):
            EvictionPolicy("snapkv", 0.5, query="both", question_weight=bad)
    assert EvictionPolicy("snapkv", 0.5, query="generic").question_query_weight(32, 11) == 1.0  # only "both" mixes
    assert EvictionPolicy("snapkv", 0.5, query="both", question_weight=2.0).question_query_weight(32, 8) == 8.0  # 2 x 32 / 8


def test_a_request_preempted_while_its_generic_question_runs_computes_it_again(tiny_dir):
    path = tiny_dir("llama")
    prompt = random_prompts(1, 90, 90, seed=26)[0]
    # a step of 100 tokens holds the prompt, not its question too: the question runs in a step of its own
    llm = _llm(path, kv_compression="snapkv", snapkv_query="generic", kv_keep_ratio=0.4, snapkv_window=8, max_num_batched_tokens=100)
    engine, question = llm.engine, _generic(llm)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # the prompt, its first token sampled; the question is next
    assert seq.probe == question and seq.num_tokens == 90 + len(question) and len(seq.token_ids) == 91
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq)
    assert seq.probe is None and seq.num_tokens == 91
    while not seq.is_finished:
        engine.step()
    assert seq.num_output_tokens == 8 and seq.num_preemptions == 1
    # counted once: the first question was dropped unrun
    assert llm.stats()["kv_probe_tokens_total"] == len(question) and llm.stats()["kv_compactions_total"] == 1
    _check_free(llm)


@pytest.mark.parametrize("query", ["generic", "both"])
def test_the_prompts_last_chunk_takes_the_generic_question_on(tiny_dir, monkeypatch, query):
    """With room in the step, the generic question is computed with the prompt's last chunk: one step
    samples the first token, scores with transformers' attention and compresses; the tokens and the
    positions kept are those of the question computed in a step of its own (a 100-token step)."""
    path = tiny_dir("llama")
    prompt = random_prompts(1, 90, 90, seed=28)[0]
    runs = {}
    for budget in (512, 100, 72):  # one chunk with the question; the prompt alone; two chunks, the second with the question
        seen = []
        real = engine_eviction.top_positions
        monkeypatch.setattr(engine_eviction, "top_positions", lambda scores, *a: seen.append(scores.clone()) or real(scores, *a))
        llm = _llm(path, kv_compression="snapkv", snapkv_query=query, kv_keep_ratio=0.4, snapkv_window=8, max_num_batched_tokens=budget,
                   snapkv_question_weight=3.0)  # fmt: skip
        kept = _record_compactions(llm)
        question, engine = _generic(llm), llm.engine
        seq = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        steps = 1 if budget == 512 else 2
        for _ in range(steps):
            engine.step()
        assert seq.eviction_started and seq.probe is None and len(seq.token_ids) == 91 and seq.num_computed_tokens == 90
        assert llm.stats()["kv_probe_tokens_total"] == len(question) and llm.stats()["kv_compactions_total"] == 1
        while not seq.is_finished:
            engine.step()
        monkeypatch.setattr(engine_eviction, "top_positions", real)
        runs[budget] = (seq.output_token_ids, seen[0], kept[0])
        _check_free(llm)
    asked = _hf_window_scores(path, prompt + question, len(question), 2)[..., :90]
    expected = asked if query == "generic" else _hf_window_scores(path, prompt, 8, 2) + asked * (3.0 * 8 / len(question))
    for budget, (tokens, scores, keep) in runs.items():
        torch.testing.assert_close(scores, expected, atol=1e-4, rtol=1e-4, msg=f"budget {budget}")
        assert tokens == runs[100][0] and torch.equal(keep, runs[100][2]), budget


def test_a_prompt_whose_last_chunk_asks_the_generic_question_completes_its_step_at_prefill_step_tokens(tiny_dir):
    """--prefill-step-tokens counts a chunk that takes the generic question on as completing its prompt (its
    first token is drawn in that step): found on the ladder, where compressing requests never closed a step."""
    path = tiny_dir("llama")
    prompts = random_prompts(3, 90, 90, seed=31)
    runs = {}
    for target in (0, 60):
        llm = _llm(path, kv_compression="snapkv", snapkv_query="generic", kv_keep_ratio=0.4, snapkv_window=8, max_num_batched_tokens=512,
                   prefill_step_tokens=target)  # fmt: skip
        engine = llm.engine
        seqs = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in prompts]
        engine.step()  # three prompts and their questions fit the budget; at 60 the first closes the step
        assert [s.num_output_tokens for s in seqs] == ([1, 1, 1] if target == 0 else [1, 0, 0])
        assert llm.stats()["kv_probe_tokens_total"] == len(_generic(llm)) * (3 if target == 0 else 1)
        while engine.has_unfinished_requests():
            engine.step()
        runs[target] = [s.output_token_ids for s in seqs]
        _check_free(llm)
    assert runs[60] == runs[0]


def test_prompt_logprobs_of_a_prompt_whose_last_chunk_asks_the_generic_question(tiny_dir):
    """The question's rows score no prompt token: the prompt's logprobs are those of the uncompressed run."""
    path = tiny_dir("llama")
    prompt = random_prompts(1, 90, 90, seed=29)[0]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    compressed = _llm(path, kv_compression="snapkv", snapkv_query="generic", kv_keep_ratio=0.4, snapkv_window=8, max_num_batched_tokens=64)
    plain = _llm(path, max_num_batched_tokens=64)
    got, want = (llm.generate([prompt], params, use_tqdm=False)[0] for llm in (compressed, plain))
    assert compressed.stats()["kv_probe_tokens_total"] == len(_generic(compressed))
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == 90 and got.token_ids[0] == want.token_ids[0]
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and a.rank == b.rank and a.top.keys() == b.top.keys() and abs(a.logprob - b.logprob) < 1e-4


def test_a_request_chooses_the_generic_question(tiny_dir):
    path = tiny_dir("llama")
    prompt = random_prompts(1, 90, 90, seed=27)[0]
    llm = _llm(path, kv_compression="snapkv", kv_keep_ratio=0.4, snapkv_window=8, snapkv_query="window")  # the engine scores with the window
    generic = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, snapkv_query="generic")
    out = llm.generate([prompt], generic, use_tqdm=False)[0]
    assert llm.stats()["kv_probe_tokens_total"] == len(_generic(llm))
    engine_wide = _llm(path, kv_compression="snapkv", snapkv_query="generic", kv_keep_ratio=0.4, snapkv_window=8)
    assert engine_wide.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids[:6] == out.token_ids
    window = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, snapkv_query="window")
    assert engine_wide.generate([prompt], window, use_tqdm=False)[0].token_ids == llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids[:6]
    assert engine_wide.stats()["kv_probe_tokens_total"] == len(_generic(llm))  # the window request asked nothing
    with pytest.raises(ValueError, match="snapkv_query must be one of"):
        SamplingParams(snapkv_query="question")
    for field in ("snapkv_query", "kv_compression"):  # a client's long string is not echoed whole
        with pytest.raises(ValueError, match=field) as refused:
            SamplingParams(**{field: "x" * 100_000})
        assert len(str(refused.value)) < 200
    with pytest.raises(ValueError, match="snapkv_query needs kv_compression snapkv"):
        llm.engine.eviction_policy(SamplingParams(snapkv_query="generic", kv_compression="streaming"))
    with pytest.raises(ValueError, match="snapkv_query needs kv_compression snapkv"):
        _llm(path).engine.eviction_policy(SamplingParams(snapkv_query="generic"))
    with pytest.raises(ValueError, match="tokenizer"):
        _llm(path, kv_compression="snapkv", kv_keep_ratio=0.5, skip_tokenizer_init=True).engine.eviction_policy(generic)
    body = CompletionRequest(prompt="hi", kv_compression="snapkv", kv_keep_ratio=0.5, snapkv_query="generic")
    assert body.sampling_params(4, None).snapkv_query == "generic"
    _check_free(llm)


def _run_counting_blocks(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[int]]:
    """The request's tokens, and the free blocks after each step from its second output token on."""
    seq, free = llm.engine.add_request(prompt, params), []
    while not seq.is_finished:
        llm.engine.step()
        if seq.num_output_tokens >= 2:
            free.append(llm.stats()["num_free_blocks"])
    return seq.output_token_ids, free


def test_a_generic_question_on_gemma3_and_where_it_cannot_run(tiny_dir):
    """Hybrid models: the question's slots in the sliding groups are dropped too, and their window is
    intact after it (tokens equal a window-scored run made to keep the same positions). A prompt at
    max_model_len leaves no positions for the question: it scores nothing and keeps the window. An
    engine without a tokenizer cannot write the question."""
    path = tiny_dir("gemma3")
    prompts = random_prompts(3, 70, 90, seed=24)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = _llm(path, kv_compression="snapkv", snapkv_query="generic", kv_keep_ratio=0.4, snapkv_window=8)
    kept = _record_compactions(llm)
    runs = [_run_counting_blocks(llm, p, params) for p in prompts]
    assert llm.stats()["kv_probe_tokens_total"] == 3 * len(_generic(llm))
    _check_free(llm)
    for prompt, keep, run in zip(prompts, kept, runs):
        plain = _llm(path, kv_compression="snapkv", kv_keep_ratio=0.4, snapkv_window=8, snapkv_query="window")
        plain.engine.pool.compact = (lambda compact: lambda ids, slices, _, *rest: compact(ids, slices, keep, *rest))(plain.engine.pool.compact)
        assert _run_counting_blocks(plain, prompt, params) == run  # same tokens, and no block of the question held
    full = _llm(path, kv_compression="snapkv", snapkv_query="generic", kv_budget=8, snapkv_window=8, max_model_len=40)
    out = full.generate([random_prompts(1, 39, 39, seed=25)[0]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and full.stats()["kv_probe_tokens_total"] == 0  # finished on its first token: never computed
    seq = full.engine.add_request(random_prompts(1, 38, 38, seed=25)[0], SamplingParams(max_tokens=2, temperature=0))
    full.engine.step()  # the prompt and the room left below max_model_len of the question, in one step
    assert seq.eviction_started and full.stats()["kv_probe_tokens_total"] == 2 and full.stats()["kv_compactions_total"] == 1
    while not seq.is_finished:
        full.engine.step()
    assert full.stats()["kv_probe_tokens_total"] == 2 and full.stats()["kv_compactions_total"] == 1
    with pytest.raises(ValueError, match="tokenizer"):
        _llm(path, kv_compression="snapkv", snapkv_query="generic", kv_keep_ratio=0.5, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="snapkv_query both writes its generic question.*--snapkv-query window; both is"):
        _llm(path, kv_compression="snapkv", kv_keep_ratio=0.5, skip_tokenizer_init=True)
    _llm(path, kv_compression="snapkv", kv_keep_ratio=0.5, skip_tokenizer_init=True, snapkv_query="window")  # the prompt's window needs none


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma3_compresses_its_full_attention_layers_and_its_sliding_layers_keep_their_window(tiny_dir, backend):
    """Hybrid models: the full-attention group is compacted, the sliding groups are not (their slots
    stay positions), and the result is transformers' with the evicted positions masked out of the
    full layers only."""
    path = tiny_dir("gemma3-w4")
    llm, hidden, kept, full, tokens = _compressed_at(path, backend, 24, 64)
    assert len(kept) == 1 and kept[0].shape[0] == 2  # one group: layers 2 and 5
    causal = torch.ones(100, 100).tril().bool()
    sliding = causal & ~torch.ones(100, 100).tril(-4).bool()  # query i sees keys i-3 .. i
    masks = {}
    for name, allowed in (("full_attention", full), ("sliding_attention", sliding)):
        masks[name] = torch.zeros(1, 1, 100, 100)
        masks[name][0, 0][~allowed] = torch.finfo(torch.float32).min
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([tokens]), attention_mask=masks).logits[0].float()
    with torch.inference_mode():
        logits = llm.engine.model.compute_logits(hidden).float()
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)
    _check_free(llm)


def test_gemma3_compression_frees_blocks_and_works_batched_chunked_and_preempted(tiny_dir):
    path = tiny_dir("gemma3-w8")
    prompts = random_prompts(6, 100, 140, seed=25)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for method in ("snapkv", "streaming"):
        flags = dict(kv_compression=method, kv_keep_ratio=0.5, snapkv_window=8)
        alone = [_llm(path, **flags).generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
        batched = _llm(path, max_num_batched_tokens=48, **flags)
        assert [o.token_ids for o in batched.generate(prompts, params, use_tqdm=False)] == alone, method
        # two sliding groups hold ~2 blocks each, the full group half the prompt and what it generates: 30 blocks preempt
        # (a preempted sequence is recomputed and compressed again, its output so far included: its tokens may change);
        # snapkv is admitted with the blocks its compaction writes into as well (the prompt's stay whole): 36 do
        squeezed = _llm(path, num_kv_blocks=36 if method == "snapkv" else 30, max_num_batched_tokens=48, **flags)
        assert [len(o.token_ids) for o in squeezed.generate(prompts, params, use_tqdm=False)] == [100] * 6
        assert squeezed.stats()["num_preemptions"] > 0 and squeezed.stats()["kv_evicted_tokens_total"] > 0
        _check_free(batched)
        _check_free(squeezed)
    llm = _llm(path, kv_compression="snapkv", kv_keep_ratio=0.25, block_size=16)
    engine = llm.engine
    seq = engine.add_request(random_prompts(1, 400, 400, seed=26)[0], SamplingParams(max_tokens=4))
    while not seq.eviction_started:
        engine.step()
    full = [g for g, group in enumerate(engine.kv.groups) if group.window is None]
    assert [engine.kv.num_held_blocks(seq.request_id, g) for g in full] == [math.ceil(100 / 16)]
    assert all(engine.kv.num_held_blocks(seq.request_id, g) <= 2 for g in range(len(engine.kv.groups)) if g not in full)


def test_compress_at_the_prompt_end_is_compressing_after_prefill_and_bad_points_are_refused(tiny_dir):
    path = tiny_dir("llama")
    prompt = random_prompts(1, 90, 90, seed=22)[0]
    llm = _llm(path, kv_compression="snapkv", kv_keep_ratio=0.3, snapkv_window=8, max_num_batched_tokens=32)
    engine = llm.engine

    def run(compress_at):
        seq = engine.add_request(prompt, GREEDY, compress_at=compress_at)
        while not seq.is_finished:
            engine.step()
        return seq.output_token_ids

    at_end = run(None)
    assert run(len(prompt)) == at_end
    assert run(50) != at_end  # the question-agnostic cache is another cache
    for bad in (0, len(prompt) + 1, 2.5, True):
        with pytest.raises(ValueError, match="compress_at"):
            engine.add_request(prompt, GREEDY, compress_at=bad)
    with pytest.raises(ValueError, match="leaves none"):
        engine.score(prompt, compress_at=len(prompt))
    _check_free(llm)


def test_streaming_keeps_evicting_while_the_rest_of_the_prompt_is_computed(tiny_dir):
    path = tiny_dir("llama")
    tokens = random_prompts(1, 200, 200, seed=23)[0]
    llm = _llm(path, kv_compression="streaming", kv_budget=24, sink_tokens=4, block_size=16)
    engine = llm.engine
    held = []
    score_step = engine.step

    def step():
        out = score_step()
        for seq in engine.scheduler.running:
            held.append(engine.kv.num_held_blocks(seq.request_id, 0))
        return out

    engine.step = step
    engine.score(tokens, chunk=8, compress_at=40)
    # after the compression at 40, never more than budget + a block + a chunk: 48 slots, 3 blocks
    assert max(held[5:]) <= 3 and llm.stats()["kv_compactions_total"] > 5
    _check_free(llm)
