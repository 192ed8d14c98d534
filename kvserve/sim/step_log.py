"""`--step-log FILE`: every engine step's shape and duration, one JSON line each.

What the step model is fitted from when kvserve is calibrated through its own server
(`kvserve plan calibrate --engine`): the steps the server ran, with everything serving adds
to them (delivering outputs to the HTTP streams, the event loop's share of the cores). The
duration is from the step's start to the end of delivering its outputs, so back-to-back
steps' durations add up to the time between them.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from kvserve.errors import ConfigError
from kvserve.sim.step_shape import StepShape


HEADER_KEY = "kvserve_step_log"


class StepLog:
    """`header`: what the engine is (model, c_kv, context, ...), written first, so a log
    describes itself; a log appended to gets a header line per engine that wrote to it."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # a line per step: a killed server loses none
        except OSError as exc:
            raise ConfigError("step_log", f"cannot write {self.path}: {exc}") from exc
        self._lock = threading.Lock()
        self._file.write(json.dumps({HEADER_KEY: 1, **header}) + "\n")

    def record(self, shape: StepShape, seconds: float) -> None:
        # "end": time.monotonic() when recorded, the clock requests' arrival times use, so the
        # gaps between steps (the engine thread not stepping) can be read from a log too
        row = {"seconds": round(seconds, 7), "end": round(time.monotonic(), 6), **shape.as_dict()}
        line = json.dumps(row, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def record_request(self, request) -> None:
        """A finished request's timestamps (engine.request.RequestTiming, the same monotonic
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


def kind_of(shape: StepShape) -> str:
    if shape.prefill_rows and shape.decode_rows:
        return "mixed"
    return "prefill" if shape.prefill_rows else "decode"


def read_step_log(path: str | Path) -> tuple[dict, list]:
    """(the last engine header, the logged steps as measure.Sample objects)."""
    from kvserve.sim.measure import Sample

    path = Path(path)
    if not path.is_file():
        raise ConfigError("step_log", f"no such file: {path}")
    fields = StepShape.__dataclass_fields__
    header: dict = {}
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if HEADER_KEY in row:
                header = row
                continue
            if "request" in row:  # a finished request's timestamps (record_request)
                continue
            shape = StepShape(**{k: int(row[k]) for k in fields})
            out.append(Sample(kind_of(shape), shape, float(row["seconds"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError("step_log", f"{path}:{number} is not a step record ({exc})") from None
    return header, out


def read_timeline(path: str | Path) -> tuple[list[tuple[float, float]], list[dict]]:
    """(every logged step's (start, end) on the monotonic clock, every finished request's
    timestamps as record_request wrote them), each in the log's order."""
    spans, requests = [], []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "request" in row:
            requests.append(row)
        elif "end" in row:
            spans.append((row["end"] - row["seconds"], row["end"]))
    return spans, requests
