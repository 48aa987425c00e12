"""HTTP server flags (their defaults are ServerConfig's)."""

from __future__ import annotations

import argparse

from kvserve.server.config import API_KEY_ENV, MIGRATION_KEY_ENV, ServerConfig

_DEFAULTS = ServerConfig()


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind")
    group.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    group.add_argument("--served-model-name", default=None, help="model name clients send and /v1/models lists (default: --model)")
    group.add_argument("--chat-template", default=None, help="Jinja chat template, inline or a file path; overrides the model's own")
    group.add_argument("--max-waiting-requests", type=int, default=_DEFAULTS.max_waiting_requests,
                       help="answer 503 at once when this many requests are already waiting")
    group.add_argument("--api-key", default=None,
                       help=f"require `Authorization: Bearer KEY` on /v1/* and POST /reset_prefix_cache (401 otherwise); "
                       f"default: ${API_KEY_ENV}, else no key")
    group.add_argument("--allowed-hosts", default=None,
                       help="comma-separated Host header names this server answers to (others get 400; * = any); "
                       "default: localhost,127.0.0.1,::1 when bound to a loopback address, else any")
    group.add_argument("--max-request-bytes", type=int, default=_DEFAULTS.max_request_bytes,
                       help="largest request body; larger ones get 413")
    group.add_argument("--request-timeout", type=float, default=_DEFAULTS.request_timeout,
                       help="seconds a request may take from arrival to its last token; then it is aborted "
                       "(504, or an error event in a stream); 0 = no limit")
    group.add_argument("--shutdown-timeout", type=float, default=_DEFAULTS.shutdown_timeout,
                       help="on SIGTERM/SIGINT: stop admitting (503), let running requests finish for this many seconds, "
                       "abort the rest, exit 0; a second signal exits at once")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template field in chat requests (refused by default: a template is code); "
                       "every template renders sandboxed, with limits on output size and time")
    group.add_argument("--migration-targets", default=None, metavar="URLS",
                       help="comma-separated base URLs of kvserve servers (same model and KV settings) that POST /v1/kv/migrate "
                       "may move a running request to; the client's response goes on through this server. Unset: migration "
                       "is refused (403). Needs --migration-key. Servers in a group share one --api-key. See docs/kv-sharing.md")
    group.add_argument("--migration-key", default=None, metavar="SECRET",
                       help=f"the secret a migration group's servers share (16+ characters): a source sends it, and "
                       f"POST /v1/kv/import takes a request (and its KV) only with it; without it this server takes no migrated "
                       f"request (403). Default: ${MIGRATION_KEY_ENV}, else none")
    group.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level")
