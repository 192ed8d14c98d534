"""`--step-log FILE`: every engine step's shape and duration, one JSON line each, and each
finished request's timestamps.

What the step model is fitted from when kvserve is calibrated through its own server
(`kvserve plan calibrate --engine`): the steps the server ran, with everything serving adds
to them (delivering outputs to the HTTP streams, the event loop's share of the cores). The
duration is from the step's start to the end of delivering its outputs, so back-to-back
steps' durations add up to the time between them. The engine writes it; the simulator reads
it (sim/step_log.py).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from kvserve.errors import ConfigError

HEADER_KEY = "kvserve_step_log"


class StepLog:
    """`header`: what the engine is (model, c_kv, context, ...; engine/describe.py
    `step_log_header`), written first, so a log describes itself; a log appended to gets a
    header line per engine that wrote to it."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # a line per step: a killed server loses none
        except OSError as exc:
            raise ConfigError("step_log", f"cannot write {self.path}: {exc}") from exc
        self._lock = threading.Lock()
        self._file.write(json.dumps({HEADER_KEY: 1, **header}) + "\n")

    def record(self, shape, seconds: float) -> None:
        """A step of this shape (engine/step_shape.py StepShape) took `seconds`."""
        # "end": time.monotonic() when recorded, the clock requests' arrival times use, so the
        # gaps between steps (the engine thread not stepping) can be read from a log too
        row = {"seconds": round(seconds, 7), "end": round(time.monotonic(), 6), **shape.as_dict()}
        line = json.dumps(row, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def record_request(self, request) -> None:
        """A finished request's timestamps (request_state.RequestTiming, the same monotonic
        clock as "end"), so a log can tell, beside a client's own figures, where a request's
        time went: before it reached the engine, queued, computing, and after its first token."""
        t = request.timing
        row = {"request": request.request_id, "prompt_tokens": request.num_prompt_tokens,
               "output_tokens": len(request.output_token_ids), "arrival": t.arrival,
               "first_scheduled": t.first_scheduled, "first_token": t.first_token, "finished": t.finished}  # fmt: skip
        line = json.dumps(row, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
