"""/metrics parses with prometheus_client's parser and moves as requests run."""

from __future__ import annotations

from tests.server.conftest import metrics

FAMILIES = [
    "kvserve:time_to_first_token_seconds_count",
    "kvserve:inter_token_latency_seconds_count",
    "kvserve:request_time_per_output_token_seconds_count",
    "kvserve:e2e_request_latency_seconds_count",
    "kvserve:request_queue_time_seconds_count",
    "kvserve:prompt_tokens_total",
    "kvserve:generation_tokens_total",
    "kvserve:num_requests_running",
    "kvserve:num_requests_waiting",
    "kvserve:kv_cache_usage_perc",
    "kvserve:prefix_cache_queries_total",
    "kvserve:prefix_cache_hits_total",
    "kvserve:num_preemptions_total",
    "kvserve:request_success_total{finished_reason=length}",
]


def test_metrics_move_with_a_request(server, http):
    before = metrics(server.url)
    assert all(name in before for name in FAMILIES), sorted(set(FAMILIES) - set(before))

    prompt = "0123456789 !?.,;:'()[]{}<>+-*/=_ " * 2
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert num_prompt > 16  # at least one full KV block, for the prefix cache below
    body = {"prompt": prompt, "max_tokens": 9, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    after = metrics(server.url)

    def moved(name):
        return after[name] - before[name]

    assert moved("kvserve:prompt_tokens_total") == num_prompt
    assert moved("kvserve:generation_tokens_total") == 9
    assert moved("kvserve:request_success_total{finished_reason=length}") == 1
    assert moved("kvserve:time_to_first_token_seconds_count") == 1
    assert moved("kvserve:inter_token_latency_seconds_count") == 8  # 9 tokens, 8 gaps
    assert moved("kvserve:e2e_request_latency_seconds_count") == 1
    assert moved("kvserve:prefix_cache_queries_total") > 0

    # the same prompt again: its full blocks come from the prefix cache
    assert http.post("/v1/completions", json=body).status_code == 200
    again = metrics(server.url)
    assert again["kvserve:prefix_cache_hits_total"] > after["kvserve:prefix_cache_hits_total"]


def test_kv_events_are_off_unless_asked_for(http):
    r = http.get("/v1/kv_events")
    assert r.status_code == 404 and r.json()["error"]["code"] == "kv_events_off"
    assert "--enable-kv-cache-events" in r.json()["error"]["message"]
