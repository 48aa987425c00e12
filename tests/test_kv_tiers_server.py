"""A server with host and disk tiers restarts warm (found by QA: write_through wrote only to the host
tier, so a crash lost every block the host tier still held, and a graceful stop left the pool's
blocks behind): after SIGKILL with write_through, every block written before the kill is a hit; after
SIGTERM with write_back, the drain sends the pool's and the host tier's blocks down to disk."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from conftest import random_prompts
from server_process import launch_server, server_log, stop_server

BLOCK = 16
# three: a tier's first three loads are always taken (to measure it), so every hit below is a load
PROMPTS = random_prompts(3, 100, 140, seed=71)


def start(model_dir, disk, policy: str):
    # a host tier large enough to drop nothing: whatever reaches the disk got there by the policy
    return launch_server(["--model", str(model_dir), "--port", "0", "--dtype", "float32", "--num-kv-blocks", "256",
                          "--kv-offload-host-gib", "0.05", "--kv-offload-disk-dir", str(disk), "--kv-offload-disk-gib", "0.2",
                          "--kv-offload-policy", policy])  # fmt: skip


def complete(url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def answer(response: dict) -> tuple:
    choice = response["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def tiers(url: str) -> dict:
    return httpx.get(url + "/v1/kv/snapshot", timeout=30).json()["tiers"]


def disk_records(disk) -> int:
    return len(list(disk.glob("*.kvb")))


@pytest.mark.parametrize("kill, policy", [(signal.SIGKILL, "write_through"), (signal.SIGTERM, "write_back")], ids=["sigkill", "sigterm"])
def test_a_restart_on_the_same_disk_tier_starts_warm(tiny_dir, tmp_path, kill, policy):
    model, disk = tiny_dir("llama"), tmp_path / "disk"
    proc, url = start(model, disk, policy)
    try:
        first = [answer(complete(url, prompt)) for prompt in PROMPTS]
        # every computed block: the prompt's whole blocks and the output's (5 of 6 tokens computed)
        blocks = sum((len(prompt) + 5) // BLOCK for prompt in PROMPTS)
        if policy == "write_through":
            while tiers(url)["disk"]["entries"] < blocks:  # the writer's queue drains (the test's own timeout bounds it)
                time.sleep(0.05)
            assert tiers(url)["host"]["entries"] == blocks
        else:
            assert disk_records(disk) == 0  # write_back: nothing is evicted from a pool this large
        proc.send_signal(kill)
        proc.wait(timeout=60)
        log = server_log(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert disk_records(disk) == blocks, log
    if kill == signal.SIGTERM:
        assert f"persisted {blocks} KV records" in log
    proc, url = start(model, disk, policy)
    try:
        for prompt, want in zip(PROMPTS, first):
            response = complete(url, prompt)
            assert answer(response) == want  # nothing served corrupt: the same bits as computing it
            assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // BLOCK * BLOCK
        assert "Traceback" not in server_log(proc)
    finally:
        stop_server(proc)
