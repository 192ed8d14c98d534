// Shared by every playground page: the API key field, fetch with the key, error text.
// The pages themselves are served without the key (they carry no data); every JSON
// route they call is under /v1 and needs `Authorization: Bearer <key>` when the server
// was started with --api-key.
"use strict";

const KV = (() => {
  const KEY_STORAGE = "kvserve.apiKey";

  function apiKey() {
    return localStorage.getItem(KEY_STORAGE) || "";
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function showAuthNeeded(serverMessage) {
    const banner = document.getElementById("auth-banner");
    if (!banner) return;
    banner.textContent =
      "401 Unauthorized: this server needs an API key. Enter it in the \u201cAPI key\u201d field at the top " +
      "right (it is kept in this browser only)." + (serverMessage ? " Server said: " + serverMessage : "");
    banner.hidden = false;
    const input = document.getElementById("api-key");
    if (input) input.classList.add("needs-key");
  }

  function clearAuthNeeded() {
    const banner = document.getElementById("auth-banner");
    if (banner) banner.hidden = true;
  }

  // The message of an OpenAI-style error body, or the status line.
  async function errorText(res) {
    let message = res.status + " " + (res.statusText || "error");
    try {
      const body = await res.json();
      if (body && body.error && body.error.message) message = res.status + ": " + body.error.message;
    } catch (_) { /* not JSON */ }
    return message;
  }

  // fetch with the key; a 401 raises the banner and throws; other errors throw their message.
  async function api(path, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const res = await fetch(path, opts);
    if (res.status === 401) {
      const text = await errorText(res);
      showAuthNeeded(text.replace(/^401: /, ""));
      const err = new Error("401: this server needs an API key (enter it at the top right)");
      err.status = 401;
      throw err;
    }
    if (!res.ok) {
      const err = new Error(await errorText(res));
      err.status = res.status;
      throw err;
    }
    clearAuthNeeded();
    return res;
  }

  async function json(path, options) {
    return (await api(path, options)).json();
  }

  // Announce the served model in the header; doubles as the key check on page load.
  async function loadModel() {
    const el = document.getElementById("model-name");
    try {
      const models = await json("/v1/models");
      const model = models.data && models.data[0];
      if (el && model) el.textContent = model.id + (model.max_model_len ? " \u00b7 ctx " + model.max_model_len : "");
      return model || null;
    } catch (err) {
      if (el) el.textContent = err.status === 401 ? "(API key needed)" : String(err.message || err);
      return null;
    }
  }

  function initKeyField(onChange) {
    const input = document.getElementById("api-key");
    if (!input) return;
    input.value = apiKey();
    let timer = null;
    input.addEventListener("input", () => {
      const v = input.value.trim();
      if (v) localStorage.setItem(KEY_STORAGE, v);
      else localStorage.removeItem(KEY_STORAGE);
      input.classList.remove("needs-key");
      clearTimeout(timer); // typed keys: act once the typing pauses
      if (onChange) timer = setTimeout(onChange, 300);
    });
  }

  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "\u2014";
    if (!Number.isFinite(value)) return "\u221e";
    const d = digits === undefined ? 3 : digits;
    const abs = Math.abs(value);
    if (abs >= 1e15 || (abs !== 0 && abs < 1e-3)) return value.toExponential(2);
    for (const [scale, suffix] of [[1e12, "T"], [1e9, "G"], [1e6, "M"]]) {
      if (abs >= scale) return Number((value / scale).toPrecision(Math.max(d, 1))) + suffix;
    }
    return Number(value.toPrecision(Math.max(d, 1))).toLocaleString("en-US");
  }

  function fmtMs(seconds) {
    if (seconds === null || seconds === undefined) return "\u2014";
    return fmt(seconds * 1e3, 3) + " ms";
  }

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  return { apiKey, headers, api, json, errorText, showAuthNeeded, clearAuthNeeded, loadModel, initKeyField, fmt, fmtMs, cssVar };
})();
