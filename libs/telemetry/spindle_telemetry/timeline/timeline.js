"use strict";
// Draws the timeline embedded in #timeline-data (model.py's Timeline as JSON) into #svg: a row per instance with
// its prefill chunks, decode batches and KV moves, a KV-use area under each row, the cluster's queues, and the
// decisions beside. Static pages zoom (wheel) and pan (drag; double-click resets); a live page polls its URL.
const NS = "http://www.w3.org/2000/svg";
const LIVE = document.body.dataset.live || "";
const ROLES = { prefill: 0, decode: 1, elastic: 2, kvstore: 3 };
const LABEL_W = 180, RIGHT = 12, AXIS_H = 26, ROW_H = 44, LANE = 26, QUEUE_H = 90;
const MOVES = { transfer: "#888", park: "#d80", reshard: "#a3c" };
let data = JSON.parse(document.getElementById("timeline-data").textContent);
let view = null; // [t0, t1] after a zoom or pan; null: the whole window
let geom = null; // the last drawing's time -> x mapping

function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

function hue(s) { // FNV-1a, spread by the golden angle: neighbouring ids get distant colours
  let h = 2166136261;
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 16777619) >>> 0;
  return Math.round((h % 1000) * 137.508) % 360;
}
const color = (rid) => `hsl(${hue(rid)},65%,52%)`;
const short = (rid) => rid.replace(/^(req-|cmpl-|chatcmpl-)/, "").slice(0, 8);
const secs = (t) => (t - data.origin).toFixed(Math.abs(t - data.origin) < 100 ? 2 : 1);

function niceStep(range, n) {
  const raw = range / n, p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

function instanceRows() {
  const rows = new Map(data.instances.map((r) => [r.id, r]));
  for (const s of data.spans) if (!rows.has(s.instance)) rows.set(s.instance, { id: s.instance, role: "?" });
  return [...rows.values()].sort((a, b) =>
    (ROLES[a.role] ?? 9) - (ROLES[b.role] ?? 9) || (a.rank ?? 0) - (b.rank ?? 0) || a.id.localeCompare(b.id));
}

function axis(svg, x, t0, t1, y, height) {
  const step = niceStep(t1 - t0, Math.max(2, Math.floor((geom.width - LABEL_W) / 90)));
  const first = Math.ceil((t0 - data.origin) / step) * step;
  for (let v = first; v + data.origin <= t1; v += step) {
    const px = x(v + data.origin);
    el("line", { x1: px, x2: px, y1: AXIS_H, y2: height, class: "grid" }, svg);
    el("text", { x: px, y, "text-anchor": "middle" }, svg, `${+v.toFixed(6)} s`);
  }
}

function kvArea(g, samples, x, t1, top, h) {
  if (!samples.length) return "";
  const yOf = (s) => top + h - (s.total ? s.used / s.total : 0) * h;
  let d = `M${x(samples[0].t)},${top + h}`;
  for (const s of samples) d += `H${x(s.t)}V${yOf(s)}`;
  el("path", { d: d + `H${x(t1)}V${top + h}Z`, fill: "rgba(40,160,120,0.45)", stroke: "rgba(20,120,90,0.8)",
    "stroke-width": 0.5, class: "kv" }, g);
  const pct = (s) => (100 * (s.total ? s.used / s.total : 0)).toFixed(0);
  const peak = samples.reduce((a, s) => (s.used > a.used ? s : a)), last = samples[samples.length - 1];
  return `KV of ${last.total} blocks: peak ${pct(peak)}%, last ${pct(last)}%`;
}

function queueChart(svg, x, t0, t1, top) {
  const last = new Map(), pts = [];
  const samples = data.queues.map((q) => ({ inst: q[0], t: q[1], waiting: q[2], tokens: q[3] }));
  samples.sort((a, b) => a.t - b.t);
  for (const q of samples.filter((q) => q.t <= t1)) {
    last.set(q.inst, q);
    let w = 0, tok = 0;
    for (const v of last.values()) { w += v.waiting; tok += v.tokens; }
    if (pts.length && pts[pts.length - 1].t === q.t) pts.pop();
    pts.push({ t: q.t, w, tok });
  }
  el("text", { x: 6, y: top + 12 }, svg, "queues (cluster)");
  el("rect", { x: LABEL_W, y: top, width: geom.width - LABEL_W - RIGHT, height: QUEUE_H, fill: "none", stroke: "#ccc" }, svg);
  const maxW = Math.max(1, ...pts.map((p) => p.w)), maxT = Math.max(1, ...pts.map((p) => p.tok));
  for (const [key, max, stroke, name] of [["w", maxW, "#e60", "waiting"], ["tok", maxT, "#63c", "queued tokens"]]) {
    let d = "";
    for (const p of pts) {
      const y = top + QUEUE_H - 4 - (p[key] / max) * (QUEUE_H - 12);
      d += d ? `H${x(Math.max(p.t, t0))}V${y}` : `M${x(Math.max(p.t, t0))},${y}`;
    }
    if (d) el("path", { d: d + `H${x(t1)}`, fill: "none", stroke, "stroke-width": 1.5 }, svg);
    el("text", { x: 6, y: top + (key === "w" ? 30 : 46), class: "small", fill: stroke }, svg, `${name}: max ${max}`);
  }
}

function stack(spans) { // prompts an instance ran at the same time (one batch) share its prefill lane
  let cluster = [], ends = [], clusterEnd = -Infinity;
  const close = () => { for (const s of cluster) s.lanes = ends.length; cluster = []; ends = []; };
  for (const s of [...spans].sort((a, b) => a.start - b.start)) {
    if (s.start >= clusterEnd - 1e-9) { close(); clusterEnd = -Infinity; }
    let k = ends.findIndex((e) => e <= s.start + 1e-9);
    if (k < 0) { k = ends.length; ends.push(s.end); } else ends[k] = s.end;
    s.lane = k;
    cluster.push(s);
    clusterEnd = Math.max(clusterEnd, s.end);
  }
  close();
}

function draw() {
  const svg = document.getElementById("svg");
  svg.replaceChildren();
  const width = Math.max(600, document.getElementById("chart").clientWidth);
  let [t0, t1] = view || [data.start, data.end];
  if (!(t1 > t0)) t1 = t0 + 1;
  const x = (t) => LABEL_W + ((t - t0) / (t1 - t0)) * (width - LABEL_W - RIGHT);
  geom = { width, t0, t1 };
  const rows = instanceRows();
  const height = AXIS_H + rows.length * ROW_H + QUEUE_H + AXIS_H + 8;
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  axis(svg, x, t0, t1, AXIS_H - 8, height - AXIS_H);
  const top = new Map(rows.map((r, i) => [r.id, AXIS_H + i * ROW_H]));
  const groups = new Map(), kv = new Map();
  for (const s of data.kv) {
    const [inst, t, used, total] = s;
    if (!kv.has(inst)) kv.set(inst, []);
    if (t <= t1) kv.get(inst).push({ t: Math.max(t, t0), used, total });
  }
  for (const r of rows) {
    const y = top.get(r.id), g = el("g", { class: "row", "data-instance": r.id, "data-role": r.role }, svg);
    groups.set(r.id, g);
    el("rect", { x: LABEL_W, y, width: width - LABEL_W - RIGHT, height: LANE, fill: "#f7f7f7" }, g);
    const kvText = kvArea(g, kv.get(r.id) || [], x, t1, y + LANE + 6, ROW_H - LANE - 9);
    el("text", { x: 6, y: y + 12 }, g, r.id);
    const info = [r.role, r.node, r.group].filter(Boolean).join(" · ");
    el("text", { x: 6, y: y + 25, class: "small" }, g, info);
    el("text", { x: 6, y: y + 37, class: "small" }, g, kvText);
  }
  const shown = data.spans.filter((s) => s.end >= t0 && s.start <= t1 && top.has(s.instance));
  const maxBatch = Math.max(1, ...shown.filter((s) => s.kind === "decode").map((s) => s.batch || 0));
  const counts = { prefill: 0, decode: 0, moves: 0 }, requests = new Set(), links = new Map();
  for (const r of rows) stack(shown.filter((s) => s.kind === "prefill" && s.instance === r.id));
  for (const s of shown) {
    const y = top.get(s.instance), g = groups.get(s.instance);
    const x0 = Math.max(LABEL_W, x(s.start)), w = Math.max(0.8, Math.min(x(s.end), width - RIGHT) - x0);
    const rids = s.requests || [];
    let rect;
    if (s.kind === "prefill") {
      counts.prefill++;
      rids.forEach((r) => requests.add(r));
      const sp = s.sp || 1, n = s.chunks || 1;
      const tokens = (s.token_end ? ` tokens ${s.token_start || 0}-${s.token_end}` : "") + (n > 1 ? ` (${n} chunks)` : "");
      const h = 12 / s.lanes, py = y + 1 + s.lane * h;
      rect = el("rect", { x: x0, y: py, width: w, height: h, fill: color(rids[0] || s.label || "?"),
        stroke: sp > 1 && w >= 4 ? "#333" : "none", "stroke-width": 0.6, class: "span prefill", "data-kind": "prefill" }, g);
      el("title", {}, rect, `${rids.join(", ")} prefill${tokens}${sp > 1 ? ` SP ${sp}: ${(s.group || []).join(", ")}` : ""}` +
        ` ${secs(s.start)}-${secs(s.end)} s ${s.label || ""}`);
      if (w > 46 && h >= 9) el("text", { x: x0 + 2, y: py + 9, class: "on-span" }, g,
        short(rids[0] || "") + (sp > 1 ? ` SP${sp}` : ""));
      if ((s.group || []).length > 1 && w >= 4) { // narrower: zoom in to see the links
        const key = `${rids[0]}|${s.token_start}|${s.group.join(",")}`;
        if (!links.has(key)) links.set(key, { x: x0, ys: [], c: color(rids[0] || "") });
        links.get(key).ys.push(py + h / 2);
      }
    } else if (s.kind === "decode") {
      counts.decode++;
      const f = (s.batch || 0) / maxBatch, h = Math.max(2, 12 * f);
      rect = el("rect", { x: x0, y: y + LANE - 1 - h, width: w, height: h, fill: `rgba(45,45,70,${0.25 + 0.75 * f})`,
        class: "span decode", "data-kind": "decode" }, g);
      el("title", {}, rect, `decode batch ${s.batch} ${secs(s.start)}-${secs(s.end)} s: ${rids.slice(0, 12).join(", ")}` +
        (rids.length > 12 ? ", ..." : "") + (s.label ? ` ${s.label}` : ""));
    } else {
      counts.moves++;
      rect = el("rect", { x: x0, y: y + LANE + 1, width: w, height: 4, fill: MOVES[s.kind] || "#999",
        class: `span ${s.kind}`, "data-kind": s.kind }, g);
      el("title", {}, rect, `${s.kind} ${rids.join(", ")} ${secs(s.start)}-${secs(s.end)} s ${s.label || ""}`);
    }
  }
  for (const l of links.values()) {
    if (l.ys.length < 2) continue;
    el("line", { x1: l.x + 1, x2: l.x + 1, y1: Math.min(...l.ys), y2: Math.max(...l.ys), stroke: l.c,
      "stroke-width": 1.5, "stroke-dasharray": "3,2", "stroke-opacity": 0.85, class: "sp-link" }, svg);
  }
  queueChart(svg, x, t0, t1, AXIS_H + rows.length * ROW_H + 4);
  axis(svg, x, t0, t1, height - 8, height - AXIS_H);
  decisions(t0, t1);
  header(rows, counts, requests);
  Object.assign(document.body.dataset, { drawn: "1", instances: rows.map((r) => r.id).join(" "),
    prefillSpans: counts.prefill, decodeSpans: counts.decode, requests: requests.size });
}

function decisions(t0, t1) {
  const ol = document.getElementById("decisions");
  ol.replaceChildren();
  const shown = data.decisions.filter((d) => d.t >= t0 && d.t <= t1).slice(-300).reverse();
  for (const d of shown) {
    const li = document.createElement("li");
    const t = document.createElement("span");
    t.className = "t";
    t.textContent = `${secs(d.t)} s`;
    const who = document.createElement("b");
    who.textContent = d.request_id || "";
    li.append(t, who, ` ${d.text || ""}`);
    if (d.strategy) li.title = d.strategy;
    ol.appendChild(li);
  }
}

function header(rows, counts, requests) {
  document.getElementById("title").textContent = data.title || "Spindle timeline";
  document.title = data.title || "Spindle timeline";
  const [t0, t1] = [geom.t0, geom.t1];
  document.getElementById("summary").textContent = `${data.strategy ? data.strategy + " · " : ""}${rows.length} ` +
    `instances · ${requests.size} requests prefilled · ${counts.prefill} prefill spans · ${counts.decode} decode spans · ` +
    `${secs(t0)}-${secs(t1)} s${LIVE ? " · live" : view ? " · zoomed (double-click resets)" : ""}`;
  document.getElementById("notes").textContent = (data.notes || []).join(" ");
}

function zoomAndPan(svg) {
  const tAt = (px) => geom.t0 + ((px - LABEL_W) / (geom.width - LABEL_W - RIGHT)) * (geom.t1 - geom.t0);
  let drag = null;
  svg.addEventListener("wheel", (e) => {
    if (LIVE) return;
    e.preventDefault();
    const t = tAt(e.offsetX), f = e.deltaY > 0 ? 1.25 : 0.8;
    view = [t - (t - geom.t0) * f, t + (geom.t1 - t) * f];
    draw();
  }, { passive: false });
  svg.addEventListener("mousedown", (e) => { if (!LIVE) drag = { px: e.offsetX, t0: geom.t0, t1: geom.t1 }; });
  window.addEventListener("mouseup", () => { drag = null; });
  svg.addEventListener("mousemove", (e) => {
    if (!drag) return;
    const dt = ((e.offsetX - drag.px) / (geom.width - LABEL_W - RIGHT)) * (drag.t1 - drag.t0);
    view = [drag.t0 - dt, drag.t1 - dt];
    draw();
  });
  svg.addEventListener("dblclick", () => { view = null; draw(); });
}

function poll() { // the server's window: the last minutes, sliding
  fetch(LIVE)
    .then((r) => (r.ok ? r.json() : Promise.reject(new Error(`HTTP ${r.status}`))))
    .then((d) => {
      data = d;
      draw();
      document.body.dataset.updates = (+document.body.dataset.updates || 0) + 1;
    })
    .catch((e) => { document.getElementById("notes").textContent = `live update failed: ${e.message}`; })
    .finally(() => setTimeout(poll, 1000));
}

draw();
zoomAndPan(document.getElementById("svg"));
window.addEventListener("resize", draw);
if (LIVE) setTimeout(poll, 1000);
