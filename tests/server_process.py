"""`kvserve serve` as a subprocess: start it, wait for its startup line and /health, stop it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx


def launch_server(args: list[str], timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """Run `kvserve serve ARGS` and return the process and its base URL once /health answers 200."""
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("kvserve: serving"):
            url = line.split(" on ")[1].split()[0]
            break
    if url is None:
        proc.kill()
        raise RuntimeError("server did not start: " + (proc.stdout.read() or ""))
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server never became healthy")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
