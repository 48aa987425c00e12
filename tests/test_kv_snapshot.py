"""GET /v1/kv/snapshot and GET /dashboard: block states counted exactly, the grid bounded, the
snapshot consistent with itself under load and with /metrics at rest, behind the API key; the page
self-contained (no CDN) and reading the snapshot."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import time
import zlib

import httpx
import numpy as np
import pytest

from kvserve.kv.block_pool import BlockPool
from kvserve.server.kv_snapshot import MAX_CELLS, STATES, block_states, grid, pool_snapshot
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
    snapshot = pool_snapshot("pool", pool, ["full"])
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


def png_pixels(png: bytes) -> tuple[int, int, bytes]:
    """Width, height and the decompressed scanlines of a PNG (stdlib only)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    at, data, width, height = 8, b"", 0, 0
    while at < len(png):
        length = int.from_bytes(png[at : at + 4], "big")
        kind, body = png[at + 4 : at + 8], png[at + 8 : at + 8 + length]
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
        elif kind == b"IDAT":
            data += body
        at += 12 + length
    return width, height, zlib.decompress(data)


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
        assert counts["cached"] > 0 and sum(counts.values()) == int(browser.execute_script("return document.body.dataset.numBlocks"))
    finally:
        browser.quit()
    width, height, pixels = png_pixels(screenshot)
    assert width >= 800 and height >= 600
    assert len(set(pixels)) > 16  # text, bars and the grid's colours: not a blank page
    (tmp_path / "dashboard.png").write_bytes(screenshot)
