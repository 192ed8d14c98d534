"""`kvserve sim`'s engine: a discrete-event simulation of kvserve deployments.

Events on one modelled clock: a request arrives at the router; an instance's step ends; a
handoff has crossed the link. An idle instance with work schedules a step at once (its
real Scheduler decides what runs) and is busy for the step model's time. A request reaches
the router the step model's request overhead after it is sent (what the HTTP path costs,
measured through the server; `busy_request_overhead` if an instance is stepping then), and
its latencies count from the send, as a client's do; where the model keeps the measured
overheads, each request draws one (seeded).

Deployments:
- `replicas` colocated instances behind the router's own policy object (router/policy.py:
  round-robin, least-loaded, or prefix-aware over the prompt's text; here four characters
  per token, so a 64-character chunk is 16 tokens);
- `prefill` + `decode` pools: the router sends each request to the least loaded instance of
  each pool at once (the decode side allocates its blocks before the KV arrives, through the
  scheduler's connector path). A prefill instance's handoff starts on its link when the
  step that completes the prompt starts (the transport sends layer by layer while the
  forward pass runs) and arrives after bytes/bandwidth + latency, and no earlier than that
  step's end. The pools share one link, one handoff at a time (the planner's network stage). The user's
  first token comes from the prefill answer (the router streams it), the rest from decode.
- `tensor_parallel`: each instance is a TP group (step_model.TensorParallel).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from typing import Callable

from kvserve.errors import ConfigError
from kvserve.router.policy import POLICIES, Policy
from kvserve.router.replicas import Replica
from kvserve.sim.instance import InstanceSpec, SimInstance
from kvserve.sim.step_model import StepTimeModel, TensorParallel
from kvserve.sim.workload import SimRequest


@dataclasses.dataclass(frozen=True)
class Deployment:
    replicas: int = 1  # colocated instances (when prefill = decode = 0)
    policy: str = "round-robin"
    prefill: int = 0  # instances in the prefill pool
    decode: int = 0  # instances in the decode pool
    handoff_bytes_per_s: float = 10e9  # the link between the pools (one handoff at a time)
    handoff_latency_s: float = 0.0
    instance: InstanceSpec = InstanceSpec()
    prefill_instance: InstanceSpec | None = None  # the prefill pool's flags, where they differ (default: `instance`)
    tensor_parallel: TensorParallel = TensorParallel()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError("policy", f"must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if (self.prefill > 0) != (self.decode > 0):
            raise ConfigError("prefill", "disaggregation needs both pools: give --prefill and --decode instances")
        if self.replicas < 1 or self.prefill < 0 or self.decode < 0:
            raise ConfigError("replicas", "instance counts must be >= 1 (replicas) and >= 0 (pools)")
        if not self.handoff_bytes_per_s > 0 or self.handoff_latency_s < 0:
            raise ConfigError("handoff_bytes_per_s", "the handoff link needs a bandwidth > 0 and a latency >= 0")

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def num_instances(self) -> int:
        return self.prefill + self.decode if self.disaggregated else self.replicas

    @property
    def num_chips(self) -> int:
        return self.num_instances * self.tensor_parallel.size

    def describe(self) -> str:
        tp = f", TP {self.tensor_parallel.size} each" if self.tensor_parallel.size > 1 else ""
        if self.disaggregated:
            return f"{self.prefill}P{self.decode}D, handoff link {self.handoff_bytes_per_s / 1e9:g} GB/s{tp}"
        return f"{self.replicas} replica(s), {self.policy} routing{tp}" if self.replicas > 1 else f"one instance{tp}"


@dataclasses.dataclass
class RequestTrace:
    """What one user request went through, in modelled seconds from the start of the run."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 0
    first_token_s: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finished_s: float | None = None
    rejected: str | None = None  # why the server would have refused it
    preemptions: int = 0
    cached_tokens: int = 0  # prefix-cache hit where its prompt was computed
    instance: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s


@dataclasses.dataclass
class SimRun:
    deployment: Deployment
    traces: list[RequestTrace]
    instances: list[SimInstance]
    end_s: float  # when the last request finished
    handoff_bytes: int = 0
    steps: list[tuple[str, object, float]] = dataclasses.field(default_factory=list)  # with record_steps


class Simulator:
    def __init__(self, deployment: Deployment, model: StepTimeModel, record_steps: bool = False, seed: int = 0):
        if not model.kv_bytes_per_position > 0 or model.model_len < 2:
            raise ConfigError("step model", "it names no KV bytes per position or context length (rerun the calibration)")
        self.deployment = deployment
        self.model = model
        self.kv_bytes_per_position = model.kv_bytes_per_position
        self.model_len = model.model_len
        self.record_steps = record_steps  # keep every step's (instance, shape, seconds) in the run
        self.seed = seed  # of the draws of request overheads: a run is a function of its inputs

    def run(self, requests: list[SimRequest], progress: Callable[[], None] | None = None) -> SimRun:
        return _Run(self, requests, progress).run()


class _Run:
    """One simulation: its clock, its event queue and its instances."""

    def __init__(self, sim: Simulator, requests: list[SimRequest], progress):
        self.sim, self.d, self.progress = sim, sim.deployment, progress
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self._rng = random.Random(sim.seed)  # each request's overhead, drawn from the measured ones
        clock = lambda: self.now  # noqa: E731 - every scheduler reads the simulator's time
        spec, tp = self.d.instance, self.d.tensor_parallel

        def make(name: str, role: str) -> SimInstance:
            flags = self.d.prefill_instance if role == "prefill" and self.d.prefill_instance is not None else spec
            return SimInstance(name, role, flags, sim.model, tp, sim.kv_bytes_per_position, sim.model_len, clock)

        if self.d.disaggregated:
            self.prefill = [make(f"prefill-{i}", "prefill") for i in range(self.d.prefill)]
            self.decode = [make(f"decode-{i}", "decode") for i in range(self.d.decode)]
            self.instances = self.prefill + self.decode
        else:
            self.instances = [make(f"replica-{i}", "both") for i in range(self.d.replicas)]
        # the router's own policy objects, over stand-ins for its replicas
        self._fronts = {inst.name: Replica(f"sim://{inst.name}", i, pool=inst.role) for i, inst in enumerate(self.instances)}
        self._policy = Policy(self.d.policy if not self.d.disaggregated else "least-loaded")
        self._decode_policy = Policy("least-loaded")
        self._link_free = 0.0
        self.traces = {r.request_id: RequestTrace(r.request_id, r.arrival_s, len(r.prompt)) for r in requests}
        self._handoffs: dict[str, tuple[SimInstance, SimRequest]] = {}  # prefill request id -> (decode instance, request)
        self.handoff_bytes = 0
        self.steps: list = []
        for r in requests:
            self._push(r.arrival_s, self._send, r)

    def _push(self, when: float, fn, *args) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn, args))

    def run(self) -> SimRun:
        while self._events:
            when, _, fn, args = heapq.heappop(self._events)
            self.now = when
            fn(*args)
        for inst in self.instances:  # nothing may be left: every request ends in a trace
            if inst.scheduler.has_unfinished():
                raise RuntimeError(f"simulation ended with work left on {inst.name}")
        traces = list(self.traces.values())
        end = max((t.finished_s for t in traces if t.finished_s is not None), default=0.0)
        return SimRun(self.d, traces, self.instances, end, self.handoff_bytes, self.steps)

    # ---- the router ----------------------------------------------------------------------

    def _text(self, prompt: list[int]) -> str:
        return "".join(f"{t & 0xFFFF:04x}" for t in prompt)

    def _pick(self, policy: Policy, pool: list[SimInstance], prompt: list[int]) -> SimInstance:
        fronts = [self._fronts[i.name] for i in pool]
        text = self._text(prompt) if policy.name == "prefix" else ""
        chosen = policy.choose(fronts, text).replica
        return next(i for i in pool if self._fronts[i.name] is chosen)

    def _send(self, r: SimRequest) -> None:
        """A client sends `r`: it reaches the router the model's request overhead later, the
        busy one if an instance is stepping now (its HTTP path then shares the cores with the
        step; with several instances, whichever it will land on is not known yet, so any)."""
        busy = any(inst.busy for inst in self.instances)
        self._push(self.now + self.sim.model.overhead_s(busy, self._rng), self._arrive, r)

    def _arrive(self, r: SimRequest) -> None:
        trace = self.traces[r.request_id]
        if self.d.disaggregated:
            p = self._pick(self._policy, self.prefill, r.prompt)
            dec = self._pick(self._decode_policy, self.decode, r.prompt)
            if not self._admissible(r, trace, (p, dec)):
                return
            # the decode request first, as the router sends it alongside: it allocates before anything arrives
            dec.add(r.request_id, r.prompt, r.output_len, r.arrival_s, transfer_id=r.request_id)
            p.add(r.request_id + ":prefill", r.prompt, 1, r.arrival_s)
            self._handoffs[r.request_id + ":prefill"] = (dec, r)
            trace.instance = f"{p.name} → {dec.name}"
            for inst in (p, dec):
                self._fronts[inst.name].in_flight += 1
                self._lengthen(inst)
            self._poke(dec)
            self._poke(p)
        else:
            inst = self._pick(self._policy, self.instances, r.prompt)
            if not self._admissible(r, trace, (inst,)):
                return
            inst.add(r.request_id, r.prompt, r.output_len, r.arrival_s)
            trace.instance = inst.name
            self._fronts[inst.name].in_flight += 1
            self._lengthen(inst)
            self._poke(inst)

    def _lengthen(self, inst: SimInstance) -> None:
        """A request taken in while a step runs slows that step (the step model's `per_arrival`)."""
        cost = self.sim.model.per_arrival
        if inst.busy and cost > 0:
            inst.lengthen_step(cost)
            self._push(inst.step_ends, self._step_done, inst, inst.step_version)

    def _admissible(self, r: SimRequest, trace: RequestTrace, instances) -> bool:
        """The server's fit_max_tokens: a prompt and max_tokens that do not fit the context are refused (a 400)."""
        limit = min(i.max_model_len for i in instances)
        if len(r.prompt) + r.output_len > limit:
            trace.rejected = f"{len(r.prompt)} prompt + {r.output_len} output tokens; the engine holds {limit} positions"
            self._done_one()
            return False
        return True

    def _done_one(self) -> None:
        if self.progress is not None:
            self.progress()

    # ---- instances -----------------------------------------------------------------------

    def _poke(self, inst: SimInstance) -> None:
        """An idle instance with work starts a step now."""
        if inst.busy:
            return
        arrived, seconds, shape = inst.start_step(self.now)
        for request in arrived:  # a decode request's first token came with its KV, or its handoff failed
            if request.is_finished:
                self._finished(inst, request)
        if seconds is not None:
            self._push(inst.step_ends, self._step_done, inst, inst.step_version)
            if self.sim.record_steps:
                self.steps.append((inst.name, shape, seconds))
            if inst.role == "prefill":
                self._start_handoffs(inst, seconds)

    def _start_handoffs(self, inst: SimInstance, seconds: float) -> None:
        for s in inst.step.scheduled:
            if s.samples and s.request.request_id in self._handoffs:
                dec, r = self._handoffs[s.request.request_id]
                nbytes = len(r.prompt) * self.sim.kv_bytes_per_position
                start = max(self.now, self._link_free)
                self._link_free = start + nbytes / self.d.handoff_bytes_per_s
                arrives = max(self._link_free, self.now + seconds) + self.d.handoff_latency_s
                self.handoff_bytes += int(nbytes)
                self._push(arrives, self._handoff_arrives, dec, r.request_id)

    def _handoff_arrives(self, dec: SimInstance, transfer_id: str) -> None:
        dec.connector.deliver(transfer_id)
        self._poke(dec)

    def _step_done(self, inst: SimInstance, version: int) -> None:
        if version != inst.step_version:  # lengthened since: a later event ends it
            return
        update = inst.finish_step(self.now)
        for request in update.finished:
            self._finished(inst, request)
        self._poke(inst)

    def _finished(self, inst: SimInstance, request) -> None:
        rid = request.request_id
        timing = request.timing
        if rid in self._handoffs:  # the prefill half: the user's first token
            dec, r = self._handoffs.pop(rid)
            trace = self.traces[r.request_id]
            trace.first_token_s = timing.first_token
            trace.token_times = [timing.first_token]
            trace.cached_tokens = request.num_cached_tokens
            trace.preemptions += request.num_preemptions
            self._fronts[inst.name].in_flight -= 1
            return
        trace = self.traces[rid]
        if self.d.disaggregated:  # the decode half: its first token is the prefill's, already counted
            if not request.kv_transfer.recomputed:
                trace.token_times += timing.token_times[1:]
            else:
                trace.token_times = list(timing.token_times)
                trace.first_token_s = timing.first_token
                trace.cached_tokens = request.num_cached_tokens
        else:
            trace.first_token_s = timing.first_token
            trace.token_times = list(timing.token_times)
            trace.cached_tokens = request.num_cached_tokens
        trace.output_tokens = request.num_output_tokens
        trace.finished_s = timing.finished
        trace.preemptions += request.num_preemptions
        self._fronts[inst.name].in_flight -= 1
        self._done_one()
