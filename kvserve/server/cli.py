"""`kvserve serve`: its flags. The process itself (engine, uvicorn, signals) is
`server/runner.py`, imported only when the command runs."""

from __future__ import annotations

import argparse
import os

from kvserve.engine_args import add_engine_args, engine_config_from_args

API_KEY_ENV = "KVSERVE_API_KEY"
# the per-field sampling defaults; same names as `kvserve generate`'s flags
_SAMPLING_FLAGS = [
    ("--temperature", float),
    ("--top-p", float),
    ("--top-k", int),
    ("--min-p", float),
    ("--repetition-penalty", float),
    ("--presence-penalty", float),
    ("--frequency-penalty", float),
    ("--max-tokens", int),
]


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
    g.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer KEY` on every route but /health, /version and the playground pages (or set {API_KEY_ENV})")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model's own name)")
    g.add_argument(
        "--max-waiting-requests", type=int, default=1024,
        help="waiting-queue limit, in samples (a request with n=4 counts 4); more get 429 (0 = unbounded)",
    )  # fmt: skip
    g.add_argument(
        "--max-waiting-tokens", type=int, default=None,
        help="prompt tokens waiting to start; more get 429 (default: 4 KV pools' worth, at least max-model-len; 0 = unbounded)",
    )  # fmt: skip
    g.add_argument("--max-request-bytes", default="8MiB", help="largest request body; larger ones get 413 (default 8MiB)")
    g.add_argument("--drain-timeout", type=float, default=10.0, help="seconds in-flight requests may finish after SIGTERM/SIGINT")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True, help="log one line per request")
    g.add_argument(
        "--restart-engine",
        action="store_true",
        help="if the engine fails, build a fresh one in this process (the model reloaded) instead of exiting 1; "
        "a second failure within 60s of a restart still exits 1",
    )
    d = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    d.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                   help="both (default): colocated, and either half of a handoff per request; prefill: only prefills and "
                        "sends the KV; decode: receives the KV and decodes (and computes prompts sent to it plainly)")
    d.add_argument("--kv-transfer-failure", choices=["recompute", "fail"], default="recompute",
                   help="a decode request whose KV handoff fails or times out: recompute the prompt here (default), or "
                        "fail the request with a 502")
    d.add_argument("--kv-transfer-timeout", type=float, default=60.0, help="seconds a decode request waits for its KV (default 60)")
    d.add_argument("--kv-transport", choices=["shm", "torch"], default="shm",
                   help="shm (default): handoffs through /dev/shm, every instance on this host; torch: torch.distributed "
                        "point to point over gloo, between hosts")
    d.add_argument("--kv-transfer-listen", default=None, metavar="HOST:PORT",
                   help="torch transport, decode side: where prefill instances connect (default 127.0.0.1 and a free port; "
                        "0.0.0.0:PORT for other hosts)")
    d.add_argument("--disaggregation", default=None, metavar="xPyD",
                   help="start x prefill and y decode servers on this host (free ports) and a router in front of them on "
                        "--host/--port, e.g. 1P1D; the engine flags go to every server")
    s = p.add_argument_group("sampling defaults (for fields a request leaves unset; the request's own values always win)")
    s.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "none"],
        help="auto: the model's generation_config.json / GGUF general.sampling.*, else llama.cpp's defaults "
        "(temperature 0.8, top_k 40, top_p 0.95, min_p 0.05); none: OpenAI's (temperature 1, no filtering)",
    )
    for flag, kind in _SAMPLING_FLAGS:
        s.add_argument(flag, type=kind, default=None, help="default for requests that leave it unset")
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace, build_engine=None) -> int:
    """`build_engine(engine_config)`: the AsyncLLMEngine to serve (by default a plain one; a test
    may build one with a fault in it, tests/support/faulty_server.py)."""
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
        restart_engine=args.restart_engine,
        generation_config=args.generation_config,
        sampling_overrides={flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _ in _SAMPLING_FLAGS},
    )
    if args.disaggregation:
        from kvserve.disagg.launch import run_disaggregated

        return run_disaggregated(args)
    engine_config = engine_config_from_args(
        args, max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
        kv_role=args.role, kv_transfer_failure=args.kv_transfer_failure, kv_transfer_timeout_s=args.kv_transfer_timeout,
        kv_transport=args.kv_transport, kv_transfer_listen=args.kv_transfer_listen,
    )  # fmt: skip
    from kvserve.distributed.launch import launched_by_torchrun
    from kvserve.engine.tp_worker import run_worker

    if launched_by_torchrun() and os.environ["RANK"] != "0":
        # torchrun started every rank: rank 0 serves HTTP and schedules, the others follow its steps
        run_worker(engine_config)
        return 0
    return run_server(engine_config, server_config, log_level=args.log_level, build_engine=build_engine)
