"""Prometheus metrics of one server, in vLLM's names with a `kvserve:` prefix.

Latency histograms (TTFT, ITL, TPOT, end-to-end, queue time) are observed from a
request's `timings` when it finishes. Everything the engine already counts (tokens,
prefix-cache lookups, preemptions, finished requests by reason) and every level
(running, waiting, KV usage) is read from the engine at scrape time by a collector, so
the server keeps no second tally that could drift from the engine's.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str):
        # `_created` series double every family's size and no dashboard reads them
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"kvserve:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first output token.", _LATENCY_BUCKETS_S)
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive output tokens of a request.", _TOKEN_GAP_BUCKETS_S)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Mean gap between output tokens, per request.", _TOKEN_GAP_BUCKETS_S
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last output token.", _E2E_BUCKETS_S)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first being scheduled.", _LATENCY_BUCKETS_S)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_COUNT_BUCKETS)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request (all n samples).", _TOKEN_COUNT_BUCKETS
        )
        self._collector = _EngineCollector(engine, model_name)
        self.registry.register(self._collector)

    def bind_engine(self, engine: LLMEngine) -> None:
        """Read a new engine's tallies from now on (after an engine restart; its counters
        start from 0, which Prometheus reads as a counter reset)."""
        self._collector.engine = engine

    def observe_finished(self, output: RequestOutput) -> None:
        """Record a request that ran to its end (a client that left is counted by the engine only)."""
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(output.num_generated_tokens)
        for timing in output.timings:
            if timing.queue_time_s is not None:
                self.queue_time.observe(timing.queue_time_s)
            if timing.ttft_s is not None:
                self.ttft.observe(timing.ttft_s)
            for gap in timing.itl_s:
                self.itl.observe(gap)
            if timing.tpot_s is not None:
                self.tpot.observe(timing.tpot_s)
            if timing.e2e_s is not None:
                self.e2e.observe(timing.e2e_s)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class _EngineCollector:
    """Reads the engine's own tallies at scrape time. They are plain ints and lists the
    engine thread updates; reading them from the event loop sees a consistent-enough
    snapshot (each value is read atomically under the GIL)."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.labels = [model_name]

    def collect(self):
        engine = self.engine
        kv = engine.kv_cache
        yield self._gauge("num_requests_running", "Requests in the running batch.", engine.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", engine.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction (0-1) of KV blocks held by live requests.", kv.usage())
        yield self._gauge("kv_cache_blocks_total", "KV blocks in the pool.", kv.num_blocks)
        yield self._gauge("kv_cache_blocks_free", "KV blocks not held by any request (cached ones included).", kv.num_free_blocks())

        counters = engine.counters
        yield self._counter("prompt_tokens", "Prompt tokens admitted.", counters.prompt_tokens)
        yield self._counter("generation_tokens", "Tokens generated.", counters.generation_tokens)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.prefix_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_hits)
        yield self._counter("num_preemptions", "Requests preempted (recomputed) for lack of KV blocks.", engine.scheduler.num_preemptions)
        yield self._counter("attention_kv_bytes_read", "KV cache bytes read by attention (shared prefixes read once per group where "
                            "shared-prefix attention ran).", counters.attention_kv_bytes_read)
        yield self._counter("attention_kv_bytes_read_without_sharing", "KV cache bytes attention would read scanning every "
                            "request's history alone.", counters.attention_kv_bytes_read_without_sharing)

        if engine.arch.num_experts and engine.model is not None:  # a mixture of experts: what its routed experts read (model/moe.py)
            moe = engine.model.expert_counts
            yield self._counter("moe_experts_touched", "Routed experts run, summed over sparse layers and steps "
                                "(each chosen expert once per layer per step).", moe.experts_touched)
            yield self._counter("moe_expert_weight_bytes_read", "Bytes of routed experts' weights read (this rank's share "
                                "under tensor parallelism).", moe.expert_weight_bytes)
            yield self._counter("moe_expert_weight_bytes_dense_equivalent", "Bytes the same steps would have read running "
                                "every expert.", moe.all_experts_bytes)
            yield self._counter("moe_layer_passes", "Sparse layers run, summed over steps.", moe.layer_passes)

        finished = CounterMetricFamily(
            "kvserve:request_success", "Finished requests (samples) by reason: stop, length, abort.", labels=["model_name", "finished_reason"]
        )
        for reason, count in dict(counters.finished).items():
            finished.add_metric([*self.labels, reason], count)
        yield finished

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"kvserve:{name}", doc, labels=["model_name"])
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"kvserve:{name}", doc, labels=["model_name"])
        family.add_metric(self.labels, value)
        return family
