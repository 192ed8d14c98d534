"""Time kvserve's steps through its own server: the grid of measure.py, sent as HTTP requests.

A `kvserve serve --step-log FILE` starts on a loopback port with the engine flags given; the
grid's shapes are made by streamed completions (random token ids, ignore_eos), as real
clients stream them; the server logs every step it runs with its shape and its duration up to
its outputs delivered (step_log.py). Every logged step is a sample: what serving adds to a
step (the event loop's share of the cores, delivering each token to its stream) is in it, as
it is in every latency a client measures. The phases' lines in the log say which steps were
warm-up (dropped), fitted, or held out.

The request overheads, the time a request spends outside the engine's steps (HTTP in, the
first token's way out), are measured twice from the log's request lines: on an idle server
(the lone prompts) and under a serving load (Poisson arrivals at half the rate the steps
fitted so far sustain), where the HTTP path shares the cores with the engine thread.

Shapes come about as the scheduler makes them: R requests sent together prefill in one or
more steps, then decode together; a chunk sent while they decode shares their steps.
"""

from __future__ import annotations

import asyncio
import bisect
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from kvserve.errors import ConfigError
from kvserve.loadgen.client import completion_payload, send_completion
from kvserve.sim.measure import Grid, Sample
from kvserve.sim.step_log import read_step_log, read_timeline

_SERVING = re.compile(r"serving (\S+) at (http://\S+)/v1")


class _Client:
    def __init__(self, base: str, model: str, vocab: int, seed: int):
        self.url, self.model, self.vocab = base + "/completions", model, vocab
        self.rng = np.random.default_rng(seed)

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(1, self.vocab, size=n).tolist()

    async def one(self, client: httpx.AsyncClient, prompt: list[int], max_tokens: int, timings: list | None = None) -> float:
        """Its TTFT as this client saw it; appended to `timings` with when it was sent and its
        prompt's length: (sent, prompt tokens, TTFT)."""
        sent = time.monotonic()  # the server's clock too: one host
        record = await send_completion(client, self.url, completion_payload(self.model, prompt, max_tokens), len(prompt))
        if record.ok:
            ttft = record.ttft_s
        elif record.e2e_s is not None and record.output_tokens >= 1:  # its tokens made no text (a partial character)
            ttft = record.e2e_s
        else:
            raise ConfigError("calibrate", f"a calibration request failed: {record.error}")
        if timings is not None:
            timings.append((sent, len(prompt), ttft))
        return ttft

    async def together(self, client, prompts: list[list[int]], max_tokens: int) -> None:
        await asyncio.gather(*(self.one(client, p, max_tokens) for p in prompts))


async def _drive(client_: _Client, grid: Grid, log: Path, header: dict, limit: int, pool: int,
                 progress) -> tuple[int, int, int, list[float], list[float]]:  # fmt: skip
    """Every grid point through the server; returns the logged steps' counts where the fitted
    phase starts, where the held-out phase starts and where it ends, and the request overheads
    (_overheads): of each prompt sent alone to an idle server, and of each request of the
    serving phase sent while a step ran."""
    c = client_
    steps_per_point = grid.decode_steps * (grid.repeats + 1)

    async def lines() -> int:
        """Steps logged so far, once the count holds still: the server logs a step only after
        delivering its outputs, so the last one of a phase can land after its responses."""
        n = len(read_step_log(log)[1])
        while True:
            await asyncio.sleep(0.1)
            again = len(read_step_log(log)[1])
            if again == n:
                return n
            n = again

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)) as client:
        await c.together(client, [c.ids(64), c.ids(64)], 8)  # warm-up: the first steps of a fresh server
        fitted_from = await lines()

        lone: list[tuple[float, int, float]] = []  # the prefill phase's requests, each sent to an idle server

        async def prefill(s0: int, t: int) -> None:
            if s0 + t + 1 > limit or t > limit:
                return
            for _ in range(grid.repeats):
                prefix = c.ids(s0)
                if s0:
                    await c.one(client, prefix + c.ids(1), 1, lone)
                await c.one(client, prefix + c.ids(t), 1, lone)

        async def decode(rows: int, context: int, chunk: int) -> None:
            if rows * (context + steps_per_point + 8) + chunk > pool or rows + chunk > limit:
                return
            batch = asyncio.create_task(c.together(client, [c.ids(context) for _ in range(rows)], steps_per_point))
            try:
                if chunk:
                    await asyncio.sleep(0.05)  # their prompts in: the chunks then share decode steps
                    for _ in range(grid.repeats + 1):
                        if batch.done():
                            break
                        await c.one(client, c.ids(chunk), 1)
            finally:
                await batch

        async def poisson(n: int, gap: float, p_lo: int, p_hi: int, o_lo: int, o_hi: int) -> list[tuple[float, int, float]]:
            """n requests, exponential gaps of mean `gap`; each one's (sent, prompt tokens, TTFT)."""
            timings: list[tuple[float, int, float]] = []
            tasks = []
            for _ in range(n):
                await asyncio.sleep(float(c.rng.exponential(gap)))
                prompt = c.ids(min(int(c.rng.integers(p_lo, p_hi + 1)), limit - o_hi - 1))
                tasks.append(asyncio.create_task(c.one(client, prompt, int(c.rng.integers(o_lo, o_hi + 1)), timings)))
            await asyncio.gather(*tasks)
            if progress is not None:
                progress()
            return timings

        async def point(rows: int, context: int, chunk: int) -> None:
            await (prefill(context, chunk) if rows == 0 else decode(rows, context, chunk))
            if progress is not None:
                progress()

        for s0 in grid.prefill_cached:
            for t in grid.prefill_tokens:
                await point(0, s0, t)
        await lines()
        overheads = _overheads(log, lone, busy=False)
        for s in grid.decode_context:
            for r in grid.decode_rows:
                await point(r, s, 0)
        for r, s, t in grid.mixed:
            await point(r, s, t)
        await poisson(*grid.arrivals)
        n, load, *lengths = grid.serving
        rate = _sustained_rate(read_step_log(log)[1][fitted_from : await lines()], header, n, lengths, c.rng)
        busy_overheads = _overheads(log, await poisson(n, 1 / (load * rate), *lengths), busy=True)
        held_from = await lines()
        for r, s, t in grid.held_out:
            await point(r, s, t)
        held_until = await lines()  # the probe's steps after it are neither
    return fitted_from, held_from, held_until, overheads, busy_overheads


def _sustained_rate(samples: list[Sample], header: dict, n: int, lengths: list[int], rng) -> float:
    """Requests/s the server sustains on the serving phase's workload, as the steps measured so
    far predict it: a step model fitted to them, `kvserve sim` at saturation on the engine's
    own pool and token budget."""
    from kvserve.sim.instance import InstanceSpec
    from kvserve.sim.simulator import Deployment, Simulator
    from kvserve.sim.step_model import fit
    from kvserve.sim.workload import SimRequest

    model = fit(samples, kv_bytes_per_position=float(header["kv_bytes_per_position"]), model_len=int(header["model_len"]),
                layer_windows=tuple(header.get("layer_windows") or ()))  # fmt: skip
    spec = InstanceSpec(kv_cache_memory=int(header["num_kv_positions"] * header["kv_bytes_per_position"]),
                        block_size=int(header["block_size"]), max_num_batched_tokens=int(header["max_num_batched_tokens"]),
                        max_model_len=int(header["max_model_len"]))  # fmt: skip
    p_lo, p_hi, o_lo, o_hi = lengths
    requests = [SimRequest(f"r{i}", 0.0, rng.integers(1, 30000, size=int(rng.integers(p_lo, p_hi + 1))).tolist(),
                           int(rng.integers(o_lo, o_hi + 1))) for i in range(max(n, 32))]  # fmt: skip
    run = Simulator(Deployment(instance=spec), model).run(requests)
    return len(requests) / run.end_s


def _overheads(log: Path, timings: list[tuple[float, int, float]], busy: bool) -> list[float]:
    """The request overhead of each of a phase's requests (`timings`: (sent, prompt tokens,
    TTFT)) sent while a step was running (`busy`) or while none was: its TTFT at the client
    less the server's time from taking it in to the end of the step that made its first token
    (the step log's request and step lines). Requests are paired with the server's in order of
    arrival, and a pair whose prompt lengths differ is left out."""
    spans, served = read_timeline(log)
    if not timings:
        return []
    ends = [b for _, b in spans]  # the log's steps run one after another: their ends ascend

    def step_at(t: float) -> tuple[float, float] | None:
        i = bisect.bisect_left(ends, t)
        return spans[i] if i < len(spans) and spans[i][0] <= t else None

    first_sent = min(sent for sent, _, _ in timings)
    served = sorted((r for r in served if r["arrival"] >= first_sent and r["first_token"] is not None), key=lambda r: r["arrival"])
    out = []
    for (sent, prompt_tokens, ttft), r in zip(sorted(timings), served):
        if r["prompt_tokens"] != prompt_tokens or (step_at(sent) is not None) != busy:
            continue
        made = step_at(r["first_token"])
        if made is not None:
            out.append(ttft - (made[1] - r["arrival"]))
    return out


PROBE_PROMPT, PROBE_OUTPUT, PROBE_REQUESTS = 128, 48, 3


def probe_server(base: str, model: str, seed: int, vocab: int) -> dict[str, float]:
    """The machine's speed now, as one server answers: the median TTFT and TPOT (seconds) of a
    few lone requests of PROBE_PROMPT random ids and PROBE_OUTPUT tokens, sent one after
    another. Measured at calibration and again later, the ratio is how much slower (or faster)
    the machine has become meanwhile."""
    import statistics

    from kvserve.loadgen.load import run_at_rate

    rng = np.random.default_rng(seed + 77)
    prompts = [rng.integers(1, vocab, size=PROBE_PROMPT).tolist() for _ in range(PROBE_REQUESTS)]
    records, _ = run_at_rate(base, model, prompts, [PROBE_PROMPT] * PROBE_REQUESTS, [PROBE_OUTPUT] * PROBE_REQUESTS,
                             rate=float("inf"), burstiness=1.0, max_concurrency=1, seed=seed, timeout_s=120, progress=False)  # fmt: skip
    failed = [r for r in records if not r.ok or r.tpot_s is None]
    if failed:
        raise ConfigError("calibrate", f"a probe request failed: {failed[0].error or 'no tokens after the first'}")
    return {"ttft_s": statistics.median(r.ttft_s for r in records), "tpot_s": statistics.median(r.tpot_s for r in records)}


def start_server(engine_flags: list[str], log: Path, timeout_s: float = 300.0, what: str = "calibrate") -> tuple[subprocess.Popen, str, str]:
    """`kvserve serve` on a free loopback port with `engine_flags`; (process, base URL, model name)."""
    from kvserve.disagg.launch import start_and_wait

    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", "0", *engine_flags]
    proc, match = start_and_wait(cmd, log, _SERVING, timeout_s, field=what)
    return proc, match.group(2) + "/v1", match.group(1)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure_through_server(engine_flags: list[str], grid: Grid = Grid(), seed: int = 0, progress=None,
                           workdir: Path | None = None) -> tuple[list[Sample], dict]:  # fmt: skip
    """The server's logged steps as samples (held-out ones marked), and the engine's own
    description from the log's header (model, c_kv, context, ...), with where the logs are."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kvserve-calibrate-"))
    log = workdir / "steps.jsonl"
    log.unlink(missing_ok=True)
    proc, base, model = start_server([*engine_flags, "--step-log", str(log)], workdir / "server.log")
    try:
        started = time.perf_counter()
        header, _ = read_step_log(log)
        client = _Client(base, model, min(header["vocab_size"], 32000), seed)  # ids of ordinary tokens in most vocabularies
        limit = min(header["max_model_len"], header["max_num_batched_tokens"])
        probe_server(base, model, seed, client.vocab)  # a fresh server's first requests are slow: a warm-up
        # the probe, at the start and at the end: the fit describes the machine over the whole
        # calibration, so its speed is their mean (later probes are compared with it)
        probes = [probe_server(base, model, seed + 1, client.vocab)]
        fitted_from, held_from, held_until, overheads, busy_overheads = asyncio.run(
            _drive(client, grid, log, header, limit, min(header["num_kv_positions"], grid.max_decode_positions), progress)
        )
        seconds = time.perf_counter() - started
        probes.append(probe_server(base, model, seed + 2, client.vocab))
        probe = {k: (probes[0][k] + probes[1][k]) / 2 for k in probes[0]}
    finally:
        stop_server(proc)
    header, samples = read_step_log(log)
    out = samples[fitted_from:held_from] + [Sample(s.kind, s.shape, s.seconds, held_out=True) for s in samples[held_from:held_until]]
    return out, {"engine": header, "step_log": str(log), "server_log": str(workdir / "server.log"),
                 "warm_up_steps": fitted_from, "seconds": seconds, "request_overheads_s": overheads,
                 "busy_request_overheads_s": busy_overheads,
                 "probe": probe, "probes": probes}  # fmt: skip
