"""LoRA adapters through the HTTP API of a real `kvserve serve`, with a real HTTP client: the request's
`model` picks an adapter (--lora-modules), /v1/models lists each with its parent, adapters load and
unload at run time behind the API key while requests run, bad adapters are 400s, and the metrics
count requests per adapter."""

from __future__ import annotations

import threading

import httpx
import pytest

from server_process import launch_server, stop_server
from test_lora import make_adapter
from kvserve import LLM, BeamSearchParams, LoRARequest, SamplingParams

KEY = "lora-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 17, 99, 23, 41, 8, 77, 12, 64, 3, 19, 31]


@pytest.fixture(scope="module")
def served(tiny_root, tmp_path_factory):
    from tiny_models import tiny_model_dir

    base = tiny_model_dir("llama", tiny_root)
    root = tmp_path_factory.mktemp("lora-server")
    a, b = make_adapter(base, root / "a", seed=1), make_adapter(base, root / "b", seed=2)
    proc, url = launch_server(["--model", str(base), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.02", "--enable-lora",
                               "--max-loras", "2", "--lora-modules", f"ada={a}", "--allow-runtime-lora-updating", "--api-key", KEY])  # fmt: skip
    yield base, a, b, url
    stop_server(proc)


def complete(url: str, model: str, max_tokens: int = 12, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)


def offline_text(base, adapter, max_tokens: int = 12) -> str:
    llm = LLM(str(base), dtype="float32", kv_cache_memory=0.02, enable_lora=True)
    lora = LoRARequest("x", 1, str(adapter)) if adapter is not None else None
    return llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False,
                        lora_request=lora)[0].text  # fmt: skip


def test_the_model_field_picks_the_adapter(served):
    base, a, _, url = served
    models = httpx.get(url + "/v1/models", headers=AUTH).json()["data"]
    base_name = models[0]["id"]
    assert [(m["id"], m.get("parent")) for m in models] == [(base_name, None), ("ada", base_name)]
    got = complete(url, "ada")
    assert got.status_code == 200, got.text
    assert got.json()["model"] == "ada"
    assert got.json()["choices"][0]["text"] == offline_text(base, a)
    plain = complete(url, base_name).json()["choices"][0]["text"]
    assert plain == offline_text(base, None) and plain != got.json()["choices"][0]["text"]
    beams = complete(url, "ada", use_beam_search=True, n=2)
    assert beams.status_code == 200, beams.text
    llm = LLM(str(base), dtype="float32", kv_cache_memory=0.02, enable_lora=True)
    offline = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=12), lora_request=LoRARequest("x", 1, str(a)))[0]
    assert [c["text"] for c in beams.json()["choices"]] == [llm.tokenizer.decode(s.tokens[len(PROMPT) :]) for s in offline.sequences]
    missing = complete(url, "nope")
    assert missing.status_code == 404 and "ada" in missing.json()["error"]["message"]
    metrics = httpx.get(url + "/metrics", headers=AUTH).text
    assert 'kvserve:lora_requests_total{lora_name="ada"' in metrics
    assert "kvserve:lora_requests_info{" in metrics


def test_adapters_load_and_unload_at_run_time_while_requests_run(served, tmp_path):
    base, a, b, url = served
    load = lambda body, headers=AUTH: httpx.post(url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=60)  # noqa: E731
    unload = lambda name: httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=60)  # noqa: E731
    assert load({"lora_name": "bee", "lora_path": str(b)}, headers={}).status_code == 401
    assert load({"lora_name": "bee", "lora_path": str(b)}).status_code == 200
    assert load({"lora_name": "bee", "lora_path": str(b)}).status_code == 400  # already served
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}')
    refused = load({"lora_name": "bad", "lora_path": str(bad)})
    assert refused.status_code == 400 and "modules_to_save" in refused.json()["error"]["message"] and str(bad) in refused.json()["error"]["message"]
    assert load({"lora_name": "gone", "lora_path": str(tmp_path / "missing")}).status_code == 400
    assert load({"lora_name": 5}).status_code == 400
    # a long request on bee runs to its end while bee is unloaded
    results = {}
    thread = threading.Thread(target=lambda: results.update(long=complete(url, "bee", max_tokens=150)))
    thread.start()
    assert complete(url, "bee").json()["choices"][0]["text"] == offline_text(base, b)
    assert unload("bee").status_code == 200
    thread.join(timeout=120)
    assert results["long"].status_code == 200 and results["long"].json()["usage"]["completion_tokens"] == 150
    assert 'lora_name="bee"' not in httpx.get(url + "/metrics", headers=AUTH).text  # finishing after the unload: not counted
    assert complete(url, "bee").status_code == 404
    assert unload("bee").status_code == 404
    # a named adapter is held as loaded: its files may go (nothing is read again), and bad names are 400s
    import shutil

    moved = shutil.copytree(b, tmp_path / "moved")
    assert load({"lora_name": "moved", "lora_path": str(moved)}).status_code == 200
    shutil.rmtree(moved)
    assert complete(url, "moved").json()["choices"][0]["text"] == offline_text(base, b)
    for name in ("x,y", 'q"t', "", "a" * 300):
        assert load({"lora_name": name, "lora_path": str(b)}).status_code == 400
    long_path = load({"lora_name": "long", "lora_path": "/tmp/" + "a" * 300})
    assert long_path.status_code == 400 and "cannot be read" in long_path.json()["error"]["message"]
    assert unload("moved").status_code == 200
    assert 'lora_name="moved"' not in httpx.get(url + "/metrics", headers=AUTH).text


def test_unloading_drops_the_adapters_cached_prefix(served, tmp_path):
    """An adapter's prompt is cached under it (its reuse shown per adapter in the metrics and the KV
    snapshot); unloaded, its blocks go: the same weights loaded again recompute the prompt."""
    base, _, _, url = served
    cee = make_adapter(base, tmp_path / "c", seed=3)
    prompt = [(7 * i + 3) % 200 + 2 for i in range(40)]
    post = lambda path, body: httpx.post(url + path, json=body, headers=AUTH, timeout=60)  # noqa: E731

    def cached_run(model: str) -> tuple[int, str]:
        got = post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert got.status_code == 200, got.text
        return got.json()["usage"]["prompt_tokens_details"]["cached_tokens"], got.json()["choices"][0]["text"]

    racing: list[int] = []  # loads of one name at once: one wins, and the others hold nothing (its unload drops its blocks)
    threads = [threading.Thread(target=lambda: racing.append(post("/v1/load_lora_adapter", {"lora_name": "cee", "lora_path": str(cee)}
                                                                  ).status_code)) for _ in range(4)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(racing) == [200, 400, 400, 400]
    (cold, text), (warm, again) = cached_run("cee"), cached_run("cee")
    assert cold == 0 and warm >= 32 and again == text
    rows = httpx.get(url + "/v1/kv/snapshot", headers=AUTH).json()["lora_adapters"]
    row = next(r for r in rows if r["lora_names"] == ["cee"])
    assert row["requests"] == 2 and row["hit_tokens"] == warm
    assert any(line.startswith("kvserve:lora_prefix_cache_hits_total{") and 'lora_name="cee"' in line and line.endswith(f" {warm:.1f}")
               for line in httpx.get(url + "/metrics", headers=AUTH).text.splitlines())  # fmt: skip
    assert post("/v1/unload_lora_adapter", {"lora_name": "cee"}).status_code == 200
    assert post("/v1/load_lora_adapter", {"lora_name": "cee-again", "lora_path": str(cee)}).status_code == 200
    assert cached_run("cee-again") == (0, text)
    assert cached_run("cee-again")[0] >= 32
    assert post("/v1/unload_lora_adapter", {"lora_name": "cee-again"}).status_code == 200


def test_cluster_replicas_get_every_adapter_flag():
    import argparse

    from kvserve.engine_args import add_engine_args
    from kvserve.server.args import add_server_args
    from kvserve.server.cluster import replica_flags

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(["--enable-lora", "--max-loras", "3", "--lora-modules", "x=/a", "y=/b", "--allow-runtime-lora-updating"])
    assert replica_flags(args, add_server_args, skip=()) == ["--lora-modules", "x=/a", "y=/b", "--allow-runtime-lora-updating"]
    assert replica_flags(args, add_engine_args, skip=()) == ["--enable-lora", "--max-loras", "3"]
