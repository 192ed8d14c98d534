"""Time the real engine in this process over a grid of step shapes (`kvserve plan calibrate
--engine --in-process`; by default the same Grid goes through a server, measure_server.py).

Each point makes the engine run steps of one shape, from requests of random token ids
(distinct, so no prefix-cache hit unless a point asks for one):
- a prompt chunk of T positions over S0 cached ones (the cache is filled first by a
  request of the S0-position prefix), sampling its first token;
- R requests decoding at a context of about S each;
- R decoding rows beside a chunk of T: mixed steps, the continuous-batching case;
- held-out points of every kind, shapes the fit does not see, to measure its error.

A step's time is `LLMEngine.step()` on the wall clock: scheduling, the forward pass,
sampling, detokenizing and emitting, as the server's engine thread runs it. Each point
keeps the median of its repeats. The shape of each timed step is read from the
scheduler's own plan by the engine (step_shape.py, as --step-log does), so the fit sees
exactly what ran.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from kvserve.sampling_params import SamplingParams
from kvserve.engine.step_shape import StepShape


@dataclasses.dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048)
    prefill_cached: tuple[int, ...] = (0, 1024)  # S0 under each chunk (block multiples)
    decode_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    decode_context: tuple[int, ...] = (64, 512, 1536)
    max_decode_positions: int = 40_000  # R·S cap: the pool must hold every row's history
    mixed: tuple[tuple[int, int, int], ...] = ((1, 256, 256), (8, 256, 64), (8, 256, 512), (32, 256, 256), (32, 512, 64),
                                               (64, 256, 512), (16, 1024, 1024))  # (R, S, T)  # fmt: skip
    # not fitted: (R, S, T), T = 0 a decode point, R = 0 a prompt of T over S cached
    held_out: tuple[tuple[int, int, int], ...] = ((0, 0, 384), (0, 512, 192), (24, 768, 0), (6, 128, 0), (4, 384, 128),
                                                  (24, 128, 384))  # fmt: skip
    # through the server only: requests arriving while it computes (their HTTP handling shares the
    # cores): (requests, mean gap s, prompt lo, hi, output lo, hi), Poisson
    arrivals: tuple[int, float, int, int, int, int] = (48, 0.15, 32, 512, 16, 96)
    # through the server only: a serving load, Poisson at this fraction of the rate the steps
    # fitted so far say the server sustains: (requests, load, prompt lo, hi, output lo, hi).
    # Its steps are fitted like the rest (a serving mix of shapes); the requests sent while a
    # step runs measure the busy request overhead.
    serving: tuple[int, float, int, int, int, int] = (40, 0.5, 64, 256, 32, 128)
    repeats: int = 3
    decode_steps: int = 4  # timed steps per decode point, after the prompts are in

    @classmethod
    def quick(cls) -> "Grid":
        """A small grid for tests: seconds, not minutes."""
        return cls(prefill_tokens=(16, 64, 160), prefill_cached=(0, 64), decode_rows=(1, 4, 12), decode_context=(32, 96),
                   mixed=((4, 48, 64), (8, 32, 32)), held_out=((0, 0, 48), (6, 40, 0), (3, 40, 40)),
                   arrivals=(12, 0.01, 16, 64, 8, 24), serving=(12, 0.5, 16, 64, 8, 24), repeats=2,
                   decode_steps=2)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Sample:
    kind: str  # prefill | decode | mixed
    shape: StepShape
    seconds: float
    held_out: bool = False  # measured to check the fit, not fitted

    def as_dict(self) -> dict:
        return {"kind": self.kind, "held_out": self.held_out, "seconds": self.seconds, **self.shape.as_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "Sample":
        fields = {f.name: int(data[f.name]) for f in dataclasses.fields(StepShape)}
        return cls(str(data["kind"]), StepShape(**fields), float(data["seconds"]), bool(data.get("held_out", False)))


class _Timed:
    """Steps the engine, timing each step; its shape is the one the engine read from the
    scheduler's plan (`LLMEngine.read_step_shapes`, as for --step-log)."""

    def __init__(self, engine):
        self.engine = engine
        engine.read_step_shapes = True

    def step(self) -> tuple[StepShape, float]:
        start = time.perf_counter()
        self.engine.step()
        return self.engine.last_step_shape, time.perf_counter() - start

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _ids(rng: np.random.Generator, n: int, vocab: int, exclude: frozenset[int]) -> list[int]:
    ids = rng.integers(0, vocab, size=n).tolist()
    return [t if t not in exclude else (t + 1) % vocab for t in ids]


def measure(engine, grid: Grid = Grid(), seed: int = 0, progress=None) -> list[Sample]:
    """Every grid point that fits this engine's pool and budget, as timed steps."""
    rng = np.random.default_rng(seed)
    vocab, exclude = engine.arch.vocab_size, frozenset(engine.tokenizer.eos_token_ids)
    bs = engine.config.block_size
    limit = min(engine.max_model_len, engine.config.max_num_batched_tokens)
    timed = _Timed(engine)
    samples: list[Sample] = []
    timed.drain()
    pool = min(grid.max_decode_positions, engine.layout.num_tokens)

    def point(rows: int, context: int, chunk: int, held_out: bool = False) -> None:
        if rows == 0:
            if context + chunk + 1 > engine.max_model_len or chunk > limit:
                return
            samples.append(_prefill_point(engine, timed, rng, context // bs * bs, chunk, grid, vocab, exclude, held_out))
        else:
            if rows * (context + grid.decode_steps * (grid.repeats + 2) + 4) + chunk > pool or rows > engine.config.max_num_seqs \
                    or rows + chunk > limit:  # fmt: skip
                return
            samples.extend(_decode_point(engine, timed, rng, rows, context, chunk, grid, vocab, exclude, held_out))
        if progress is not None:
            progress()

    for s0 in grid.prefill_cached:
        for t in grid.prefill_tokens:
            point(0, s0, t)
    for s in grid.decode_context:
        for r in grid.decode_rows:
            point(r, s, 0)
    for r, s, t in grid.mixed:
        point(r, s, t)
    for r, s, t in grid.held_out:
        point(r, s, t, held_out=True)
    return samples


def num_points(grid: Grid) -> int:
    """Grid points, for a progress bar (some may be skipped where the engine's pool is small)."""
    return len(grid.prefill_cached) * len(grid.prefill_tokens) + len(grid.decode_context) * len(grid.decode_rows) \
        + len(grid.mixed) + len(grid.held_out) + 2  # fmt: skip


def _prefill_point(engine, timed: _Timed, rng, s0: int, t: int, grid: Grid, vocab: int, exclude, held_out: bool) -> Sample:
    """A prompt of t new positions over s0 cached ones (a prefix run first fills the cache)."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times, shape = [], None
    for _ in range(grid.repeats + 1):  # the first run of a shape warms it up
        prefix = _ids(rng, s0, vocab, exclude)
        if s0:
            engine.add_request(None, prefix + _ids(rng, 1, vocab, exclude), greedy)
            timed.drain()
        engine.add_request(None, prefix + _ids(rng, t, vocab, exclude), greedy)
        shape, seconds = timed.step()
        times.append(seconds)
        timed.drain()
    return Sample("prefill", shape, statistics.median(times[1:]), held_out)


def _decode_point(engine, timed: _Timed, rng, rows: int, context: int, chunk: int, grid: Grid, vocab: int, exclude,
                  held_out: bool) -> list[Sample]:  # fmt: skip
    """`rows` requests decoding at about `context` positions; with `chunk`, a new prompt of that
    many positions joins each timed step (the steps are mixed)."""
    params = SamplingParams(max_tokens=grid.decode_steps * (grid.repeats + 2) + 4, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(None, _ids(rng, context, vocab, exclude), params) for _ in range(rows)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.waiting) or engine.scheduler.waiting or \
            any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):  # fmt: skip
        engine.step()
    engine.step()  # the first all-decode step warms the shape up
    times, shapes = [], []
    for _ in range(grid.decode_steps):
        if chunk:
            engine.add_request(None, _ids(rng, chunk, vocab, exclude), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        shape, seconds = timed.step()
        times.append(seconds)
        shapes.append(shape)
    for request_id in ids:
        engine.abort_request(request_id)
    timed.drain()
    kind = "mixed" if chunk else "decode"
    # one sample per timed step: their shapes differ by a position of context each
    return [Sample(kind, sh, sec, held_out) for sh, sec in zip(shapes, times)]
