"""GET /v1/kv/snapshot and GET /dashboard: block states counted exactly, the grid bounded, the
snapshot consistent with itself under load and with /metrics at rest, behind the API key; the page
self-contained (no CDN) and reading the snapshot."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import numpy as np
import pytest

from kvserve.kv.block_pool import BlockPool
from kvserve.server.kv_snapshot import MAX_CELLS, STATES, _pool, block_states, grid
from server_process import launch_server, stop_server

KEY = "sk-snapshot-test"


def test_block_states_and_grid():
    pool = BlockPool(10)
    held = pool.allocate(4, group=0)
    pool.touch(held[0])  # shared by two
    pool.free([held[3]])
    held[3].block_hash = 123  # freed, still cached
    states, groups = block_states(pool)
    assert states.tolist() == [3, 2, 2, 1, 0, 0, 0, 0, 0, 0]  # shared, owned, owned, free but cached, free
    assert [STATES[i] for i in (3, 2, 1, 0)] == ["shared", "owned", "cached", "free"]
    cells, per_cell = grid(np.array([0, 2, 1, 3, 0, 0], np.int8), max_cells=3)
    assert (cells, per_cell) == ("230", 2)  # a cell of several blocks shows the busiest


def test_a_100k_block_pool_is_sampled_into_a_small_grid():
    pool = BlockPool(100_000)
    held = pool.allocate(60_000)
    for block in held[::3]:
        pool.touch(block)
    snapshot = _pool("pool", pool, ["full"])
    assert len(snapshot["cells"]) <= MAX_CELLS and snapshot["blocks_per_cell"] == 25
    assert snapshot["counts"] == {"free": 40_000, "cached": 0, "owned": 40_000, "shared": 20_000}
    assert len(json.dumps(snapshot)) < 200_000


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
    busiest = max(seen, key=lambda s: s["pools"][0]["held_blocks"])
    assert busiest["pools"][0]["counts"]["shared"] > 0  # n = 2 and the shared prefix hold blocks twice
    assert busiest["requests"]["running"] > 0
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
