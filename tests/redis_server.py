"""A real `redis-server` (Debian's, installed by `make setup`) on a free loopback port, with a
password: started by the tests, stopped after. Missing, it fails the test (never a skip)."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, password: str | None = None, maxmemory: str = "512mb") -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is missing: `make setup` installs it (apt-get install redis-server)"
        self.binary = binary
        self.port = port or free_port()
        self.password = password or secrets.token_hex(8)
        self.maxmemory = maxmemory
        self.directory = tempfile.mkdtemp(prefix="kvserve-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def start(self) -> "RedisServer":
        log = Path(self.directory) / "redis.log"
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", self.password, "--save", "",
             "--appendonly", "no", "--dir", self.directory, "--logfile", str(log), "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start: {log.read_text() if log.exists() else ''}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
