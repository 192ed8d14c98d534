// The live view: GET /v1/engine/stats every second; rates from the difference of two polls.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000;
  const HISTORY = 60;
  let last = null;
  const genRates = [];

  function delta(now, prev, pick) {
    return prev ? pick(now) - pick(prev) : 0;
  }

  // mean over the last poll interval where something was observed, else the p50 since start
  function latencyText(now, prev, key) {
    const h = now.latency[key];
    const count = delta(now, prev, (s) => s.latency[key].count);
    const recent = count > 0 ? delta(now, prev, (s) => s.latency[key].sum_s) / count : null;
    return (recent === null ? "\u2014" : KV.fmtMs(recent)) + " \u00b7 " + KV.fmtMs(h.p50_s);
  }

  function render(now, prev) {
    const dt = prev ? now.time - prev.time : 0;
    const genRate = dt > 0 ? delta(now, prev, (s) => s.generation_tokens) / dt : null;
    const promptRate = dt > 0 ? delta(now, prev, (s) => s.prompt_tokens) / dt : null;
    if (genRate !== null) {
      genRates.push(genRate);
      if (genRates.length > HISTORY) genRates.shift();
    }
    $("s-gen-rate").textContent = genRate === null ? "\u2014" : KV.fmt(genRate) + " tok/s";
    $("s-prompt-rate").textContent = promptRate === null ? "\u2014" : KV.fmt(promptRate) + " tok/s";
    $("s-ttft").textContent = latencyText(now, prev, "ttft");
    $("s-itl").textContent = latencyText(now, prev, "itl");
    $("s-queue").textContent = now.running + " / " + now.waiting;
    const kv = now.kv_cache;
    $("s-kv").textContent = KV.fmt(kv.usage * 100, 3) + " % of " + kv.blocks_total + " blocks";
    $("s-kv-bar").style.width = Math.min(100, kv.usage * 100) + "%";
    const pc = now.prefix_cache;
    $("s-prefix").textContent = pc.hit_rate === null ? "\u2014" : KV.fmt(pc.hit_rate * 100, 3) + " % (" + pc.hits + " / " + pc.queries + ")";
    $("s-preempt").textContent = String(now.preemptions);
    $("s-gen-total").textContent = String(now.generation_tokens);
    $("s-prompt-total").textContent = String(now.prompt_tokens);
    const finished = Object.entries(now.requests_finished).map(([k, v]) => k + " " + v).join(", ");
    $("s-finished").textContent = finished || "0";
    $("stats-error").textContent = now.engine_alive ? "" : "The engine is not running.";
    drawSpark();
  }

  function drawSpark() {
    const canvas = $("spark");
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (!w || !h) return;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.strokeStyle = KV.cssVar("--chart-grid");
    g.strokeRect(0.5, 0.5, w - 1, h - 1);
    const top = Math.max(1, ...genRates);
    g.strokeStyle = KV.cssVar("--chart-1");
    g.lineWidth = 1.5;
    g.beginPath();
    genRates.forEach((v, i) => {
      const x = w - (genRates.length - 1 - i) * (w / (HISTORY - 1));
      const y = h - 2 - (v / top) * (h - 6);
      if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
    });
    g.stroke();
    g.fillStyle = KV.cssVar("--muted");
    g.font = "10px system-ui, sans-serif";
    g.fillText("max " + KV.fmt(top) + " tok/s", 4, 11);
  }

  async function poll() {
    try {
      const now = await KV.json("/v1/engine/stats");
      render(now, last);
      last = now;
    } catch (err) {
      $("stats-error").textContent = err.status === 401 ? "API key needed (top right)." : "Stats unavailable: " + (err.message || err);
      last = null;
    } finally {
      setTimeout(poll, POLL_MS); // the next poll starts after this one ends: never piles up
    }
  }
  poll();
})();
