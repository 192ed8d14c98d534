"""The server process: load the model, start the engine thread, serve HTTP until a signal.

On SIGTERM or SIGINT, uvicorn stops accepting connections and in-flight requests get
`drain_timeout_s` to finish. Those still running then are aborted in the engine, so each
client still gets a proper end (finish_reason "abort", then [DONE]) rather than a cut
connection; the engine thread stops and the process exits 0. A second SIGINT skips
the wait.

If the engine thread fails (engine/async_engine.py: a step that raised leaves the engine's
state unknown, so it is not repaired in place), every open stream has already got an
error event and [DONE], /health answers 503, new requests get 503, and the server shuts
down as on SIGTERM and the process exits with status 1, for its supervisor (systemd,
Kubernetes, a shell loop) to start a clean one; with `--restart-engine` a fresh engine is
built in the process instead (server/supervisor.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import sys
from typing import Callable

import uvicorn

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.describe import describe
from kvserve.engine.gc_policy import freeze_after_startup
from kvserve.server.api import build_app
from kvserve.server.config import ServerConfig
from kvserve.server.context import ServingContext
from kvserve.server.supervisor import EngineSupervisor

_ABORT_GRACE_S = 5.0
EXIT_ENGINE_DEAD = 1


def run_server(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info",
               build_engine: Callable[[EngineConfig], AsyncLLMEngine] | None = None) -> int:  # fmt: skip
    """`build_engine`: how this process builds its engine, the first and after a restart."""
    build_engine = build_engine or AsyncLLMEngine
    engine = build_engine(engine_config)
    freeze_after_startup()
    ctx: ServingContext | None = None
    try:
        _say(describe(engine.engine))
        app = build_app(engine, server_config)
        ctx = app.state.ctx
        _say(ctx.sampling_defaults.describe())
        uv_config = uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=log_level,
            access_log=server_config.access_log,
            # past the drain, aborted streams need a moment to send their last chunk
            timeout_graceful_shutdown=server_config.drain_timeout_s + _ABORT_GRACE_S,
            lifespan="off",
        )
        server = _Server(uv_config, ctx, server_config)
        supervisor = EngineSupervisor(ctx, engine_config, server_config.restart_engine, server.exit_soon, build_engine)
        # uvicorn re-raises the signal it shut down on into the handler it found; make
        # that one a no-op so a graceful SIGTERM ends in exit status 0, not death by signal
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server.run()
    finally:
        # the engine now serving (a restart may have replaced the first); uvicorn already
        # drained, so this aborts what is left
        (ctx.engine if ctx is not None else engine).shutdown(drain_timeout_s=0)
    if supervisor.failed is not None:
        _say(f"stopped: the engine failed ({supervisor.failed!r}); exit status {EXIT_ENGINE_DEAD}")
        return EXIT_ENGINE_DEAD
    _say("stopped")
    return 0


class _Server(uvicorn.Server):
    """Reports the bound address (the real port when --port 0); drains, then aborts."""

    def __init__(self, config: uvicorn.Config, ctx: ServingContext, server_config: ServerConfig):
        super().__init__(config)
        self.ctx = ctx
        self.model_name = ctx.model_name
        self.server_config = server_config

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.ctx.engine  # the current one: a restart replaces it

    def exit_soon(self) -> None:
        """From any thread: shut down as on SIGTERM."""
        self.should_exit = True  # uvicorn's main loop polls it

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            auth = "API key required but on /health, /version and the pages" if self.server_config.api_key else "no API key"
            if not self.server_config.api_key and not _is_loopback(host):
                _say(f"warning: {host} is reachable from other machines and no --api-key is set")
            _say(f"serving {self.model_name} at {_address(host, port)}/v1 ({auth}); also /health /metrics /tokenize /detokenize")

    async def shutdown(self, sockets=None) -> None:
        drain_s = self.server_config.drain_timeout_s
        _say(f"shutting down; in-flight requests have {drain_s:g}s to finish")
        ender = asyncio.ensure_future(self._abort_in_flight_after(drain_s))
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _abort_in_flight_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self.engine.num_in_flight():
            _say(f"aborting {self.engine.num_in_flight()} request(s) still running")
        # shutdown joins the engine thread: off the event loop, which must deliver the aborts
        await asyncio.to_thread(self.engine.shutdown, 0.0)


def _address(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _say(message: str) -> None:
    print(f"kvserve: {message}", file=sys.stderr, flush=True)
