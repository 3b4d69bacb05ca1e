"""The one page ``dmi ui`` serves: plain HTML, inline JS and SVG, no build step, no CDN.

Left: build a plan — pick a model, see its blocks with the hook points on them, select
hooks, layers and phases, watch the estimate (``POST /api/estimate``) update, save the plan
(``POST /api/plan``). Right: browse the store — models, requests, hooks, the norm heatmap.
Every control is a native form element (usable by keyboard); status changes go to an
``aria-live`` region so screen readers announce them.
"""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>DMI</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;color:#222}
header{background:#223;color:#fff;padding:8px 16px}
main{display:grid;grid-template-columns:minmax(420px,1fr) minmax(360px,1fr);gap:16px;padding:16px}
section{border:1px solid #ccd;border-radius:6px;padding:12px}
fieldset{border:1px solid #dde;margin:8px 0}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #eee;padding:2px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}
#status{min-height:1.4em;color:#035}#status.error{color:#a00}
label{margin-right:10px;white-space:nowrap}
button{margin:2px}
:focus{outline:2px solid #36c}
svg text{font-size:10px}
</style></head><body>
<header><h1 style="font-size:18px;margin:0">DMI: capture plan and store</h1></header>
<div id="status" role="status" aria-live="polite"></div>
<main>
<section aria-labelledby="plan-h"><h2 id="plan-h">Plan</h2>
<label>Model <select id="model"></select></label>
<div id="diagram" aria-label="model architecture with hook points"></div>
<fieldset><legend>Hooks</legend><div id="hooks"></div></fieldset>
<fieldset><legend>Layers and phases</legend>
<label>Layers <input id="layers" value="all" size="10" aria-describedby="layers-help"></label>
<span id="layers-help">all, START:STOP, FIRST-LAST, or N,M,...</span><br>
<label><input type="checkbox" name="phase" value="prefill" checked> prefill</label>
<label><input type="checkbox" name="phase" value="decode" checked> decode</label>
<label><input type="checkbox" name="phase" value="forward" checked> forward</label>
</fieldset>
<fieldset><legend>Workload</legend>
<label>Tokens <input id="tokens" type="number" min="1" value="512" size="6"></label>
<label>New tokens <input id="new_tokens" type="number" min="0" value="0" size="4"></label>
<label>Batch <input id="batch" type="number" min="1" value="1" size="4"></label>
<label>TP <input id="tp" type="number" min="1" value="1" size="3"></label>
</fieldset>
<h3>Estimate</h3><div id="estimate"></div>
<button id="save">Save plan</button> <span id="plan-path"></span>
<pre id="plan-text"></pre>
</section>
<section aria-labelledby="store-h"><h2 id="store-h">Store</h2>
<button id="load-models">Load models</button>
<div id="models"></div><div id="requests"></div><div id="contents"></div>
<img id="plot" alt="" style="max-width:100%">
</section>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const token = new URLSearchParams(location.search).get("token");
const headers = token ? {"X-DMI-Token": token} : {};
let session = null, described = null, timer = null;

function say(text, error) { const s = $("status"); s.textContent = text; s.className = error ? "error" : ""; }
async function api(path, body) {
  const init = body === undefined ? {headers} :
    {method: "POST", headers: {...headers, "Content-Type": "application/json"}, body: JSON.stringify(body)};
  const r = await fetch(path, init);
  const data = await r.json();
  if (!r.ok) throw new Error((data.field ? data.field + ": " : "") + data.error);
  return data;
}
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}
function human(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(2) : String(n)) + " " + u[i];
}
function plan() {
  const hooks = [...document.querySelectorAll("input[name=hook]:checked")].map((c) => c.value);
  const phases = [...document.querySelectorAll("input[name=phase]:checked")].map((c) => c.value);
  const layers = $("layers").value.trim();
  const p = {version: 1, model: $("model").value, hooks, schedule: {phases}};
  if (layers && layers !== "all") p.layers = layers.includes(":") || SPAN.test(layers) ? layers : layers.split(",").map(Number);
  return JSON.stringify(p);
}
function workload() {
  return {tokens: +$("tokens").value, new_tokens: +$("new_tokens").value, batch: +$("batch").value, tp: +$("tp").value};
}
function drawDiagram(d, selected) {
  const g = d.geometry, n = Math.min(g.layers, 12), w = 380, rowH = 26, top = 30;
  const svg = [`<svg xmlns="http://www.w3.org/2000/svg" width="${w}" height="${top + (n + 2) * rowH}" role="img">`,
    `<title>${d.model_type}: ${g.layers} layers, hidden ${g.hidden}</title>`,
    `<rect x="10" y="4" width="${w - 20}" height="20" fill="#eef"/><text x="16" y="18">embed (vocab ${g.vocab})</text>`];
  const spots = {resid_pre: 30, attn_q: 100, attn_k: 114, attn_v: 128, attn_z: 142, attn_pattern: 156, attn_out: 170,
    resid_mid: 205, mlp_post: 260, router_logits: 274, router_topk: 288, mlp_out: 302, resid_post: 340};
  const layers = selectedLayers(g.layers);
  for (let i = 0; i < n; i++) {
    const y = top + i * rowH, layer = i === n - 1 ? g.layers - 1 : i;
    svg.push(`<rect x="60" y="${y}" width="120" height="20" fill="#dfe"/><text x="63" y="${y + 14}">attn</text>`,
      `<rect x="225" y="${y}" width="90" height="20" fill="#fde"/><text x="228" y="${y + 14}">mlp</text>`,
      `<text x="${w - 16}" y="${y + 14}" text-anchor="end">${layer}</text>`);
    for (const h of d.hooks.filter((h) => h.scope === "layer")) {
      const on = selected.has(h.name) && layers.has(layer);
      svg.push(`<circle cx="${spots[h.name] || 0}" cy="${y + 10}" r="4" fill="${on ? "#c30" : "#bbb"}"><title>${h.name} L${layer}: ${h.record_shape} ${h.dtype}</title></circle>`);
    }
  }
  const y = top + n * rowH;
  svg.push(`<rect x="10" y="${y}" width="${w - 20}" height="20" fill="#eef"/><text x="16" y="${y + 14}">final norm, lm head${g.layers > n ? " (" + (g.layers - n) + " layers not drawn)" : ""}</text></svg>`);
  $("diagram").innerHTML = svg.join("");
}
const SPAN = /^(\d+)\s*-\s*(\d+)$/;  // FIRST-LAST, both included: the span `dmi show` prints
function selectedLayers(n) {
  const text = $("layers").value.trim(), all = [...Array(n).keys()], span = SPAN.exec(text);
  if (!text || text === "all") return new Set(all);
  if (text.includes(":")) { const [a, b] = text.split(":").map(Number); return new Set(all.filter((l) => l >= a && l < b)); }
  if (span) return new Set(all.filter((l) => l >= +span[1] && l <= +span[2]));
  return new Set(text.split(",").map(Number).map((l) => (l + n) % n));
}
async function describe() {
  const model = $("model").value;
  say("reading " + model + " ...");
  try { described = await api("/api/describe?model=" + encodeURIComponent(model)); }
  catch (e) { say(e.message, true); return; }
  const box = $("hooks"); box.replaceChildren();
  const chosen = new Set(session.fields.hooks);
  for (const h of described.hooks) {
    const c = el("input", {type: "checkbox", name: "hook", value: h.name});
    c.checked = chosen.has(h.name);
    box.append(el("label", {title: h.doc}, c, " " + h.name));
  }
  say(`${described.model_type}: ${described.geometry.layers} layers, ${described.hooks.length} hooks`);
  update();
}
function update() {
  clearTimeout(timer);
  timer = setTimeout(async () => {
    const selected = new Set([...document.querySelectorAll("input[name=hook]:checked")].map((c) => c.value));
    drawDiagram(described, selected);
    try {
      const e = await api("/api/estimate", {plan: plan(), ...workload()});
      const rows = e.hooks.map((h) => el("tr", {}, el("td", {}, h.hook), el("td", {}, String(h.layers.length)),
        el("td", {}, String(h.bytes_per_token)), el("td", {}, human(h.raw_bytes_per_request))));
      $("estimate").replaceChildren(el("table", {id: "estimate-table"},
        el("tr", {}, el("th", {}, "hook"), el("th", {}, "layers"), el("th", {}, "bytes/token"), el("th", {}, "raw/request")),
        ...rows),
        el("p", {id: "estimate-total", "data-raw": String(e.raw_bytes_per_million_tokens)},
          `per million tokens: ${human(e.raw_bytes_per_million_tokens)} raw, ${human(e.stored_bytes_per_million_tokens)} stored (${e.codec}); ` +
          `peak step ${human(e.peak_step_bytes)}, ${e.packs_per_million_tokens} packs`));
      say("estimate updated");
    } catch (err) { $("estimate").replaceChildren(); say(err.message, true); }
  }, 150);
}
async function save() {
  try { const r = await api("/api/plan", {plan: plan()}); $("plan-text").textContent = r.plan; say("saved " + r.saved); }
  catch (e) { say(e.message, true); }
}
function plot(model, request, run, hook) {
  const q = new URLSearchParams({model, request, run, hook}); if (token) q.set("token", token);
  $("plot").src = "/api/plot.png?" + q; $("plot").alt = `${hook} norms of ${request}`; say("plotting " + hook);
}
async function browseTo(deep) {
  /* #model=M&request=R&hook=H opens the store at that request (and plots the hook): a link to share */
  const model = deep.get("model"), request = deep.get("request"), hook = deep.get("hook");
  await loadModels();
  const reqs = await loadRequests(model);
  const r = (reqs || []).find((r) => r.request_id === request);
  if (!r) return;
  await loadContents(model, r.request_id, r.run_id);
  if (hook) plot(model, r.request_id, r.run_id, hook);
}
async function loadModels() {
  try {
    const models = await api("/api/models");
    $("models").replaceChildren(el("h3", {}, "Models"), ...models.map((m) => {
      const b = el("button", {}, `${m.model_id} (${m.requests} requests)`); b.onclick = () => loadRequests(m.model_id); return b;
    }));
    say(models.length + " models");
  } catch (e) { say(e.message, true); }
}
async function loadRequests(model) {
  try {
    const reqs = await api("/api/requests?model=" + encodeURIComponent(model));
    $("requests").replaceChildren(el("h3", {}, "Requests of " + model), ...reqs.map((r) => {
      const b = el("button", {}, `${r.request_id} (${r.run_id}, ${r.n_tokens} tokens)`);
      b.onclick = () => loadContents(model, r.request_id, r.run_id); return b;
    }));
    say(reqs.length + " requests");
    return reqs;
  } catch (e) { say(e.message, true); }
}
async function loadContents(model, request, run) {
  try {
    const c = await api(`/api/contents?model=${encodeURIComponent(model)}&request=${encodeURIComponent(request)}&run=${encodeURIComponent(run)}`);
    $("contents").replaceChildren(el("h3", {}, "Hooks of " + request), el("table", {},
      el("tr", {}, el("th", {}, "hook"), el("th", {}, "layers"), el("th", {}, "tokens"), el("th", {}, "dtype"), el("th", {}, "raw")),
      ...c.hooks.map((h) => {
        const b = el("button", {}, h.hook);
        b.onclick = () => plot(model, request, run, h.hook);
        return el("tr", {}, el("td", {}, b), el("td", {}, String(h.layers.length)), el("td", {}, String(h.n_tokens)),
          el("td", {}, h.dtype), el("td", {}, human(h.raw_bytes)));
      })));
    say(c.hooks.length + " hooks");
  } catch (e) { say(e.message, true); }
}
async function start() {
  session = await api("/api/session");
  for (const m of session.models) $("model").append(el("option", {value: m}, m));
  $("model").value = session.fields.model || session.models[0];
  $("layers").value = Array.isArray(session.fields.layers) ? session.fields.layers.join(",") : session.fields.layers;
  document.querySelectorAll("input[name=phase]").forEach((c) => { c.checked = session.fields.phases.includes(c.value); });
  if (!session.fields.phases.includes("forward")) $("new_tokens").value = 16;  // a generate workload
  $("plan-path").textContent = session.plan_path ? "to " + session.plan_path : "(no plan path: dmi ui --plan FILE)";
  $("plan-text").textContent = session.plan;
  $("save").disabled = !session.plan_path;
  $("load-models").disabled = !session.store;
  $("model").onchange = describe;
  $("save").onclick = save;
  $("load-models").onclick = loadModels;
  document.querySelector("main").addEventListener("input", (e) => { if (e.target.id !== "model") update(); });
  await describe();
  const deep = new URLSearchParams(location.hash.slice(1));
  if (deep.get("model") && session.store) await browseTo(deep);
}
start().catch((e) => say(e.message, true));
</script></body></html>
"""
