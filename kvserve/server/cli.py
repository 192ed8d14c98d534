"""`kvserve serve`: its flags. The process itself (engine, uvicorn, signals) is
`server/runner.py`, imported only when the command runs."""

from __future__ import annotations

import argparse
import os

from kvserve.engine_args import add_engine_args, engine_config_from_args

API_KEY_ENV = "KVSERVE_API_KEY"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics …)",
        description="Serve a model over the OpenAI HTTP API, on 127.0.0.1:8000 by default.",
    )
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (0 = any free port, printed at start)")
    g.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer KEY` on /v1 routes (or set {API_KEY_ENV})")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model's own name)")
    g.add_argument(
        "--max-waiting-requests", type=int, default=1024, help="waiting-queue limit; more requests get 429 (0 = unbounded)"
    )
    g.add_argument("--max-request-bytes", default="8MiB", help="largest request body; larger ones get 413 (default 8MiB)")
    g.add_argument("--drain-timeout", type=float, default=10.0, help="seconds in-flight requests may finish after SIGTERM/SIGINT")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True, help="log one line per request")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from kvserve.server.config import ServerConfig
    from kvserve.server.runner import run_server

    # every flag is checked before the model loads, so a typo costs no wait
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        served_model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_s=args.drain_timeout,
        access_log=args.access_log,
    )
    engine_config = engine_config_from_args(args, max_waiting_requests=args.max_waiting_requests)
    return run_server(engine_config, server_config, log_level=args.log_level)
