"""HTTP server flags."""

from __future__ import annotations

import argparse


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind")
    group.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    group.add_argument("--served-model-name", default=None, help="model name clients send and /v1/models lists (default: --model)")
    group.add_argument("--chat-template", default=None, help="Jinja chat template, inline or a file path; overrides the model's own")
    group.add_argument("--max-waiting-requests", type=int, default=256,
                       help="answer 503 at once when this many requests are already waiting")
    group.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level")
