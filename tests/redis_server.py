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
    def __init__(self, port: int | None = None, password: str | None = None, maxmemory: str = "512mb", tls: bool = False) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is missing: `make setup` installs it (apt-get install redis-server)"
        self.binary = binary
        self.port = port or free_port()
        self.password = password or secrets.token_hex(8)
        self.maxmemory = maxmemory
        self.tls = tls
        self.directory = tempfile.mkdtemp(prefix="kvserve-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> str:
        return str(Path(self.directory) / "ca.pem")

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, **({"ssl_ca_certs": self.ca_file} if self.tls else {}))

    def _port_flags(self) -> list[str]:
        if not self.tls:
            return ["--port", str(self.port)]
        d = Path(self.directory)
        if not (d / "server.pem").exists():
            self._make_certificates()
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(d / "server.pem"), "--tls-key-file",
                str(d / "server.key"), "--tls-ca-cert-file", self.ca_file, "--tls-auth-clients", "no"]  # fmt: skip

    def _make_certificates(self) -> None:
        """A throwaway CA and a server certificate for 127.0.0.1 (openssl)."""
        d = Path(self.directory)
        run = lambda *args: subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)  # noqa: E731
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvserve-test-ca")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
        (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
        run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.pem", "-days", "2",
            "-extfile", "ext.cnf")  # fmt: skip

    def start(self) -> "RedisServer":
        log = Path(self.directory) / "redis.log"
        self.proc = subprocess.Popen(
            [self.binary, *self._port_flags(), "--bind", "127.0.0.1", "--requirepass", self.password, "--save", "",
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
