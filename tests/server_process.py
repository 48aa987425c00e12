"""`kvserve serve` as a subprocess: start it, wait for its startup line and /health, stop it.

The server's output goes to a file (`proc.log_path`), never to a pipe nobody reads: a server
that logs a line per rejected request would otherwise block once the pipe is full.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def launch_server(args: list[str], timeout: float = 120, command: list[str] | None = None,
                  env: dict[str, str] | None = None, subcommand: str = "serve", health: bool = True) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """Run `kvserve serve ARGS` (or `command ARGS`, or another subcommand) and return the process and
    its base URL once /health answers 200 (health=False: once its port accepts connections)."""
    cmd = [*(command or [sys.executable, "-m", "kvserve.cli"]), subcommand, *args]
    log = Path(tempfile.mkstemp(prefix="kvserve-server-", suffix=".log")[1])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})  # fmt: skip
    proc.log_path = log
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline and url is None:
        for line in log.read_text().splitlines():
            if line.startswith("kvserve: serving"):
                url = line.split(" on ")[1].split()[0]
        if url is None:
            if proc.poll() is not None:
                raise RuntimeError("server did not start: " + log.read_text())
            time.sleep(0.1)
    if url is None:
        proc.kill()
        raise RuntimeError("server did not start: " + log.read_text())
    while time.monotonic() < deadline:
        if health:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        elif _listening(url):  # a server whose /health is not 200 by design (a proxy before a dead producer)
            return proc, url
        if proc.poll() is not None:
            raise RuntimeError("server exited: " + log.read_text())
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server never became healthy" if health else "server never listened")


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def server_log(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text()


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log_path.unlink(missing_ok=True)
