"""LoRA adapters against peft: adapters made here with peft on the tiny models of every family,
saved with save_pretrained and served by kvserve; greedy tokens equal peft's and logits agree to
float32 tolerance; a batch mixing the base model and three adapters gives each request its alone
bits (also chunked and after prefix hits); the adapter's identity keys its cached blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import random_prompts
from tiny_models import FAMILIES, hf_model
from kvserve import LLM, LoRARequest, SamplingParams
from test_models_vs_transformers import engine_last_logits

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def make_adapter(base: Path, out: Path, seed: int, rank: int = 8, targets=TARGETS, **lora) -> Path:
    """A peft LoRA adapter of random (not zero) weights on the model at `base`, saved to `out`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                                                      lora_dropout=0.0, **lora))  # fmt: skip
    with torch.no_grad():  # peft's init leaves B at small values: make the adapter move the tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(str(out))
    return out


def peft_model(base: Path, adapter: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(base), str(adapter)).eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_root):
    """Three adapters per family (llama, qwen2, qwen3, gemma3), made once."""
    from tiny_models import tiny_model_dir

    made = {}
    for family in FAMILIES:
        base = tiny_model_dir(family, tiny_root)
        root = tmp_path_factory.mktemp(f"lora-{family}")
        made[family] = (base, [make_adapter(base, root / f"a{i}", seed=i, rank=4 * (i + 1), targets=TARGETS if i != 2 else ["q_proj", "v_proj"])
                               for i in range(3)])  # fmt: skip
    return made


def lora_llm(base: Path, **settings) -> LLM:
    return LLM(str(base), **{"dtype": "float32", "kv_cache_memory": 0.02, "enable_lora": True, "max_loras": 4, "max_lora_rank": 16, **settings})


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logits_match_peft(adapters, family):
    base, paths = adapters[family]
    llm = lora_llm(base)
    for i, path in enumerate(paths):
        reference = peft_model(base, path)
        request = LoRARequest(f"a{i}", i + 1, str(path))
        for prompt in random_prompts(2, 14, 20, seed=i):
            with torch.no_grad():
                ref = reference.generate(input_ids=torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
                ref_logits = reference(input_ids=torch.tensor([prompt])).logits[0, -1]
            got = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request)[0].token_ids
            assert got == ref, (family, i)
            engine = llm.engine
            seq = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), lora_request=request)
            samplers, logits = engine.runner.forward(engine.scheduler.schedule())
            engine.abort_request(seq.request_id)
            rel = (logits[0] - ref_logits).abs().max() / ref_logits.abs().max()
            assert rel < 1e-4, f"{family} adapter {i}: last-position logits differ by {rel:.2e}"
        # the adapter changes the model: the base's tokens differ somewhere
        base_tokens = llm.generate(random_prompts(2, 14, 20, seed=i), GREEDY, use_tqdm=False)
        lora_tokens = llm.generate(random_prompts(2, 14, 20, seed=i), GREEDY, use_tqdm=False, lora_request=request)
        assert [o.token_ids for o in base_tokens] != [o.token_ids for o in lora_tokens]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mixed_batch_gives_each_request_its_alone_bits(adapters, dtype):
    """The base model and three adapters in one batch, chunked prefills, then again after prefix hits:
    every request's tokens and logprobs are those it gets alone."""
    base, paths = adapters["gemma3"]
    requests = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    prompts = random_prompts(8, 20, 60, seed=3)
    loras = [requests[i % 4] for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)

    def traces(outs):
        return [(o.token_ids, [(t.token_id, t.logprob) for t in o.logprobs]) for o in outs]

    settings = dict(dtype=dtype) if dtype != "float32" else {}
    alone_llm = LLM(str(base), kv_cache_memory=0.02, enable_lora=True, max_loras=4, max_lora_rank=16, enable_prefix_caching=False,
                    **{"dtype": "float32", **settings})  # fmt: skip
    alone = [traces(alone_llm.generate([p], params, use_tqdm=False, lora_request=r))[0] for p, r in zip(prompts, loras)]
    together = LLM(str(base), kv_cache_memory=0.02, enable_lora=True, max_loras=4, max_lora_rank=16, max_num_batched_tokens=48,
                   **{"dtype": "float32", **settings})  # fmt: skip
    assert traces(together.generate(prompts, params, use_tqdm=False, lora_request=loras)) == alone
    # again: every prompt's blocks are cached under its own adapter, and the hits give the same bits
    again = together.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert traces(again) == alone
    assert all(o.num_cached_tokens > 0 for o in again)
    # and preempted: a pool that cannot hold the batch recomputes requests, with the same bits
    probe = together.stats()["bytes_per_token"]
    tight = LLM(str(base), kv_cache_memory=160 * probe / 1024**3, enable_lora=True, max_loras=4, max_lora_rank=16,
                max_model_len=96, enable_prefix_caching=False, **{"dtype": "float32", **settings})  # fmt: skip
    assert traces(tight.generate(prompts, params, use_tqdm=False, lora_request=loras)) == alone
    assert tight.stats()["num_preemptions"] > 0


def test_the_adapter_identity_keys_the_cached_blocks(adapters):
    """The same prompt under adapter a, then b, then a: b reuses nothing cached under a, a's repeat
    reuses its blocks; the base model reuses neither."""
    base, paths = adapters["llama"]
    llm = lora_llm(base)
    a, b = LoRARequest("a", 1, str(paths[0])), LoRARequest("b", 2, str(paths[1]))
    prompt = random_prompts(1, 70, 70, seed=9)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    cached = []
    for request in (a, b, a, None, b):
        cached.append(llm.generate([prompt], params, use_tqdm=False, lora_request=request)[0].num_cached_tokens)
    assert cached[0] == 0 and cached[1] == 0 and cached[2] >= 64 and cached[3] == 0 and cached[4] >= 64
    # the same weights under another name and id share the blocks (the identity is the contents)
    same = LoRARequest("a-again", 7, str(paths[0]))
    assert llm.generate([prompt], params, use_tqdm=False, lora_request=same)[0].num_cached_tokens >= 64


def test_bad_adapters_are_refused_naming_the_file_and_the_reason(adapters, tmp_path):
    from kvserve.lora.adapter import AdapterError

    base, paths = adapters["qwen2"]
    llm = lora_llm(base, max_lora_rank=8)
    with pytest.raises(AdapterError, match="rank 12 is over --max-lora-rank 8"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 1, str(paths[2])))
    with pytest.raises(AdapterError, match="does not exist"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("none", 2, str(tmp_path / "missing")))

    def variant(name: str, change) -> Path:
        import shutil

        out = tmp_path / name
        shutil.copytree(paths[0], out)
        change(out)
        return out

    def edit_config(**fields):
        def change(out: Path) -> None:
            config = json.loads((out / "adapter_config.json").read_text())
            config.update(fields)
            (out / "adapter_config.json").write_text(json.dumps(config))

        return change

    cases = [
        (edit_config(modules_to_save=["lm_head"]), "modules_to_save replaces whole modules"),
        (edit_config(target_modules=["q_proj", "lm_head"]), "target module.s. lm_head unknown"),
        (edit_config(use_dora=True), "DoRA"),
        (lambda out: (out / "adapter_model.safetensors").write_bytes(b"\x00" * 40), "not a readable safetensors file"),
        (lambda out: (out / "adapter_config.json").write_text("{"), "not valid JSON"),
        (lambda out: (out / "adapter_config.json").write_text("[" * 200_000 + "]" * 200_000), "not valid JSON"),
        (edit_config(alora_invocation_tokens=[5, 9]), "alora_invocation_tokens"),
        (edit_config(layer_replication=[[0, 2], [0, 2]]), "layer_replication"),
        (edit_config(use_dora="false"), "use_dora"),
        (edit_config(lora_alpha=1e30), "lora_alpha must be a number of magnitude"),
        # the config says which projections peft adapts: tensors of others are refused, not applied
        (edit_config(target_modules=["q_proj"]), "not one the config adapts"),
        (edit_config(exclude_modules=["q_proj"]), "not one the config adapts"),
        (edit_config(target_modules=".*layers\\.0\\..*"), "not one the config adapts"),
        (edit_config(target_modules="(unclosed"), "not a valid regular expression"),
        (lambda out: _rewrite_tensors(out, lambda k, t: (k.replace("self_attn.q_proj", "mlp.q_proj"), t)), "a projection of self_attn"),
        (lambda out: _rewrite_tensors(out, lambda k, t: (k, t * 1e18 if "lora_B" in k else t)), "over 10000"),
        (edit_config(arrow_config={"top_k": 2}), "Arrow"),
        (edit_config(use_bdlora=True), "BD-LoRA"),
        (lambda out: ((out / "adapter_model.safetensors").unlink(), os.mkfifo(out / "adapter_model.safetensors")), "not a regular file"),
        (lambda out: ((out / "adapter_config.json").unlink(), (out / "adapter_config.json").symlink_to("/dev/zero")), "not a regular file"),
        (lambda out: ((out / "adapter_config.json").unlink(), (out / "adapter_config.json").symlink_to("/proc/kmsg")), "not a regular file"),
        (lambda out: (out / "adapter_config.json").write_text(""), "empty"),
    ]
    for n, (change, words) in enumerate(cases):
        with pytest.raises(AdapterError, match=words):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest(f"bad{n}", 10 + n, str(variant(f"bad{n}", change))))
    for path, words in ((tmp_path / ("a" * 300), "cannot be read"), (tmp_path / "missing", "does not exist"),
                        ("https://huggingface.co/x/y", "a URL")):  # fmt: skip
        with pytest.raises(AdapterError, match=words):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("p", 40, str(path)))
    with pytest.raises(ValueError, match="lora_path must be a non-empty str"):
        LoRARequest("p", 41, tmp_path)
    # an adapter made for another base: shapes differ
    other_base, other_paths = adapters["gemma3"]
    with pytest.raises(AdapterError, match="has shape|the base model has"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 30, str(other_paths[0])))
    # a base engine without enable_lora
    plain = LLM(str(base), dtype="float32", kv_cache_memory=0.02)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(paths[0])))
    # nothing was left queued by the refusals
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter"):
        ok = LoRARequest("a", 1, str(paths[0]))
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=ok)
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("z", 1, str(paths[2])))


def _rewrite_tensors(out: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    file = out / "adapter_model.safetensors"
    save_file(dict(change(k, t) for k, t in load_file(str(file)).items()), str(file))


def test_the_host_tier_keeps_adapters_apart(adapters):
    """A prompt under adapter a, pushed out of a 24-block pool into the host tier by other traffic:
    under b it reuses nothing, under a it comes back from the tier with a's first tokens."""
    base, paths = adapters["llama"]
    llm = lora_llm(base, num_kv_blocks=24, max_num_seqs=2, kv_offload_host_gib=0.002)
    a, b = LoRARequest("a", 1, str(paths[0])), LoRARequest("b", 2, str(paths[1]))
    prompt, *others = random_prompts(5, 90, 120, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)

    def run(prompts, request):
        return [llm.generate([p], params, use_tqdm=False, lora_request=request)[0] for p in prompts]

    first = run([prompt], a)[0]
    run(others, None)
    under_b = run([prompt], b)[0]
    assert under_b.num_cached_tokens == 0 and under_b.token_ids != first.token_ids
    run(others, None)
    again = run([prompt], a)[0]
    assert again.num_cached_tokens >= 64 and again.token_ids == first.token_ids
    assert [t.logprob for t in again.logprobs] == [t.logprob for t in first.logprobs]
    assert sum(t["hit_tokens"] for t in llm.stats()["kv_tiers"].values()) >= 64


def test_the_native_call_matches_float64_and_leaves_rows_without_an_adapter_alone():
    """kernels/lora.cpp: two adapters (one on all three parts of a fused projection, one on its last
    part only) over rows of either or none: each part's product lands in its own columns."""
    from kvserve.kernels import library
    from kvserve.kernels.lora import LoraCall

    if not library.cpu_kernels_available():
        pytest.skip("no native kernels")
    g = torch.Generator().manual_seed(0)
    k, widths = 40, [24, 8, 8]
    n = sum(widths)
    layouts = [[3, 4, 0, 24, 4, 24, 8, 4, 32, 8], [1, 8, 32, 8]]
    adapters = []
    for layout in layouts:
        rank = sum(layout[1::3])
        a = torch.randn(rank, k, generator=g)
        bt = torch.randn(sum(r * w for r, w in zip(layout[1::3], layout[3::3])), generator=g)
        adapters.append((a, bt, torch.tensor(layout, dtype=torch.int32)))
    slots = torch.tensor([0, -1, 1, 0, -1, 1, 1], dtype=torch.int32)
    x = torch.randn(7, k, generator=g)
    out = torch.randn(7, n, generator=g)
    before = out.clone()
    LoraCall(slots, n, *map(list, zip(*adapters))).add(x, out)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(out[row], before[row])
            continue
        a, bt, layout = adapters[slot]
        h = x[row].double() @ a.double().t()
        expected = before[row].double().clone()
        first = at = 0
        for p in range(layout[0]):
            rank, column, width = layout[1 + 3 * p : 4 + 3 * p].tolist()
            expected[column : column + width] += h[first : first + rank] @ bt[at : at + rank * width].double().view(rank, width)
            first, at = first + rank, at + rank * width
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5)
    bad = [(a, bt, torch.tensor([1, 8, 36, 8], dtype=torch.int32)) for a, bt, _ in adapters[1:]]  # columns past n
    with pytest.raises(ValueError, match="lora"):
        LoraCall(torch.tensor([0], dtype=torch.int32), n, *map(list, zip(*bad))).add(x[:1], out[:1])


def test_the_planner_counts_the_bytes_an_adapter_holds_resident(adapters):
    import json as jsonlib

    from test_plan import run_plan

    base, paths = adapters["qwen2"]
    llm = lora_llm(base)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(paths[1])))  # rank 8, all projections
    resident = llm.stats()["lora"]["resident_bytes"]
    proc = run_plan("--model", str(base), "--seq-lens", "100", "--memory-gib", "1", "--dtype", "float32", "--max-loras", "3",
                    "--max-lora-rank", "8", "--json")  # fmt: skip
    planned = jsonlib.loads(proc.stdout)
    assert planned["lora_bytes_per_adapter"] == resident > 0 and planned["lora_bytes"] == 3 * resident
    assert "3 LoRA adapters of rank 8" in planned["weights_held_as"]
    rank8 = lora_llm(base, max_loras=3, max_lora_rank=8)  # what the engine says it may hold beside its pool, as the planner counts
    assert rank8.stats()["lora"]["max_resident_bytes"] == planned["lora_bytes"]
    assert f"up to 3 adapters of rank 8 resident ({planned['lora_bytes'] / (1 << 20):.0f} MiB" in rank8.engine.lora_description()


def test_the_torch_products_off_the_cpu_kernels_agree(adapters, monkeypatch):
    """Where the native call does not run (another device), torch computes each adapter's parts over
    its rows: the same greedy tokens and logprobs to float32 rounding."""
    import kvserve.lora.rows as rows

    base, paths = adapters["qwen3"]
    requests = [LoRARequest("a", 1, str(paths[0])), None, LoRARequest("c", 3, str(paths[2]))]
    prompts = random_prompts(3, 20, 40, seed=6)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    native = lora_llm(base).generate(prompts, params, use_tqdm=False, lora_request=requests)
    monkeypatch.setattr(rows, "lora_available", lambda dtype, device: False)
    fallback = lora_llm(base).generate(prompts, params, use_tqdm=False, lora_request=requests)
    for a, b in zip(native, fallback):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_redis_keeps_adapters_apart_between_engines(adapters):
    """An engine computes a prompt under adapter a into a real Redis; a second engine (another
    replica) reuses nothing of it under b and reads it back under a, with a's tokens and logprobs."""
    from redis_server import RedisServer

    base, paths = adapters["llama"]
    a, b = LoRARequest("a", 1, str(paths[0])), LoRARequest("b", 2, str(paths[1]))
    prompt = random_prompts(1, 90, 90, seed=5)[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    with RedisServer() as server:

        def replica() -> LLM:
            llm = lora_llm(base, num_kv_blocks=24, max_num_seqs=2, kv_remote_url=server.url)
            llm.engine.kv.offloader.prefill_rate = 1.0  # a tiny model recomputes faster than a tier reads: let loads win
            llm.engine.kv.offloader.observe_prefill = lambda tokens, seconds: None
            return llm

        first_engine = replica()
        first = first_engine.generate([prompt], params, use_tqdm=False, lora_request=a)[0]
        first_engine.engine.kv.offloader.drain()
        assert server.client().dbsize() >= 5
        second = replica()
        under_b = second.generate([prompt], params, use_tqdm=False, lora_request=b)[0]
        assert under_b.num_cached_tokens == 0 and under_b.token_ids != first.token_ids
        under_base = second.generate([prompt], params, use_tqdm=False)[0]
        assert under_base.num_cached_tokens == 0
        again = second.generate([prompt], params, use_tqdm=False, lora_request=a)[0]
        assert again.num_cached_tokens >= 80 and again.token_ids == first.token_ids
        assert [t.logprob for t in again.logprobs] == [t.logprob for t in first.logprobs]
        assert second.stats()["kv_tiers"]["remote"]["hit_tokens"] >= 80


def test_removing_an_adapter_drops_its_blocks_from_the_pool_and_the_host_tier(adapters):
    """remove_lora: a's cached blocks leave the pool and the host tier, b's stay; the same adapter
    served again recomputes its prompt to the same bits and is cached again. The reuse per adapter
    counts each adapter's own requests. With max_loras=1, b's reading pushes a out of what is held
    (max_cpu_loras): remove_lora still finds a's blocks."""
    base, paths = adapters["llama"]
    llm = lora_llm(base, num_kv_blocks=24, max_num_seqs=2, kv_offload_host_gib=0.002, max_loras=1)
    engine, kv = llm.engine, llm.engine.kv
    a, b = LoRARequest("a", 1, str(paths[0])), LoRARequest("b", 2, str(paths[1]))
    prompt, *others = random_prompts(4, 90, 90, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=a)[0]
    for other in others:  # push prompt's blocks down to the host tier
        llm.generate([other], params, use_tqdm=False, lora_request=a)
    llm.generate([prompt], params, use_tqdm=False, lora_request=b)
    kv.offloader.drain()
    idb = engine.lora.resolve(b).identity
    ida = next(identity for identity in kv.prefix_stats.adapters if identity != idb)
    host = kv.offloader.local[0]
    assert any(block.adapter == ida for block in kv.prefix_cache.blocks()) and host.usage().entries > 0
    held_by_a = [key for key, _ in host.records() if key in kv.offloader._adapter_keys.get(ida, {})]
    assert held_by_a

    assert 1 not in engine.lora._read  # pushed out by b: read, not held
    with pytest.raises(TypeError):
        engine.remove_lora("1")
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    kv.offloader.drain()
    assert not any(block.adapter == ida for block in kv.prefix_cache.blocks())
    assert any(block.adapter == idb for block in kv.prefix_cache.blocks())
    assert not any(host.contains(key) for key in held_by_a)

    again = llm.generate([prompt], params, use_tqdm=False, lora_request=a)[0]  # read again from its directory
    assert again.num_cached_tokens == 0
    assert again.token_ids == first.token_ids and [t.logprob for t in again.logprobs] == [t.logprob for t in first.logprobs]
    assert llm.generate([prompt], params, use_tqdm=False, lora_request=a)[0].num_cached_tokens >= 80
    reuse = {row["adapter"]: row for row in llm.stats()["lora"]["reuse"]}
    assert reuse[ida[:16]]["requests"] == 2 and reuse[ida[:16]]["lora_names"] == ["a"]  # counted anew since the removal
    assert reuse[idb[:16]]["requests"] == 1 and reuse[idb[:16]]["hit_tokens"] == 0
    assert reuse[ida[:16]]["hit_tokens"] >= 80


def test_beam_search_runs_every_beam_on_the_adapter(adapters):
    """LLM.beam_search(lora_request=...) gives peft's generate(num_beams=...) beams and scores: the
    forked beams keep their parent's adapter."""
    from kvserve import BeamSearchParams

    base, paths = adapters["qwen2"]
    llm = lora_llm(base)
    eos = sorted(llm.engine.eos_token_ids)
    prompt = random_prompts(1, 12, 12, seed=3)[0]
    adapter = LoRARequest("a", 1, str(paths[1]))
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10), lora_request=adapter)[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = peft_model(base, paths[1]).generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=3,
                                                  max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                                                  output_scores=True, return_dict_in_generate=True)  # fmt: skip
    theirs = []
    for seq, score in zip(ref.sequences.tolist(), ref.sequences_scores.tolist()):
        tail = seq[len(prompt) :]
        end = next((i + 1 for i, t in enumerate(tail) if t in eos), len(tail))
        theirs.append((tail[:end], score))
    assert [s.tokens[len(prompt) :] for s in out.sequences] == [t for t, _ in theirs]
    assert [s.score for s in out.sequences] == pytest.approx([s for _, s in theirs], rel=1e-5, abs=1e-4)
    plain = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10))[0]
    assert [s.tokens for s in plain.sequences] != [s.tokens for s in out.sequences]
