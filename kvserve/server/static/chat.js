// The chat page: POST /v1/chat/completions with stream: true, read as SSE off a ReadableStream.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const NUMBER_FIELDS = { temperature: parseFloat, top_p: parseFloat, top_k: (v) => parseInt(v, 10), min_p: parseFloat, max_tokens: (v) => parseInt(v, 10), seed: (v) => parseInt(v, 10) };
  const SAVED = [...Object.keys(NUMBER_FIELDS), "stop", "response_format", "json_schema", "system"];
  const SETTINGS_STORAGE = "kvserve.chatSettings";

  const history = []; // {role, content}
  let controller = null;

  // --- settings, kept in localStorage ---------------------------------------------------------
  function loadSettings() {
    let saved = {};
    try { saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}"); } catch (_) { saved = {}; }
    for (const id of SAVED) if (typeof saved[id] === "string") $(id).value = saved[id];
    showSchemaField();
  }
  function saveSettings() {
    const out = {};
    for (const id of SAVED) out[id] = $(id).value;
    localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(out));
  }
  function showSchemaField() {
    $("schema-field").hidden = $("response_format").value !== "json_schema";
  }

  // The sampling fields as the request sends them: an empty field is left out (server default).
  function samplingFields() {
    const body = {};
    for (const [id, parse] of Object.entries(NUMBER_FIELDS)) {
      const raw = $(id).value.trim();
      if (raw === "") continue;
      const value = parse(raw);
      if (Number.isNaN(value)) throw new Error(id + " must be a number");
      body[id] = value;
    }
    const stops = $("stop").value.split("\n").filter((s) => s !== "").map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
    if (stops.length) body.stop = stops;
    return body;
  }

  function responseFormat() {
    const kind = $("response_format").value;
    $("schema-error").textContent = "";
    if (kind === "json_object") return { type: "json_object" };
    if (kind !== "json_schema") return null;
    let parsed;
    try {
      parsed = JSON.parse($("json_schema").value);
    } catch (err) {
      $("schema-error").textContent = "Not valid JSON: " + err.message;
      throw new Error("the JSON schema is not valid JSON");
    }
    if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
      $("schema-error").textContent = "The schema must be a JSON object.";
      throw new Error("the JSON schema must be an object");
    }
    // pasted in OpenAI's wrapper ({name, schema, strict}) or as a bare schema
    const wrapped = parsed.schema && typeof parsed.schema === "object" && !parsed.type;
    const json_schema = wrapped
      ? Object.assign({ name: "schema", strict: true }, parsed)
      : { name: (typeof parsed.title === "string" && /^[\w-]{1,64}$/.test(parsed.title)) ? parsed.title : "schema", schema: parsed, strict: true };
    return { type: "json_schema", json_schema };
  }

  // --- messages -------------------------------------------------------------------------------
  function addMessage(role, text) {
    const empty = $("empty");
    if (empty) empty.remove();
    const el = document.createElement("div");
    el.className = "msg " + role;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    el.append(label, content, meta);
    $("messages").append(el);
    scrollDown();
    return { el, content, meta };
  }
  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }
  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop-btn").hidden = !busy;
  }

  // --- one turn -------------------------------------------------------------------------------
  async function send(text) {
    let body;
    try {
      body = Object.assign({ messages: [], stream: true, stream_options: { include_usage: true } }, samplingFields());
      const format = responseFormat();
      if (format) body.response_format = format;
    } catch (err) {
      const m = addMessage("assistant", "Not sent: " + err.message);
      m.el.classList.add("error");
      return;
    }
    const system = $("system").value.trim();
    if (system) body.messages.push({ role: "system", content: system });
    history.push({ role: "user", content: text });
    body.messages.push(...history);
    addMessage("user", text);
    const reply = addMessage("assistant", "");
    reply.el.classList.add("streaming");
    reply.el.dataset.state = "streaming";
    setBusy(true);
    controller = new AbortController();
    const started = performance.now();
    let firstAt = null;
    let answer = "";
    let finish = null;
    let usage = null;
    let pieces = 0;
    try {
      const res = await KV.api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      let done = false;
      while (!done) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buffer += decoder.decode(chunk.value, { stream: true });
        let cut;
        while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
          const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (!data) continue;
          if (data === "[DONE]") { done = true; break; }
          const msg = JSON.parse(data);
          if (msg.error) throw new Error(msg.error.message || "the server sent an error");
          if (msg.usage) usage = msg.usage;
          for (const choice of msg.choices || []) {
            const delta = choice.delta || {};
            if (delta.content) {
              if (firstAt === null) firstAt = performance.now();
              answer += delta.content;
              pieces += 1;
              reply.content.textContent = answer;
              scrollDown();
            }
            if (delta.tool_calls) reply.content.textContent = answer + "\n[tool call] " + JSON.stringify(delta.tool_calls);
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
      reply.el.dataset.state = "done";
    } catch (err) {
      if (err.name === "AbortError") {
        finish = "stopped";
        reply.el.dataset.state = "done";
      } else {
        reply.el.classList.add("error");
        reply.el.dataset.state = "error";
        reply.content.textContent = (answer ? answer + "\n\n" : "") + "Error: " + (err.message || err);
      }
    } finally {
      reply.el.classList.remove("streaming");
      setBusy(false);
      controller = null;
    }
    if (answer) history.push({ role: "assistant", content: answer });
    else if (reply.el.dataset.state === "error") history.pop(); // the failed turn is not part of the chat
    const elapsed = (performance.now() - started) / 1e3;
    const tokens = usage ? usage.completion_tokens : pieces;
    const parts = [tokens + " tokens"];
    if (firstAt !== null) {
      parts.push("TTFT " + Math.round(firstAt - started) + " ms");
      const decodeS = (performance.now() - firstAt) / 1e3;
      if (tokens > 1 && decodeS > 0) parts.push(KV.fmt((tokens - 1) / decodeS) + " tok/s");
    }
    parts.push(KV.fmt(elapsed) + " s");
    if (finish) parts.push("finish: " + finish);
    if (body.response_format) {
      parts.push(body.response_format.type);
      if (answer && reply.el.dataset.state === "done") {
        try { JSON.parse(answer); parts.push("valid JSON"); } catch (_) {
          parts.push(finish === "length" ? "JSON cut short at max_tokens" : "not valid JSON");
        }
      }
    }
    reply.meta.textContent = parts.join(" \u00b7 ");
  }

  // --- wiring ---------------------------------------------------------------------------------
  function init() {
    // an empty field shows what the server applies instead (/v1/models' sampling_defaults, where it has them)
    const showDefaults = async () => {
      const model = await KV.loadModel();
      const defaults = (model && model.sampling_defaults) || {};
      for (const id of Object.keys(NUMBER_FIELDS)) {
        if (typeof defaults[id] === "number") $(id).placeholder = "default " + defaults[id];
      }
    };
    KV.initKeyField(showDefaults);
    loadSettings();
    for (const id of SAVED) $(id).addEventListener("change", saveSettings);
    $("response_format").addEventListener("change", showSchemaField);
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop-btn").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      if (controller) controller.abort();
      history.length = 0;
      $("messages").innerHTML = '<div class="empty" id="empty">Send a message to start.</div>';
    });
    showDefaults();
  }
  init();
})();
