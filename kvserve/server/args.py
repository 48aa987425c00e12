"""HTTP server flags (their defaults are ServerConfig's)."""

from __future__ import annotations

import argparse

from kvserve.server.config import API_KEY_ENV, MIGRATION_KEY_ENV, ServerConfig
from kvserve.structured.worker import MAX_PENDING_PER_CLIENT

_DEFAULTS = ServerConfig()


def add_server_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The flags of `kvserve serve`, less those named in `skip` (`kvserve cluster` has its own --host and --port)."""
    group = parser.add_argument_group("server")

    def flag(name: str, **kwargs) -> None:
        if name not in skip:
            group.add_argument(name, **kwargs)

    flag("--host", default="127.0.0.1", help="address to bind")
    flag("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    flag("--served-model-name", default=None, help="model name clients send and /v1/models lists (default: --model)")
    flag("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
         help="LoRA adapters (PEFT directories) served by name with --enable-lora: a request whose `model` is NAME runs with it; "
         "/v1/models lists each with the base model as its parent")
    flag("--allow-runtime-lora-updating", action="store_true",
         help="serve POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name} (behind --api-key)")
    flag("--responses-store-max", type=int, default=_DEFAULTS.responses_store_max, metavar="N",
         help="responses the Responses API keeps (store: true) for GET /v1/responses/{id} and follow-ups "
         "(previous_response_id), least recently used out first; with --kv-remote-url they are kept in that Redis "
         "server instead, shared by replicas (default: %(default)s)")
    flag("--responses-store-max-mib", type=int, default=_DEFAULTS.responses_store_max_mib, metavar="MIB",
         help="the memory stored responses may take in this process (default: %(default)s)")
    flag("--chat-template", default=None, help="Jinja chat template, inline or a file path; overrides the model's own")
    flag("--max-waiting-requests", type=int, default=_DEFAULTS.max_waiting_requests,
         help="answer 503 at once when this many requests are already waiting")
    flag("--api-key", default=None,
         help=f"require `Authorization: Bearer KEY` on /v1/*, /flush_cache, POST /reset_prefix_cache, the tokenizer endpoints and "
         f"/docs, /redoc, /openapi.json (401 otherwise); "
         f"default: ${API_KEY_ENV}, else no key")
    flag("--allowed-hosts", default=None,
         help="comma-separated Host header names this server answers to (others get 400; * = any); "
         "default: localhost,127.0.0.1,::1 when bound to a loopback address, else any")
    flag("--max-request-bytes", type=int, default=_DEFAULTS.max_request_bytes,
         help="largest request body; larger ones get 413")
    flag("--request-timeout", type=float, default=_DEFAULTS.request_timeout,
         help="seconds a request may take from arrival to its last token; then it is aborted "
         "(504, or an error event in a stream); 0 = no limit")
    flag("--shutdown-timeout", type=float, default=_DEFAULTS.shutdown_timeout,
         help="on SIGTERM/SIGINT: stop admitting (503), let running requests finish for this many seconds, "
         "abort the rest, exit 0; a second signal exits at once")
    flag("--trust-request-chat-template", action="store_true",
         help="accept a chat_template field in chat requests (refused by default: a template is code); "
         "every template renders sandboxed, with limits on output size and time")
    flag("--migration-targets", default=None, metavar="URLS",
         help="comma-separated base URLs of kvserve servers (same model and KV settings) that POST /v1/kv/migrate "
         "may move a running request to; the client's response goes on through this server. Unset: migration "
         "is refused (403). Needs --migration-key. Servers in a group share one --api-key. See docs/kv-sharing.md")
    flag("--migration-key", default=None, metavar="SECRET",
         help=f"the secret a migration group's servers share (16+ characters): a source sends it, and "
         f"POST /v1/kv/import takes a request (and its KV) only with it; without it this server takes no migrated "
         f"request (403). Default: ${MIGRATION_KEY_ENV}, else none")
    flag("--grammar-compile-timeout", type=float, default=_DEFAULTS.grammar_compile_timeout,
         help="seconds a structured-outputs grammar (response_format, structured_outputs, guided_*) may take to compile, "
         "in a child process killed past it; the request then gets a 400. Compiled grammars are cached")
    flag("--grammar-compile-workers", type=int, default=_DEFAULTS.grammar_compile_workers, metavar="N",
         help="grammar compile processes. Clients (by address) take turns, and one client's compiles run on all "
         f"workers but one, so another client's never waits behind their queue; each client has at most "
         f"{MAX_PENDING_PER_CLIENT} compiles queued (then a 429). Requests without a constraint never wait for a compile")
    flag("--grammar-compile-memory-mb", type=int, default=_DEFAULTS.grammar_compile_memory_mb, metavar="MIB",
         help="memory one grammar compile may take (above what a compile process holds at start); past it the "
         "process is restarted and the request gets a 400")
    flag("--dashboard-show-tokens", action="store_true",
         help="the KV page (GET /dashboard) and GET /v1/kv/snapshot show the text of cached prefixes; off by default "
         "(the page then shows shapes, counts and salt digests, never prompt text). Both need --api-key when one is set")
    flag("--disable-fastapi-docs", action="store_true",
         help="serve no /docs (Swagger UI), /redoc or /openapi.json; without it they are served, behind --api-key when one is set")
    flag("--uvicorn-log-level", default="warning", help="uvicorn's log level")
