"""`kvserve cluster`: N `kvserve serve` replicas on this machine behind smg, a cache-aware router.

smg (PyPI: the gateway that succeeded sglang-router; `pip install 'kvserve[cluster]'`) sends each
request to the replica whose prefix tree already matches its text (`--router-policy cache_aware`),
balances by the load every replica reports on GET /v1/loads, retries a refused or failed request
on another replica and fans POST /flush_cache out to all. Each replica gets its share of the CPU
threads. Ctrl-C or SIGTERM stops the router first (no new requests), then every replica, each
draining for --shutdown-timeout. A replica that dies is routed around; the cluster stops when the
router or every replica is gone.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvserve.kv.tiers.signing import KEY_ENV as KV_KEY_ENV
from kvserve.libc import libc
from kvserve.server.config import API_KEY_ENV

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two")
SMG_VERSION = "1.13.0"  # the router version this command and tests/test_cluster.py are checked against
_MISSING_SMG = f"kvserve cluster needs smg, the router: pip install 'kvserve[cluster]' (or pip install smg=={SMG_VERSION})"
# flags of `kvserve serve` that are the router's here, or that make no sense behind it
ROUTER_SERVER_FLAGS = ("--host", "--port", "--allowed-hosts", "--migration-targets", "--migration-key")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # smg colours its log lines whatever NO_COLOR says


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--replicas", type=int, default=2, help="kvserve serve processes to start")
    group.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                       help="how smg picks a replica: cache_aware (the one whose prefix tree matches the request's text, "
                       "unless it is much busier), round_robin, power_of_two (the less loaded of two at random)")
    group.add_argument("--host", default="127.0.0.1", help="the router's address (replicas listen on 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="the router's port (0 picks a free one)")
    group.add_argument("--router-prometheus-port", type=int, default=0,
                       help="port of the router's Prometheus listener on 127.0.0.1 (0 picks a free one)")
    group.add_argument("--cache-threshold", type=float, default=None,
                       help="smg --cache-threshold: the share of a request's text its best replica must already hold "
                       "for cache_aware to send it there (smg's default: 0.3)")
    group.add_argument("--balance-abs-threshold", type=int, default=None,
                       help="smg --balance-abs-threshold: how many more requests than the mean a matched replica may "
                       "have before cache_aware sends to the least loaded instead (smg's default: 64)")
    group.add_argument("--balance-rel-threshold", type=float, default=None,
                       help="smg --balance-rel-threshold: the same as a multiple of the mean (smg's default: 1.5)")
    group.add_argument("--router-args", default="", metavar="ARGS",
                       help="more `smg launch` flags, as one shell-quoted string (see `smg launch --help`)")
    group.add_argument("--router-log-level", default="warn", choices=["debug", "info", "warn", "error"], help="smg's log level")
    group.add_argument("--startup-timeout", type=float, default=600.0,
                       help="seconds to wait for every replica to load and the router to report them healthy")
    group.add_argument("--smg", default=None, metavar="PATH", help="the smg executable (default: the one installed beside kvserve)")


def find_smg(given: str | None) -> str:
    if given is not None:
        if not os.access(given, os.X_OK):
            raise ValueError(f"--smg {given}: not an executable file. {_MISSING_SMG}")
        return given
    found = shutil.which("smg", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        raise ValueError(_MISSING_SMG)
    return found


def replica_flags(args: argparse.Namespace, add_args: Callable[[argparse.ArgumentParser], None], skip: tuple[str, ...]) -> list[str]:
    """The command-line flags, among those `add_args` defines, whose values in `args` are not their
    defaults: what a replica is started with."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    argv: list[str] = []
    for action in parser._actions:  # argparse has no public view of a parser's options
        if not action.option_strings or action.dest in skip:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:  # store_true / store_false
            argv.append(flag)
        elif isinstance(value, (list, tuple)):  # nargs="+" (--lora-modules)
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.replicas <= 64:
        raise ValueError(f"--replicas must be in [1, 64], got {args.replicas}")
    if args.router_policy == "power_of_two" and args.replicas < 2:
        raise ValueError("--router-policy power_of_two picks the less loaded of two replicas: give --replicas 2 or more")
    for name in ("port", "router_prometheus_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 65535], got {getattr(args, name)}")
    if args.cache_threshold is not None and not 0.0 <= args.cache_threshold <= 1.0:
        raise ValueError(f"--cache-threshold must be in [0, 1], got {args.cache_threshold}")
    if args.balance_abs_threshold is not None and args.balance_abs_threshold < 0:
        raise ValueError(f"--balance-abs-threshold must be >= 0, got {args.balance_abs_threshold}")
    if args.balance_rel_threshold is not None and not args.balance_rel_threshold >= 1.0:
        raise ValueError(f"--balance-rel-threshold must be >= 1.0, got {args.balance_rel_threshold}")
    if not (math.isfinite(args.startup_timeout) and args.startup_timeout > 0):
        raise ValueError(f"--startup-timeout must be a finite number > 0, got {args.startup_timeout}")
    try:
        shlex.split(args.router_args)
    except ValueError as exc:
        raise ValueError(f"--router-args: {exc}") from None


def _reserved_port(host: str, port: int, flags: str | None = None) -> socket.socket:
    """A listening socket on `port` of `host` (a free port for 0; smg itself takes no port 0), held
    until the router is started on it: meanwhile no replica binding port 0 can be given the same
    port (a released one could be, and then the router failed to bind)."""
    from kvserve.server.shutdown import bound_socket

    return bound_socket(host, port, flags)


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when the cluster process dies, however it dies (SIGKILL, OOM),
    so that no replica outlives it serving on its own. Linux only; elsewhere a no-op."""
    c = libc()
    if c is not None and hasattr(c, "prctl"):
        c.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class _Child:
    """A started process whose output is copied, each line prefixed with its name, to our stdout."""

    lock = threading.Lock()

    def __init__(self, name: str, argv: list[str], env: dict[str, str], watch: str | None = None) -> None:
        self.name = name
        self.found: str | None = None  # the first line that starts with `watch`
        self.tail: list[str] = []
        self._watch = watch
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                     text=True, errors="replace", start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
        self._reader = threading.Thread(target=self._copy, name=f"kvserve-cluster-{name}", daemon=True)
        self._reader.start()

    def _copy(self) -> None:
        for line in self.proc.stdout:
            line = _ANSI_ESCAPE.sub("", line.rstrip("\n"))
            if not line.strip():
                continue
            if self._watch is not None and self.found is None and line.startswith(self._watch):
                self.found = line
            self.tail = [*self.tail[-19:], line]
            with self.lock:
                print(f"[{self.name}] {line}", flush=True)

    def drained(self, timeout: float) -> None:
        """Wait until an exited process's last lines are read (its reader sees the pipe's end)."""
        self._reader.join(timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Cluster:
    def __init__(self, args: argparse.Namespace, smg: str, replica_argv: list[str], threads: int, api_key: str | None) -> None:
        self.args = args
        self.smg = smg
        self.replica_argv = replica_argv
        self.threads = threads
        self.api_key = api_key
        # the replicas share one KV record key (kv/tiers/signing.py): the operator's, else one drawn here
        given = "--kv-remote-key-file" in replica_argv or KV_KEY_ENV in os.environ
        self.record_key = None if given else secrets.token_hex(32)
        self.replicas: list[_Child] = []
        self.router: _Child | None = None
        self.urls: list[str] = []
        self._stop = threading.Event()
        self.forced = False  # a second signal killed everything
        self._reported: set[int] = set()

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key  # not on a command line, where `ps` would show it
        if self.record_key is not None:
            env[KV_KEY_ENV] = self.record_key
        return env

    def _failed(self, child: _Child, what: str) -> ValueError:
        child.drained(timeout=2.0)
        tail = "\n  ".join(child.tail[-8:]) or "(no output)"
        return ValueError(f"{child.name} {what} (exit code {child.proc.returncode}); its last lines:\n  {tail}")

    def start(self) -> str:
        """Start every replica and the router; return the router's URL once it reports them all healthy."""
        args = self.args
        deadline = time.monotonic() + args.startup_timeout
        # the router's ports first: a port in use is an error before minutes of model loading
        reserved = [_reserved_port(args.host, args.port)]
        try:
            reserved.append(_reserved_port("127.0.0.1", args.router_prometheus_port,
                                           f"--router-prometheus-port {args.router_prometheus_port}"))  # fmt: skip
            port, metrics_port = (sock.getsockname()[1] for sock in reserved)
            self._start_replicas(deadline)
        finally:
            for sock in reserved:
                sock.close()
        router_argv = [self.smg, "launch", "--worker-urls", *self.urls, "--policy", args.router_policy, "--host", args.host,
                       "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                       "--log-level", args.router_log_level]  # fmt: skip
        for flag, value in (("--cache-threshold", args.cache_threshold), ("--balance-abs-threshold", args.balance_abs_threshold),
                            ("--balance-rel-threshold", args.balance_rel_threshold)):  # fmt: skip
            if value is not None:
                router_argv += [flag, str(value)]
        if self.api_key is not None:
            router_argv += ["--api-key", self.api_key]  # smg presents it to the replicas and asks it of clients
        router_argv += shlex.split(args.router_args)
        self.router = _Child("router", router_argv, dict(os.environ))
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self._wait_ready(deadline)
        return self.url

    def _start_replicas(self, deadline: float) -> None:
        """Start every replica on a port of its own choosing; return once each reports serving."""
        args = self.args
        command = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
        for i in range(args.replicas):
            self.replicas.append(_Child(f"replica {i}", [*command, *self.replica_argv, "--threads", str(self.threads)], self._env(),
                                        watch="kvserve: serving"))  # fmt: skip
        while any(r.found is None for r in self.replicas):
            for r in self.replicas:
                if r.found is None and r.proc.poll() is not None:
                    raise self._failed(r, "exited before it was serving")
            if self._stop.is_set():
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise ValueError(f"the replicas did not all start within --startup-timeout {args.startup_timeout:g} s")
            time.sleep(0.1)
        self.urls = [r.found.split(" on ", 1)[1].split()[0] for r in self.replicas]

    def _wait_ready(self, deadline: float) -> None:
        want = len(self.replicas)
        seen = None
        while True:
            if self.router.proc.poll() is not None:
                raise self._failed(self.router, "exited before it was ready")
            for r in self.replicas:
                if r.proc.poll() is not None:
                    raise self._failed(r, "exited before the router was ready")
            try:
                seen = httpx.get(self.url + "/readiness", timeout=2).json()
                if seen.get("healthy_workers") == want:
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            if self._stop.is_set():
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise ValueError(f"the router did not report {want} healthy replicas within --startup-timeout "
                                 f"{self.args.startup_timeout:g} s (last /readiness: {seen})")  # fmt: skip
            time.sleep(0.2)

    def watch(self) -> int:
        """Until a signal, the router's exit or every replica's: report replicas that die; the exit status."""
        while not self._stop.wait(0.5):
            if self.router.proc.poll() is not None:
                print(f"kvserve cluster: the router exited (code {self.router.proc.returncode}); stopping the replicas",
                      file=sys.stderr, flush=True)  # fmt: skip
                return 1
            for i, r in enumerate(self.replicas):
                if r.proc.poll() is not None and i not in self._reported:
                    self._reported.add(i)
                    left = len(self.replicas) - len(self._reported)
                    then = f"the router sends its requests to the {left} left" if left else "none is left"
                    print(f"kvserve cluster: replica {i} ({self.urls[i]}) exited (code {r.proc.returncode}); {then}",
                          file=sys.stderr, flush=True)  # fmt: skip
            if len(self._reported) == len(self.replicas):
                print("kvserve cluster: every replica has exited", file=sys.stderr, flush=True)
                return 1
        return 0

    def request_stop(self) -> None:
        if self._stop.is_set():  # a second signal: no more waiting
            self.forced = True
            for child in [self.router, *self.replicas]:
                if child is not None:
                    child.stop(signal.SIGKILL)
        self._stop.set()

    def stop(self) -> None:
        """The router first (no new requests reach a stopping replica), then every replica at once."""
        if self._stop.is_set() and not self.forced:
            print(f"kvserve cluster: stopping the router, then {len(self.replicas)} replicas (each drains for up to "
                  f"--shutdown-timeout {self.args.shutdown_timeout:g} s); a second Ctrl-C kills them", file=sys.stderr, flush=True)  # fmt: skip
        if self.router is not None:
            self.router.stop()
            self.router.wait(15)
        for r in self.replicas:
            r.stop()
        deadline = time.monotonic() + self.args.shutdown_timeout + 15
        for r in self.replicas:
            r.wait(deadline - time.monotonic())


def run_cluster(args: argparse.Namespace) -> int:
    from kvserve.engine_args import add_engine_args, engine_config_from_args
    from kvserve.server.args import add_server_args
    from kvserve.server.config import ServerConfig

    _check(args)
    smg = find_smg(args.smg)
    engine_config_from_args(args)  # every engine flag checked here, once, rather than in N replicas
    ServerConfig.from_args(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads if args.threads is not None else max(1, cores // args.replicas)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    replica_argv = [*replica_flags(args, add_engine_args, skip=("threads",)),
                    *replica_flags(args, lambda p: add_server_args(p, skip=ROUTER_SERVER_FLAGS), skip=("api_key",)),
                    "--log-level", args.log_level]  # fmt: skip
    cluster = Cluster(args, smg, replica_argv, threads, api_key)
    previous = {sig: signal.signal(sig, lambda *_: cluster.request_stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = cluster.start()
        for i, (r, replica_url) in enumerate(zip(cluster.replicas, cluster.urls)):
            print(f"kvserve cluster: replica {i} on {replica_url} (pid {r.proc.pid}, {threads} thread{'s' * (threads != 1)})", flush=True)
        print(f"kvserve cluster: serving {len(cluster.replicas)} replicas behind smg ({args.router_policy}, pid "
              f"{cluster.router.proc.pid}) on {url} (router metrics: {cluster.metrics_url}; Ctrl-C stops all)", flush=True)  # fmt: skip
        status = cluster.watch()
        cluster.stop()
        return 130 if cluster.forced else status
    except BaseException:
        cluster.stop()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
