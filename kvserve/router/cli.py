"""`kvserve router`: its flags, validated here, and the process (uvicorn on the router app)."""

from __future__ import annotations

import os
import sys
from urllib.parse import urlparse

from kvserve.errors import ConfigError

API_KEY_ENV = "KVSERVE_API_KEY"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "router",
        help="one OpenAI-compatible front for several kvserve servers (prefix-aware, health-checked)",
        description="Route OpenAI API requests to kvserve replicas: requests sharing a prompt prefix go to the replica "
                    "that has it cached, within a load bound; a dead replica is marked down and its requests retried.",
    )  # fmt: skip
    p.add_argument("--replica", nargs="+", default=[], metavar="URL", help="base URLs of colocated replicas (http://host:port)")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                   help="prefill instances (kvserve serve --role prefill): each request's prompt runs there to its first token")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL",
                   help="decode instances (kvserve serve --role decode): they receive the KV and answer the client")
    p.add_argument("--policy", choices=["prefix", "round-robin", "least-loaded"], default="prefix",
                   help="prefix (default): the replica with the prompt's prefix cached, within the load bound")  # fmt: skip
    p.add_argument("--balance-abs", type=int, default=8, help="load bound: in-flight requests beyond the least loaded replica's (default 8) ...")
    p.add_argument("--balance-rel", type=float, default=1.5, help="... and this many times it (default 1.5) make the least loaded win")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="least fraction of the prompt a replica must have seen to win on its cache (default 0.5)")  # fmt: skip
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health and load polls (default 2)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take on a replica (default 600)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port to bind (default 8100; 0 = any free port, printed at start)")
    p.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer KEY` but on /health (or set {API_KEY_ENV})")
    p.add_argument("--replica-api-key", default=None, help="the key the replicas want (default: none)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def _check(args) -> None:
    if not args.replica and not (args.prefill and args.decode):
        raise ConfigError("replica", "give --replica URL…, or both --prefill URL… and --decode URL…")
    if bool(args.prefill) != bool(args.decode):
        raise ConfigError("prefill", "--prefill and --decode go together: a prefill instance hands its KV to a decode instance")
    urls = args.replica + args.prefill + args.decode
    for url in urls:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError("replica", f"{url!r} is not an http(s)://host:port URL")
    if len(set(u.rstrip("/") for u in urls)) != len(urls):
        raise ConfigError("replica", "the same URL is given twice")
    if args.balance_abs < 0 or args.balance_rel < 1:
        raise ConfigError("balance", "--balance-abs must be >= 0 and --balance-rel >= 1")
    if not 0 <= args.cache_threshold <= 1:
        raise ConfigError("cache_threshold", f"must be in [0, 1], got {args.cache_threshold}")
    if args.health_interval <= 0 or args.request_timeout <= 0:
        raise ConfigError("interval", "--health-interval and --request-timeout must be > 0")
    if not 0 <= args.port <= 65535:
        raise ConfigError("port", f"must be in [0, 65535], got {args.port}")


def run(args) -> int:
    import uvicorn

    from kvserve.router.app import create_router_app
    from kvserve.router.policy import Policy

    _check(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    policy = Policy(args.policy, args.balance_abs, args.balance_rel, args.cache_threshold)
    app = create_router_app(args.replica, policy, api_key, args.replica_api_key, args.health_interval, args.request_timeout,
                            args.prefill, args.decode)  # fmt: skip

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                pools = [f"{name} {', '.join(urls)}" for name, urls in
                         (("replicas", args.replica), ("prefill", args.prefill), ("decode", args.decode)) if urls]  # fmt: skip
                print(f"kvserve: router ({args.policy}) at http://{host}:{port}/v1 over {'; '.join(pools)}; also /health /metrics",
                      file=sys.stderr, flush=True)  # fmt: skip

    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run()
    return 0
