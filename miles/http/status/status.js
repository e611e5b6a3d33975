// The status page: polls GET /status every second and redraws. Plain DOM, no framework, no
// network beyond this controller. Values are set as text, never as HTML.
"use strict";

const PHASE_COLOURS = {
  lock_wait: "#8c959f", validate: "#bf8700", transfer: "#8250df", pause: "#cf222e",
  load: "#0969da", confirm: "#1a7f37", commit: "#57ab5a", rollback: "#e16f24",
};
const POLL_MS = 1000;
let credential = sessionStorage.getItem("miles-credential") || "";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "style") node.setAttribute("style", value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(child == null ? "" : String(child)));
  }
  return node;
}

function seconds(value) {
  if (value == null) return "-";
  return value < 1 ? `${(value * 1000).toFixed(1)} ms` : `${value.toFixed(2)} s`;
}

function short(text, n = 12) {
  return text ? (text.length > n ? text.slice(0, n) + "…" : text) : "-";
}

function time(iso) {
  return new Date(iso).toLocaleTimeString([], { hour12: false });
}

function drawFleet(health) {
  const badge = document.getElementById("fleet-status");
  badge.textContent = health.status;
  badge.className = `badge ${health.status}`;
  document.getElementById("uptime").textContent = `up ${Math.round(health.uptime_s)} s`;
  const models = document.getElementById("models");
  models.replaceChildren(
    ...Object.values(health.models).map((m) =>
      el("p", { class: "model", "data-model": m.model_name },
        el("b", {}, m.model_name), ` version ${m.weight_version ?? Object.keys(m.versions).join(", ") ?? "-"}, `,
        `${m.serving}/${m.total} serving`, m.accepting_requests ? "" : el("span", { class: "updating" }, ", requests held"))
    )
  );
  const rows = health.servers.map((s) => {
    const probe = s.last_probe_ok == null ? "-" : `${s.last_probe_ok ? "ok" : "failing"} ${seconds(s.last_probe_age_s)} ago`;
    return el("tr", { "data-server": s.server_id },
      el("td", { class: "mono" }, s.server_id),
      el("td", {}, s.model_name),
      el("td", { class: s.state, "data-field": "state" }, s.state),
      el("td", { class: "mono", "data-field": "version" }, s.weight_version ?? "-"),
      el("td", { class: "mono", title: s.checksum ?? "" }, short(s.checksum)),
      el("td", {}, s.node_address ?? s.node_id ?? "local"),
      el("td", {}, s.gpu_ids.length ? `GPU ${s.gpu_ids.join(",")}` : s.device),
      el("td", {}, s.in_flight),
      el("td", { class: s.last_probe_ok === false ? "failing" : "" }, probe),
      el("td", {}, s.restarts));
  });
  document.querySelector("#servers tbody").replaceChildren(...rows);
}

function drawLock(lock) {
  const items = [
    ["state", lock.held ? (lock.detached ? "held by a training window" : "held") : "free"],
    ["holder", lock.holder ?? "-"],
    ["since", lock.held_since ? `${time(lock.held_since)} (${seconds(lock.held_for_s)})` : "-"],
    ["waiters", lock.waiters],
    ["token", lock.token ?? "-"],
  ];
  if (lock.lease_expires_at) items.push(["lease expires", time(lock.lease_expires_at)]);
  document.getElementById("lock").replaceChildren(...items.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

function drawUpdates(updates) {
  const blocks = updates.map((u) => {
    const total = Object.values(u.phases).reduce((a, b) => a + b, 0) || 1;
    const bar = el("div", { class: "bar", title: "phases" },
      ...Object.entries(u.phases).map(([phase, s]) =>
        el("span", { title: `${phase} ${seconds(s)}`, style: `width:${(100 * s) / total}%;background:${PHASE_COLOURS[phase] ?? "#999"}` })));
    const legend = el("div", { class: "legend dim" },
      ...Object.entries(u.phases).map(([phase, s]) =>
        el("span", {}, el("i", { style: `background:${PHASE_COLOURS[phase] ?? "#999"}` }), `${phase} ${seconds(s)}`)));
    const steps = el("details", {}, el("summary", { class: "dim" }, `${u.steps.length} server steps`),
      el("table", {}, el("tbody", {}, ...u.steps.map((s) =>
        el("tr", {}, el("td", {}, `+${s.at_s.toFixed(3)} s`), el("td", { class: "mono" }, s.server_id ?? ""), el("td", {}, s.what))))));
    return el("div", { class: "update", "data-update": u.update_id, "data-status": u.status },
      el("div", {},
        el("span", { class: "dim" }, `${time(u.started_at)} `), el("b", {}, `${u.model_name} → ${u.weight_version}`),
        ` ${u.strategy}/${u.pause_mode} `, el("span", { class: u.status }, u.status),
        ` in ${seconds(u.duration_s)}`, u.serving_blocked_s != null ? `, serving blocked ${seconds(u.serving_blocked_s)}` : "",
        u.message ? el("span", { class: "dim" }, ` — ${u.message}`) : ""),
      bar, legend, steps);
  });
  const target = document.getElementById("updates");
  // Keep the open/closed state of each update's steps across redraws.
  const open = new Set([...target.querySelectorAll("details[open]")].map((d) => d.closest(".update").dataset.update));
  target.replaceChildren(...(blocks.length ? blocks : [el("p", { class: "dim" }, "no update yet")]));
  for (const node of target.querySelectorAll(".update")) if (open.has(node.dataset.update)) node.querySelector("details").open = true;
}

function line(svg, values, colour, label) {
  const numbers = values.map((v) => v ?? 0);
  const top = Math.max(...numbers, 1e-9);
  const step = 600 / Math.max(values.length - 1, 1);
  const points = numbers.map((v, i) => `${(i * step).toFixed(1)},${(88 - (v / top) * 80).toFixed(1)}`).join(" ");
  const poly = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  poly.setAttribute("points", points);
  poly.setAttribute("stroke", colour);
  const caption = document.createElementNS("http://www.w3.org/2000/svg", "text");
  caption.setAttribute("x", 4);
  caption.setAttribute("y", 12);
  caption.textContent = `${label} (max ${top.toFixed(top < 10 ? 2 : 0)})`;
  svg.replaceChildren(poly, caption);
}

function drawRequests(requests) {
  const summary = document.getElementById("request-summary");
  if (!requests) {
    summary.textContent = "metrics are off on this controller (MILES_METRICS_ENABLED=false)";
    return;
  }
  line(document.getElementById("rate-chart"), requests.requests, "#0969da", "requests/s");
  line(document.getElementById("latency-chart"), requests.mean_latency_ms, "#8250df", "mean latency ms");
  const last = requests.requests.slice(-60);
  const served = last.reduce((a, b) => a + b, 0);
  const failed = requests.failed.slice(-60).reduce((a, b) => a + b, 0);
  const latencies = requests.mean_latency_ms.slice(-60).filter((v) => v != null);
  const mean = latencies.length ? latencies.reduce((a, b) => a + b, 0) / latencies.length : null;
  summary.textContent = `last minute: ${(served / 60).toFixed(2)} requests/s, ${failed} failed` +
    (mean != null ? `, mean latency ${mean.toFixed(1)} ms` : "");
}

function drawEvents(events) {
  document.querySelector("#events tbody").replaceChildren(...events.map((e) =>
    el("tr", {}, el("td", { class: "dim" }, time(e.timestamp)), el("td", {}, e.type),
      el("td", { class: "mono" }, e.servers.join(", ")), el("td", { class: "wrap" }, e.summary))));
}

async function refresh() {
  const problem = document.getElementById("problem");
  try {
    const headers = credential ? { authorization: `Bearer ${credential}` } : {};
    const response = await fetch("status", { headers, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      document.getElementById("credential").hidden = false;
      problem.hidden = true;
      return;
    }
    if (!response.ok) throw new Error(`the controller answered ${response.status}`);
    const status = await response.json();
    drawFleet(status.health);
    drawLock(status.health.lock);
    drawUpdates(status.updates);
    drawRequests(status.requests);
    drawEvents(status.events);
    problem.hidden = true;
    document.getElementById("refreshed").textContent = `updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
  } catch (error) {
    problem.textContent = `cannot reach the controller: ${error.message}; retrying`;
    problem.hidden = false;
  }
}

document.getElementById("credential").addEventListener("submit", (event) => {
  event.preventDefault();
  credential = document.getElementById("credential-key").value.trim();
  sessionStorage.setItem("miles-credential", credential);
  document.getElementById("credential").hidden = true;
  refresh();
});

async function loop() {
  await refresh();
  setTimeout(loop, POLL_MS);
}
loop();
