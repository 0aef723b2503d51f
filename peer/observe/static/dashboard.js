// Tasklet dashboard: polls /api/swarm and draws it with plain DOM and SVG (no libraries, works offline).
// Everything from the swarm is set as text (textContent, setAttribute), never parsed as markup.
"use strict";

const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";
const MAX_POINTS = 600; // circles drawn per chart; the line always shows every step

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function short(id) { return id ? String(id).slice(0, 12) : "-"; }
function fmt(x, digits) { return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "-"; }
function fmtNum(x) {
  if (typeof x !== "number" || !isFinite(x)) return "-";
  return Math.abs(x) >= 100 ? x.toFixed(0) : String(Number(x.toPrecision(3)));
}

function setText(id, text) { document.getElementById(id).textContent = text; }

function lineChart(svg, xs, ys, label) {
  svg.replaceChildren();
  const W = 560, H = 220, L = 58, R = 12, T = 10, B = 28;
  const pts = xs.map((x, i) => [x, ys[i]]).filter(([x, y]) => typeof y === "number" && isFinite(y));
  if (pts.length === 0) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no steps yet"));
    return;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const d = Math.abs(y0) * 0.05 || 1; y0 -= d; y1 += d; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  svg.appendChild(svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  svg.appendChild(svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    svg.appendChild(svgEl("text", { x: L - 6, y: py(y) + 4, "text-anchor": "end", class: "tick" }, fmtNum(y)));
  }
  [[x0, "start"], [x1, "end"]].forEach(([x, anchor]) => {
    svg.appendChild(svgEl("text", { x: px(x), y: H - 8, "text-anchor": anchor, class: "tick" }, `step ${Math.round(x)}`));
  });
  svg.appendChild(svgEl("polyline", {
    class: "series", points: pts.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" "),
  }));
  const every = Math.ceil(pts.length / MAX_POINTS);
  pts.forEach(([x, y], i) => {
    if (i % every !== 0 && i !== pts.length - 1) return;
    const c = svgEl("circle", { cx: px(x).toFixed(1), cy: py(y).toFixed(1), r: 3, class: "point", "data-step": x });
    c.appendChild(svgEl("title", {}, `step ${x}: ${label} ${fmtNum(y)}`));
    svg.appendChild(c);
  });
}

function bandwidthColour(mbps, lo, hi) {
  if (!(mbps > 0)) return "#eee";
  const a = Math.log10(lo), b = Math.log10(hi);
  const t = b > a ? (Math.log10(mbps) - a) / (b - a) : 1;
  return `hsl(${Math.round(8 + 112 * Math.max(0, Math.min(1, t)))}, 60%, 78%)`;
}

function syncText(sync) {
  if (!sync) return "";
  if (sync.period === 1) return "exact sync";
  const codec = sync.codec === "none" ? "fp32" : sync.codec;
  return `DiLoCo H=${sync.period}, ${codec}${sync.overlap ? ", overlapped" : ""}`;
}

function renderSummary(s) {
  setText("run-name", s.run ? `run ${s.run}` : "");
  const state = document.getElementById("state");
  state.textContent = s.waiting || s.state || "unknown";
  state.className = `badge ${s.state || ""}`;
  setText("step", s.step === null || s.step === undefined ? "-" : (s.steps ? `${s.step}/${s.steps}` : `${s.step}`));
  setText("loss", fmt(s.loss, 4));
  setText("tps", fmtNum(s.tokens_per_s));
  setText("sync", syncText(s.sync));
  setText("peer-count", (s.peers || []).length);
  setText("epoch", s.plan && s.plan.epoch !== null ? s.plan.epoch : "-");
  setText("freshness", s.age_s === null || s.age_s === undefined ? "" : `read ${fmt(s.age_s, 1)} s ago`);
  const err = document.getElementById("error");
  err.hidden = !s.error;
  err.textContent = s.error ? `last read failed: ${s.error}` : "";
}

function renderPlan(s, byId) {
  const table = document.getElementById("plan-grid");
  table.replaceChildren();
  const plan = s.plan || {};
  const pipes = plan.pipelines || [], stages = plan.stages || [];
  setText("plan-caption", plan.epoch ? `epoch ${plan.epoch}, ${pipes.length} replica(s) x ${stages.length} stage(s)`
    + (plan.reason ? `: ${plan.reason}` : "") : "(no plan yet)");
  if (!pipes.length) return;
  const head = el("tr");
  head.appendChild(el("th", {}, "stage (layers)"));
  pipes.forEach((_, r) => head.appendChild(el("th", {}, `replica ${r}`)));
  table.appendChild(el("thead")).appendChild(head);
  const body = table.appendChild(el("tbody"));
  stages.forEach((range, st) => {
    const row = el("tr");
    row.appendChild(el("th", {}, `stage ${st} (layers ${range[0]}–${range[1] - 1})`));
    pipes.forEach((pipe) => {
      const pid = pipe[st];
      const peer = byId[pid];
      const cell = el("td", { "data-peer-id": pid || "", title: pid || "" });
      if (pid === plan.leader) cell.className = "leader";
      cell.appendChild(el("span", {}, short(pid) + (peer ? "" : " (gone)")));
      if (peer) cell.appendChild(el("span", { class: "sub" }, `${peer.device} · ${fmtNum(peer.tflops)} TFLOP/s`
        + (peer.region ? ` · ${peer.region}` : "")));
      row.appendChild(cell);
    });
    body.appendChild(row);
  });
}

function renderPeers(s) {
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  const n = (s.peers || []).length;
  for (const p of s.peers || []) {
    const row = el("tr", { "data-peer-id": p.peer_id, class: "peer" });
    const id = el("td", { title: p.peer_id }, short(p.peer_id) + (p.leader ? " ★" : ""));
    row.appendChild(id);
    row.appendChild(el("td", {}, p.device));
    row.appendChild(el("td", { class: "num" }, fmtNum(p.tflops) + (p.emulated ? "*" : "")));
    row.appendChild(el("td", { class: "num" }, `${fmt(p.memory_gb, 1)} GB`));
    row.appendChild(el("td", {}, p.region || "-"));
    row.appendChild(el("td", { class: "num" }, p.stage ?? "-"));
    row.appendChild(el("td", { class: "num" }, p.replica ?? "-"));
    row.appendChild(el("td", {}, p.layers ? `${p.layers[0]}–${p.layers[1] - 1}` : "-"));
    row.appendChild(el("td", { class: "num", title: "share of its last step the device computed" },
                       p.compute_share == null ? "-" : `${Math.round(p.compute_share * 100)} %`));
    row.appendChild(el("td", { class: "num" }, n > 1 ? `${p.reached_by}/${n - 1} peers` : "-"));
    row.appendChild(el("td", { class: "num" }, `${fmt(p.last_seen_s, 1)} s ago`));
    row.appendChild(el("td", {}, p.endpoint));
    body.appendChild(row);
  }
}

function renderCredit(s) {
  const body = document.querySelector("#credit tbody");
  body.replaceChildren();
  const rows = s.credit || [];
  const total = rows.reduce((sum, r) => sum + r.microbatches, 0);
  for (const r of rows) {
    const row = el("tr", { "data-peer-id": r.peer_id, class: "credit" });
    row.appendChild(el("td", { title: r.peer_id }, short(r.peer_id)));
    row.appendChild(el("td", { class: "num" }, String(r.microbatches)));
    row.appendChild(el("td", { class: "num" }, total ? `${fmt(100 * r.microbatches / total, 1)} %` : "-"));
    row.appendChild(el("td", { class: "num" }, String(r.steps)));
    row.appendChild(el("td", { class: "num" }, String(r.plans)));
    row.appendChild(el("td", { class: "num" }, `${fmt(r.train_s, 1)} s`));
    row.appendChild(el("td", { class: "num" }, `${fmt(r.bytes_served / 1e6, 1)} MB`));
    row.appendChild(el("td", { class: "num" }, String(r.excluded)));
    row.appendChild(el("td", {}, r.last_exclusion || "-"));
    body.appendChild(row);
  }
}

function renderLinks(s) {
  const table = document.getElementById("links");
  table.replaceChildren();
  const peers = (s.peers || []).map((p) => p.peer_id);
  const links = {};
  const bws = [];
  for (const l of s.links || []) {
    links[`${l.src}>${l.dst}`] = l;
    if (l.bandwidth_mbps > 0) bws.push(l.bandwidth_mbps);
  }
  const lo = bws.length ? Math.min(...bws) : 1, hi = bws.length ? Math.max(...bws) : 1;
  const head = el("tr");
  head.appendChild(el("th", {}, "from \\ to"));
  peers.forEach((p) => head.appendChild(el("th", { title: p }, short(p))));
  table.appendChild(el("thead")).appendChild(head);
  const body = table.appendChild(el("tbody"));
  for (const src of peers) {
    const row = el("tr");
    row.appendChild(el("th", { title: src }, short(src)));
    for (const dst of peers) {
      const cell = el("td");
      const l = links[`${src}>${dst}`];
      if (src === dst) cell.className = "self";
      else if (l) {
        cell.style.background = bandwidthColour(l.bandwidth_mbps, lo, hi);
        cell.title = `${short(src)} → ${short(dst)}: ${fmtNum(l.bandwidth_mbps)} Mbit/s, RTT ${fmtNum(l.rtt_ms)} ms`
          + (l.measured ? "" : " (estimated)");
        cell.appendChild(el("span", {}, `${fmtNum(l.bandwidth_mbps)} Mb/s`));
        cell.appendChild(el("span", { class: "sub" }, `${fmtNum(l.rtt_ms)} ms`));
      } else cell.textContent = "·";
      row.appendChild(cell);
    }
    body.appendChild(row);
  }
  const legend = document.getElementById("links-legend");
  legend.replaceChildren();
  if (bws.length) {
    legend.appendChild(document.createTextNode(`${fmtNum(lo)} Mbit/s `));
    for (let i = 0; i <= 4; i++) {
      const v = Math.pow(10, Math.log10(lo) + (i / 4) * (Math.log10(hi) - Math.log10(lo)));
      const sw = el("span");
      sw.style.background = bandwidthColour(v, lo, hi);
      legend.appendChild(sw);
    }
    legend.appendChild(document.createTextNode(` ${fmtNum(hi)} Mbit/s`));
  } else legend.textContent = "no link measured yet";
}

function renderEvents(s) {
  const list = document.getElementById("events");
  list.replaceChildren();
  for (const e of s.events || []) {
    const item = el("li", { class: e.kind });
    item.appendChild(el("span", { class: "muted" }, new Date(e.time * 1000).toLocaleTimeString() + " "));
    item.appendChild(el("span", { class: "kind" }, e.kind));
    item.appendChild(document.createTextNode(" " + e.text));
    list.appendChild(item);
  }
}

function render(s) {
  const byId = {};
  for (const p of s.peers || []) byId[p.peer_id] = p;
  renderSummary(s);
  const h = s.history || { step: [], loss: [], tokens_per_s: [] };
  lineChart(document.getElementById("loss-chart"), h.step, h.loss, "loss");
  lineChart(document.getElementById("tps-chart"), h.step, h.tokens_per_s, "tokens/s");
  renderPlan(s, byId);
  renderPeers(s);
  renderCredit(s);
  renderLinks(s);
  renderEvents(s);
  document.body.setAttribute("data-rendered-at", String(s.time || ""));
}

async function poll() {
  try {
    const reply = await fetch("/api/swarm", { cache: "no-store" });
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    render(await reply.json());
  } catch (exc) {
    const err = document.getElementById("error");
    err.hidden = false;
    err.textContent = `cannot reach the dashboard server: ${exc}`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
