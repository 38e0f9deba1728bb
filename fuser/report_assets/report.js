// fuser report: renders the embedded JSON (id "fuser-data") into the page. No network.
// Drawings are made when a fusion is opened (lazy), so a model with thousands of fusions
// opens quickly; lists are filled in pages and filtered by one text box.
(() => {
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const PAGE = 200;

const reportError = window.fuserReportError;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) if (c != null) node.append(c);
  return node;
}

function titled(node, text) {
  node.append(svg("title", {}, text));
  return node;
}

const fmt = (x) => Math.round(x).toLocaleString("en-US");
const speed = (x) => (x == null || !isFinite(x) ? "–" : x.toFixed(2) + "×");
// Long names keep their tail, which tells nodes of one layer apart ("…/layer.3/MatMul_1").
const clip = (s, n) => (s.length <= n ? s : "…" + s.slice(s.length - n + 1));

function section(id, title, open, ...body) {
  const details = el("details", { id }, el("summary", { text: title }), el("div", { class: "body" }, ...body));
  details.open = open;
  return el("section", {}, details);
}

// -- summary -----------------------------------------------------------------------------

function summaryTable(data) {
  const table = el("table", { id: "summary" });
  table.append(el("tr", {},
    el("th", { text: "pattern" }), el("th", { class: "num", text: "fused" }),
    el("th", { class: "num", text: "near-misses" }), el("th", { class: "num", text: "predicted speedup" }),
    el("th", { class: "num", text: "simulated cycles saved" })));
  for (const row of data.summary) {
    const p = row.predicted_speedup;
    table.append(el("tr", {},
      el("td", { text: row.pattern }), el("td", { class: "num", text: String(row.fusions) }),
      el("td", { class: "num", text: String(row.near_misses) }),
      el("td", { class: "num", text: p ? `${speed(p[0])} – ${speed(p[1])}` : "–" }),
      el("td", { class: "num", text: row.simulated_saved_cycles == null ? "–" : fmt(row.simulated_saved_cycles) })));
  }
  return table;
}

// -- timelines ---------------------------------------------------------------------------

function timelines(data) {
  const t = data.timelines;
  if (!t) return el("p", { class: "empty", text: "not simulated (--no-simulate)" });
  const width = 1300, lane = 34, left = 90, right = 200, top = 8;
  const span = Math.max(t.original.total_cycles, t.fused.total_cycles, 1);
  const scale = (width - left - right) / span;
  const root = svg("svg", { viewBox: `0 0 ${width} ${top + 2 * (lane + 14) + 24}`, width: "100%", id: "timeline" });
  const lanes = [["original", t.original, "var(--replaced)"], ["fused", t.fused, "var(--fused)"]];
  lanes.forEach(([name, tl, color], row) => {
    const y = top + row * (lane + 14);
    root.append(svg("text", { x: 0, y: y + lane / 2 + 4, class: "lane-label" }, name));
    root.append(svg("rect", { x: left, y, width: tl.total_cycles * scale, height: lane, fill: "#eef1f5" }));
    // Nodes narrower than a pixel are merged with their neighbours of the same kind: a 10k-node
    // model stays a few thousand rectangles.
    let run = null;
    const flush = () => {
      if (!run) return;
      const r = svg("rect", { x: left + run.start * scale, y, width: Math.max((run.end - run.start) * scale, 0.6),
        height: lane, fill: run.kind ? color : "var(--plain)", stroke: "#fff", "stroke-width": 0.3 });
      titled(r, run.names.length === 1 ? `${run.names[0]} (${run.op}): ${fmt(run.end - run.start)} cycles`
        : `${run.names.length} nodes, ${fmt(run.end - run.start)} cycles`);
      root.append(r);
      run = null;
    };
    for (const [start, cycles, nodeName, op, kind] of tl.nodes) {
      if (cycles <= 0) continue;
      const wide = cycles * scale >= 1;
      if (run && (wide || run.wide || run.kind !== kind || (run.end - run.start) * scale >= 1)) flush();
      if (!run) run = { start, end: start, kind, wide, names: [], op };
      run.end = start + cycles;
      run.names.push(nodeName);
    }
    flush();
    root.append(svg("text", { x: left + tl.total_cycles * scale + 8, y: y + lane / 2 + 4, class: "lane-label" },
      `${tl.total_us.toFixed(1)} µs, ${tl.launches} launches`));
  });
  const axisY = top + 2 * (lane + 14) + 4;
  const us = span / t.clock_hz * 1e6;
  const step = niceStep(us / 8);
  for (let v = 0; v <= us + 1e-9; v += step) {
    const x = left + (v * 1e-6 * t.clock_hz) * scale;
    root.append(svg("line", { x1: x, x2: x, y1: axisY - 4, y2: axisY, stroke: "#9aa4b2" }));
    root.append(svg("text", { x, y: axisY + 12, "text-anchor": "middle", class: "lane-label" }, `${+v.toFixed(3)} µs`));
  }
  const ratio = t.fused.total_cycles > 0 ? t.original.total_cycles / t.fused.total_cycles : null;
  const legend = el("div", { class: "legend" },
    el("span", {}, el("i", { style: "background: var(--replaced)" }), "nodes that were fused"),
    el("span", {}, el("i", { style: "background: var(--fused)" }), "fused nodes"),
    el("span", {}, el("i", { style: "background: var(--plain)" }), "other nodes"),
    el("span", { text: `whole model: ${speed(ratio)} on ${data.target}` + dims(t.dims) }));
  return el("div", {}, legend, root, opTable(t));
}

function dims(d) {
  const parts = Object.entries(d || {}).map(([k, v]) => `${k}=${v}`);
  return parts.length ? ` (dims ${parts.join(", ")})` : "";
}

function niceStep(x) {
  const p = Math.pow(10, Math.floor(Math.log10(x || 1)));
  for (const m of [1, 2, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

function opTable(t) {
  const acc = new Map();
  const add = (tl, i) => {
    for (const [, cycles, , op] of tl.nodes) {
      const row = acc.get(op) || [0, 0, 0, 0];
      row[i] += cycles; row[i + 2] += 1;
      acc.set(op, row);
    }
  };
  add(t.original, 0); add(t.fused, 1);
  const rows = [...acc.entries()].sort((a, b) => Math.max(b[1][0], b[1][1]) - Math.max(a[1][0], a[1][1]));
  const table = el("table", { id: "ops" });
  table.append(el("tr", {}, el("th", { text: "op" }), el("th", { class: "num", text: "nodes before" }),
    el("th", { class: "num", text: "cycles before" }), el("th", { class: "num", text: "nodes after" }),
    el("th", { class: "num", text: "cycles after" })));
  for (const [op, [b, a, nb, na]] of rows.slice(0, 20)) {
    table.append(el("tr", {}, el("td", { class: "mono", text: op }), el("td", { class: "num", text: String(nb) }),
      el("td", { class: "num", text: fmt(b) }), el("td", { class: "num", text: String(na) }),
      el("td", { class: "num", text: fmt(a) })));
  }
  return el("details", {}, el("summary", { text: `time per op type (${rows.length} types, most expensive first)` }), table);
}

// -- one fusion's drawing ----------------------------------------------------------------

const BOX_W = 176, BOX_H = 36, GAP_X = 22, GAP_Y = 20, PILL_W = 124, PILL_GAP = 8, PILL_H = 20;
// Where the i-th of n value pills starts in a drawing `width` wide, and the row's width.
const pillX = (width, n, i) => (width - pillsWidth(n)) / 2 + PILL_GAP + i * (PILL_W + PILL_GAP);
const pillsWidth = (n) => n * (PILL_W + PILL_GAP) + PILL_GAP;

function layers(sub) {
  // Longest path from the subgraph's sources: a layered drawing, producers above readers.
  const n = sub.nodes.length, layer = new Array(n).fill(0);
  for (let pass = 0; pass < n; pass++) {
    let changed = false;
    for (const [a, b] of sub.edges) if (layer[b] < layer[a] + 1) { layer[b] = layer[a] + 1; changed = true; }
    if (!changed) break;
  }
  return layer;
}

function drawSubgraph(sub) {
  const layer = layers(sub);
  const rows = [];
  layer.forEach((l, k) => (rows[l] = rows[l] || []).push(k));
  // Order each row by the mean position of its producers (one barycentre sweep is enough here).
  const x = new Array(sub.nodes.length).fill(0);
  rows.forEach((row, l) => {
    if (l > 0) {
      const bary = (k) => {
        const ps = sub.edges.filter((e) => e[1] === k).map((e) => x[e[0]]);
        return ps.length ? ps.reduce((s, v) => s + v, 0) / ps.length : 0;
      };
      row.sort((a, b) => bary(a) - bary(b));
    }
    row.forEach((k, i) => (x[k] = i));
  });
  const cols = Math.max(1, ...rows.map((r) => r.length));
  const width = Math.max(cols * (BOX_W + GAP_X) + GAP_X, pillsWidth(sub.inputs.length), pillsWidth(sub.outputs.length));
  const pos = (k) => {
    const row = rows[layer[k]];
    const offset = (width - row.length * (BOX_W + GAP_X) + GAP_X) / 2;
    return [offset + x[k] * (BOX_W + GAP_X), PILL_H + GAP_Y + layer[k] * (BOX_H + GAP_Y)];
  };
  const height = PILL_H * 2 + GAP_Y * 2 + rows.length * (BOX_H + GAP_Y) - GAP_Y;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "subgraph" });
  root.append(arrowHead());
  const edges = svg("g", { stroke: "#8d97a5", fill: "none" });
  root.append(edges);
  const pills = (values, y, anchor) => values.map((v, i) => {
    const px = pillX(width, values.length, i);
    root.append(pill(v.value, px, y));
    return [px + PILL_W / 2, anchor ? y + PILL_H : y];
  });
  const inAt = pills(sub.inputs, 0, true);
  const outY = height - PILL_H;
  const outAt = pills(sub.outputs, outY, false);
  sub.inputs.forEach((v, i) => v.to.forEach((k) => edges.append(edge(inAt[i], topOf(pos(k))))));
  for (const [a, b, value] of sub.edges) edges.append(titled(edge(bottomOf(pos(a)), topOf(pos(b))), value));
  sub.outputs.forEach((v, i) => edges.append(edge(bottomOf(pos(v.from)), outAt[i])));
  sub.nodes.forEach((node, k) => root.append(box(node.op, node.name, ...pos(k), "#fff", "#9aa4b2")));
  return root;
}

function drawFused(f, sub) {
  const fused = f.fused;
  const ins = fused.inputs.map((v) => ({ value: v })), outs = fused.outputs.map((v) => ({ value: v }));
  const width = Math.max(BOX_W + 2 * GAP_X, pillsWidth(ins.length), pillsWidth(outs.length));
  const height = PILL_H * 2 + GAP_Y * 2 + BOX_H;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "fused" });
  root.append(arrowHead());
  const edges = svg("g", { stroke: "#8d97a5", fill: "none" });
  root.append(edges);
  const at = [(width - BOX_W) / 2, PILL_H + GAP_Y];
  ins.forEach((v, i) => {
    const px = pillX(width, ins.length, i);
    root.append(pill(v.value, px, 0));
    edges.append(edge([px + PILL_W / 2, PILL_H], topOf(at)));
  });
  outs.forEach((v, i) => {
    const px = pillX(width, outs.length, i);
    root.append(pill(v.value, px, height - PILL_H));
    edges.append(edge(bottomOf(at), [px + PILL_W / 2, height - PILL_H]));
  });
  root.append(box(fused.op, fused.name, ...at, "#e3f4ec", "var(--fused)"));
  return root;
}

const topOf = ([x, y]) => [x + BOX_W / 2, y];
const bottomOf = ([x, y]) => [x + BOX_W / 2, y + BOX_H];

function edge([x1, y1], [x2, y2]) {
  const m = (y1 + y2) / 2;
  return svg("path", { d: `M${x1},${y1} C${x1},${m} ${x2},${m} ${x2},${y2 - 2}`, "marker-end": "url(#arrow)" });
}

function arrowHead() {
  return svg("defs", {}, svg("marker", { id: "arrow", viewBox: "0 0 8 8", refX: 7, refY: 4, markerWidth: 7,
    markerHeight: 7, orient: "auto" }, svg("path", { d: "M0,0 L8,4 L0,8 z", fill: "#8d97a5" })));
}

function box(op, name, x, y, fill, stroke) {
  const g = svg("g", {});
  g.append(svg("rect", { x, y, width: BOX_W, height: BOX_H, rx: 6, fill, stroke }));
  g.append(svg("text", { x: x + BOX_W / 2, y: y + 15, "text-anchor": "middle", "font-weight": 600, "font-size": 13 }, op || "?"));
  g.append(svg("text", { x: x + BOX_W / 2, y: y + 29, "text-anchor": "middle", "font-size": 10, fill: "#5f6b7a",
    "font-family": "ui-monospace, Menlo, monospace" }, clip(name, 28)));
  return titled(g, `${name} (${op})`);
}

function pill(value, x, y) {
  const g = svg("g", {});
  g.append(svg("rect", { x, y, width: PILL_W, height: PILL_H, rx: PILL_H / 2, fill: "#f0f3f7", stroke: "#c5ccd6" }));
  g.append(svg("text", { x: x + PILL_W / 2, y: y + 14, "text-anchor": "middle", "font-size": 10,
    "font-family": "ui-monospace, Menlo, monospace" }, clip(value, 20)));
  return titled(g, value);
}

function fusionDetail(f) {
  const detail = el("div", { class: "detail" });
  const drawing = el("div", { class: "drawing" });
  if (f.subgraph) {
    drawing.append(el("figure", {}, drawSubgraph(f.subgraph), el("figcaption", { text: `replaced: ${f.nodes.length} nodes` +
      (f.subgraph.weights ? `, ${f.subgraph.weights} weights` : "") })));
  }
  if (f.subgraph && f.fused) drawing.append(el("div", { class: "arrow", text: "⟶" }));
  if (f.fused) drawing.append(el("figure", {}, drawFused(f), el("figcaption", { text: "fused" + (f.fused.weights ? `: ${f.fused.weights} weights` : "") })));
  if (!f.subgraph) drawing.append(el("p", { class: "empty", text: `inside subgraph ${f.graph}: not drawn` }));
  detail.append(drawing);
  const table = el("table", {});
  table.append(el("tr", {}, el("th", { text: "replaced nodes" }), el("th", { text: "op" })));
  f.nodes.forEach((name, k) => table.append(el("tr", {}, el("td", { class: "names", text: name }),
    el("td", { class: "mono", text: f.subgraph ? f.subgraph.nodes[k].op : "" }))));
  detail.append(table);
  const facts = [];
  if (f.prediction) facts.push(`predicted: ${fmt(f.prediction.unfused_cycles)} → ${fmt(f.prediction.fused_cycles)} cycles (${speed(f.prediction.speedup)})`);
  if (f.simulated) facts.push(`simulated: ${fmt(f.simulated.unfused_cycles)} → ${fmt(f.simulated.fused_cycles)} cycles (${speed(f.simulated.speedup)})`);
  const attrs = Object.entries(f.attributes).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ");
  if (attrs) facts.push(`attributes: ${attrs}`);
  facts.push(...f.notes);
  detail.append(el("ul", { class: "notes" }, ...facts.map((t) => el("li", { text: t }))));
  return detail;
}

function fusionRow(f) {
  const details = el("details", { class: "fusion", id: `fusion-${f.id}`, "data-pattern": f.pattern });
  const p = f.prediction ? f.prediction.speedup : null, s = f.simulated ? f.simulated.speedup : null;
  details.append(el("summary", {},
    el("span", { class: "tag", text: f.pattern }), el("span", { class: "tag op", text: f.op }),
    el("span", { class: "name", text: f.node }),
    el("span", { class: "tag speed", text: `${f.nodes.length} nodes` }),
    el("span", { class: "tag speed", title: "predicted by the cost model", text: `pred ${speed(p)}` }),
    el("span", { class: "tag speed", title: "simulated on the target", text: `sim ${speed(s)}` })));
  details.addEventListener("toggle", () => {
    if (details.open && !details.dataset.drawn) {
      details.dataset.drawn = "1";
      details.append(fusionDetail(f));
    }
  });
  return details;
}

function missRow(r) {
  return el("tr", { id: `miss-${r.id}`, "data-pattern": r.pattern },
    el("td", { text: r.pattern }), el("td", { class: "names", text: r.nodes.join(", ") }),
    el("td", { class: "reason", text: (r.graph ? `[${r.graph}] ` : "") + r.reason }),
    el("td", { class: "mono", text: r.value || "" }));
}

// -- lists with a filter -----------------------------------------------------------------

function searchText(item) {
  return [item.pattern, item.op || "", item.node || "", item.reason || "", ...item.nodes].join(" ").toLowerCase();
}

function pagedList(items, container, make, noun) {
  // Items matching the filter, PAGE at a time; rows already made are kept and re-shown.
  const made = new Map();
  const count = el("span", { class: "count" });
  const more = el("button", { class: "more", type: "button" });
  let shown = [], limit = PAGE;
  const render = () => {
    container.replaceChildren();
    for (const item of shown.slice(0, limit)) {
      if (!made.has(item.id)) made.set(item.id, make(item));
      container.append(made.get(item.id));
    }
    const visible = Math.min(limit, shown.length);
    count.textContent = shown.length === items.length ? `${visible} of ${items.length} ${noun} shown`
      : `${visible} of ${shown.length} matching ${noun} shown (${items.length} in all)`;
    more.textContent = `show ${Math.min(PAGE, shown.length - limit)} more`;
    more.classList.toggle("hidden", shown.length <= limit);
  };
  more.addEventListener("click", () => { limit += PAGE; render(); });
  const keys = items.map(searchText);
  return {
    count, more,
    filter(words) {
      shown = items.filter((_, i) => words.every((w) => keys[i].includes(w)));
      limit = PAGE;
      render();
    },
  };
}

function build(data) {
  const app = document.getElementById("app");
  const header = el("header", {},
    el("h1", { text: `fuser report: ${data.input}` }),
    el("div", { class: "meta", text: `target ${data.target} · fuser ${data.fuser_version} · schema ${data.schema_version}` }));
  const t = data.timelines;
  const stat = (value, label) => el("div", { class: "stat" }, el("b", { text: value }), el("span", { text: label }));
  const stats = el("div", { class: "stats" },
    stat(`${data.nodes_before} → ${data.nodes_after}`, "nodes"),
    stat(String(data.fusions.length), "fusions"), stat(String(data.near_misses.length), "near-misses"));
  if (t) stats.append(stat(`${t.original.total_us.toFixed(1)} → ${t.fused.total_us.toFixed(1)} µs`, "simulated time"),
    stat(speed(t.fused.total_cycles > 0 ? t.original.total_cycles / t.fused.total_cycles : null), "whole-model speedup"));
  header.append(stats);

  const filter = el("input", { type: "search", id: "filter", placeholder: "filter by pattern, op, node name or reason (words AND-ed)" });
  const expand = el("button", { type: "button", text: "open shown" });
  const collapse = el("button", { type: "button", text: "close all" });
  const fusionBox = el("div", { id: "fusions" }), missBody = el("tbody", {});
  const fusions = pagedList(data.fusions, fusionBox, fusionRow, "fusions");
  const misses = pagedList(data.near_misses, missBody, missRow, "near-misses");
  const missTable = el("table", { id: "near-misses" }, el("thead", {}, el("tr", {}, el("th", { text: "pattern" }),
    el("th", { text: "nodes" }), el("th", { text: "reason" }), el("th", { text: "value" }))), missBody);
  expand.addEventListener("click", () => fusionBox.querySelectorAll("details.fusion").forEach((d) => (d.open = true)));
  collapse.addEventListener("click", () => fusionBox.querySelectorAll("details.fusion").forEach((d) => (d.open = false)));
  const apply = () => {
    const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
    fusions.filter(words);
    misses.filter(words);
  };
  filter.addEventListener("input", apply);
  // report.html?filter=words opens the page filtered (a link to what one is looking at).
  filter.value = new URLSearchParams(window.location.search).get("filter") || "";
  apply();

  const main = el("main", {},
    section("summary-section", "Summary per pattern", true, summaryTable(data)),
    section("timeline-section", `Simulated timeline on ${data.target}: original and fused`, true, timelines(data)),
    el("div", { class: "toolbar" }, filter, expand, collapse),
    section("fusions-section", `Fusions (${data.fusions.length})`, true,
      el("div", { class: "toolbar" }, fusions.count), fusionBox, fusions.more,
      data.fusions.length ? null : el("p", { class: "empty", text: "nothing was fused" })),
    section("near-misses-section", `Near-misses (${data.near_misses.length})`, true,
      el("div", { class: "toolbar" }, misses.count), data.near_misses.length ? missTable : el("p", { class: "empty", text: "none" }),
      misses.more));
  app.replaceChildren(header, main);
  // Small reports open with every fusion drawn; large ones draw on demand.
  if (data.fusions.length <= 12) fusionBox.querySelectorAll("details.fusion").forEach((d) => (d.open = true));
  // report.html#fusion-7 opens that fusion and scrolls to it (if it is on the page shown).
  const linked = window.location.hash && document.getElementById(window.location.hash.slice(1));
  if (linked && linked.matches("details.fusion")) { linked.open = true; linked.scrollIntoView(); }
  document.body.dataset.ready = "1";
}

try {
  build(JSON.parse(document.getElementById("fuser-data").textContent));
} catch (e) {
  reportError(e && e.stack ? e.stack : String(e));
}
})();
