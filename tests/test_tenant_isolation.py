"""No signal one tenant can read depends on another salt's blocks (found by QA: /metrics counted misses
against another salt's cached first block as other_salt, and /v1/kv/snapshot's per-salt rows
confirmed a guessed salt).

The attacker holds the API key, not the tenant's salt. Each test runs the same story on two fresh
servers that differ only in whether the attacker's guess is right, and compares everything the
attacker can read: /metrics (all but timings), the snapshot, the response's headers and usage.
"""

from __future__ import annotations

import re

import httpx
import pytest

from conftest import random_prompts
from server_process import launch_server, stop_server

KEY = "tenant-isolation-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TENANT_SALT = "tenant-a-secret-salt"
# what varies between two runs of the same requests however the guesses fall: clocks and durations
_TIMING = re.compile(r"_seconds|_time|_rate|_per_second|process_|python_gc|created")


def visible_metrics(url: str) -> dict[str, str]:
    text = httpx.get(url + "/metrics", timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if not _TIMING.search(name.split("{")[0]):
                samples[name] = value
    return samples


def visible_snapshot(url: str) -> dict:
    snap = httpx.get(url + "/v1/kv/snapshot", headers=AUTH, timeout=30).json()
    for volatile in ("time", "snapshot_ms"):
        snap.pop(volatile)
    tree = snap.pop("prefix_tree")
    # runs keyed by shape, not by the order hashing happens to give them
    snap["runs"] = sorted((r["blocks"], r["tokens"], r["hits"], r["refs"], r["salt"], r["parent"] is None) for r in tree["runs"])
    snap["tree"] = {k: v for k, v in tree.items() if k != "runs"}
    return snap


def visible_answer(response: httpx.Response) -> tuple:
    headers = {k: v for k, v in response.headers.items() if k not in ("date", "x-request-id", "content-length")}
    body = response.json()
    return response.status_code, headers, body["usage"]


def story(tiny_dir, tenant_prompt: list[int], attacker_prompt: list[int], attacker_salt: str) -> tuple:
    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.02",
                               "--api-key", KEY])  # fmt: skip
    try:
        def complete(prompt, salt):
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "cache_salt": salt}
            response = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
            assert response.status_code == 200, response.text
            return response

        for _ in range(3):
            complete(tenant_prompt, TENANT_SALT)
        answer = complete(attacker_prompt, attacker_salt)
        return visible_metrics(url), visible_snapshot(url), visible_answer(answer)
    finally:
        stop_server(proc)


def test_a_guessed_prompt_start_under_the_attackers_salt_tells_nothing(tiny_dir):
    tenant, other = random_prompts(2, 96, 96, seed=51)
    tail = random_prompts(1, 32, 32, seed=52)[0]
    right = story(tiny_dir, tenant, tenant[:64] + tail, "attacker-salt")  # the guess: the tenant's first four blocks
    wrong = story(tiny_dir, tenant, other[:64] + tail, "attacker-salt")
    assert right[0] == wrong[0]  # /metrics: no miss reason tells the two apart
    assert right[1] == wrong[1]  # /v1/kv/snapshot
    assert right[2] == wrong[2] and right[2][2]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_guessed_salt_tells_nothing(tiny_dir):
    tenant, probe = random_prompts(2, 96, 96, seed=53)
    right = story(tiny_dir, tenant, probe, TENANT_SALT)  # the guessed salt is the tenant's: only its rows would move
    wrong = story(tiny_dir, tenant, probe, "a-wrong-guess")
    assert right[0] == wrong[0] and right[1] == wrong[1] and right[2] == wrong[2]
    assert right[1]["salts"] == []  # no per-salt rows without --expose-salt-stats


@pytest.mark.parametrize("flag", [["--expose-salt-stats"]])
def test_an_operator_who_opts_in_sees_other_salt_misses_and_rows(tiny_dir, flag):
    proc, url = launch_server(["--model", str(tiny_dir("llama")), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.02",
                               *flag])  # fmt: skip
    try:
        prompt = random_prompts(1, 96, 96, seed=54)[0]
        for salt in ("a", "b"):
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert re.search(r'^kvserve:prefix_cache_misses_total\{[^}]*reason="other_salt"[^}]*\} 1\.0$', metrics, re.M), metrics
        assert len(httpx.get(url + "/v1/kv/snapshot", timeout=30).json()["salts"]) == 2
    finally:
        stop_server(proc)
