"""Reading a `--step-log` file (the engine writes it: engine/step_log.py): the steps as samples
for the step model's fit, and the timeline of steps and requests.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.engine.step_log import HEADER_KEY
from kvserve.errors import ConfigError
from kvserve.engine.step_shape import StepShape


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
