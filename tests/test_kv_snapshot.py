"""GET /v1/kv/snapshot and GET /dashboard: block states counted exactly, the grid bounded, the
snapshot consistent with itself under load and with /metrics at rest, behind the API key; the prefix
tree's hit counts exact, salts never shown, token text only when asked for, a 100K-block cache's
tree bounded; the page self-contained (no CDN) and reading the snapshot."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import time

import httpx
import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.prefix import HashPrefixCache, PrefixHit
from kvserve.kv.prefix_stats import MAX_SALTS, OTHER_SALTS, PrefixCacheStats, salt_label
from kvserve.kv.radix import RadixPrefixCache
from kvserve.kv.spec import KVCacheGroupSpec
from kvserve.server.kv_snapshot import MAX_CELLS, STATES, block_states, grid, kv_snapshot, pool_snapshot
from kvserve.server.prefix_tree import MAX_TREE_BLOCKS, prefix_tree
from conftest import png_pixels
from server_process import launch_server, stop_server

KEY = "sk-snapshot-test"


def test_block_states_and_grid():
    pool = BlockPool(10)
    held = pool.allocate(4, group=0)
    pool.touch(held[0])  # shared by two
    pool.free([held[3]])
    held[3].block_hash = 123  # freed, still cached
    states = block_states(pool)
    assert states.tolist() == [3, 2, 2, 1, 0, 0, 0, 0, 0, 0]  # shared, owned, owned, free but cached, free
    assert [STATES[i] for i in (3, 2, 1, 0)] == ["shared", "owned", "cached", "free"]
    cells, per_cell = grid(np.array([0, 2, 1, 3, 0, 0], np.int8), max_cells=3)
    assert (cells, per_cell) == ("230", 2)  # a cell of several blocks shows the busiest
    pool = BlockPool(8)
    pool.allocate(3, group=0)
    pool.touch(pool.allocate(2, group=1)[0])
    groups = pool_snapshot("pool", pool, ["full", "sliding window 4"])["groups"]
    assert [(g["owned"], g["shared"]) for g in groups] == [(3, 0), (1, 1)]


def test_a_100k_block_pool_is_sampled_into_a_small_grid():
    pool = BlockPool(100_000)
    held = pool.allocate(60_000)
    for block in held[::3]:
        pool.touch(block)
    snapshot = pool_snapshot("pool", pool, ["full"])
    assert snapshot["groups"] == [{"group": 0, "attention": "full", "owned": 40_000, "shared": 20_000}]
    assert len(snapshot["cells"]) <= MAX_CELLS and snapshot["blocks_per_cell"] == 25
    assert snapshot["counts"] == {"free": 40_000, "cached": 0, "owned": 40_000, "shared": 20_000}
    assert len(json.dumps(snapshot)) < 200_000


def chain(cache, pool: BlockPool, parent: int, keys: list[int], block_size: int = 4) -> list:
    """Publish one block per key, each under the previous one."""
    blocks = pool.allocate(len(keys))
    for block, key in zip(blocks, keys):
        cache.publish(0, block, key, parent, [key % 1000] * block_size)
        parent = key
    return blocks


@pytest.mark.parametrize("kind", [HashPrefixCache, RadixPrefixCache])
def test_prefix_tree_merges_runs_and_counts_hits(kind):
    pool = BlockPool(64)
    cache = kind([KVCacheGroupSpec((0,))], 4, root=7)
    pool.on_evict = cache.evicted
    stats = PrefixCacheStats(per_salt=True)
    root = cache.parent_of_first("tenant secret")
    system = chain(cache, pool, root, [11, 12, 13])  # a prompt three requests share...
    tails = [chain(cache, pool, 13, [21 + i, 31 + i]) for i in range(3)]  # ...each with its own question
    lone = chain(cache, pool, cache.parent_of_first(None), [41])
    for i, tail in enumerate(tails):
        stats.record(PrefixHit(num_tokens=4 * (3 + i), blocks=[system + tail[:i]]), 20, "tenant secret", root)
    stats.record(PrefixHit(), 8, None, cache.parent_of_first(None))
    pool.free(list(reversed([*system, *lone, *[b for t in tails for b in t]])))
    tree = prefix_tree(cache, 0, stats)
    assert tree["cached_blocks"] == tree["shown_blocks"] == 10 and tree["kind"] == kind.name
    runs = {(r["blocks"], r["hits"]): r for r in tree["runs"]}
    top = runs[(3, 3)]  # the shared prompt: one run of three blocks, reused by three requests
    assert top["parent"] is None and top["salt"] == salt_label("tenant secret") != "tenant secret" and top["tokens"] == 12
    below = sorted(((r["blocks"], r["hits"]) for r in tree["runs"] if r["parent"] == top["id"]))
    assert below == [(1, 1), (2, 0), (2, 1)]  # tail 1's first block reused once (then its unused second), tail 0 never, tail 2 whole
    tail1 = next(r for r in tree["runs"] if r["parent"] == top["id"] and r["blocks"] == 1)
    assert [(r["blocks"], r["hits"]) for r in tree["runs"] if r["parent"] == tail1["id"]] == [(1, 0)]
    assert [r["salt"] for r in tree["runs"] if r["parent"] is None and r["blocks"] == 1] == ["(none)"]  # the unsalted lone block
    assert "text" not in top and "tenant secret" not in json.dumps(tree)
    assert "text" in prefix_tree(cache, 0, stats, decode=lambda ids: " ".join(map(str, ids)))["runs"][0]
    pool.allocate(64)  # evicts every cached block: their hit counts go with them
    assert all(b.hits == 0 and b.parent is None for b in pool.blocks)


def test_salts_are_digests_and_bounded():
    stats = PrefixCacheStats(per_salt=True)
    for i in range(MAX_SALTS + 5):
        stats.record(PrefixHit(num_tokens=4), 10, f"tenant-{i}", i)
    assert len(stats.salts) == MAX_SALTS + 1 and stats.salts[OTHER_SALTS].requests == 5
    assert stats.salt_roots[MAX_SALTS + 4] == OTHER_SALTS and stats.salt_roots[0] == salt_label("tenant-0")  # the tree labels both
    assert not any("tenant" in label for label in stats.salts) and salt_label("a") == salt_label("a") != salt_label("b")
    assert sum(r.hits for r in stats.salts.values()) == stats.hits == 4 * (MAX_SALTS + 5)


def test_a_100k_block_prefix_cache_gives_a_bounded_tree():
    pool = BlockPool(100_000)
    cache = HashPrefixCache([KVCacheGroupSpec((0,))], 16, root=7)
    stats = PrefixCacheStats()
    parent = cache.parent_of_first(None)
    for start in range(0, 100_000, 50):  # 2,000 documents of 50 blocks under one shared first block
        blocks = chain(cache, pool, parent if start else cache.parent_of_first(None), list(range(start + 1, start + 51)), 16)
        for k, block in enumerate(blocks):
            block.hits = (start * 7 + k) % 13
    tree = prefix_tree(cache, 0, stats)
    assert tree["cached_blocks"] == 100_000 and MAX_TREE_BLOCKS <= tree["shown_blocks"] <= 2 * MAX_TREE_BLOCKS
    ids = {r["id"] for r in tree["runs"]}
    assert all(r["parent"] in ids for r in tree["runs"] if r["parent"] is not None)
    assert len(json.dumps(tree)) < 200_000


def test_engine_snapshot_counts_reuse_and_hides_text_unless_asked(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.01, kv_offload_host_gib=0.01, kv_offload_policy="write_through",
              expose_salt_stats=True)  # fmt: skip
    shared = list(range(5, 5 + 48))  # three blocks
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([shared + [100]], params, use_tqdm=False)
    llm.generate([shared + [101 + i] for i in range(4)], params, use_tqdm=False)
    llm.generate([shared + [200]], params, use_tqdm=False, cache_salt="acme-secret")
    llm.engine.kv.offloader.flushed().result(timeout=30)
    snap = kv_snapshot(llm.engine, "tiny")
    tree, text = snap["prefix_tree"], json.dumps(snap)
    top = max(tree["runs"], key=lambda r: r["hits"])
    assert (top["tokens"], top["hits"], top["salt"]) == (48, 4, "(none)")  # the four requests after the first reused it
    assert top["tiers"] == {"host": 3} and snap["tiers"]["host"]["entries"] >= 3  # written through to the host tier
    salted = [r for r in tree["runs"] if r["salt"] == salt_label("acme-secret")]
    assert len(salted) == 1 and salted[0]["hits"] == 0 and salted[0]["parent"] is None  # a salt shares nothing
    rows = {r["salt"]: r for r in snap["salts"]}
    assert rows["(none)"]["requests"] == 5 and rows["(none)"]["hit_tokens"] == 4 * 48 == snap["prefix_cache"]["hit_tokens"]
    assert rows[salt_label("acme-secret")]["hit_tokens"] == 0
    assert "acme-secret" not in text and "text" not in top and not snap["show_tokens"]
    shown = kv_snapshot(llm.engine, "tiny", show_tokens=True)
    top = max(shown["prefix_tree"]["runs"], key=lambda r: r["hits"])
    assert top["text"] == llm.engine.tokenizer.decode(shared)[: len(top["text"])] and top["text"]


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--dtype", "float32", "--port", "0", "--kv-cache-memory", "0.005",
                               "--api-key", KEY])  # fmt: skip
    yield url
    stop_server(proc)


def snapshot(url: str) -> dict:
    resp = httpx.get(url + "/v1/kv/snapshot", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def check_consistent(s: dict) -> None:
    pool = s["pools"][0]
    assert sum(pool["counts"].values()) == pool["num_blocks"] == s["num_blocks"]
    assert pool["counts"]["free"] + pool["counts"]["cached"] == s["num_free_blocks"]
    assert pool["held_blocks"] == s["num_blocks"] - s["num_free_blocks"]
    assert abs(s["usage"] - pool["held_blocks"] / s["num_blocks"]) < 1e-9
    assert len(pool["cells"]) <= MAX_CELLS and set(pool["cells"]) <= set("0123")


def test_snapshot_under_load_and_at_rest(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    shared = "Copyright (C) 2007 Free Software Foundation, Inc. Everyone is permitted to copy and distribute verbatim copies. "
    bodies = [{"prompt": shared * 3 + f"question {i}", "max_tokens": 40, "ignore_eos": True, "n": 2, "temperature": 1.0} for i in range(8)]
    seen = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(httpx.post, server + "/v1/completions", json=b, headers=headers, timeout=120) for b in bodies]
        while not all(f.done() for f in futures):
            s = snapshot(server)
            check_consistent(s)
            seen.append(s)
        assert all(f.result().status_code == 200 for f in futures)
    # n = 2 and the shared prefix hold blocks twice while the samples decode (40 steps): some snapshot sees it (on a busy
    # machine the fullest one can fall in the prefills, before any sample forked)
    assert any(s["pools"][0]["counts"]["shared"] > 0 and s["requests"]["running"] > 0 for s in seen)
    rest = snapshot(server)
    check_consistent(rest)
    assert rest["pools"][0]["counts"]["cached"] > 0 and rest["requests"] == {"running": 0, "waiting": 0}
    metrics = httpx.get(server + "/metrics").text
    value = lambda name: float(re.search(rf"^kvserve:{name}{{[^}}]*}} (\S+)$", metrics, re.M).group(1))  # noqa: E731
    assert value("kv_cache_blocks_free") == rest["num_free_blocks"] and value("kv_cache_blocks_total") == rest["num_blocks"]
    assert rest["prefix_cache"]["hit_tokens"] == value("prefix_cache_hits_total") > 0


def test_snapshot_needs_the_key_and_the_page_is_self_contained(server):
    assert httpx.get(server + "/v1/kv/snapshot").status_code == 401
    page = httpx.get(server + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "v1/kv/snapshot" in page.text and "Bearer" in page.text
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)  # no CDN: works offline
    assert snapshot(server)["model"]


def test_dashboard_in_headless_chromium_under_load(server, tmp_path):
    """The page loads in a real browser, draws the pool, updates while requests run, shows the block
    counts /metrics shows once they settle, and screenshots as a PNG that is not blank."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for binary in ("chromium", "chromedriver"):
        assert shutil.which(binary), f"{binary} is missing: `make setup` installs it (apt-get install chromium chromium-driver)"
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,1300"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    headers = {"Authorization": f"Bearer {KEY}"}
    bodies = [{"prompt": f"Everyone is permitted to copy {i} " * 6, "max_tokens": 400, "ignore_eos": True, "n": 2, "temperature": 1.0}
              for i in range(16)]  # fmt: skip
    try:
        browser.get(server + "/version")  # same origin: the key goes where the page looks for it
        browser.execute_script("sessionStorage.setItem('kvserve-key', arguments[0])", KEY)
        browser.get(server + "/dashboard")
        updates = lambda: int(browser.execute_script("return document.body.dataset.updates || 0"))  # noqa: E731
        deadline = time.monotonic() + 30
        while updates() < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert updates() >= 1, browser.find_element("id", "status").text
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(httpx.post, server + "/v1/completions", json=b, headers=headers, timeout=300) for b in bodies]
            held = []
            while not all(f.done() for f in futures):
                held.append(int(browser.execute_script("return document.body.dataset.numBlocks - document.body.dataset.freeBlocks")))
                time.sleep(0.3)
            assert all(f.result().status_code == 200 for f in futures)
        assert max(held) > 0  # the page showed blocks held while the requests ran
        screenshot = browser.get_screenshot_as_png()
        seen = updates()
        while updates() < seen + 2:
            time.sleep(0.2)
        metrics = httpx.get(server + "/metrics").text
        free = float(re.search(r"^kvserve:kv_cache_blocks_free{[^}]*} (\S+)$", metrics, re.M).group(1))
        assert int(browser.execute_script("return document.body.dataset.freeBlocks")) == free
        counts = json.loads(browser.execute_script("return document.querySelector('[data-pool=pool]').dataset.counts"))
        runs = int(browser.execute_script("return document.getElementById('tree').dataset.runs || 0"))
        assert runs == len(snapshot(server)["prefix_tree"]["runs"]) > 0  # the prefix tree drew every run
        assert counts["cached"] > 0 and sum(counts.values()) == int(browser.execute_script("return document.body.dataset.numBlocks"))
    finally:
        browser.quit()
    width, height, pixels = png_pixels(screenshot)
    assert width >= 800 and height >= 600
    assert len(set(pixels)) > 16  # text, bars and the grid's colours: not a blank page
    (tmp_path / "dashboard.png").write_bytes(screenshot)
