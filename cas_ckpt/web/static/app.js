// cas-ckpt browser view: plain JavaScript, no library, nothing fetched from anywhere but this
// server. Each page (runs, run, checkpoint, diff, storage) is drawn from the JSON API under
// /ui/api/. Charts and the commit graph are SVG. When a page has drawn what it first shows, it sets
// <body data-ready="PAGE">; parts that arrive later (norms, storage) set data-state="done".

const SVG_NS = "http://www.w3.org/2000/svg";
const PAGE = 100;
const GRAPH_PAGE = 200;
const NORMS_BATCH = 50;
const MAX_DOTS = 400;  // series longer than this are drawn as a line only
const LANE = 14;
const ROW = 24;
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
                 "#e377c2", "#7f7f7f", "#bcbd22"];

// -- small helpers --------------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  node.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  node.append(...children.flat().filter((c) => c !== null && c !== undefined));
  return node;
}

function setAttrs(node, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.setAttribute("class", value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
}

function url(path, params = {}) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== null && value !== undefined && value !== "" && value !== false) query.set(key, value);
  }
  const text = query.toString();
  return text ? `${path}?${text}` : path;
}

async function api(path, params = {}) {
  const response = await fetch(url(`/ui/api/${path}`, params), { credentials: "same-origin" });
  let body;
  try {
    body = await response.json();
  } catch {
    throw new Error(`${response.status} ${response.statusText}`);
  }
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

function number(value) {  // the API writes non-finite floats as "nan", "inf", "-inf"
  if (value === "nan") return NaN;
  if (value === "inf") return Infinity;
  if (value === "-inf") return -Infinity;
  return value;
}

function fmt(value) {
  value = number(value);
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isNaN(value)) return "NaN";
  if (!Number.isFinite(value)) return value > 0 ? "inf" : "-inf";
  if (Number.isInteger(value) && Math.abs(value) < 1e15) return String(value);
  return Number(value.toPrecision(4)).toString();
}

function bytes(n) {
  if (n === null || n === undefined) return "…";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function when(seconds) {
  const d = new Date(seconds * 1000);
  const pad = (x) => String(x).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

const short = (cid) => cid.slice(0, 16);
const color = (i) => PALETTE[i % PALETTE.length];
const main = () => document.getElementById("main");

function show(...children) {  // the page's content: everything but null and undefined
  main().replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}

function metricsText(metrics) {
  return Object.entries(metrics || {}).map(([k, v]) => `${k}=${fmt(v)}`).join(" ");
}

function checkpointLink(cid, ref, text) {
  return el("a", { href: url("/ui/checkpoint", { target: cid, ref }), class: "mono" }, text || short(cid));
}

function runLink(ref) {
  return el("a", { href: url("/ui/run", { ref }) }, ref);
}

function ready(page) {  // milliseconds since the navigation began, for the tests' timings
  document.body.dataset.readyMs = Math.round(performance.now());
  document.body.dataset.ready = page;
}

function fail(error) {
  show(el("p", { class: "error", id: "error" }, error.message || String(error)));
  ready("error");
}

function pager(total, offset, limit, go) {
  const last = Math.min(offset + limit, total);
  return el("div", { class: "pager" },
    el("button", { class: "prev", disabled: offset <= 0, onclick: () => go(Math.max(0, offset - limit)) }, "‹ Previous"),
    el("span", { class: "range" }, total ? `${offset + 1}–${last} of ${total}` : "none"),
    el("button", { class: "next", disabled: last >= total, onclick: () => go(offset + limit) }, "Next ›"));
}

function replaceQuery(params) {
  history.replaceState(null, "", url(location.pathname, params));
}

function debounce(fn, ms) {
  let timer;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
}

// -- runs -----------------------------------------------------------------------------------------
async function runsPage(query) {
  const state = { prefix: query.get("prefix") || "", every: query.get("every") === "1",
                  offset: Number(query.get("offset")) || 0 };
  const selected = new Set();
  const body = el("tbody");
  const table = el("table", { id: "runs" },
    el("thead", {}, el("tr", {}, el("th", {}, ""), el("th", {}, "Ref"), el("th", { class: "num" }, "Step"),
      el("th", {}, "Time"), el("th", {}, "Metrics"), el("th", { class: "num" }, "Kept steps"),
      el("th", { class: "num" }, "Stored"), el("th", { class: "num" }, "Only in this run"))), body);
  const pages = el("div");
  const compare = el("button", { id: "compare", disabled: true,
    onclick: () => { location.href = url("/ui/run", { refs: [...selected].join(",") }); } }, "Compare selected runs");
  const filter = el("input", { type: "search", id: "prefix", placeholder: "filter by prefix, e.g. runs/",
                               value: state.prefix });
  const every = el("input", { type: "checkbox", id: "every", checked: state.every });
  filter.addEventListener("input", debounce(() => { state.prefix = filter.value; state.offset = 0; load(); }, 250));
  every.addEventListener("change", () => { state.every = every.checked; state.offset = 0; load(); });
  show(el("h1", {}, "Runs"),
    el("div", { class: "toolbar" }, filter, el("label", {}, every, " every ref (retained steps too)"), compare),
    table, pages);

  async function load() {
    replaceQuery({ prefix: state.prefix, every: state.every ? "1" : "", offset: state.offset || "" });
    const data = await api("runs", { prefix: state.prefix, every: state.every ? 1 : "", offset: state.offset,
                                     limit: PAGE });
    body.replaceChildren(...data.rows.map((row) => runRow(row, selected, compare)));
    pages.replaceChildren(pager(data.total, data.offset, PAGE, (offset) => { state.offset = offset; load(); }));
    table.dataset.total = data.total;
    if (!data.storage_ready) fillStorage(body, table);
    else table.dataset.storage = "done";
  }
  await load();
  ready("runs");
}

function runRow(row, selected, compare) {
  const commit = row.commit;
  const box = el("input", { type: "checkbox", class: "pick", onchange: (event) => {
    if (event.target.checked) selected.add(row.ref); else selected.delete(row.ref);
    compare.disabled = selected.size === 0;
  } });
  return el("tr", { dataset: { ref: row.ref, run: row.run } },
    el("td", {}, box),
    el("td", {}, runLink(row.ref), commit && commit.expired ? el("span", { class: "badge expired" }, "expired") : null),
    el("td", { class: "num" }, commit ? fmt(commit.step) : "–"),
    el("td", {}, commit ? when(commit.time) : "–"),
    el("td", { class: "mono wrap" }, commit ? metricsText(commit.metrics) : ""),
    el("td", { class: "num" }, String(row.steps_kept)),
    el("td", { class: "num stored" }, row.ref === row.run ? bytes(row.stored_bytes) : ""),
    el("td", { class: "num exclusive" }, row.ref === row.run ? bytes(row.exclusive_bytes) : ""));
}

async function fillStorage(body, table) {
  const report = await api("storage");
  const byRun = new Map(report.runs.map((r) => [r.run, r]));
  for (const tr of body.querySelectorAll("tr")) {
    const usage = byRun.get(tr.dataset.ref);
    if (!usage) continue;
    tr.querySelector(".stored").textContent = bytes(usage.stored_bytes);
    tr.querySelector(".exclusive").textContent = bytes(usage.exclusive_bytes);
  }
  table.dataset.storage = "done";
}

// -- a run's history ------------------------------------------------------------------------------
async function runPage(query) {
  const ref = query.get("ref");
  const refs = query.get("refs");
  const params = { ref, refs };
  const [graph, metrics] = await Promise.all([api("graph", { ...params, offset: 0, limit: GRAPH_PAGE }),
                                              api("metrics", params)]);
  const names = graph.refs;
  const picked = [];
  const diffButton = el("button", { id: "diff-picked", disabled: true,
    onclick: () => { location.href = url("/ui/diff", { a: picked[0], b: picked[1] }); } }, "Diff the two selected");
  const rows = el("tbody");
  const table = el("table", { id: "graph", dataset: { total: graph.total } }, el("thead", {}, el("tr", {},
    el("th", {}, ""), el("th", {}, "Graph"), el("th", { class: "num" }, "Step"), el("th", {}, "Checkpoint"),
    el("th", {}, "Refs"), el("th", {}, "Time"), el("th", {}, "Metrics"), el("th", {}, "Message"))), rows);
  const more = el("button", { id: "more" }, "Load more");
  const found = el("div", { id: "nonfinite" });
  const scan = el("button", { id: "find-nonfinite", onclick: () => findNonfinite(names[0], found, rows) },
    `Find the first NaN/Inf in ${names[0]}`);
  show(
    el("h1", {}, ref ? `Run ${ref}` : `Runs ${names.join(", ")}`),
    names.length > 1 ? el("p", { class: "muted" }, "With: ",
      ...names.slice(ref ? 1 : 0).flatMap((n, i) => [i ? ", " : "", runLink(n)])) : null,
    el("h2", {}, "Metrics"), charts(metrics, ref),
    el("div", { class: "toolbar" }, scan), found,
    el("h2", {}, "History"), el("div", { class: "toolbar" }, diffButton,
      el("span", { class: "muted" }, "Click a checkpoint to open its tree; tick two to diff them.")),
    table, more);
  let offset = 0;
  const addRows = (page) => {
    for (const row of page.rows) rows.append(graphRow(row, graph.width, ref, picked, diffButton));
    offset = page.offset + page.rows.length;
    more.hidden = offset >= page.total;
    table.dataset.loaded = offset;
  };
  addRows(graph);
  more.addEventListener("click", async () => {
    more.disabled = true;
    addRows(await api("graph", { ...params, offset, limit: GRAPH_PAGE }));
    more.disabled = false;
  });
  ready("run");
}

function graphRow(row, width, ref, picked, diffButton) {
  const x = (column) => LANE / 2 + column * LANE;
  const lanes = svg("svg", { width: Math.max(width, 1) * LANE, height: ROW, class: "lanes" });
  for (const [start, end, lane] of row.above) {  // the lower half of the lines from the row above
    lanes.append(svg("line", { x1: (x(start) + x(end)) / 2, y1: 0, x2: x(end), y2: ROW / 2,
                               stroke: color(lane), "stroke-width": 2 }));
  }
  for (const [start, end, lane] of row.edges) {  // the upper half of the lines to the row below
    lanes.append(svg("line", { x1: x(start), y1: ROW / 2, x2: (x(start) + x(end)) / 2, y2: ROW,
                               stroke: color(lane), "stroke-width": 2 }));
  }
  lanes.append(svg("circle", { cx: x(row.column), cy: ROW / 2, r: 4.5, class: "commit",
                               fill: row.expired ? "#ffffff" : color(row.color), stroke: color(row.color),
                               "stroke-width": 2, "data-cid": row.cid }));
  const box = el("input", { type: "checkbox", class: "pick", disabled: row.expired, onclick: (event) => {
    event.stopPropagation();
    if (event.target.checked) picked.push(row.cid);
    else picked.splice(picked.indexOf(row.cid), 1);
    diffButton.disabled = picked.length !== 2;
  } });
  const badges = [
    ...row.refs.map((name) => el("span", { class: "badge" }, name)),
    row.expired ? el("span", { class: "badge expired" }, "expired") : null,
    row.children > 1 ? el("span", { class: "badge fork" }, `fork ×${row.children}`) : null,
    row.merge ? el("span", { class: "badge merge" }, "merge") : null,
  ];
  const open = () => { location.href = url("/ui/checkpoint", { target: row.cid, ref }); };
  return el("tr", { class: `clickable${row.expired ? " expired" : ""}`, onclick: open,
                    dataset: { cid: row.cid, step: row.step === null ? "" : row.step } },
    el("td", {}, box), el("td", { class: "lanes" }, lanes),
    el("td", { class: "num" }, fmt(row.step)),
    el("td", {}, checkpointLink(row.cid, ref)),
    el("td", {}, badges), el("td", {}, when(row.time)),
    el("td", { class: "mono wrap" }, metricsText(row.metrics)),
    el("td", { class: "wrap" }, row.message || ""));
}

async function findNonfinite(ref, out, rows) {
  out.replaceChildren(el("p", { class: "muted" }, `Scanning ${ref}'s history…`));
  try {
    const report = await api("nonfinite", { ref });
    out.dataset.state = "done";
    if (!report.found) {
      out.dataset.step = "";
      out.replaceChildren(el("p", { class: "notice" }, `${report.message}.`));
      return;
    }
    out.dataset.step = report.step;
    out.dataset.cid = report.commit;
    for (const tr of rows.querySelectorAll("tr")) tr.classList.toggle("marked", tr.dataset.cid === report.commit);
    out.replaceChildren(el("div", { class: "notice" },
      el("p", {}, "First NaN/Inf at ", el("strong", { class: "bad" }, `step ${fmt(report.step)}`), " (",
        checkpointLink(report.commit, ref), ") in:"),
      report.expired || report.metric !== null
        ? el("p", { class: "muted", id: "nonfinite-gap" }, `${report.message}.`) : null,
      statsTable(report.tensors)));
  } catch (error) {
    out.replaceChildren(el("p", { class: "error" }, error.message));
  }
}

function statsTable(rows) {
  return el("table", { class: "stats" }, el("thead", {}, el("tr", {},
    ...["Path", "DType", "Shape", "Min", "Max", "Mean", "Std", "L2", "NaN", "Inf"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows.map((s) => el("tr", { dataset: { path: s.path } },
      el("td", { class: "mono" }, s.path), el("td", {}, s.dtype), el("td", {}, s.shape.join("×") || "scalar"),
      ...[s.min, s.max, s.mean, s.std, s.l2].map((v) => el("td", { class: "num" }, fmt(v))),
      el("td", { class: `num${s.nan ? " bad" : ""}` }, String(s.nan)),
      el("td", { class: `num${s.inf ? " bad" : ""}` }, String(s.inf))))));
}

// -- charts ---------------------------------------------------------------------------------------
function charts(data, ref) {
  const box = el("div", { class: "charts", id: "charts", dataset: { metrics: data.metrics.length } });
  if (!data.metrics.length) box.append(el("p", { class: "muted" }, "No metrics in these commits."));
  for (const metric of data.metrics) box.append(lineChart(metric, data.series, ref));
  return box;
}

function pointsOf(series, metric) {  // [[step, value], ...] where the commit holds the metric
  const values = series.values[metric] || [];
  return series.steps.map((step, i) => [step, values[i]]).filter(([, v]) => v !== null && v !== undefined);
}

function lineChart(metric, series, ref) {
  const W = 560, H = 220, L = 56, R = 12, T = 10, B = 28;
  const lines = series.map((s, i) => ({ ref: s.ref, color: color(i), points: pointsOf(s, metric) }))
    .filter((line) => line.points.length);
  const all = lines.flatMap((line) => line.points);
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) || 1; y1 += Math.abs(y1) || 1; }
  const pad = (y1 - y0) * 0.05;
  y0 -= pad; y1 += pad;
  const sx = (v) => L + (v - x0) / (x1 - x0) * (W - L - R);
  const sy = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  const open = (line, step) => { location.href = url("/ui/checkpoint", { ref: line.ref, step }); };
  const plot = svg("svg", { width: W, height: H, class: "chart", "data-metric": metric, role: "img" },
    svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  for (const v of ticks(y0, y1)) {
    plot.append(svg("line", { x1: L, y1: sy(v), x2: W - R, y2: sy(v), class: "grid" }),
                svg("text", { x: L - 4, y: sy(v) + 3, "text-anchor": "end" }, fmt(v)));
  }
  for (const v of ticks(x0, x1)) {
    plot.append(svg("text", { x: sx(v), y: H - B + 14, "text-anchor": "middle" }, fmt(v)));
  }
  plot.append(svg("text", { x: W - R, y: H - 2, "text-anchor": "end" }, "step"));
  // Hovering anywhere shows the nearest point; a click opens its checkpoint. Dots are drawn for
  // series short enough to tell them apart.
  const marker = svg("circle", { r: 4, fill: "none", stroke: "#1d2430", "stroke-width": 1.5, visibility: "hidden" });
  const label = svg("text", { x: W - R, y: T + 10, "text-anchor": "end", class: "hover" }, "");
  const nearest = (event) => {
    const box = plot.getBoundingClientRect();
    const [mx, my] = [event.clientX - box.left, event.clientY - box.top];
    let best = null;
    for (const line of lines) {
      for (const [step, value] of line.points) {
        const d = (sx(step) - mx) ** 2 + (sy(value) - my) ** 2;
        if (!best || d < best.d) best = { d, line, step, value };
      }
    }
    return best;
  };
  plot.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "transparent",
    "pointer-events": "all", class: "hover-area",
    onmousemove: (event) => {
      const hit = nearest(event);
      marker.setAttribute("cx", sx(hit.step));
      marker.setAttribute("cy", sy(hit.value));
      marker.setAttribute("visibility", "visible");
      label.textContent = `${hit.line.ref} step ${hit.step}: ${fmt(hit.value)}`;
    },
    onclick: (event) => { const hit = nearest(event); open(hit.line, hit.step); } }));
  const legend = el("div", { class: "legend" });
  for (const line of lines) {
    const group = svg("g", { class: "series", "data-ref": line.ref, "data-points": line.points.length });
    group.append(svg("polyline", { fill: "none", stroke: line.color, "stroke-width": 1.5, "pointer-events": "none",
      points: line.points.map(([s, v]) => `${sx(s).toFixed(1)},${sy(v).toFixed(1)}`).join(" ") }));
    if (line.points.length <= MAX_DOTS) {
      for (const [step, value] of line.points) {
        group.append(svg("circle", { cx: sx(step), cy: sy(value), r: 2.5, fill: line.color, class: "point",
          "data-step": step, onclick: () => open(line, step) },
          svg("title", {}, `${line.ref} step ${step}: ${metric} = ${fmt(value)}`)));
      }
    }
    plot.append(group);
    legend.append(el("span", {}, el("span", { class: "swatch", dataset: { color: line.color } }), line.ref));
  }
  plot.append(marker, label);
  for (const swatch of legend.querySelectorAll(".swatch")) swatch.style.background = swatch.dataset.color;
  return el("div", { class: "chart-box" }, el("h3", {}, metric), plot, legend);
}

function ticks(lo, hi, count = 5) {
  const span = hi - lo;
  const step = 10 ** Math.floor(Math.log10(span / count));
  const nice = [1, 2, 5, 10].map((m) => m * step).find((s) => span / s <= count) || step * 10;
  const out = [];
  for (let v = Math.ceil(lo / nice) * nice; v <= hi + nice * 1e-9; v += nice) out.push(Number(v.toPrecision(12)));
  return out;
}

// -- one checkpoint -------------------------------------------------------------------------------
async function checkpointPage(query) {
  const ref = query.get("ref") || "";
  const state = { q: query.get("q") || "", changed: query.get("changed") === "1",
                  offset: Number(query.get("offset")) || 0 };
  const info = await api("checkpoint", { target: query.get("target"), ref, step: query.get("step") });
  const target = info.cid;
  const commit = info.commit;
  const facts = el("dl", { class: "facts" },
    el("dt", {}, "CID"), el("dd", { class: "mono", id: "cid" }, info.cid),
    el("dt", {}, "Tree"), el("dd", { class: "mono" }, info.tree));
  if (commit) {
    facts.append(el("dt", {}, "Time"), el("dd", {}, when(commit.time)),
      el("dt", {}, "Metrics"), el("dd", { class: "mono" }, metricsText(commit.metrics) || "–"),
      el("dt", {}, "Message"), el("dd", {}, commit.message || "–"),
      el("dt", {}, "Parents"), el("dd", {}, ...commit.parents.flatMap((p, i) => [i ? ", " : "", checkpointLink(p, ref)])),
      el("dt", {}, "Held by"), el("dd", {}, info.refs.length ? info.refs.join(", ") : "no ref (history only)"));
  }
  const links = el("div", { class: "toolbar" });
  if (commit && commit.parents.length) {
    links.append(el("a", { id: "diff-parent", href: url("/ui/diff", { a: commit.parents[0], b: info.cid }) },
      "Diff with its parent"));
  }
  if (ref) links.append(el("a", { href: url("/ui/run", { ref }) }, `History of ${ref}`));
  const title = commit && commit.step !== null ? `Checkpoint at step ${commit.step}` : "Checkpoint";
  show(el("h1", {}, title), facts, links);
  if (info.expired) {
    main().append(el("p", { class: "notice", id: "expired" },
      "Expired: GC removed this checkpoint's data; its commit stays in the history."));
    ready("checkpoint");
    return;
  }
  const search = el("input", { type: "search", id: "search", placeholder: "search paths", value: state.q });
  const changed = el("input", { type: "checkbox", id: "changed", checked: state.changed });
  const pageStats = el("button", { id: "page-stats" }, "Statistics for this page");
  const body = el("tbody");
  const table = el("table", { id: "tree" }, el("thead", {}, el("tr", {},
    el("th", {}, "Path"), el("th", {}, "Type"), el("th", {}, "DType"), el("th", {}, "Shape or value"),
    el("th", { class: "num" }, "Logical"), el("th", { class: "num" }, "Stored"),
    el("th", { class: "num", title: "chunks its parent lacks" }, "New here"),
    el("th", { class: "num" }, "Shared with parent"), el("th", { class: "num" }, "Shared with other refs"),
    el("th", {}, "Statistics"))), body);
  const pages = el("div");
  const note = el("p", { class: "muted", id: "tree-note" });
  main().append(el("h2", {}, `Tree (${info.values} values)`), note,
    el("div", { class: "toolbar" }, search, el("label", {}, changed, " only values changed from the parent"), pageStats),
    table, pages);
  search.addEventListener("input", debounce(() => { state.q = search.value; state.offset = 0; load(); }, 250));
  changed.addEventListener("change", () => { state.changed = changed.checked; state.offset = 0; load(); });
  pageStats.addEventListener("click", async () => {
    pageStats.disabled = true;
    for (const button of body.querySelectorAll("button.stats")) await button.onclickStats();
    pageStats.disabled = false;
  });

  async function load() {
    replaceQuery({ target, ref, q: state.q, changed: state.changed ? "1" : "", offset: state.offset || "" });
    const data = await api("tree", { target: info.cid, ref, q: state.q, changed: state.changed ? 1 : "",
                                     offset: state.offset, limit: PAGE });
    body.replaceChildren(...data.rows.map((row) => treeRow(row, info.cid)));
    note.textContent = data.parent_expired ? "Its parent's data was collected by GC: what is new here is not known." : "";
    pages.replaceChildren(pager(data.total, data.offset, PAGE, (offset) => { state.offset = offset; load(); }));
    table.dataset.total = data.total;
  }
  await load();
  ready("checkpoint");
}

const known = (n) => (n === null ? "–" : bytes(n));

function treeRow(row, cid) {
  // A tensor's statistics, once computed, go in a row of their own below it.
  const cell = el("td", { class: "stats-cell" });
  const tr = el("tr", { dataset: { path: row.path }, class: row.changed ? "changed" : "" });
  if (row.tensor) {
    const button = el("button", { class: "stats" }, "compute");
    button.onclickStats = async () => {
      button.disabled = true;
      let line;
      try {
        const s = await api("stats", { target: cid, path: row.path });
        for (const key of ["min", "max", "mean", "std", "l2", "nan", "inf"]) cell.dataset[key] = s[key];
        line = el("div", { class: "stats-line" },
          ...[["min", s.min], ["max", s.max], ["mean", s.mean], ["std", s.std], ["L2", s.l2]]
            .map(([k, v]) => el("span", {}, el("span", { class: "muted" }, `${k} `), fmt(v))),
          el("span", { class: s.nan ? "bad" : "" }, el("span", { class: "muted" }, "NaN "), String(s.nan)),
          el("span", { class: s.inf ? "bad" : "" }, el("span", { class: "muted" }, "Inf "), String(s.inf)));
        button.textContent = "✓";
      } catch (error) {
        line = el("span", { class: "error" }, error.message);
      }
      const below = tr.nextElementSibling;
      const statsRow = el("tr", { class: "stats-row" }, el("td", { colspan: 10 }, line));
      if (below && below.classList.contains("stats-row")) below.replaceWith(statsRow); else tr.after(statsRow);
    };
    button.addEventListener("click", button.onclickStats);
    cell.append(button);
  }
  const shape = row.shape ? (row.shape.length ? row.shape.join("×") : "scalar") : "";
  const value = row.value !== undefined ? JSON.stringify(row.value) : "";
  const chunked = row.type === "array" || row.type === "bytes" || row.type === "str";
  tr.append(
    el("td", { class: "mono" }, row.path || "<root>"),
    el("td", {}, row.type), el("td", {}, row.dtype || ""), el("td", {}, shape || value),
    el("td", { class: "num" }, row.nbytes !== undefined && row.nbytes !== null ? bytes(row.nbytes) : ""),
    el("td", { class: "num" }, row.inline ? "inline" : chunked ? bytes(row.stored_bytes) : ""),
    el("td", { class: "num new" }, chunked && !row.inline ? known(row.new_bytes) : ""),
    el("td", { class: "num" }, chunked && !row.inline ? known(row.parent_bytes) : ""),
    el("td", { class: "num" }, chunked && !row.inline ? known(row.other_bytes) : ""),
    cell);
  return tr;
}

// -- two checkpoints ------------------------------------------------------------------------------
async function diffPage(query) {
  const a = query.get("a"), b = query.get("b"), path = query.get("path") || "";
  const data = await api("diff", { a, b, path });
  const tensors = data.changed.filter((c) => c.tensor);
  const others = data.changed.filter((c) => !c.tensor);
  const body = el("tbody");
  const rowOf = new Map();
  for (const change of tensors) {
    const tr = el("tr", { dataset: { path: change.path } },
      el("td", { class: "mono" }, change.path),
      el("td", { class: "num relative" }, "…"), el("td", { class: "rel-bar" }),
      el("td", { class: "num l2" }, ""), el("td", { class: "num a-norm" }, ""), el("td", { class: "num max-abs" }, ""),
      el("td", {}, el("a", { href: url("/ui/checkpoint", { target: data.a, q: change.path }) }, "A"), " ",
        el("a", { href: url("/ui/checkpoint", { target: data.b, q: change.path }) }, "B")),
      el("td", { class: "muted" }, change.detail === "array values changed" ? "" : change.detail));
    rowOf.set(change.path, tr);
    body.append(tr);
  }
  const table = el("table", { id: "changed", dataset: { total: tensors.length } }, el("thead", {}, el("tr", {},
    el("th", {}, "Tensor"), el("th", { class: "num" }, "‖a−b‖/‖a‖"), el("th", {}, ""),
    el("th", { class: "num" }, "‖a−b‖"), el("th", { class: "num" }, "‖a‖"), el("th", { class: "num" }, "max |a−b|"),
    el("th", {}, "Sides"), el("th", {}, ""))), body);
  const progress = el("span", { class: "progress", id: "norms-progress" }, tensors.length ? `0 of ${tensors.length}` : "");
  const chart = el("div", { id: "layers" });
  const list = (id, title, items) => items.length ? el("div", { id },
    el("h2", {}, `${title} (${items.length})`), el("ul", {}, ...items.map((p) => el("li", { class: "mono" }, p)))) : null;
  show(
    el("h1", {}, "Diff"),
    el("p", {}, "From ", checkpointLink(data.a, null, short(data.a)), " to ", checkpointLink(data.b, null, short(data.b)),
      path ? ` below ${path}` : ""),
    el("p", { id: "summary" }, `${tensors.length} tensors changed, ${others.length} other values changed, ` +
      `${data.added.length} added, ${data.removed.length} removed, ${data.unchanged} unchanged; ` +
      `${bytes(data.shared_bytes)} shared (${bytes(data.a_bytes)} in A, ${bytes(data.b_bytes)} in B).`),
    el("h2", {}, "Relative change by layer", progress), chart,
    el("h2", {}, "Changed tensors"), table,
    others.length ? el("div", { id: "other-changes" }, el("h2", {}, `Other changed values (${others.length})`),
      el("ul", {}, ...others.map((c) => el("li", {}, el("span", { class: "mono" }, c.path), `: ${c.detail}`)))) : null,
    list("added", "Added", data.added), list("removed", "Removed", data.removed));
  ready("diff");
  const norms = [];
  for (let offset = 0; offset < tensors.length; offset += NORMS_BATCH) {
    const page = await api("diff/norms", { a: data.a, b: data.b, path, offset, limit: NORMS_BATCH });
    for (const n of page.rows) {
      norms.push(n);
      const tr = rowOf.get(n.path);
      tr.querySelector(".relative").textContent = fmt(n.relative);
      tr.querySelector(".l2").textContent = fmt(n.l2);
      tr.querySelector(".a-norm").textContent = fmt(n.a_norm);
      tr.querySelector(".max-abs").textContent = fmt(n.max_abs);
      tr.dataset.relative = n.relative;
    }
    progress.textContent = `${norms.length} of ${tensors.length}`;
    layerChart(chart, norms);
  }
  const largest = Math.max(0, ...norms.map((n) => number(n.relative)).filter(Number.isFinite));
  for (const n of norms) {
    const v = number(n.relative);
    const bar = el("span", { class: "bar" });
    bar.style.width = `${Number.isFinite(v) && largest ? Math.max(1, 120 * v / largest) : Number.isNaN(v) ? 0 : 120}px`;
    rowOf.get(n.path).querySelector(".rel-bar").replaceChildren(bar);
  }
  const rank = (n) => { const v = number(n.relative); return Number.isNaN(v) ? Infinity : v; };
  norms.sort((x, y) => rank(y) - rank(x));
  body.replaceChildren(...norms.map((n) => rowOf.get(n.path)));
  table.dataset.state = "done";
  chart.dataset.state = "done";
}

function layerOf(path) {
  // model.encoder.layer.5.attention.q.weight -> model.encoder.layer.5: up to the first index;
  // without one, the parent of the tensor.
  const parts = path.split(".");
  const index = parts.findIndex((p) => /^\d+$/.test(p));
  if (index >= 0) return parts.slice(0, index + 1).join(".");
  return parts.length > 1 ? parts.slice(0, -1).join(".") : path;
}

function layerChart(box, norms) {
  const layers = new Map();
  for (const n of norms) {
    const key = layerOf(n.path);
    const v = number(n.relative);
    const entry = layers.get(key) || { max: 0, count: 0, nan: false };
    entry.count += 1;
    if (Number.isNaN(v)) entry.nan = true; else entry.max = Math.max(entry.max, v);
    layers.set(key, entry);
  }
  const entries = [...layers.entries()];
  const finite = entries.map(([, e]) => e.max).filter(Number.isFinite);
  const largest = Math.max(0, ...finite);
  const W = 760, label = 300, BAR = 16;
  const plot = svg("svg", { width: W, height: entries.length * (BAR + 4) + 20, class: "layer-chart",
                            "data-layers": entries.length });
  entries.forEach(([name, e], i) => {
    const y = i * (BAR + 4);
    const width = Number.isFinite(e.max) && largest ? Math.max(1, (W - label - 90) * e.max / largest) : W - label - 90;
    plot.append(svg("text", { x: label - 6, y: y + BAR - 4, "text-anchor": "end" }, name),
      svg("rect", { x: label, y, width, height: BAR, fill: e.nan ? "#b3261e" : "#1f4e79", class: "layer",
                    "data-layer": name, "data-count": e.count },
        svg("title", {}, `${name}: largest ‖a−b‖/‖a‖ ${fmt(e.max)} over ${e.count} changed tensors`)),
      svg("text", { x: label + width + 4, y: y + BAR - 4 }, e.nan ? "NaN" : fmt(e.max)));
  });
  plot.append(svg("text", { x: label, y: entries.length * (BAR + 4) + 14 },
    "largest relative change ‖a−b‖/‖a‖ among the layer's changed tensors"));
  box.replaceChildren(plot);
}

// -- storage --------------------------------------------------------------------------------------
async function storagePage() {
  show(el("h1", {}, "Storage"), el("p", { class: "muted", id: "working" }, "Working out the figures…"));
  const report = await api("storage");
  const runs = [...report.runs].sort((x, y) => y.stored_bytes - x.stored_bytes);
  const largest = Math.max(1, ...runs.map((r) => r.stored_bytes));
  const W = 760, label = 260, BAR = 16;
  const bars = svg("svg", { width: W, height: runs.length * (BAR + 4) + 24, id: "run-bars" });
  runs.forEach((r, i) => {
    const y = i * (BAR + 4);
    const scale = (n) => (W - label - 90) * n / largest;
    bars.append(svg("text", { x: label - 6, y: y + BAR - 4, "text-anchor": "end" }, r.run),
      svg("rect", { x: label, y, width: scale(r.stored_bytes - r.shared_bytes), height: BAR, fill: "#1f4e79",
                    class: "exclusive" },
        svg("title", {}, `${r.run}: ${bytes(r.stored_bytes - r.shared_bytes)} only in this run`)),
      svg("rect", { x: label + scale(r.stored_bytes - r.shared_bytes), y, width: scale(r.shared_bytes), height: BAR,
                    fill: "#9fc0de", class: "shared" },
        svg("title", {}, `${r.run}: ${bytes(r.shared_bytes)} shared with other runs, pins or history`)),
      svg("text", { x: label + scale(r.stored_bytes) + 4, y: y + BAR - 4 }, bytes(r.stored_bytes)));
  });
  bars.append(svg("text", { x: label, y: runs.length * (BAR + 4) + 16 },
    "dark: only in this run; light: shared with other runs, pins or history"));
  const facts = el("dl", { class: "facts", id: "totals" },
    el("dt", {}, "Reachable from refs"), el("dd", { id: "stored" }, bytes(report.stored_bytes)),
    el("dt", {}, "All blocks stored"), el("dd", {}, `${bytes(report.total_bytes)} in ${report.total_blocks} blocks`),
    el("dt", {}, "GC would free now"), el("dd", { id: "gc-free" },
      `${bytes(report.unreachable_bytes)} (${report.unreachable_blocks} blocks no ref, pin, reflog entry younger than ` +
      `${Math.round(report.reflog_expiry / 86400)} days or history keeps)`));
  const table = el("table", { id: "run-storage" }, el("thead", {}, el("tr", {},
    el("th", {}, "Run"), el("th", { class: "num" }, "Refs"), el("th", { class: "num" }, "Checkpoints (logical)"),
    el("th", { class: "num" }, "Stored"), el("th", { class: "num" }, "Shared"),
    el("th", { class: "num" }, "Freed if deleted"))),
    el("tbody", {}, ...runs.map((r) => el("tr", { dataset: { run: r.run } }, el("td", {}, runLink(r.run)),
      el("td", { class: "num" }, String(r.refs)), el("td", { class: "num" }, bytes(r.logical_bytes)),
      el("td", { class: "num stored" }, bytes(r.stored_bytes)), el("td", { class: "num shared" }, bytes(r.shared_bytes)),
      el("td", { class: "num exclusive" }, bytes(r.exclusive_bytes))))));
  show(el("h1", {}, "Storage"), facts, el("h2", {}, "Bytes per run"), bars, table);
  ready("storage");
}

// -- start ----------------------------------------------------------------------------------------
const ROUTES = { "": runsPage, runs: runsPage, run: runPage, checkpoint: checkpointPage, diff: diffPage,
                 storage: storagePage };

async function start() {
  const page = location.pathname.replace(/^\/ui\/?/, "").replace(/\/$/, "");
  const nav = document.getElementById(`nav-${page || "runs"}`);
  if (nav) nav.classList.add("here");
  api("repo").then((repo) => {
    document.getElementById("location").textContent = repo.location;
    document.title = `cas-ckpt · ${repo.location}`;
  }, () => {});
  try {
    await (ROUTES[page] || runsPage)(new URLSearchParams(location.search));
  } catch (error) {
    fail(error);
  }
}

start();
