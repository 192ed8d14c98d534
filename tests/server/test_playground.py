"""The web playground at `/`, end to end: a real `kvserve serve` (the shared server of
tests/server/conftest.py, API key on) and a real headless Chromium driven by Selenium.

The first tests read the routes with httpx and need no browser; the rest skip, with the
reason, where no Chromium can run (tests/support/browser.py).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY
from tests.support.browser import console_errors, start_chromium, unavailable, wait_for

NO_BROWSER = unavailable()
needs_browser = pytest.mark.skipif(NO_BROWSER is not None, reason=f"no headless browser: {NO_BROWSER}")

MESSAGE = "What is the capital of France?"
_CHAT = {"messages": [{"role": "user", "content": MESSAGE}], "ignore_eos": True}  # exactly max_tokens tokens


# --- the routes, without a browser ---------------------------------------------------------------


def test_pages_are_served_without_the_key(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache" and "/playground/chat.js" in page.text
    for path, kind in [("chat.js", "javascript"), ("common.js", "javascript"), ("style.css", "text/css"), ("planner.html", "text/html")]:
        r = httpx.get(f"{server.url}/playground/{path}")
        assert r.status_code == 200 and kind in r.headers["content-type"], (path, r.headers)
        assert r.headers["cache-control"] == "no-cache"
    assert httpx.get(f"{server.url}/playground/nope.js").status_code == 404


def test_data_routes_need_the_key(server, http):
    for path in ("/v1/engine/stats", "/v1/planner/presets", "/v1/planner/sweep"):
        assert httpx.get(f"{server.url}{path}").status_code == 401, path
    stats = http.get("/v1/engine/stats").json()
    assert stats["object"] == "engine.stats" and stats["model"] == server.model_name
    assert {"running", "waiting", "kv_cache", "prefix_cache", "preemptions", "generation_tokens", "latency"} <= set(stats)
    assert set(stats["latency"]) == {"ttft", "itl", "tpot", "e2e", "queue_time"}
    assert stats["kv_cache"]["blocks_total"] > 0
    # the CPU kernels' level and each family's, as the start-up report names them
    from kvserve.kernels.isa import LEVELS, native_level

    kernels = stats["kernels"]
    assert set(kernels) == {"level", "families"}
    if kernels["level"] is not None:
        assert kernels["level"] in LEVELS and LEVELS.index(kernels["level"]) <= LEVELS.index(native_level())
        assert kernels["families"] and set(kernels["families"].values()) <= set(LEVELS)
    assert stats["experts"] is None  # a dense model; a mixture of experts' counts: tests/model/test_moe.py


def test_stats_agree_with_metrics(server, http):
    from tests.server.conftest import metrics, wait_until_idle

    wait_until_idle(server.url)
    assert http.post("/v1/chat/completions", json={**_CHAT, "max_tokens": 5}).status_code == 200
    m, stats = metrics(server.url), http.get("/v1/engine/stats").json()
    assert stats["generation_tokens"] == m["kvserve:generation_tokens_total"]
    assert stats["prompt_tokens"] == m["kvserve:prompt_tokens_total"]
    assert stats["latency"]["ttft"]["count"] == m["kvserve:time_to_first_token_seconds_count"]
    assert stats["latency"]["itl"]["sum_s"] == pytest.approx(m["kvserve:inter_token_latency_seconds_sum"])
    assert stats["latency"]["ttft"]["p50_s"] > 0 and stats["requests_finished"]["length"] >= 1


def test_planner_sweep_is_the_planners_arithmetic(http):
    from kvserve.planner import CHIP_PRESETS, MODEL_PRESETS, PlanInputs, make_plan

    r = http.get("/v1/planner/sweep", params={"model": "seed-8b", "chip": "h100", "num_chips": 4, "context_positions": 4096,
                                               "step_target_ms": 20, "reserved_gb_per_chip": 8, "batches": "1,64,453"})
    assert r.status_code == 200, r.text
    out = r.json()
    plan = make_plan(PlanInputs(MODEL_PRESETS["seed-8b"], CHIP_PRESETS["h100"], num_chips=4, reserved_bytes_per_chip=8e9,
                                history_positions=4096, prompt_positions=4096, step_target_s=0.020))
    assert [p["batch"] for p in out["points"]] == [1, 64, 453]
    for p in out["points"]:
        assert p["step_s"] == pytest.approx(plan.derived.step(p["batch"]).total_s)
        assert p["tokens_per_s"] == pytest.approx(p["batch"] / p["step_s"])
    assert out["max_batch_meeting_target"] == plan["max_batch_meeting_target"] == 453  # docs/planner.md's session
    assert out["capacity_batch"] == plan.derived.capacity_batch()

    served = http.get("/v1/planner/sweep", params={"model": "served", "chip": "h200"}).json()
    assert served["model"]["name"] == http.get("/v1/models").json()["data"][0]["id"]
    batches = [p["batch"] for p in served["points"]]
    assert batches[0] == 1 and batches == sorted(batches) and len(batches) > 10

    presets = http.get("/v1/planner/presets").json()
    assert {"served", "seed-8b"} <= {m["key"] for m in presets["models"]} and "h100" in {c["key"] for c in presets["chips"]}
    bad = http.get("/v1/planner/sweep", params={"model": "/etc/passwd"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
    bad = http.get("/v1/planner/sweep", params={"model": "seed-8b", "num_chips": "3"})  # 8 KV heads over 3 chips
    assert bad.status_code == 400 and "num_chips" in bad.json()["error"]["message"]


# --- in the browser --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if NO_BROWSER is not None:
        pytest.skip(f"no headless browser: {NO_BROWSER}")
    driver = start_chromium()
    yield driver
    driver.quit()


def open_page(browser, server, path: str = "/", key: str | None = API_KEY):
    """Load `path` with a fresh localStorage holding `key` (None: no key stored)."""
    browser.get(f"{server.url}/playground/style.css")  # the origin, without the page's scripts
    browser.execute_script(
        "localStorage.clear(); if (arguments[0]) localStorage.setItem('kvserve.apiKey', arguments[0]);", key
    )
    browser.get(f"{server.url}{path}")


def by_id(browser, element_id: str):
    from selenium.webdriver.common.by import By

    return browser.find_element(By.ID, element_id)


def set_field(browser, element_id: str, value: str) -> None:
    el = by_id(browser, element_id)
    el.clear()
    el.send_keys(value)


def record_requests(browser) -> None:
    """Keep every fetch body the page sends to /v1/chat/completions in window.__sent."""
    browser.execute_script("""
        window.__sent = [];
        const original = window.fetch;
        window.fetch = (url, opts) => {
            if (String(url).includes('/v1/chat/completions')) window.__sent.push(JSON.parse(opts.body));
            return original(url, opts);
        };""")


def send(browser, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = by_id(browser, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_reply(browser, timeout_s: float = 15) -> dict:
    """Wait for the last assistant message to end; its state (done|error), text and meta line."""
    script = """
        const m = [...document.querySelectorAll('.msg.assistant')].pop();
        if (!m || m.dataset.state === 'streaming') return null;
        return {state: m.dataset.state, text: m.querySelector('.content').textContent, meta: m.querySelector('.meta').textContent};"""
    return wait_for(lambda: browser.execute_script(script), timeout_s, message="the assistant's reply to end")


def page_errors(browser) -> list[str]:
    # a 401 or 400 answer is logged by Chromium as a failed load; the page handles those itself
    return [e for e in console_errors(browser) if "Failed to load resource" not in e]


@needs_browser
def test_chat_streams_into_the_page(browser, server, http):
    open_page(browser, server)
    wait_for(lambda: by_id(browser, "model-name").text.startswith(server.model_name), message="the model name")
    defaults = http.get("/v1/models").json()["data"][0].get("sampling_defaults") or {}
    if "top_p" in defaults:  # an empty field says what the server applies instead
        shown = lambda: by_id(browser, "top_p").get_attribute("placeholder").partition("default ")[2]  # noqa: E731
        assert float(wait_for(shown, message="top_p's default in its placeholder")) == defaults["top_p"]
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "64")
    record_requests(browser)
    browser.execute_script("""
        window.__lengths = [];
        new MutationObserver(() => {
            const c = [...document.querySelectorAll('.msg.assistant .content')].pop();
            if (c) window.__lengths.push(c.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    send(browser, MESSAGE)
    reply = last_reply(browser)
    assert reply["state"] == "done", reply
    assert reply["text"] and "finish:" in reply["meta"] and "tokens" in reply["meta"], reply
    lengths = [n for n in browser.execute_script("return window.__lengths") if n]
    assert len(set(lengths)) >= 2 and lengths == sorted(lengths), lengths  # it grew, piece by piece

    sent = browser.execute_script("return window.__sent")[0]
    assert sent["stream"] is True and sent["temperature"] == 0 and sent["max_tokens"] == 64
    assert not {"top_p", "top_k", "min_p", "seed", "stop", "response_format"} & set(sent)  # empty fields stay unset
    # the page shows exactly what the server answers to the same request
    whole = http.post("/v1/chat/completions", json={**sent, "stream": False}).json()
    assert reply["text"] == whole["choices"][0]["message"]["content"]
    assert page_errors(browser) == []


@needs_browser
def test_json_mode_sends_response_format(browser, server, http):
    from selenium.webdriver.support.ui import Select

    open_page(browser, server)
    set_field(browser, "max_tokens", "40")
    set_field(browser, "seed", "3")
    record_requests(browser)
    Select(by_id(browser, "response_format")).select_by_value("json_object")
    send(browser, "Answer in JSON.")
    reply = last_reply(browser, timeout_s=18)
    sent = browser.execute_script("return window.__sent")[-1]
    assert sent["response_format"] == {"type": "json_object"} and sent["seed"] == 3
    # whatever this server does with it (constrained JSON, or a 400 while unsupported), the page shows it
    direct = http.post("/v1/chat/completions", json={**sent, "stream": False})
    if direct.status_code == 200:
        assert reply["state"] == "done" and "json_object" in reply["meta"], reply
    else:
        assert reply["state"] == "error" and direct.json()["error"]["message"] in reply["text"], (reply, direct.text)

    # a schema pasted in the box goes out as json_schema; a broken one is not sent at all
    Select(by_id(browser, "response_format")).select_by_value("json_schema")
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    set_field(browser, "json_schema", "{not json")
    send(browser, "Again.")
    assert "Not sent" in last_reply(browser)["text"] and len(browser.execute_script("return window.__sent")) == 1
    by_id(browser, "json_schema").clear()
    browser.execute_script("const t = document.getElementById('json_schema'); t.value = arguments[0];", json.dumps(schema))
    send(browser, "Again.")
    last_reply(browser, timeout_s=18)
    sent = browser.execute_script("return window.__sent")[-1]
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["schema"] == schema and sent["response_format"]["json_schema"]["name"]
    assert page_errors(browser) == []


@needs_browser
def test_live_view_moves_with_a_request(browser, server, http):
    open_page(browser, server)

    def total() -> int | None:
        text = by_id(browser, "s-gen-total").text
        return int(text) if text.isdigit() else None

    before = wait_for(lambda: total() is not None and (total(),), message="the first stats poll")[0]
    assert "/" in by_id(browser, "s-queue").text and "%" in by_id(browser, "s-kv").text
    browser.execute_script("""
        window.__rates = [];
        new MutationObserver(() => window.__rates.push(document.getElementById('s-gen-rate').textContent))
            .observe(document.getElementById('s-gen-rate'), {subtree: true, childList: true, characterData: true});""")
    assert http.post("/v1/chat/completions", json={**_CHAT, "max_tokens": 12}).status_code == 200
    wait_for(lambda: total() == before + 12, timeout_s=5, message=f"tokens generated to reach {before + 12}")
    rates = browser.execute_script("return window.__rates")
    assert any(r.endswith("tok/s") and float(r.split()[0].replace(",", "")) > 0 for r in rates), rates
    assert by_id(browser, "s-ttft").text != "—" and "length" in by_id(browser, "s-finished").text
    assert page_errors(browser) == []


@needs_browser
def test_planner_draws_a_chart(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    open_page(browser, server, "/playground/planner.html")
    rows = lambda: browser.find_elements(By.CSS_SELECTOR, "#plan-table tbody tr")  # noqa: E731
    wait_for(lambda: len(rows()) > 5, message="the planner table (served model)")
    assert server.model_name in by_id(browser, "plan-summary").text

    Select(by_id(browser, "model")).select_by_value("seed-8b")
    Select(by_id(browser, "chip")).select_by_value("h100")
    set_field(browser, "step_target_ms", "20")
    by_id(browser, "plan-run").click()
    wait_for(lambda: "seed-8b" in by_id(browser, "plan-summary").text, message="the seed-8b plan")
    first = rows()[0].find_elements(By.TAG_NAME, "td")
    assert first[0].text == "1" and float(first[1].text.replace(",", "")) > 0
    drawn = browser.execute_script("""
        const c = document.getElementById('chart');
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 3; i < px.length; i += 4) if (px[i] > 0) n++;
        return {points: Number(c.dataset.points), painted: n / (c.width * c.height)};""")
    assert drawn["points"] == len(rows()) and drawn["painted"] > 0.01, drawn
    assert page_errors(browser) == []


@needs_browser
def test_api_key_asked_for_then_used(browser, server):
    open_page(browser, server, key=None)
    banner = by_id(browser, "auth-banner")
    wait_for(banner.is_displayed, message="the 401 banner")
    assert "API key" in banner.text and "401" in banner.text
    assert by_id(browser, "model-name").text == "(API key needed)"
    send(browser, MESSAGE)
    reply = last_reply(browser)
    assert reply["state"] == "error" and "API key" in reply["text"], reply

    by_id(browser, "api-key").send_keys(API_KEY)
    wait_for(lambda: not banner.is_displayed(), message="the banner to go once the key is in")
    assert browser.execute_script("return localStorage.getItem('kvserve.apiKey')") == API_KEY
    set_field(browser, "max_tokens", "8")
    send(browser, MESSAGE)
    assert last_reply(browser)["state"] == "done"
    wait_for(lambda: by_id(browser, "s-gen-total").text.isdigit(), message="the live view with the key")
