"""HTTP server configuration: a frozen, validated dataclass whose field names match the serve flags."""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, fields

from kvserve.model.tokenizer import read_chat_template

API_KEY_ENV = "KVSERVE_API_KEY"
MIGRATION_KEY_ENV = "KVSERVE_MIGRATION_KEY"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' name=path (vLLM's form; its JSON form is not taken)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes name=path, got {text!r}")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    chat_template: str | None = None  # the template's text (--chat-template may name a file)
    max_waiting_requests: int = 256
    api_key: str | None = None
    # Host header names served; None: the loopback names when bound to loopback, else any; "*" = any
    allowed_hosts: tuple[str, ...] | None = None
    max_request_bytes: int = 8 * 2**20
    request_timeout: float | None = 600.0  # seconds from arrival; None = no limit
    shutdown_timeout: float = 30.0
    trust_request_chat_template: bool = False
    migration_targets: tuple[str, ...] = ()  # base URLs POST /v1/kv/migrate may move a request to (none: migration off)
    migration_key: str | None = None  # the secret servers of a migration group share: /v1/kv/import takes a request only with it
    grammar_compile_timeout: float = 10.0  # seconds one structured-outputs grammar may take to compile (then a 400)
    grammar_compile_workers: int = 2  # compile processes; one client's compiles use all but one of them
    grammar_compile_memory_mb: int = 1024  # memory one compile may take (then a 400)
    dashboard_show_tokens: bool = False  # the KV page's prefix tree shows the cached tokens' text
    disable_fastapi_docs: bool = False  # serve no /docs, /redoc, /openapi.json (vLLM's flag)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, adapter directory): the `model` names that pick an adapter
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's switch)
    responses_store_max: int = 1000  # stored responses kept in memory (least recently used out first; 0: none stored)
    responses_store_max_mib: int = 256  # and the memory they may take

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_waiting_requests", "max_request_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be positive (seconds), got {self.request_timeout}")
        if not isinstance(self.grammar_compile_workers, int) or not 1 <= self.grammar_compile_workers <= 64:
            raise ValueError(f"grammar_compile_workers must be an integer in [1, 64], got {self.grammar_compile_workers!r}")
        if not isinstance(self.grammar_compile_memory_mb, int) or not 64 <= self.grammar_compile_memory_mb <= 1 << 20:
            raise ValueError(f"grammar_compile_memory_mb must be an integer of at least 64 (MiB), got {self.grammar_compile_memory_mb!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be positive (seconds), got {self.grammar_compile_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 (seconds), got {self.shutdown_timeout}")
        if not isinstance(self.responses_store_max, int) or not 0 <= self.responses_store_max <= 10**7:
            raise ValueError(f"responses_store_max must be an integer in [0, 10000000], got {self.responses_store_max!r}")
        if not isinstance(self.responses_store_max_mib, int) or not 1 <= self.responses_store_max_mib <= 1 << 20:
            raise ValueError(f"responses_store_max_mib must be a positive integer (MiB), got {self.responses_store_max_mib!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        targets = tuple(t.strip().rstrip("/") for t in self.migration_targets if t.strip())
        for target in targets:
            if not target.startswith(("http://", "https://")):
                raise ValueError(f"--migration-targets must list http:// or https:// base URLs, got {target!r}")
        object.__setattr__(self, "migration_targets", targets)
        if self.migration_key is not None and len(self.migration_key.strip()) < 16:
            raise ValueError("--migration-key must be at least 16 characters (a shared secret: it lets a server put KV into this one)")
        if targets and self.migration_key is None:
            raise ValueError(f"--migration-targets needs --migration-key (or ${MIGRATION_KEY_ENV}): the secret the targets accept")
        if self.allowed_hosts is None:
            hosts = LOOPBACK_HOSTS if is_loopback(self.host) else ("*",)
        else:
            hosts = tuple(h.strip().lower().removeprefix("[").removesuffix("]") for h in self.allowed_hosts if h.strip())
            if not hosts:
                raise ValueError("allowed_hosts must name at least one host (or *)")
        object.__setattr__(self, "allowed_hosts", hosts)

    def host_allowed(self, host_header: str) -> bool:
        """Whether a request's Host header (name, optionally with a port) is one this server answers to."""
        if "*" in self.allowed_hosts:
            return True
        host = host_header.strip().lower()
        if host.startswith("["):  # [::1]:8000
            host = host[1 : host.find("]")] if "]" in host else host
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        return host in self.allowed_hosts

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["chat_template"] = read_chat_template(values.get("chat_template"))
        if values.get("api_key") is None:
            values["api_key"] = os.environ.get(API_KEY_ENV) or None
        if values.get("migration_key") is None:
            values["migration_key"] = os.environ.get(MIGRATION_KEY_ENV) or None
        hosts = values.get("allowed_hosts")
        if hosts is not None:
            values["allowed_hosts"] = tuple(hosts.split(","))
        if values.get("request_timeout") == 0:
            values["request_timeout"] = None
        values["migration_targets"] = tuple((values.get("migration_targets") or "").split(","))
        values["lora_modules"] = tuple(parse_lora_module(m) for m in values.get("lora_modules") or ())
        return cls(**values)
