// The planner page: GET /v1/planner/sweep, drawn on a <canvas> (step time and throughput
// against batch, log-scale batch axis) and listed in a table.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const FIELDS = ["model", "chip", "num_chips", "context_positions", "step_target_ms", "max_batch", "bytes_per_weight", "bytes_per_kv_element", "reserved_gb_per_chip", "kv_layout"];
  const STORAGE = "kvserve.plannerSettings";
  let presets = null;
  let result = null;

  function option(value, text) {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = text;
    return o;
  }

  async function loadPresets() {
    presets = await KV.json("/v1/planner/presets");
    $("model").replaceChildren(...presets.models.map((m) => option(m.key, m.key === "served" ? "served: " + m.name : m.name)));
    $("chip").replaceChildren(...presets.chips.map((c) => option(c.key, c.name)));
    $("model").value = presets.default_model;
    $("chip").value = presets.default_chip;
    let saved = {};
    try { saved = JSON.parse(localStorage.getItem(STORAGE) || "{}"); } catch (_) { saved = {}; }
    for (const id of FIELDS) {
      if (typeof saved[id] !== "string") continue;
      const el = $(id);
      if (el.tagName === "SELECT" && ![...el.options].some((o) => o.value === saved[id])) continue;
      el.value = saved[id];
    }
    showNote();
  }

  function showNote() {
    if (!presets) return;
    const m = presets.models.find((x) => x.key === $("model").value);
    const c = presets.chips.find((x) => x.key === $("chip").value);
    $("model-note").textContent = [m && m.note, c && c.note].filter(Boolean).join(" \u2014 ");
  }

  async function run() {
    $("plan-error").textContent = "";
    const saved = {};
    const query = new URLSearchParams();
    for (const id of FIELDS) {
      const v = $(id).value.trim();
      saved[id] = v;
      if (v !== "") query.set(id, v);
    }
    localStorage.setItem(STORAGE, JSON.stringify(saved));
    $("plan-run").disabled = true;
    try {
      if (!presets) await loadPresets();
      result = await KV.json("/v1/planner/sweep?" + query.toString());
      renderSummary(result);
      renderTable(result);
      draw(result);
    } catch (err) {
      $("plan-error").textContent = err.message || String(err);
    } finally {
      $("plan-run").disabled = false;
    }
  }

  function renderSummary(r) {
    const i = r.inputs;
    $("plan-summary").textContent =
      r.model.name + " on " + i.num_chips + "\u00d7 " + r.chip.name + ", S=" + i.context_positions +
      ", p_w=" + i.bytes_per_weight + " B, p_kv=" + i.bytes_per_kv_element + " B, " + i.kv_layout + " layout\n" +
      "capacity batch " + r.capacity_batch.toLocaleString("en-US") +
      " \u00b7 critical batch B* " + KV.fmt(r.critical_batch) +
      " \u00b7 largest batch meeting " + KV.fmt(i.step_target_s * 1e3) + " ms: " + r.max_batch_meeting_target.toLocaleString("en-US") +
      "\ndecode batch " + r.decode_batch + " (" + r.decode_batch_note + "): step " + KV.fmtMs(r.decode_step_s) +
      ", " + KV.fmt(r.decode_tokens_per_s) + " tok/s";
  }

  function renderTable(r) {
    const marks = new Set([r.capacity_batch, r.decode_batch, r.max_batch_meeting_target]);
    const rows = r.points.map((p) => {
      const tr = document.createElement("tr");
      if (!p.fits) tr.className = "nofit";
      if (marks.has(p.batch)) tr.classList.add("mark");
      const cells = [p.batch.toLocaleString("en-US"), KV.fmt(p.step_s * 1e3), KV.fmt(p.projection_s * 1e3), KV.fmt(p.kv_read_s * 1e3),
        p.branch, KV.fmt(p.tokens_per_s), KV.fmt(p.tokens_per_s_per_chip), p.fits ? "yes" : "no", p.meets_target ? "yes" : "no"];
      for (const c of cells) {
        const td = document.createElement("td");
        td.textContent = c;
        tr.append(td);
      }
      return tr;
    });
    $("plan-table").tBodies[0].replaceChildren(...rows);
  }

  // --- the chart ------------------------------------------------------------------------------
  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const n = raw / mag;
    return (n >= 5 ? 10 : n >= 2 ? 5 : n >= 1 ? 2 : 1) * mag;
  }

  function panel(g, box, r, series, yLabel, opts) {
    const pts = r.points;
    const xs = pts.map((p) => p.batch);
    const x0 = Math.log2(Math.min(...xs)), x1 = Math.max(Math.log2(Math.max(...xs)), x0 + 1);
    let yMax = 0;
    for (const s of series) for (const p of pts) yMax = Math.max(yMax, s.value(p));
    // a target far above every curve would flatten them: then it is only named
    const hline = opts.hline && opts.hline.value <= 4 * yMax ? opts.hline : null;
    if (hline) yMax = Math.max(yMax, hline.value);
    yMax = yMax > 0 ? yMax * 1.08 : 1;
    const X = (b) => box.x + ((Math.log2(b) - x0) / (x1 - x0)) * box.w;
    const Y = (v) => box.y + box.h - (v / yMax) * box.h;
    const grid = KV.cssVar("--chart-grid"), muted = KV.cssVar("--muted"), text = KV.cssVar("--text");
    g.font = "11px system-ui, sans-serif";
    g.lineWidth = 1;
    // y grid and labels
    const step = niceStep(yMax, 5);
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let v = 0; v <= yMax; v += step) {
      g.strokeStyle = grid;
      g.beginPath(); g.moveTo(box.x, Y(v) + 0.5); g.lineTo(box.x + box.w, Y(v) + 0.5); g.stroke();
      g.fillStyle = muted;
      g.fillText(KV.fmt(v), box.x - 6, Y(v));
    }
    // x grid at powers of two
    g.textAlign = "center";
    g.textBaseline = "top";
    const every = Math.max(1, Math.ceil((x1 - x0) / 12));
    for (let k = Math.ceil(x0); k <= Math.floor(x1); k += every) {
      const x = X(Math.pow(2, k));
      g.strokeStyle = grid;
      g.beginPath(); g.moveTo(x + 0.5, box.y); g.lineTo(x + 0.5, box.y + box.h); g.stroke();
      g.fillStyle = muted;
      g.fillText(Math.pow(2, k).toLocaleString("en-US"), x, box.y + box.h + 4);
    }
    // beyond capacity: shaded, it does not fit
    const maxB = Math.max(...xs);
    if (r.capacity_batch < maxB) {
      const cx = r.capacity_batch >= 1 ? X(r.capacity_batch) : box.x;
      g.fillStyle = "rgba(128,128,128,0.14)";
      g.fillRect(cx, box.y, box.x + box.w - cx, box.h);
    }
    const vline = (b, color, dash, label) => {
      if (!(b >= Math.min(...xs) && b <= maxB)) return;
      g.save();
      g.strokeStyle = color; g.setLineDash(dash);
      g.beginPath(); g.moveTo(X(b) + 0.5, box.y); g.lineTo(X(b) + 0.5, box.y + box.h); g.stroke();
      g.restore();
      if (opts.labels) {
        const nearRight = X(b) > box.x + box.w - 110; // keep the label inside the frame
        g.fillStyle = color; g.textAlign = nearRight ? "right" : "left"; g.textBaseline = "top";
        g.fillText(label, X(b) + (nearRight ? -3 : 3), box.y + 2 + opts.labelRow++ * 13);
      }
    };
    opts.labelRow = 0;
    vline(r.capacity_batch, text, [], "capacity " + r.capacity_batch.toLocaleString("en-US"));
    vline(r.critical_batch, muted, [4, 3], "B* " + KV.fmt(r.critical_batch));
    vline(r.decode_batch, KV.cssVar("--chart-4"), [6, 3, 2, 3], "decode batch " + r.decode_batch);
    if (hline) {
      g.save();
      g.strokeStyle = KV.cssVar("--error"); g.setLineDash([2, 2]);
      g.beginPath(); g.moveTo(box.x, Y(hline.value) + 0.5); g.lineTo(box.x + box.w, Y(hline.value) + 0.5); g.stroke();
      g.restore();
    } else if (opts.hline) {
      g.fillStyle = KV.cssVar("--error"); g.textAlign = "right"; g.textBaseline = "top";
      g.fillText(opts.hline.label + " " + KV.fmt(opts.hline.value) + " ms: above the plotted range", box.x + box.w - 4, box.y + box.h - 16);
    }
    // the curves
    for (const s of series) {
      g.save();
      g.strokeStyle = s.color; g.lineWidth = s.width || 2; g.setLineDash(s.dash || []);
      g.beginPath();
      pts.forEach((p, i) => (i ? g.lineTo(X(p.batch), Y(s.value(p))) : g.moveTo(X(p.batch), Y(s.value(p)))));
      g.stroke();
      g.restore();
    }
    // frame, titles and legend
    g.strokeStyle = KV.cssVar("--border");
    g.strokeRect(box.x + 0.5, box.y + 0.5, box.w, box.h);
    g.fillStyle = text; g.textAlign = "left"; g.textBaseline = "bottom"; g.font = "600 12px system-ui, sans-serif";
    g.fillText(yLabel, box.x, box.y - 6);
    g.font = "11px system-ui, sans-serif";
    let lx = box.x + box.w;
    g.textAlign = "right";
    const legend = [...series.map((s) => [s.label, s.color, s.dash])];
    if (opts.hline) legend.push([opts.hline.label, KV.cssVar("--error"), [2, 2]]);
    for (const [label, color, dash] of legend.reverse()) {
      g.fillStyle = muted;
      g.fillText(label, lx, box.y - 6);
      lx -= g.measureText(label).width + 6;
      g.save(); g.strokeStyle = color; g.lineWidth = 2; g.setLineDash(dash || []);
      g.beginPath(); g.moveTo(lx - 18, box.y - 10); g.lineTo(lx, box.y - 10); g.stroke(); g.restore();
      lx -= 30;
    }
  }

  function draw(r) {
    const canvas = $("chart");
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    if (!r.points.length) return;
    const left = 64, right = 16, ph = (h - 40 - 44 - 24) / 2;
    const top = { x: left, y: 28, w: w - left - right, h: ph };
    const bottom = { x: left, y: 28 + ph + 48, w: w - left - right, h: ph };
    panel(g, top, r, [
      { label: "step time", color: KV.cssVar("--chart-1"), value: (p) => p.step_s * 1e3 },
      { label: "projections", color: KV.cssVar("--chart-3"), dash: [5, 3], width: 1.5, value: (p) => p.projection_s * 1e3 },
      { label: "KV read", color: KV.cssVar("--chart-4"), dash: [2, 2], width: 1.5, value: (p) => p.kv_read_s * 1e3 },
    ], "step time, ms", { hline: { value: r.inputs.step_target_s * 1e3, label: "target" }, labels: true });
    panel(g, bottom, r, [
      { label: "tokens/s (system)", color: KV.cssVar("--chart-2"), value: (p) => p.tokens_per_s },
    ], "throughput, tokens/s", { labels: false });
    g.fillStyle = KV.cssVar("--muted"); g.textAlign = "center"; g.textBaseline = "bottom"; g.font = "11px system-ui, sans-serif";
    g.fillText("decode batch B (log scale); shaded: does not fit in memory", left + (w - left - right) / 2, h - 2);
    canvas.dataset.points = String(r.points.length);
  }

  function init() {
    KV.initKeyField(() => { KV.loadModel(); presets = null; run(); });
    $("plan-form").addEventListener("submit", (e) => { e.preventDefault(); run(); });
    $("model").addEventListener("change", showNote);
    $("chip").addEventListener("change", showNote);
    window.addEventListener("resize", () => result && draw(result));
    KV.loadModel();
    run();
  }
  init();
})();
