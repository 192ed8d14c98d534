"""What the server does when its engine thread fails: exit 1, or with `--restart-engine`
start a fresh engine in the same process.

By the time `engine_died` is called, the failed engine has already ended every open
stream with an error event and [DONE] and answers new requests 503 (engine/async_engine.py),
and /health is 503. Without restarting, the server then shuts down and the process exits 1
for its supervisor (systemd, Kubernetes) to start a clean one. With it, the old engine's
model and KV pool are let go first (two copies of an 8B model would not fit), a new one is
built from the same config, and the server routes to it: /health turns 200 again. A
second failure within `CRASH_LOOP_S` of a restart means the fault is not transient: the
process exits 1 instead of restarting forever.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Callable

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.gc_policy import freeze_after_startup, thaw
from kvserve.memory import release_free_memory
from kvserve.server.context import ServingContext

CRASH_LOOP_S = 60.0


class EngineSupervisor:
    def __init__(self, ctx: ServingContext, engine_config: EngineConfig, restart: bool, exit_server: Callable[[], None],
                 build_engine: Callable[[EngineConfig], AsyncLLMEngine] = AsyncLLMEngine):  # fmt: skip
        self.ctx = ctx
        self.engine_config = engine_config
        self.build_engine = build_engine
        self.restart = restart
        self.exit_server = exit_server
        self.restarts = 0
        self.failed: BaseException | None = None  # set when the process should exit 1
        self._last_restart: float | None = None
        ctx.engine.on_dead = self.engine_died

    def engine_died(self, error: BaseException) -> None:
        """Called from the dead engine's thread."""
        recent = self._last_restart is not None and time.monotonic() - self._last_restart < CRASH_LOOP_S
        if not self.restart or recent:
            why = f"it failed again within {CRASH_LOOP_S:g}s of a restart" if recent else "no --restart-engine"
            _say(f"the engine failed ({error!r}); shutting down ({why})")
            self.failed = error
            self.exit_server()
            return
        _say(f"the engine failed ({error!r}); restarting it")
        threading.Thread(target=self._restart, name="kvserve-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        old = self.ctx.engine
        try:
            old.shutdown(0.0)  # its thread has ended; this joins it and fails what is left
            old.engine.release()
            thaw()  # the old engine's objects were frozen at start-up
            gc.collect()
            release_free_memory()
            start = time.perf_counter()
            new = self.build_engine(self.engine_config)
            freeze_after_startup()
        except BaseException as exc:  # cannot come back: exit 1 as without restarting
            _say(f"the engine could not be restarted ({exc!r}); shutting down")
            self.failed = exc
            self.exit_server()
            return
        new.on_dead = self.engine_died
        self.ctx.metrics.bind_engine(new.engine)
        self.ctx.engine = new  # routes read ctx.engine per request: new requests go to it
        self.restarts += 1
        self._last_restart = time.monotonic()
        _say(f"engine restarted in {time.perf_counter() - start:.1f}s (restart {self.restarts})")


def _say(message: str) -> None:
    print(f"kvserve: {message}", file=sys.stderr, flush=True)
