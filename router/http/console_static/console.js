// The Hivenet Router operator console. Plain JavaScript, no build step, no library.
//
// Security rules this file keeps (docs/console.md):
// - the admin key lives in this tab's sessionStorage only, and goes out only as an
//   Authorization header to this page's own origin;
// - every string that comes from the router (agent names, tags, models, log lines) is
//   written with textContent or as a text node, never parsed as HTML.
"use strict";

const KEY_SLOT = "hivenet-admin-key";
const REFRESH_MS = 3000;
let adminKey = sessionStorage.getItem(KEY_SLOT) || "";
let following = null; // the registration stream's AbortController
let refreshTimer = null;
let view = "fleet";
let validatedText = null;

// --- small helpers ---------------------------------------------------------------------

function $(id) {
  return document.getElementById(id);
}

// An element with attributes and children; a string child is a text node, never HTML.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "title") node.title = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.appendChild(typeof child === "object" ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function num(value, digits) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  return Number.isInteger(value) ? String(value) : value.toFixed(digits === undefined ? 2 : digits);
}

function pct(fraction) {
  return fraction === null || fraction === undefined ? "–" : `${(fraction * 100).toFixed(0)}%`;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, options) {
  const opts = Object.assign({ method: "GET", headers: {} }, options || {});
  opts.headers = Object.assign({ Authorization: `Bearer ${adminKey}` }, opts.headers);
  opts.cache = "no-store";
  opts.credentials = "omit";
  const response = await fetch(path, opts);
  const text = await response.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch (e) {
    body = text;
  }
  if (response.status === 401) {
    logout("The admin key was refused.");
    throw new ApiError(401, "unauthorized");
  }
  if (!response.ok) {
    const err = body && body.error;
    const message = typeof err === "string" ? err : (err && err.message) || `HTTP ${response.status}`;
    throw new ApiError(response.status, message);
  }
  return body;
}

// --- login -----------------------------------------------------------------------------

async function login(event) {
  event.preventDefault();
  const input = $("admin-key");
  adminKey = input.value;
  input.value = "";
  $("login-error").textContent = "";
  try {
    await api("/admin/health");
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 401)) {
      $("login-error").textContent = `The router did not answer: ${e.message}`;
    }
    adminKey = "";
    return;
  }
  sessionStorage.setItem(KEY_SLOT, adminKey);
  start();
}

function logout(why) {
  adminKey = "";
  sessionStorage.removeItem(KEY_SLOT);
  if (following) following.abort();
  following = null;
  clearInterval(refreshTimer);
  refreshTimer = null;
  $("app").hidden = true;
  $("tabs").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = typeof why === "string" ? why : "";
}

function start() {
  $("login").hidden = true;
  $("app").hidden = false;
  $("tabs").hidden = false;
  $("logout").hidden = false;
  show(view);
  refreshFleet();
  follow();
  refreshTimer = setInterval(() => {
    if (view === "fleet") refreshFleet();
  }, REFRESH_MS);
}

function show(name) {
  view = name;
  for (const button of document.querySelectorAll("#tabs button")) {
    button.classList.toggle("active", button.dataset.view === name);
  }
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== `view-${name}`;
  }
  const loaders = { fleet: refreshFleet, explain: loadModels, requests: loadRequests,
    policy: loadPolicy, keys: loadKeys, tenants: loadTenants };
  loaders[name]().catch(() => {});
}

// --- fleet -----------------------------------------------------------------------------

// The local routing table's agents and the fleet view's (--state-url) in one shape.
function agentRow(a) {
  if (a.metadata) {
    return {
      peer_id: a.peer_id, model: a.metadata.model, engine: a.metadata.engine,
      region: a.metadata.region, machine: a.metadata.machine, tags: a.metadata.tags || [],
      healthy: a.status.healthy && a.status.backend_healthy && !a.status.draining,
      health: a.status.draining ? "draining" : !a.status.connected ? "disconnected"
        : !a.status.healthy ? "unhealthy" : !a.status.backend_healthy ? "backend unhealthy" : "healthy",
      active: a.status.active_requests, capacity: a.metadata.capacity,
      engine_gauges: a.engine, hardware: a.hardware,
      srtt: a.universal.srtt_ms, success: a.universal.success_rate, routers: null,
    };
  }
  return {
    peer_id: a.peer_id, model: a.model, engine: a.engine, region: a.region, machine: "",
    tags: [], healthy: a.healthy, health: a.healthy ? "healthy" : "unhealthy",
    active: a.active_requests, capacity: a.capacity, engine_gauges: null, hardware: null,
    srtt: a.universal.srtt, success: a.universal.success_rate, routers: a.routers,
  };
}

function gauges(e) {
  if (!e) return "–";
  return [
    `kv ${pct(e.kv_cache_utilization)}`,
    `run ${num(e.running_requests)}`,
    `wait ${num(e.waiting_requests)}`,
    `ttft ${e.avg_ttft_seconds === null || e.avg_ttft_seconds === undefined ? "–" : `${num(e.avg_ttft_seconds, 3)}s`}`,
  ].join(" · ");
}

function hardware(h) {
  if (!h) return "–";
  const gpus = (h.gpu || []).map((g) => g.model || g.name).filter(Boolean);
  return [
    gpus.length ? `${gpus.length}× ${gpus[0]}` : null,
    `gpu ${pct(h.gpu_util_percent)}`,
    `vram ${pct(h.gpu_vram_used_percent)}`,
    `cpu ${pct(h.cpu_usage_percent)}`,
  ].filter(Boolean).join(" · ");
}

async function refreshFleet() {
  const fleet = $("fleet-scope").checked;
  const [table, excl] = await Promise.all([
    api(fleet ? "/admin/routing-table?scope=fleet" : "/admin/routing-table"),
    api("/admin/exclusions"),
  ]);
  const agents = (table.agents || []).map(agentRow);
  const rows = agents.map((a) => {
    const steps = (excl.agents || {})[a.peer_id] || [];
    const why = steps.map((s) => s.excluded_by
      ? el("div", { class: "excluded" }, `${s.step}: ${s.excluded_by}`)
      : el("div", { class: "eligible" }, `${s.step}: eligible`));
    return el("tr", { "data-peer": a.peer_id },
      el("td", {}, el("div", { class: "mono", title: a.peer_id }, a.peer_id.slice(-10)),
        el("div", { class: "muted" }, a.machine)),
      el("td", {}, a.model),
      el("td", {}, a.engine),
      el("td", {}, a.region),
      el("td", {}, a.tags.map((t) => el("span", { class: "tag" }, t))),
      el("td", { class: a.healthy ? "ok" : "fail" }, a.health),
      el("td", {}, `${a.active}/${a.capacity}`),
      el("td", {}, gauges(a.engine_gauges)),
      el("td", {}, hardware(a.hardware)),
      el("td", {}, a.srtt === null || a.srtt === undefined ? "–" : `${num(a.srtt, 1)} ms`),
      el("td", {}, pct(a.success)),
      el("td", {}, why.length ? why : "–"),
      el("td", { class: "mono" }, a.routers ? a.routers.map((r) => r.slice(-8)).join(", ") : "this"),
    );
  });
  fill($("fleet-table").tBodies[0], rows);
  const healthy = agents.filter((a) => a.healthy).length;
  $("fleet-summary").textContent = `${agents.length} agents, ${healthy} healthy`;
}

// The registration stream (SSE), read with fetch so the key goes in a header: EventSource
// cannot send one, and a key in its URL would end up in logs.
async function follow() {
  if (following) following.abort();
  const control = new AbortController();
  following = control;
  while (following === control) {
    try {
      const response = await fetch("/admin/registration-stream", {
        headers: { Authorization: `Bearer ${adminKey}` }, signal: control.signal,
        cache: "no-store", credentials: "omit",
      });
      if (response.status === 401) {
        logout("The admin key was refused.");
        return;
      }
      if (!response.ok || !response.body) throw new Error(`HTTP ${response.status}`);
      $("fleet-live").textContent = "live";
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const frame = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          for (const line of frame.split("\n")) {
            if (line.startsWith("data: ")) registration(line.slice(6));
          }
        }
      }
    } catch (e) {
      if (control.signal.aborted) return;
    }
    $("fleet-live").textContent = "reconnecting…";
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

function registration(data) {
  let event;
  try {
    event = JSON.parse(data);
  } catch (e) {
    return;
  }
  const list = $("fleet-events");
  const text = `${event.timestamp || ""} ${event.event_type} ${event.agent_id || ""} ${event.model || ""}`;
  list.insertBefore(el("li", {}, text), list.firstChild);
  while (list.children.length > 50) list.removeChild(list.lastChild);
  if (view === "fleet") refreshFleet().catch(() => {});
}

// --- explain ---------------------------------------------------------------------------

async function loadModels() {
  const models = await api("/admin/models");
  fill($("explain-models"), (models.data || []).map((m) => el("option", { value: m.id })));
}

async function explain(event) {
  event.preventDefault();
  $("explain-error").textContent = "";
  const headers = {};
  for (const line of $("explain-headers").value.split("\n")) {
    const at = line.indexOf(":");
    if (at > 0) headers[line.slice(0, at).trim()] = line.slice(at + 1).trim();
  }
  const body = { model: $("explain-model").value, headers, path: $("explain-path").value };
  if ($("explain-tenant").value) body.tenant = $("explain-tenant").value;
  if ($("explain-prompt").value) body.messages = [{ role: "user", content: $("explain-prompt").value }];
  try {
    const answer = await api("/admin/explain", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    renderExplain(answer);
  } catch (e) {
    $("explain-error").textContent = e.message;
  }
}

function renderExplain(a) {
  const out = [];
  let verdict;
  if (a.outcome === "routed") verdict = el("p", { class: "outcome ok", id: "explain-chosen" },
    `Chosen: ${a.chosen} (step ${a.chosen_step})`);
  else if (a.outcome === "load_shed") verdict = el("p", { class: "outcome fail" },
    `Load shed at ${a.shed.step}: ${a.shed.rule}`);
  else {
    const ex = a.exhaustion;
    const provider = a.provider_fallback;
    verdict = el("div", {},
      el("p", { class: "outcome fail", id: "explain-exhausted" },
        `policy_exhausted chain=${ex.chain} tried=${ex.tried}`),
      el("p", { class: "mono" }, `reason="${ex.reason}"`),
      el("p", { class: provider ? "ok" : "fail" }, provider
        ? `Provider fallback: ${provider.engine} ${provider.model}`
        : `No provider fallback: the client gets ${ex.error}${ex.would_queue ? " after waiting in the queue" : ""}`));
  }
  out.push(verdict);
  out.push(el("p", { class: "muted" },
    `model ${a.model} · tenant ${a.tenant} · priority ${a.priority} · ${a.agents} agents · chain [${a.chain.join(" → ")}]`));
  for (const step of a.steps) {
    const box = el("div", { class: "step" }, el("h4", {}, `Step ${step.name}`,
      step.strategy ? ` · ${step.strategy}` : ""));
    if (step.shed) {
      box.appendChild(el("p", { class: "fail" }, `shed_if [${step.shed}]`));
      out.push(box);
      continue;
    }
    const head = el("tr", {}, el("th", {}, "Agent"),
      ...[1, 2, 3, 4, 5, 6, 7].map((n) => el("th", {}, `gate ${n}`)));
    const rows = step.agents.map((agent) => el("tr", {},
      el("td", {}, el("div", { class: "mono", title: agent.peer_id }, agent.peer_id.slice(-10)),
        el("div", { class: "muted" }, agent.machine)),
      ...agent.gates.map((g) => el("td", { class: g.pass ? "pass" : "fail" }, g.pass ? "pass" : g.why))));
    box.appendChild(el("table", { class: "gates" }, el("thead", {}, head), el("tbody", {}, rows)));
    if (step.ranking.length) {
      box.appendChild(el("p", {}, "Ranking:"));
      box.appendChild(el("ol", {}, step.ranking.map((r) => el("li", {},
        `${r.peer_id.slice(-10)} load=${num(r.load)}`, r.signal ? ` ${r.signal}=${num(r.score, 4)}` : ""))));
    }
    box.appendChild(step.chosen
      ? el("p", { class: "ok" }, `chosen ${step.chosen}`)
      : el("p", { class: "fail mono" }, `drained: ${step.drain}`));
    out.push(box);
  }
  $("explain-out").replaceChildren(...out);
}

// --- recent requests -------------------------------------------------------------------

async function loadRequests(event) {
  if (event) event.preventDefault();
  const query = new URLSearchParams({ limit: "200" });
  for (const name of ["model", "tenant", "agent", "status"]) {
    const value = $(`rq-${name}`).value.trim();
    if (value) query.set(name, value);
  }
  $("requests-error").textContent = "";
  let answer;
  try {
    answer = await api(`/admin/requests?${query}`);
  } catch (e) {
    $("requests-error").textContent = e.message;
    return;
  }
  fill($("requests-table").tBodies[0], answer.requests.map((r) => {
    const row = el("tr", { "data-id": r.id },
      el("td", {}, r.time.slice(11, 23)), el("td", { class: "mono" }, r.id),
      el("td", {}, r.path), el("td", {}, r.model), el("td", {}, r.tenant),
      el("td", { class: "mono" }, r.agent || "–"),
      el("td", { class: r.status >= 400 ? "fail" : "ok" }, String(r.status)),
      el("td", {}, `${num(r.latency_ms, 1)} ms`), el("td", {}, String(r.tries)));
    row.addEventListener("click", () => story(r.id).catch((e) => {
      $("requests-error").textContent = e.message;
    }));
    return row;
  }));
}

async function story(id) {
  const entry = await api(`/admin/requests/${encodeURIComponent(id)}`);
  $("story-title").hidden = false;
  $("story-title").textContent = `Routing story of ${entry.id}`;
  $("story").textContent = entry.lines.length ? entry.lines.join("\n")
    : "(no log lines at the router's current levels; HIVENET_LOG_LEVEL=policy=debug shows each step)";
}

// --- policy ----------------------------------------------------------------------------

async function loadPolicy() {
  const response = await fetch("/admin/policy", {
    headers: { Authorization: `Bearer ${adminKey}` }, cache: "no-store", credentials: "omit",
  });
  if (!response.ok) throw new ApiError(response.status, `HTTP ${response.status}`);
  const text = await response.text();
  $("policy-current").textContent = text;
  $("policy-version").textContent = (response.headers.get("etag") || "").replaceAll('"', "");
  if (!$("policy-text").value) $("policy-text").value = text;
}

async function validatePolicy() {
  const text = $("policy-text").value;
  const answer = await api("/admin/policy/validate", {
    method: "POST", headers: { "Content-Type": "application/yaml" }, body: text,
  });
  fill($("policy-errors"), answer.errors.map((e) => el("li", {}, e)));
  const diff = answer.diff
    ? answer.diff.split("\n").map((line) => el("span",
      { class: line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : "" }, `${line}\n`))
    : [el("span", {}, "(no change)")];
  $("policy-diff").replaceChildren(...diff);
  validatedText = answer.valid ? text : null;
  $("policy-apply").disabled = !answer.valid;
  $("policy-status").textContent = answer.valid
    ? `Valid: chain [${answer.chain.join(" → ")}]. Review the diff, then apply.`
    : "Invalid: nothing can be applied.";
}

async function applyPolicy() {
  if (validatedText === null || validatedText !== $("policy-text").value) {
    $("policy-status").textContent = "The text changed since it was validated: validate again.";
    $("policy-apply").disabled = true;
    return;
  }
  try {
    const answer = await api("/admin/policy", {
      method: "PUT", headers: { "Content-Type": "application/yaml" }, body: validatedText,
    });
    $("policy-status").textContent = `Applied: version ${answer.version}, chain [${answer.chain.join(" → ")}]`;
    $("policy-apply").disabled = true;
    validatedText = null;
    await loadPolicy();
  } catch (e) {
    $("policy-status").textContent = `Refused: ${e.message}`;
  }
}

// --- keys ------------------------------------------------------------------------------

let keysVersion = "";

async function loadKeys() {
  $("keys-error").textContent = "";
  let listed;
  try {
    listed = await api("/admin/api-keys");
  } catch (e) {
    $("keys-mode").textContent = e.status === 501
      ? "The router is not in dynamic key mode: keys live in its auth file."
      : e.message;
    $("key-form").hidden = true;
    fill($("keys-table").tBodies[0], []);
    return;
  }
  $("key-form").hidden = false;
  keysVersion = (await api("/admin/api-keys/version")).version;
  $("keys-mode").textContent = `Dynamic key registry, version ${keysVersion || "(empty)"}, ${listed.count} keys.`;
  fill($("keys-table").tBodies[0], listed.keys.map((k) => {
    const revoke = el("button", { type: "button", class: "revoke" }, "Revoke");
    revoke.addEventListener("click", () => revokeKey(k.id).catch((e) => {
      $("keys-error").textContent = e.message;
    }));
    return el("tr", { "data-key": k.id }, el("td", { class: "mono" }, k.id), el("td", {}, k.owner || ""),
      el("td", {}, k.name || ""), el("td", { class: "mono" }, k.key_preview || ""),
      el("td", {}, String(k.enabled !== false)), el("td", {}, revoke));
  }));
}

function nextVersion(version) {
  const n = parseInt((version || "rev_0").replace(/^rev_/, ""), 10) || 0;
  return `rev_${String(n + 1).padStart(8, "0")}`;
}

async function createKey(event) {
  event.preventDefault();
  $("keys-error").textContent = "";
  const id = $("key-id").value.trim();
  try {
    const minted = await api("/admin/keygen", { method: "POST" });
    const entry = { version: nextVersion(keysVersion), key_hash: minted.key_hash,
      owner: $("key-owner").value.trim(), name: $("key-name").value.trim() || id,
      key_preview: minted.preview, enabled: true };
    await api(`/admin/api-keys/${encodeURIComponent(id)}`, {
      method: "PUT", headers: { "Content-Type": "application/json" }, body: JSON.stringify(entry),
    });
    $("key-raw").textContent = minted.key;
    $("key-created").hidden = false;
    $("key-id").value = "";
  } catch (e) {
    $("keys-error").textContent = e.message;
  }
  await loadKeys();
}

async function revokeKey(id) {
  if (!window.confirm(`Revoke key ${id}? Clients using it are refused at once.`)) return;
  await api(`/admin/api-keys/${encodeURIComponent(id)}?version=${nextVersion(keysVersion)}`,
    { method: "DELETE" });
  $("key-created").hidden = true;
  $("key-raw").textContent = "";
  await loadKeys();
}

// --- tenants ---------------------------------------------------------------------------

async function loadTenants() {
  const usage = await api("/admin/tenants/usage");
  $("tenants-note").textContent = usage.tenants.length
    ? `Usage as this router counts it (state store: ${usage.state_store}).`
    : "No tenants: the router runs without an auth file or dynamic keys.";
  fill($("tenants-table").tBodies[0], usage.tenants.map((t) => el("tr", {},
    el("td", {}, t.name), el("td", {}, String(t.priority)),
    el("td", {}, `${t.usage.inflight} / ${t.max_concurrent || "∞"}`),
    el("td", {}, `${t.usage.tokens_today} / ${t.tokens_per_day || "∞"}`),
    el("td", {}, t.requests_per_minute ? String(t.requests_per_minute) : "∞"),
    el("td", {}, (t.models || []).join(", ") || "all"))));
}

// --- wiring ----------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", () => logout(""));
  for (const button of document.querySelectorAll("#tabs button")) {
    button.addEventListener("click", () => show(button.dataset.view));
  }
  $("fleet-scope").addEventListener("change", () => refreshFleet().catch(() => {}));
  $("explain-form").addEventListener("submit", explain);
  $("requests-form").addEventListener("submit", loadRequests);
  $("policy-validate").addEventListener("click", () => validatePolicy().catch((e) => {
    $("policy-status").textContent = e.message;
  }));
  $("policy-text").addEventListener("input", () => {
    $("policy-apply").disabled = true;
  });
  $("policy-apply").addEventListener("click", applyPolicy);
  $("key-form").addEventListener("submit", createKey);
  if (adminKey) start();
});
