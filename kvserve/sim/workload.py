"""What the simulator serves: requests with an arrival time, prompt token ids and an output length.

Arrivals are Poisson or gamma (loadgen/arrivals.py, the same draw `kvserve bench serve` uses, so
a simulated run and a measured one can share one schedule). Lengths are fixed, uniform, or
taken in turn from a JSONL trace of prompt/output lengths. A shared-prefix mix puts one of
`num_prefixes` common prefixes (system prompts) before each request's own tokens, round
robin. Prompt ids are random otherwise, so only the prefixes can hit the prefix cache, as in
the real benchmark's workloads.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from kvserve.errors import ConfigError
from kvserve.loadgen.arrivals import interarrival_gaps_s, send_times_s

# a trace line's prompt and output lengths, under the names traces use
_PROMPT_KEYS = ("prompt_len", "input_len", "prompt_tokens", "num_prompt_tokens", "input_length")
_OUTPUT_KEYS = ("output_len", "completion_tokens", "output_tokens", "num_output_tokens", "output_length")


@dataclasses.dataclass
class SimRequest:
    request_id: str
    arrival_s: float
    prompt: list[int]
    output_len: int


@dataclasses.dataclass(frozen=True)
class Lengths:
    """fixed:N, uniform:LO:HI (inclusive), or a trace's lengths (`from_trace`)."""

    kind: str
    low: int = 0
    high: int = 0
    values: tuple[int, ...] = ()

    @classmethod
    def parse(cls, field: str, text: str) -> "Lengths":
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                return cls._checked(field, "fixed", int(parts[0]), int(parts[0]))
            if parts[0] == "fixed" and len(parts) == 2:
                return cls._checked(field, "fixed", int(parts[1]), int(parts[1]))
            if parts[0] == "uniform" and len(parts) == 3:
                return cls._checked(field, "uniform", int(parts[1]), int(parts[2]))
        except ValueError:
            pass
        raise ConfigError(field, f"expected N, fixed:N or uniform:LO:HI (positive integers), got {text!r}")

    @classmethod
    def _checked(cls, field: str, kind: str, low: int, high: int) -> "Lengths":
        if low < 1 or high < low:
            raise ConfigError(field, f"lengths must be >= 1 with LO <= HI, got {low}..{high}")
        return cls(kind, low, high)

    def draw(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.kind == "trace":
            return [self.values[i % len(self.values)] for i in range(n)]
        if self.kind == "fixed":
            return [self.low] * n
        return rng.integers(self.low, self.high + 1, size=n).tolist()

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.kind == "trace" else (self.low + self.high) / 2


def read_trace(path: str | Path) -> tuple[Lengths, Lengths]:
    """Prompt and output lengths, one request per JSONL line, in file order."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("trace", f"no such file: {path}")
    prompts, outputs = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            p = next(int(row[k]) for k in _PROMPT_KEYS if k in row)
            o = next(int(row[k]) for k in _OUTPUT_KEYS if k in row)
        except (json.JSONDecodeError, StopIteration, TypeError, ValueError):
            raise ConfigError("trace", f"{path}:{number}: expected a JSON object with a prompt length "
                              f"({'/'.join(_PROMPT_KEYS)}) and an output length ({'/'.join(_OUTPUT_KEYS)})") from None  # fmt: skip
        if p < 1 or o < 1:
            raise ConfigError("trace", f"{path}:{number}: lengths must be >= 1, got {p} and {o}")
        prompts.append(p)
        outputs.append(o)
    if not prompts:
        raise ConfigError("trace", f"{path} holds no request")
    return Lengths("trace", values=tuple(prompts)), Lengths("trace", values=tuple(outputs))


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    rate_req_per_s: float  # inf: all at once
    prompt_lens: Lengths
    output_lens: Lengths
    burstiness: float = 1.0  # gamma shape: 1 Poisson, < 1 bursts
    shared_prefix_len: int = 0
    num_prefixes: int = 1
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ConfigError("num_requests", f"must be an integer >= 1, got {self.num_requests!r}")
        if not self.rate_req_per_s > 0:
            raise ConfigError("rate", f"must be > 0 requests/s (inf: all at once), got {self.rate_req_per_s}")
        if not self.burstiness > 0:
            raise ConfigError("burstiness", f"must be > 0, got {self.burstiness}")
        if self.shared_prefix_len < 0 or self.num_prefixes < 1:
            raise ConfigError("shared_prefix_len", "the prefix length must be >= 0 and the number of prefixes >= 1")

    def with_rate(self, rate: float) -> "WorkloadSpec":
        return dataclasses.replace(self, rate_req_per_s=rate)


def build(spec: WorkloadSpec) -> list[SimRequest]:
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    offsets = send_times_s(interarrival_gaps_s(n, spec.rate_req_per_s, spec.burstiness, spec.seed))
    prompt_lens = spec.prompt_lens.draw(n, rng)
    output_lens = spec.output_lens.draw(n, rng)
    prefixes = [rng.integers(1, spec.vocab_size, size=spec.shared_prefix_len).tolist() for _ in range(spec.num_prefixes)]
    own = rng.integers(1, spec.vocab_size, size=sum(prompt_lens)).tolist()
    out, start = [], 0
    for i in range(n):
        prompt = (prefixes[i % spec.num_prefixes] if spec.shared_prefix_len else []) + own[start : start + prompt_lens[i]]
        start += prompt_lens[i]
        out.append(SimRequest(f"sim-{i}", 0.0 if math.isinf(spec.rate_req_per_s) else offsets[i], prompt, output_lens[i]))
    return out


def from_lists(prompts: list[list[int]], output_lens: list[int], offsets_s: list[float]) -> list[SimRequest]:
    """A workload given request by request (the one a real benchmark run sends)."""
    return [SimRequest(f"sim-{i}", t, list(p), n) for i, (p, n, t) in enumerate(zip(prompts, output_lens, offsets_s))]
