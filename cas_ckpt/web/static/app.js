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
// A run's colour comes from its name (a hash into this palette), so it is the same on every page.
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
                 "#e377c2", "#bcbd22", "#393b79", "#637939", "#843c39"];
const OTHERS = "#9aa3ad";  // commits on no drawn run's first-parent line
const SMOOTHING = [["off", 0], ["0.6", 0.6], ["0.8", 0.8], ["0.9", 0.9], ["0.95", 0.95], ["0.99", 0.99]];
const GROUPS = [["model", "Model weights"], ["optimizer", "Optimizer state"], ["other", "Other values"]];

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

function runColor(name) {  // FNV-1a of the run's name into the palette
  let hash = 0x811c9dc5;
  for (let i = 0; i < name.length; i += 1) {
    hash ^= name.charCodeAt(i);
    hash = Math.imul(hash, 0x01000193) >>> 0;
  }
  return PALETTE[hash % PALETTE.length];
}

function seriesStyles(names) {
  // Each run in its own colour; a run whose colour an earlier one (the viewed run comes first)
  // already has on this chart keeps it, dashed.
  const used = new Set();
  const styles = new Map();
  for (const name of names) {
    const color = runColor(name);
    styles.set(name, { color, dash: used.has(color) });
    used.add(color);
  }
  return styles;
}

function swatch(style) {
  const node = el("span", { class: `swatch${style.dash ? " dashed" : ""}`, dataset: { color: style.color } });
  node.style.background = style.color;  // CSSOM, not a style attribute: the CSP allows it
  return node;
}
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
      el("th", {}, "Parent"), el("th", { class: "num" }, "Fork step"),
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
  const mine = row.ref === row.run;
  return el("tr", { dataset: { ref: row.ref, run: row.run, parent: row.parent || "",
                               forkStep: row.fork_step === null || row.fork_step === undefined ? "" : row.fork_step } },
    el("td", {}, box),
    el("td", { class: "wrap" }, mine ? swatch({ color: runColor(row.run) }) : null, runLink(row.ref),
      commit && commit.expired ? el("span", { class: "badge expired" }, "expired") : null),
    el("td", { class: "num" }, commit ? fmt(commit.step) : "–"),
    el("td", { class: "parent wrap" }, mine && row.parent ? runLink(row.parent) : ""),
    el("td", { class: "num fork-step" }, mine && row.parent
      ? el("a", { href: url("/ui/checkpoint", { target: row.fork_cid, ref: row.parent }) }, fmt(row.fork_step)) : ""),
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
  // The history table lists the viewed run's own history; its related runs' only when asked.
  let related = Boolean(ref) && query.get("related") === "1";
  const graphParams = () => (ref && !related ? { refs: ref } : params);
  const [graph, metrics] = await Promise.all([api("graph", { ...graphParams(), offset: 0, limit: GRAPH_PAGE }),
                                              api("metrics", params)]);
  const names = metrics.series.map((s) => s.ref);
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
    el("h2", {}, "Metrics"), charts(metrics),
    el("div", { class: "toolbar" }, scan), found,
    el("h2", {}, "History"), el("div", { class: "toolbar" }, diffButton,
      ref && names.length > 1 ? el("label", {}, el("input", { type: "checkbox", id: "related", checked: related,
        onchange: (event) => { related = event.target.checked; reload(); } }),
        ` with the related runs (${names.slice(1).join(", ")})`) : null,
      el("span", { class: "muted" }, "Click a checkpoint to open its tree; tick two to diff them.")),
    table, more);
  let offset = 0;
  let width = graph.width;
  let laneColors = [];
  const addRows = (page) => {
    for (const row of page.rows) rows.append(graphRow(row, width, laneColors, ref, picked, diffButton));
    offset = page.offset + page.rows.length;
    more.hidden = offset >= page.total;
    table.dataset.loaded = offset;
  };
  const start = (page) => {
    width = page.width;
    laneColors = page.refs.map(runColor);  // the graph's colour i is its i-th head's run
    rows.replaceChildren();
    picked.length = 0;
    diffButton.disabled = true;
    table.dataset.total = page.total;
    table.dataset.related = related ? "1" : "";
    addRows(page);
  };
  async function reload() {
    replaceQuery({ ref, refs, related: related ? "1" : "" });
    start(await api("graph", { ...graphParams(), offset: 0, limit: GRAPH_PAGE }));
  }
  start(graph);
  more.addEventListener("click", async () => {
    more.disabled = true;
    addRows(await api("graph", { ...graphParams(), offset, limit: GRAPH_PAGE }));
    more.disabled = false;
  });
  ready("run");
}

function graphRow(row, width, laneColors, ref, picked, diffButton) {
  const color = (i) => laneColors[i] || OTHERS;
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
// One chart per metric, a line per run: the first run (the viewed one) drawn last, so on top, and
// first in the legend. NaN and infinite values are marked at the chart's top (NaN, +Inf) or
// bottom (-Inf) edge. Drag across a chart to zoom into those steps, double-click to reset; the log
// scale and the smoothing (an exponential moving average, off by default) apply to every chart.
function charts(data) {
  const styles = seriesStyles(data.series.map((s) => s.ref));
  const options = { log: false, smooth: 0 };
  const drawn = data.metrics.map((metric) => lineChart(metric, data.series, styles, options));
  const box = el("div", { class: "charts", id: "charts", dataset: { metrics: data.metrics.length } },
    ...drawn.map((chart) => chart.box));
  if (!data.metrics.length) box.append(el("p", { class: "muted" }, "No metrics in these commits."));
  const redraw = () => { for (const chart of drawn) chart.draw(); };
  const log = el("input", { type: "checkbox", id: "log-scale", onchange: (event) => {
    options.log = event.target.checked; redraw(); } });
  const smooth = el("select", { id: "smoothing", onchange: (event) => {
    options.smooth = Number(event.target.value); redraw(); } },
    ...SMOOTHING.map(([label, value]) => el("option", { value }, label)));
  return el("div", {}, data.metrics.length ? el("div", { class: "toolbar chart-tools" },
    el("label", {}, log, " log scale"), el("label", {}, "smoothing ", smooth),
    el("span", { class: "muted" }, "Drag across a chart to zoom in, double-click to reset.")) : null, box);
}

function pointsOf(series, metric) {  // [[step, value], ...] where the commit holds the metric
  const values = series.values[metric] || [];
  return series.steps.map((step, i) => [step, number(values[i])]).filter(([, v]) => v !== null && v !== undefined);
}

function smoothed(points, weight) {  // a debiased exponential moving average of the finite values
  let last = 0, total = 0;
  return points.filter(([, v]) => Number.isFinite(v)).map(([step, v]) => {
    last = last * weight + (1 - weight) * v;
    total = total * weight + (1 - weight);
    return [step, last / total];
  });
}

function segments(points, drawable) {  // runs of drawable points: a line breaks where one is not
  const out = [[]];
  for (const point of points) {
    if (drawable(point[1])) out[out.length - 1].push(point);
    else if (out[out.length - 1].length) out.push([]);
  }
  return out.filter((run) => run.length);
}

function nonfiniteText(value) {
  return Number.isNaN(value) ? "NaN" : value > 0 ? "Inf" : "-Inf";
}

let chartCount = 0;

function lineChart(metric, series, styles, options) {
  const W = 560, H = 220, L = 56, R = 12, T = 12, B = 28;
  const first = series.length ? series[0].ref : null;
  const lines = series.map((s) => ({ ref: s.ref, ...styles.get(s.ref), points: pointsOf(s, metric) }))
    .filter((line) => line.points.length);
  const steps = lines.flatMap((line) => line.points.map((p) => p[0]));
  const full = [Math.min(...steps), Math.max(...steps)];
  const clip = `chart-clip-${chartCount += 1}`;
  let zoom = null;  // [first step, last step] shown, or null: every step
  let scale = null;  // the last drawing's mapping, for the mouse
  const plot = svg("svg", { width: W, height: H, class: "chart", "data-metric": metric, role: "img" });
  const note = el("p", { class: "muted chart-note" });
  const title = el("h3", {}, metric);
  const legend = el("div", { class: "legend" }, ...lines.map((line) => el("span", { dataset: { ref: line.ref } },
    swatch(line), line.ref === first ? el("strong", {}, line.ref) : line.ref)));

  function draw() {
    const smooth = options.smooth;
    const below = lines.flatMap((line) => line.points).filter(([, v]) => Number.isFinite(v) && v <= 0).length;
    const anyPositive = lines.some((line) => line.points.some(([, v]) => Number.isFinite(v) && v > 0));
    const log = options.log && anyPositive;
    note.textContent = !options.log ? "" : !anyPositive ? "No positive values: a log scale cannot show them; linear."
      : below ? `${below} value${below > 1 ? "s" : ""} ≤ 0 not drawn on the log scale.` : "";
    const drawable = (v) => Number.isFinite(v) && (!log || v > 0);
    const ty = (v) => (log ? Math.log10(v) : v);
    let [x0, x1] = zoom || full;
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    const inside = ([step]) => step >= x0 && step <= x1;
    const shown = lines.map((line) => ({ ...line, smooth: smooth ? smoothed(line.points, smooth) : [] }));
    const ys = shown.flatMap((line) => [...line.points, ...line.smooth])
      .filter((p) => inside(p) && drawable(p[1])).map((p) => ty(p[1]));
    let [y0, y1] = ys.length ? [Math.min(...ys), Math.max(...ys)] : [0, 1];
    if (y0 === y1) { y0 -= Math.abs(y0) || 1; y1 += Math.abs(y1) || 1; }
    const pad = (y1 - y0) * 0.05;
    y0 -= pad; y1 += pad;
    const sx = (v) => L + (v - x0) / (x1 - x0) * (W - L - R);
    const sy = (v) => T + (1 - (ty(v) - y0) / (y1 - y0)) * (H - T - B);
    const edge = (v) => (v < 0 ? H - B - 6 : T - 2);  // where a NaN or infinity is marked
    scale = { sx, sy, x0, x1, inside, drawable, edge };
    plot.dataset.x0 = x0;
    plot.dataset.x1 = x1;
    plot.dataset.zoomed = zoom ? "1" : "";
    plot.dataset.log = log ? "1" : "";
    plot.dataset.smooth = smooth || "";
    plot.replaceChildren(
      svg("defs", {}, svg("clipPath", { id: clip }, svg("rect", { x: L, y: 0, width: W - L - R, height: H - B + 1 }))),
      svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
      svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
    for (const v of (log ? logTicks(y0, y1) : ticks(y0, y1))) {
      const y = T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
      plot.append(svg("line", { x1: L, y1: y, x2: W - R, y2: y, class: "grid" }),
                  svg("text", { x: L - 4, y: y + 3, "text-anchor": "end" }, fmt(log ? 10 ** v : v)));
    }
    for (const v of ticks(x0, x1)) {
      plot.append(svg("text", { x: sx(v), y: H - B + 14, "text-anchor": "middle" }, fmt(v)));
    }
    plot.append(svg("text", { x: W - R, y: H - 2, "text-anchor": "end" }, "step"));
    title.textContent = log ? `${metric} (log scale)` : metric;
    for (const line of [...shown].reverse()) {  // the first series last: on top
      const top = line.ref === first;
      const group = svg("g", { class: `series${top ? " viewed" : ""}`, "data-ref": line.ref,
                               "data-points": line.points.length, "data-color": line.color });
      const stroke = { fill: "none", stroke: line.color, "stroke-width": top ? 2.25 : 1.5,
                       "stroke-dasharray": line.dash ? "5 3" : null, "pointer-events": "none",
                       "clip-path": `url(#${clip})` };
      const polyline = (run, cls) => svg("polyline", { ...stroke, class: cls,
        points: run.map(([s, v]) => `${sx(s).toFixed(1)},${sy(v).toFixed(1)}`).join(" ") });
      for (const run of segments(line.points, drawable)) group.append(polyline(run, smooth ? "raw faded" : "raw"));
      for (const run of segments(line.smooth, drawable)) group.append(polyline(run, "smoothed"));
      if (line.points.length <= MAX_DOTS) {
        for (const [step, value] of line.points) {
          if (!drawable(value) || !inside([step])) continue;
          group.append(svg("circle", { cx: sx(step), cy: sy(value), r: 2.5, fill: line.color,
            class: `point${smooth ? " faded" : ""}`, "data-step": step },
            svg("title", {}, `${line.ref} step ${step}: ${metric} = ${fmt(value)}`)));
        }
      }
      for (const [step, value] of line.points) {
        if (Number.isFinite(value) || !inside([step])) continue;
        const [x, y] = [sx(step), edge(value)];
        const shape = Number.isNaN(value) ? `M${x},${y - 1} L${x + 5},${y + 4} L${x},${y + 9} L${x - 5},${y + 4} Z`  // ◆
          : value < 0 ? `M${x - 5},${y} L${x + 5},${y} L${x},${y + 7} Z`  // ▼ at the bottom
            : `M${x - 5},${y + 7} L${x + 5},${y + 7} L${x},${y} Z`;  // ▲ at the top
        group.append(svg("path", { class: "nonfinite", "data-step": step, "data-value": nonfiniteText(value),
          d: shape, fill: line.color, stroke: "#b3261e", "stroke-width": 1.5 },
          svg("title", {}, `${line.ref}: ${metric} ${nonfiniteText(value)} at step ${step}`)));
      }
      plot.append(group);
    }
    plot.append(marker, label, selection);
  }

  // Hovering shows the nearest point; a click opens its checkpoint (after a moment: a double
  // click resets the zoom instead); a drag selects the steps to zoom into.
  const marker = svg("circle", { r: 4, fill: "none", stroke: "#1d2430", "stroke-width": 1.5, visibility: "hidden" });
  const label = svg("text", { x: W - R, y: T + 10, "text-anchor": "end", class: "hover" }, "");
  const selection = svg("rect", { y: T, height: H - T - B, class: "selection", visibility: "hidden" });
  const position = (event) => {
    const box = plot.getBoundingClientRect();
    return [event.clientX - box.left, event.clientY - box.top];
  };
  const inPlot = ([mx, my]) => mx >= L && mx <= W - R && my >= 0 && my <= H - B;
  const nearest = ([mx, my]) => {
    let best = null;
    for (const line of lines) {
      for (const [step, value] of line.points) {
        if (!scale.inside([step])) continue;
        const y = Number.isFinite(value) ? (scale.drawable(value) ? scale.sy(value) : null) : scale.edge(value);
        if (y === null) continue;
        const d = (scale.sx(step) - mx) ** 2 + (y - my) ** 2;
        if (!best || d < best.d) best = { d, line, step, value, y };
      }
    }
    return best;
  };
  let drag = null, pending = null, dragged = false;
  plot.addEventListener("mousemove", (event) => {
    const at = position(event);
    if (drag) {
      const [a, b] = [Math.min(drag, at[0]), Math.max(drag, at[0])].map((x) => Math.min(Math.max(x, L), W - R));
      selection.setAttribute("x", a);
      selection.setAttribute("width", b - a);
      selection.setAttribute("visibility", b - a > 3 ? "visible" : "hidden");
    }
    const hit = inPlot(at) ? nearest(at) : null;
    if (!hit) { marker.setAttribute("visibility", "hidden"); label.textContent = ""; return; }
    marker.setAttribute("cx", scale.sx(hit.step));
    marker.setAttribute("cy", hit.y);
    marker.setAttribute("visibility", "visible");
    label.textContent = `${hit.line.ref} step ${hit.step}: ${fmt(hit.value)}`;
  });
  plot.addEventListener("mouseleave", () => { marker.setAttribute("visibility", "hidden"); label.textContent = ""; });
  plot.addEventListener("mousedown", (event) => {
    const at = position(event);
    if (event.button !== 0 || !inPlot(at)) return;
    event.preventDefault();  // no text selection while dragging
    drag = at[0];
    dragged = false;
  });
  window.addEventListener("mouseup", (event) => {
    if (drag === null) return;
    const [a, b] = [drag, position(event)[0]].sort((p, q) => p - q).map((x) => Math.min(Math.max(x, L), W - R));
    drag = null;
    selection.setAttribute("visibility", "hidden");
    if (b - a <= 3) return;
    dragged = true;
    const step = (x) => scale.x0 + (x - L) / (W - L - R) * (scale.x1 - scale.x0);
    zoom = [step(a), step(b)];
    draw();
  });
  plot.addEventListener("click", (event) => {
    if (dragged) { dragged = false; return; }
    const at = position(event);
    if (event.detail > 1 || !inPlot(at)) return;
    const hit = nearest(at);
    if (!hit) return;
    clearTimeout(pending);
    pending = setTimeout(() => { location.href = url("/ui/checkpoint", { ref: hit.line.ref, step: hit.step }); }, 300);
  });
  plot.addEventListener("dblclick", () => {
    clearTimeout(pending);
    zoom = null;
    draw();
  });
  draw();
  const box = el("div", { class: "chart-box" }, title, plot, legend, note);
  return { box, draw };
}

function logTicks(lo, hi) {  // on a log10 axis: powers of ten, else 1-2-5 or 1..9 of a decade
  if (hi - lo >= 2) {
    const out = [];
    const every = Math.max(1, Math.ceil((hi - lo) / 6));
    for (let v = Math.ceil(lo); v <= hi; v += every) out.push(v);
    return out;
  }
  for (const mantissas of [[1], [1, 2, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]]) {
    const out = [];
    for (let k = Math.floor(lo); k <= Math.ceil(hi); k += 1) {
      for (const m of mantissas) {
        const v = Math.log10(m) + k;
        if (v >= lo && v <= hi) out.push(v);
      }
    }
    if (out.length >= 3) return out.filter((_, i) => i % Math.ceil(out.length / 6) === 0);
  }
  return ticks(10 ** lo, 10 ** hi).filter((v) => v > 0).map(Math.log10);
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
  const facts = el("dl", { class: "facts", id: "facts" },
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
    el("td", { class: "mono path" }, row.path || "<root>"),
    el("td", {}, row.type), el("td", {}, row.dtype || ""), el("td", { class: "value" }, shape || value),
    el("td", { class: "num" }, row.nbytes !== undefined && row.nbytes !== null ? bytes(row.nbytes) : ""),
    el("td", { class: "num" }, row.inline ? "inline" : chunked ? bytes(row.stored_bytes) : ""),
    el("td", { class: "num new" }, chunked && !row.inline ? known(row.new_bytes) : ""),
    el("td", { class: "num" }, chunked && !row.inline ? known(row.parent_bytes) : ""),
    el("td", { class: "num" }, chunked && !row.inline ? known(row.other_bytes) : ""),
    cell);
  return tr;
}

// -- two checkpoints ------------------------------------------------------------------------------
// From the older checkpoint to the newer (commit time, then step), whichever came first in the
// address, unless the address says order=given (the swap control's). Changed tensors in groups:
// model weights first, then optimizer state, then other values (step, RNG state, counters).
function sideLabel(id, letter, side) {
  return el("div", { class: "side", id, dataset: { run: side.run || "", step: side.step === null ? "" : side.step,
                                                   cid: side.cid } },
    el("span", { class: "side-letter" }, letter), " ",
    side.run ? runLink(side.run) : el("span", { class: "muted" }, "no run"), " ",
    el("span", { class: "side-step" }, side.step === null ? "no step" : `step ${fmt(side.step)}`), " ",
    checkpointLink(side.cid, side.run, side.cid),
    side.time !== null ? el("span", { class: "muted" }, ` ${when(side.time)}`) : null);
}

function direction(a, b) {
  if (a.time === null || b.time === null) return "";
  const key = (s) => [s.time, s.step === null ? -1 : s.step];
  const [x, y] = [key(a), key(b)];
  if (x[0] === y[0] && x[1] === y[1]) return "same time";
  return x[0] < y[0] || (x[0] === y[0] && x[1] < y[1]) ? "older → newer" : "newer → older";
}

async function diffPage(query) {
  const path = query.get("path") || "";
  const order = query.get("order") === "given" ? "given" : "older";
  let modelOnly = query.get("model") === "1";
  const data = await api("diff", { a: query.get("a"), b: query.get("b"), path, order });
  const tensors = data.changed.filter((c) => c.tensor);
  const others = data.changed.filter((c) => !c.tensor);
  const rowOf = new Map();
  const groups = new Map(GROUPS.map(([group]) => [group, el("tbody", { class: "group", dataset: { group } })]));
  for (const change of tensors) {
    const tr = el("tr", { dataset: { path: change.path, group: change.group } },
      el("td", { class: "mono path" }, change.path),
      el("td", { class: "num relative" }, "…"), el("td", { class: "rel-bar" }),
      el("td", { class: "num l2" }, ""), el("td", { class: "num a-norm" }, ""), el("td", { class: "num max-abs" }, ""),
      el("td", {}, el("a", { href: url("/ui/checkpoint", { target: data.a, q: change.path }) }, "A"), " ",
        el("a", { href: url("/ui/checkpoint", { target: data.b, q: change.path }) }, "B")),
      el("td", { class: "muted" }, change.detail === "array values changed" ? "" : change.detail));
    rowOf.set(change.path, tr);
    groups.get(change.group).append(tr);
  }
  const count = (group) => tensors.filter((c) => c.group === group).length;
  for (const [group, title] of GROUPS) {
    const body = groups.get(group);
    body.prepend(el("tr", { class: "group-head" }, el("th", { colspan: 8 }, `${title} (${count(group)})`)));
    body.hidden = !count(group);
  }
  const table = el("table", { id: "changed", dataset: { total: tensors.length } }, el("thead", {}, el("tr", {},
    el("th", {}, "Tensor"), el("th", { class: "num" }, "‖a−b‖/‖a‖"), el("th", {}, ""),
    el("th", { class: "num" }, "‖a−b‖"), el("th", { class: "num" }, "‖a‖"), el("th", { class: "num" }, "max |a−b|"),
    el("th", {}, "Sides"), el("th", {}, ""))), ...groups.values());
  const progress = el("span", { class: "progress", id: "norms-progress" }, tensors.length ? `0 of ${tensors.length}` : "");
  const chart = el("div", { id: "layers" });
  const list = (id, title, items) => items.length ? el("div", { id },
    el("h2", {}, `${title} (${items.length})`), el("ul", {}, ...items.map((p) => el("li", { class: "mono" }, p)))) : null;
  const otherChanges = others.length ? el("div", { id: "other-changes" },
    el("h2", {}, `Other changed values (${others.length})`),
    el("ul", {}, ...others.map((c) => el("li", { dataset: { group: c.group } },
      el("span", { class: "mono" }, c.path), `: ${c.detail}`)))) : null;
  const swap = el("button", { id: "swap", title: "compare the other way round",
    onclick: () => { location.href = url("/ui/diff", { a: data.b, b: data.a, path, order: "given",
                                                        model: modelOnly ? "1" : "" }); } }, "⇄ Swap");
  const only = el("input", { type: "checkbox", id: "model-only", checked: modelOnly });
  const norms = [];
  const apply = () => {  // the model-only view: the model group alone, in the table and the chart
    table.dataset.modelOnly = modelOnly ? "1" : "";
    for (const [group, body] of groups) body.hidden = !count(group) || (modelOnly && group !== "model");
    if (otherChanges) otherChanges.hidden = modelOnly;
    const rank = (n) => GROUPS.findIndex(([group]) => group === rowOf.get(n.path).dataset.group);
    const drawn = norms.filter((n) => !modelOnly || rank(n) === 0);
    layerChart(chart, drawn.map((n, i) => [n, i]).sort((x, y) => rank(x[0]) - rank(y[0]) || x[1] - y[1])
      .map(([n]) => n));
  };
  only.addEventListener("change", () => {
    modelOnly = only.checked;
    replaceQuery({ a: data.a, b: data.b, path, order: order === "given" ? "given" : "", model: modelOnly ? "1" : "" });
    apply();
  });
  const way = direction(data.side_a, data.side_b);
  show(
    el("h1", {}, "Diff"),
    el("div", { class: "sides" },
      sideLabel("side-a", "A", data.side_a), sideLabel("side-b", "B", data.side_b),
      el("div", { class: "toolbar" },
        el("span", { id: "direction", dataset: { swapped: data.swapped ? "1" : "" } },
          `From A to B${way ? `: ${way}` : ""}${path ? `, below ${path}` : ""}`), swap)),
    el("p", { id: "summary" }, `${tensors.length} tensors changed (${count("model")} model, ` +
      `${count("optimizer")} optimizer, ${count("other")} other), ${others.length} other values changed, ` +
      `${data.added.length} added, ${data.removed.length} removed, ${data.unchanged} unchanged; ` +
      `${bytes(data.shared_bytes)} shared (${bytes(data.a_bytes)} in A, ${bytes(data.b_bytes)} in B).`),
    el("div", { class: "toolbar" }, el("label", {}, only, " model weights only")),
    el("h2", {}, "Relative change by layer", progress), chart,
    el("h2", {}, "Changed tensors"), table, otherChanges,
    list("added", "Added", data.added), list("removed", "Removed", data.removed));
  apply();
  ready("diff");
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
    apply();
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
  for (const [, body] of groups) {
    const head = body.querySelector(".group-head");
    body.replaceChildren(head, ...norms.map((n) => rowOf.get(n.path)).filter((tr) => tr.parentNode === body));
  }
  apply();
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
    const shown = name.length > 44 ? `…${name.slice(-43)}` : name;  // the label column's width
    plot.append(svg("text", { x: label - 6, y: y + BAR - 4, "text-anchor": "end" }, shown),
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
