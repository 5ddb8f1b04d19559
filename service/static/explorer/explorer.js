// SPDX-License-Identifier: Apache-2.0. Written for gradserve (LICENSE); no third-party code.
// gradserve explorer: plain JavaScript, no libraries, nothing fetched but this service's
// own routes (the page's Content-Security-Policy allows 'self' only).
"use strict";

(() => {
  const SVG_NS = "http://www.w3.org/2000/svg"; // a namespace name, never fetched
  const byTestId = (id) => document.querySelector(`[data-testid="${id}"]`);
  const ui = {
    example: byTestId("example"), upload: byTestId("upload"), request: byTestId("request"),
    endpoint: byTestId("endpoint"), plan: byTestId("plan"), run: byTestId("run"),
    status: byTestId("status"), problem: byTestId("problem"), results: byTestId("results"),
    summary: byTestId("plan-summary"), graph: byTestId("graph"),
    timeline: byTestId("timeline"), costly: byTestId("costly"),
    timelineWithout: byTestId("timeline-without-section"),
    timelineWithoutView: byTestId("timeline-without"),
    keyForm: byTestId("key-form"), keyNote: byTestId("key-note"), key: byTestId("api-key"),
  };
  const ITEMSIZE = { float16: 2, float32: 4, float64: 8, int32: 4, int64: 8, bool: 1 };
  const AUX_KINDS = new Set(["cast", "constant", "derived"]);
  // A step's phase, as the graph and the timelines colour it: a recomputation (a forward
  // value computed again in the backward, to fit the memory budget) has its own.
  const phaseOf = (kind) => kind === "backward" ? "backward"
    : kind === "recompute" ? "recompute" : AUX_KINDS.has(kind) ? "aux" : "forward";
  let plannedText = null; // the request text of the plan on screen
  let drawn = null; // {nodes, edges} of the graph on screen

  // Content-Security-Policy violations, counted where a test can read them.
  let violations = 0;
  document.addEventListener("securitypolicyviolation", () => {
    violations += 1;
    document.body.dataset.cspViolations = String(violations);
  });

  // ------------------------------------------------------------ lossless JSON
  // The service reads 2.0 as float32 and 2 as int64: a request is never re-encoded by
  // JSON.stringify (which writes 2.0 as 2). Numbers are kept as their source text.
  class RawNumber {
    constructor(text) { this.text = text; }
    toString() { return this.text; }
  }
  const NUMBER_RE = /-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?/y;
  const STRING_RE = /"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/y;

  function parseLossless(text) {
    JSON.parse(text); // the browser's own message for invalid JSON
    let i = 0;
    const skip = () => { while (i < text.length && " \t\n\r".includes(text[i])) i += 1; };
    const match = (re) => { re.lastIndex = i; const m = re.exec(text); i = re.lastIndex; return m[0]; };
    function value() {
      skip();
      const c = text[i];
      if (c === "{") {
        i += 1;
        const obj = Object.create(null);
        skip();
        if (text[i] === "}") { i += 1; return obj; }
        for (;;) {
          skip();
          const key = JSON.parse(match(STRING_RE));
          skip(); i += 1; // ':'
          obj[key] = value();
          skip();
          if (text[i++] === "}") return obj; // else ','
        }
      }
      if (c === "[") {
        i += 1;
        const arr = [];
        skip();
        if (text[i] === "]") { i += 1; return arr; }
        for (;;) {
          arr.push(value());
          skip();
          if (text[i++] === "]") return arr;
        }
      }
      if (c === '"') return JSON.parse(match(STRING_RE));
      for (const [word, v] of [["true", true], ["false", false], ["null", null]]) {
        if (text.startsWith(word, i)) { i += word.length; return v; }
      }
      return new RawNumber(match(NUMBER_RE));
    }
    return value();
  }

  function writeLossless(v, limit = Infinity) {
    const out = [];
    let size = 0;
    const emit = (s) => { out.push(s); size += s.length; return size < limit; };
    function walk(x) {
      if (size >= limit) return false;
      if (x instanceof RawNumber) return emit(x.text);
      if (Array.isArray(x)) {
        if (!emit("[")) return false;
        for (let k = 0; k < x.length; k++) {
          if (k && !emit(", ")) return false;
          if (!walk(x[k])) return false;
        }
        return emit("]");
      }
      if (x !== null && typeof x === "object") {
        if (!emit("{")) return false;
        const keys = Object.keys(x);
        for (let k = 0; k < keys.length; k++) {
          if (k && !emit(", ")) return false;
          if (!emit(JSON.stringify(keys[k]) + ": ")) return false;
          if (!walk(x[keys[k]])) return false;
        }
        return emit("}");
      }
      return emit(JSON.stringify(x));
    }
    const complete = walk(v);
    const text = out.join("");
    return complete ? text : text.slice(0, limit) + " …";
  }

  const plain = (v) => JSON.parse(writeLossless(v)); // numbers as JS numbers (for drawing)

  // ------------------------------------------------------------ small helpers
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  }

  function svg(tag, attrs = {}, parent = null, text = null) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== null) node.textContent = text;
    if (parent) parent.append(node);
    return node;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let u = 0;
    let x = n;
    while (x >= 1024 && u < units.length - 1) { x /= 1024; u += 1; }
    return u ? `${x.toFixed(x < 10 ? 2 : 1)} ${units[u]}` : `${n} B`;
  }

  function count(n) {
    if (n === null || n === undefined) return "–";
    if (Math.abs(n) < 1e4) return String(n);
    return n.toExponential(2).replace("e+", "e");
  }

  const shapeText = (shape) => `[${(shape || []).join(", ")}]`;
  const clip = (s, n) => (s.length > n ? s.slice(0, n - 1) + "…" : s);

  function setStatus(text, state) {
    ui.status.textContent = text;
    if (state) document.body.dataset.state = state;
  }

  // ------------------------------------------------------------ the request
  function readRequest() {
    const text = ui.request.value;
    try {
      return { text, body: parseLossless(text) };
    } catch (err) {
      showProblem({ title: "Not JSON", detail: `the request is not JSON: ${err.message}` });
      setStatus("The request is not JSON.", "error");
      return null;
    }
  }

  function endpointOf(body) {
    const chosen = ui.endpoint.value;
    if (chosen === "forward" || chosen === "backward") return chosen;
    if (body.grad_outputs !== undefined) return "backward";
    if (body.no_grad === true) return "forward";
    const inputs = body.inputs || {};
    const wantsGrad = Object.keys(inputs).some((k) => {
      const t = inputs[k];
      return t && typeof t === "object" && !Array.isArray(t) && t.requires_grad === true;
    });
    return wantsGrad ? "backward" : "forward";
  }

  function planBody(body, endpoint) {
    const copy = Object.assign(Object.create(null), body);
    const path = endpoint === "backward" ? "backward" : body.no_grad === true ? "no_grad" : "forward";
    delete copy.no_grad;
    delete copy.encoding;
    if (path !== "backward") delete copy.grad_outputs;
    copy.path = path;
    return copy;
  }

  // ------------------------------------------------------------ the API key
  // With API keys on, the page and its files (no data) load without one; a request of
  // the page that gets 401 asks for the key, and is sent again with it. The key is kept
  // in this variable for the page's life, and nowhere else: not in sessionStorage, which
  // a browser may write to disk to restore a session, for a credential that a reload
  // costs only retyping.
  let apiKey = null;
  let keysGiven = 0; // how many keys were entered: a request tells a newer key by it
  let keyWanted = null; // while the form is shown: {promise, resolve}, shared by requests

  function askKey(refused) {
    ui.keyNote.textContent = refused
      ? "The service refused this key (401): enter a valid API key."
      : "This service asks for an API key.";
    if (!keyWanted) {
      let resolve;
      const promise = new Promise((r) => { resolve = r; });
      keyWanted = { promise, resolve };
      ui.keyForm.hidden = false;
      ui.key.focus();
    }
    return keyWanted.promise;
  }

  function useKey(event) {
    event.preventDefault(); // nothing is submitted anywhere (form-action 'none')
    const key = ui.key.value.trim();
    if (!key || !keyWanted) return;
    apiKey = key;
    keysGiven += 1;
    ui.key.value = "";
    ui.keyForm.hidden = true;
    clearProblem();
    setStatus("Sending again with the key…", "key-given");
    const { resolve } = keyWanted;
    keyWanted = null;
    resolve();
  }

  async function post(path, text) {
    for (;;) {
      const sent = apiKey;
      const given = keysGiven;
      const headers = { "Content-Type": "application/json" };
      if (sent !== null) headers["X-API-Key"] = sent;
      const r = await fetch(path, { method: "POST", headers, body: text });
      const type = r.headers.get("content-type") || "";
      const raw = await r.text();
      if (r.ok) return { ok: true, status: r.status, type, raw };
      let problem;
      try { problem = JSON.parse(raw); } catch { problem = null; }
      if (!problem || typeof problem !== "object" || !type.includes("json")) {
        problem = { status: r.status, title: r.statusText || "Error", detail: clip(raw, 1000) };
      }
      if (r.status !== 401) return { ok: false, status: r.status, problem };
      if (keysGiven !== given) continue; // a key was entered while this was on its way
      apiKey = null; // (a refused key is forgotten)
      showProblem(problem);
      setStatus(`POST ${path.split("?")[0]} answered 401: the service asks for an API key.`,
                "key-needed");
      await askKey(sent !== null);
    }
  }

  // ------------------------------------------------------------ plan
  async function plan() {
    const req = readRequest();
    if (!req) return false;
    const endpoint = endpointOf(req.body);
    const text = writeLossless(planBody(req.body, endpoint));
    setStatus(`Planning (path ${JSON.parse(text).path})…`, "planning");
    clearProblem();
    const [json, dot] = await Promise.all([post("/plan", text), post("/plan?format=dot", text)]);
    if (!json.ok) {
      plannedText = null;
      clearPlanViews("The plan failed: the graph below is drawn from the request itself.");
      drawGraph(graphFromRequest(req.body));
      showProblem(json.problem, req.body);
      setStatus(`POST /plan answered ${json.status}.`, "plan-error");
      return false;
    }
    const planned = JSON.parse(json.raw);
    const program = graphFromPlan(planned, dot.ok ? dot.raw : "");
    plannedText = req.text;
    drawSummary(planned, endpoint);
    drawGraph(program);
    drawTimeline(ui.timeline, planned.nodes, planned.planned_peak_bytes,
                 planned.memory_budget_bytes, program.inputBytes);
    const without = planned.recompute;
    ui.timelineWithout.hidden = !without;
    if (without) {
      drawTimeline(ui.timelineWithoutView, without.nodes_without, without.peak_bytes_without,
                   planned.memory_budget_bytes, program.inputBytes);
    }
    drawCostly(planned);
    setStatus(`Planned for POST /${endpoint} (path ${planned.path}): ${planned.nodes.length} steps.`,
              "planned");
    return true;
  }

  function clearPlanViews(message) {
    ui.summary.replaceChildren(el("span", { class: "empty" }, message));
    ui.graph.replaceChildren();
    ui.timeline.replaceChildren(el("div", { class: "empty" }, "No plan."));
    delete ui.timeline.dataset.overBudget;
    ui.timelineWithout.hidden = true;
    ui.costly.tBodies[0].replaceChildren();
    drawn = null;
  }

  function drawSummary(p, endpoint) {
    const memOver = p.planned_peak_bytes > p.memory_budget_bytes;
    const costOver = p.compute_cost > p.compute_budget;
    const chip = (label, value, cls = "") => {
      const c = el("span", { class: `chip ${cls}` }, `${label} `, el("b", {}, value));
      return c;
    };
    ui.summary.replaceChildren(
      chip("endpoint", `POST /${endpoint}`),
      chip("path", p.path),
      chip("planned peak", `${bytes(p.planned_peak_bytes)} of ${bytes(p.memory_budget_bytes)}`,
           memOver ? "bad" : ""),
      chip("compute cost", `${count(p.compute_cost)} of ${count(p.compute_budget)}`,
           costOver ? "bad" : ""),
      ...(p.recompute ? [chip("recomputed", `${p.recompute.steps} steps, +${count(
        p.recompute.added_cost)} cost, from a peak of ${bytes(p.recompute.peak_bytes_without)}`,
        "recompute")] : []),
      ...(p.minimum_peak_bytes ? [chip("even recomputing", `needs ${bytes(
        p.minimum_peak_bytes)}`, "bad")] : []),
      chip("", p.admitted ? "admitted" : "not admitted", p.admitted ? "good" : "bad"),
      chip("graph_id", p.graph_id.slice(0, 12) + "…"),
    );
    ui.summary.dataset.admitted = String(p.admitted);
  }

  // The program's edges come from /plan?format=dot (the JSON lists steps, not edges).
  const DOT_INPUT = /^\s*in(\d+) \[label="((?:[^"\\]|\\.)*)"/;
  const DOT_EDGE = /^\s*(s|in)(\d+) -> s(\d+) \[label="((?:[^"\\]|\\.)*)"/;
  const unescapeDot = (s) => s.replace(/\\(.)/g, "$1");

  function graphFromPlan(p, dot) {
    const nodes = [];
    const edges = [];
    let inputBytes = 0;
    for (const line of dot.split("\n")) {
      let m = DOT_INPUT.exec(line);
      if (m) {
        const cut = m[2].lastIndexOf("\\n");
        const name = unescapeDot(m[2].slice(0, cut));
        const spec = /^\[([\d, ]*)\] (\w+)$/.exec(m[2].slice(cut + 2));
        const shape = spec && spec[1].trim() ? spec[1].split(",").map(Number) : [];
        const dtype = spec ? spec[2] : "";
        const b = shape.reduce((a, d) => a * d, 1) * (ITEMSIZE[dtype] || 0);
        inputBytes += b;
        nodes.push({ key: `in${m[1]}`, id: name, title: name, sub: `${shapeText(shape)} ${dtype}`,
                     kind: "input", phase: "input", shape, dtype, bytes: b, sources: [] });
        continue;
      }
      m = DOT_EDGE.exec(line);
      if (m) edges.push({ from: `${m[1]}${m[2]}`, to: `s${m[3]}`, label: unescapeDot(m[4]) });
    }
    const outputs = new Set();
    for (const s of p.nodes) {
      const phase = phaseOf(s.kind) === "aux" ? "forward" : phaseOf(s.kind);
      nodes.push({
        key: `s${s.step}`, id: s.id, step: s.step, kind: s.kind, phase,
        title: `${s.id === null ? "" : s.id + " "}${s.op}`,
        sub: `${shapeText(s.shape)} ${s.dtype} · ${bytes(s.bytes)}`,
        shape: s.shape, dtype: s.dtype, bytes: s.bytes, cost: s.cost, freed: s.freed_after,
        sources: [],
      });
      if (s.kind === "node" && s.freed_after === null) outputs.add(`s${s.step}`);
    }
    return { nodes, edges, inputBytes, outputs, layered: "program" };
  }

  // When /plan refuses the request: its graph as written (ids, ops, references).
  function graphFromRequest(body) {
    const out = { nodes: [], edges: [], inputBytes: 0, outputs: new Set(), layered: "request" };
    let b;
    try { b = plain(body); } catch { return out; }
    const graph = b && b.graph;
    if (!graph || !Array.isArray(graph.nodes)) return out;
    const known = new Map();
    for (const name of Object.keys(b.inputs || {})) {
      known.set(name, `in:${name}`);
      out.nodes.push({ key: `in:${name}`, id: name, title: name, sub: "input", kind: "input",
                       phase: "input", sources: [] });
    }
    graph.nodes.forEach((n, index) => {
      if (!n || typeof n.id !== "string") return;
      known.set(n.id, `n:${n.id}`);
      out.nodes.push({ key: `n:${n.id}`, id: n.id, index, kind: "node", phase: "forward",
                       title: `${n.id} ${n.op || ""}`.trim(),
                       sub: n.expr !== undefined ? clip(String(n.expr), 28) : "",
                       expr: n.expr, args: n.args, sources: [] });
    });
    for (const n of out.nodes) {
      if (n.phase === "input") continue;
      const refs = Array.isArray(n.args) ? n.args.filter((a) => typeof a === "string")
        : typeof n.expr === "string" ? n.expr.match(/[A-Za-z_][A-Za-z0-9_]*/g) || [] : [];
      for (const r of new Set(refs)) {
        if (known.has(r) && r !== n.id) out.edges.push({ from: known.get(r), to: n.key, label: "" });
      }
    }
    for (const o of Array.isArray(graph.outputs) ? graph.outputs : []) {
      if (known.has(o)) out.outputs.add(known.get(o));
    }
    return out;
  }

  // ------------------------------------------------------------ the graph (layered SVG)
  const BOX_W = 132, BOX_H = 40, COL_W = 150, ROW_H = 72, PAD = 24;

  function layout(g) {
    const byKey = new Map(g.nodes.map((n) => [n.key, n]));
    for (const e of g.edges) {
      const to = byKey.get(e.to);
      if (to && byKey.has(e.from)) to.sources.push(e.from);
    }
    // Depth: inputs 0; a step one below its deepest source; the backward steps below
    // every forward one.
    const depth = new Map();
    const visiting = new Set();
    function depthOf(key, floor) {
      if (depth.has(key)) return depth.get(key);
      const n = byKey.get(key);
      if (n.phase === "input") { depth.set(key, 0); return 0; }
      if (visiting.has(key)) return floor; // (a cycle in a request: drawn, not followed)
      visiting.add(key);
      let d = floor;
      for (const s of n.sources) d = Math.max(d, depthOf(s, floor) + 1);
      visiting.delete(key);
      depth.set(key, d);
      return d;
    }
    const forward = g.nodes.filter((n) => n.phase === "forward");
    const backward = g.nodes.filter((n) => n.phase === "backward");
    for (const n of forward) depthOf(n.key, 1);
    const maxForward = Math.max(0, ...forward.map((n) => depth.get(n.key)));
    for (const n of backward) depthOf(n.key, maxForward + 1);
    const layers = [];
    for (const n of g.nodes) {
      if (!depth.has(n.key)) depthOf(n.key, 1);
      const d = depth.get(n.key);
      (layers[d] = layers[d] || []).push(n);
    }
    // Order each layer by its nodes' sources' mean position (one barycentre sweep).
    const position = new Map();
    layers.forEach((layer) => {
      if (!layer) return;
      const bary = (n) => {
        const xs = n.sources.filter((s) => position.has(s)).map((s) => position.get(s));
        return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : Infinity;
      };
      layer.sort((a, b) => (bary(a) - bary(b)) || 0);
      layer.forEach((n, i) => position.set(n.key, i - (layer.length - 1) / 2));
    });
    const widest = Math.max(1, ...layers.filter(Boolean).map((l) => l.length));
    const width = PAD * 2 + widest * COL_W;
    layers.forEach((layer, d) => {
      if (!layer) return;
      for (const n of layer) {
        n.x = width / 2 + position.get(n.key) * COL_W;
        n.y = PAD + 10 + d * ROW_H;
      }
    });
    return { byKey, layers, width, height: PAD * 2 + 20 + layers.length * ROW_H - (ROW_H - BOX_H),
             backwardRow: backward.length ? maxForward + 1 : null };
  }

  function drawGraph(g) {
    ui.graph.replaceChildren();
    drawn = g;
    if (!g.nodes.length) {
      ui.graph.append(el("div", { class: "empty" }, "No graph to draw."));
      return;
    }
    const L = layout(g);
    const root = svg("svg", { width: L.width, height: L.height, viewBox: `0 0 ${L.width} ${L.height}`,
                              role: "img", "aria-label": "program graph" });
    const defs = svg("defs", {}, root);
    const marker = svg("marker", { id: "arrow", viewBox: "0 0 8 8", refX: 8, refY: 4,
                                   markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, defs);
    svg("path", { d: "M0,0 L8,4 L0,8 z", class: "arrow" }, marker);
    if (L.backwardRow !== null) {
      const y = PAD + 10 + L.backwardRow * ROW_H - (ROW_H - BOX_H) / 2;
      svg("line", { x1: 4, x2: L.width - 4, y1: y, y2: y, class: "band-line" }, root);
      svg("text", { x: 8, y: y - 6, class: "band" }, root, "forward ↑   backward ↓");
    }
    const edgeLayer = svg("g", { class: "edges" }, root);
    for (const e of g.edges) {
      const a = L.byKey.get(e.from);
      const b = L.byKey.get(e.to);
      if (!a || !b) continue;
      const x1 = a.x, y1 = a.y + BOX_H, x2 = b.x, y2 = b.y;
      const bend = Math.max(24, (y2 - y1) / 2);
      const path = svg("path", {
        d: `M${x1},${y1} C${x1},${y1 + bend} ${x2},${y2 - bend} ${x2},${y2 - 1}`,
        class: `edge ${b.phase === "backward" ? "backward" : ""}`, "marker-end": "url(#arrow)",
        "data-testid": "edge", "data-from": e.from, "data-to": e.to, "data-shape": e.label,
      }, edgeLayer);
      svg("title", {}, path, `${a.title} → ${b.title} ${e.label}`);
      if (e.label) {
        svg("text", { x: (x1 + x2) / 2 + 4, y: (y1 + y2) / 2, class: "edge-label" }, edgeLayer, e.label);
      }
    }
    for (const n of g.nodes) {
      const cls = ["node", n.phase === "forward" && AUX_KINDS.has(n.kind) ? "aux" : n.phase];
      if (g.outputs.has(n.key)) cls.push("output");
      const group = svg("g", {
        class: cls.join(" "), transform: `translate(${n.x - BOX_W / 2},${n.y})`,
        "data-testid": "node", "data-key": n.key, "data-node-id": n.id === null ? "" : n.id,
        "data-kind": n.kind, "data-phase": n.phase,
        ...(n.step !== undefined ? { "data-step": n.step } : {}),
      }, root);
      svg("rect", { width: BOX_W, height: BOX_H, rx: 6 }, group);
      svg("text", { x: 8, y: 16 }, group, clip(n.title, 20));
      svg("text", { x: 8, y: 31, class: "sub" }, group, clip(n.sub || "", 26));
      const tip = [n.step !== undefined ? `step ${n.step} (${n.kind})` : n.kind, n.title, n.sub];
      if (n.cost !== undefined) tip.push(`cost ${n.cost}`);
      if (n.freed !== undefined) tip.push(n.freed === null ? "held to the end" : `freed after step ${n.freed}`);
      if (n.expr !== undefined) tip.push(`expr: ${n.expr}`);
      svg("title", {}, group, tip.filter(Boolean).join("\n"));
    }
    ui.graph.append(root);
  }

  // ------------------------------------------------------------ memory timeline
  // The live bytes of `steps` (a plan's nodes) in `t`, against the budget.
  function drawTimeline(t, steps, planned, budget, inputBytes) {
    const freedAt = new Map();
    steps.forEach((s) => {
      if (s.freed_after !== null) {
        if (!freedAt.has(s.freed_after)) freedAt.set(s.freed_after, []);
        freedAt.get(s.freed_after).push(s);
      }
    });
    // Live bytes at each step: the inputs, plus every value made and not yet freed (a
    // value freed after step k is still live during k).
    let live = inputBytes;
    const series = steps.map((s) => {
      live += s.bytes;
      const now = live;
      for (const f of freedAt.get(s.step) || []) live -= f.bytes;
      return now;
    });
    let peakStep = -1;
    let peak = inputBytes;
    series.forEach((v, i) => { if (v > peak) { peak = v; peakStep = i; } });
    const over = planned > budget;
    t.dataset.overBudget = String(over);
    t.dataset.peakBytes = String(peak);
    t.dataset.plannedPeakBytes = String(planned);
    t.dataset.budgetBytes = String(budget);
    t.replaceChildren();

    const n = Math.max(steps.length, 1);
    const barW = Math.max(3, Math.min(28, Math.floor(900 / n)));
    const left = 70, right = 190, top = 18, h = 180;
    const width = left + right + n * barW;
    const height = top + h + 34;
    const top1 = Math.max(peak, planned, 1);
    // The budget is drawn to scale when it is near the peak; far above, at the top.
    const budgetOnScale = budget <= top1 * 3;
    const yMax = (budgetOnScale ? Math.max(top1, budget) : top1) * 1.12;
    const y = (v) => top + h - (Math.min(v, yMax) / yMax) * h;
    const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
                              "aria-label": "memory timeline" });
    if (budgetOnScale && budget < yMax) {
      svg("rect", { x: left, y: top, width: n * barW, height: y(budget) - top, class: "over-zone" }, root);
    }
    svg("line", { x1: left, x2: left, y1: top, y2: top + h, class: "axis" }, root);
    svg("line", { x1: left, x2: left + n * barW, y1: top + h, y2: top + h, class: "axis" }, root);
    for (const v of [0, yMax / 2 / 1.12, yMax / 1.12]) {
      svg("text", { x: left - 6, y: y(v) + 3, "text-anchor": "end", class: "axis-label" }, root, bytes(Math.round(v)));
    }
    let firstBackward = null;
    steps.forEach((s, i) => {
      const phase = phaseOf(s.kind);
      if (phase === "backward" && firstBackward === null) firstBackward = i;
      const x = left + i * barW;
      const v = series[i];
      const bar = svg("rect", { x: x + 0.5, y: y(v), width: Math.max(1, barW - 1), height: top + h - y(v),
                                class: `bar ${phase}`, "data-testid": "live-bar", "data-step": s.step,
                                "data-bytes": v }, root);
      svg("title", {}, bar, `step ${s.step} ${s.id === null ? "" : s.id + " "}${s.op} (${s.kind}): ${bytes(v)} live`);
      if (budgetOnScale && v > budget) {
        svg("rect", { x: x + 0.5, y: y(v), width: Math.max(1, barW - 1), height: y(budget) - y(v),
                      class: "bar above" }, root);
      }
    });
    if (firstBackward !== null) {
      const x = left + firstBackward * barW;
      svg("line", { x1: x, x2: x, y1: top, y2: top + h, class: "band-line" }, root);
      svg("text", { x: x + 4, y: top + h + 26, class: "band" }, root, "backward →");
    }
    svg("text", { x: left, y: top + h + 26, class: "band" }, root, "forward →");
    svg("text", { x: left, y: top + h + 13, class: "axis-label" }, root, "step 0");
    svg("text", { x: left + n * barW, y: top + h + 13, "text-anchor": "end", class: "axis-label" }, root,
        `step ${steps.length - 1}`);
    // The service's planned peak (its planner reuses buffers in place, so it may be lower).
    const py = y(planned);
    svg("line", { x1: left, x2: left + n * barW, y1: py, y2: py, class: "planned-line",
                  "data-testid": "planned-peak-line" }, root);
    svg("text", { x: left + n * barW + 6, y: py + 3, class: "axis-label" }, root, `planned peak ${bytes(planned)}`);
    // The budget.
    const by = budgetOnScale ? y(budget) : top;
    const line = svg("line", {
      x1: left, x2: left + n * barW, y1: by, y2: by, class: `budget-line ${over ? "crossed" : ""}`,
      "data-testid": "budget-line", "data-bytes": budget, "data-crossed": String(over),
      "data-on-scale": String(budgetOnScale),
    }, root);
    svg("title", {}, line, `memory budget ${bytes(budget)}`);
    svg("text", { x: left + n * barW + 6, y: by + (budgetOnScale ? 3 : 10), class: "axis-label" }, root,
        `budget ${bytes(budget)}${budgetOnScale ? "" : " ↑ (off scale)"}`);
    // The peak.
    const px = peakStep < 0 ? left : left + peakStep * barW + barW / 2;
    const mark = svg("g", { "data-testid": "peak", "data-bytes": peak, "data-step": peakStep,
                            "data-over-budget": String(over) }, root);
    svg("circle", { cx: px, cy: y(peak), r: 4, class: "peak-marker" }, mark);
    svg("text", { x: px + 6, y: Math.max(top + 8, y(peak) - 6), class: "axis-label" }, mark,
        `peak ${bytes(peak)}${peakStep >= 0 ? ` at step ${peakStep}` : ""}`);
    t.append(root);
    t.append(el("div", { class: "empty" },
      over ? `Over budget: the planned peak ${bytes(planned)} crosses the budget ${bytes(budget)}.`
           : `Within budget: planned peak ${bytes(planned)} of ${bytes(budget)}.`,
      " Bars: the inputs plus each step's value until the step after which it is freed."));
  }

  // ------------------------------------------------------------ most expensive steps
  function drawCostly(p) {
    const total = p.compute_cost || 1;
    const top = [...p.nodes].sort((a, b) => b.cost - a.cost).slice(0, 10);
    const body = ui.costly.tBodies[0];
    body.replaceChildren();
    for (const s of top) {
      const share = el("span", { class: "share" });
      share.style.width = `${Math.max(1, Math.round(60 * s.cost / total))}px`;
      const row = el("tr", { "data-testid": "costly-row", "data-step": s.step },
        el("td", { class: "num" }, String(s.step)), el("td", {}, s.id === null ? "–" : s.id),
        el("td", {}, s.op), el("td", {}, s.kind), el("td", { class: "mono" }, shapeText(s.shape)),
        el("td", { class: "num" }, count(s.cost)),
        el("td", {}, share, `${(100 * s.cost / total).toFixed(1)}%`));
      row.addEventListener("click", () => focusNode(`s${s.step}`));
      body.append(row);
    }
  }

  function focusNode(key) {
    for (const g of ui.graph.querySelectorAll(".node.focus")) g.classList.remove("focus");
    const g = ui.graph.querySelector(`[data-key="${CSS.escape(key)}"]`);
    if (g) {
      g.classList.add("focus");
      g.scrollIntoView({ block: "nearest", inline: "center" });
    }
  }

  // ------------------------------------------------------------ problems
  function clearProblem() {
    ui.problem.hidden = true;
    ui.problem.replaceChildren();
    for (const g of ui.graph.querySelectorAll(".node.error")) {
      g.classList.remove("error");
      delete g.dataset.error;
      g.querySelectorAll(".error-note").forEach((x) => x.remove());
    }
  }

  // The nodes a problem names: `node`, and any `loc` that points into the graph's nodes
  // or the inputs.
  function blamed(problem, body) {
    const ids = new Set();
    if (typeof problem.node === "string") ids.add(problem.node);
    let b = null;
    try { b = body ? plain(body) : null; } catch { b = null; }
    for (const e of Array.isArray(problem.errors) ? problem.errors : []) {
      const loc = Array.isArray(e.loc) ? e.loc : [];
      if (loc[0] === "graph" && loc[1] === "nodes" && Number.isInteger(loc[2])) {
        const n = b && b.graph && Array.isArray(b.graph.nodes) ? b.graph.nodes[loc[2]] : null;
        if (n && typeof n.id === "string") ids.add(n.id);
      } else if ((loc[0] === "inputs" || loc[0] === "grad_outputs") && typeof loc[1] === "string") {
        ids.add(loc[1]);
      }
    }
    return ids;
  }

  function showProblem(problem, body = null) {
    const slug = typeof problem.type === "string" ? problem.type.replace("urn:gradserve:problem:", "") : "";
    const head = el("h4", {}, `${problem.status ? problem.status + " " : ""}${problem.title || "Error"}`,
                    slug ? ` (${slug})` : "");
    const parts = [head, el("div", { "data-testid": "problem-detail" }, problem.detail || "")];
    if (problem.node) parts.push(el("div", {}, "node: ", el("code", {}, String(problem.node))));
    const errors = Array.isArray(problem.errors) ? problem.errors : [];
    if (errors.length) {
      parts.push(el("ul", {}, ...errors.map((e) => el("li", {},
        el("code", {}, (Array.isArray(e.loc) ? e.loc : []).join(" › ")), " ", String(e.msg || "")))));
    }
    ui.problem.replaceChildren(...parts);
    ui.problem.hidden = false;
    ui.problem.dataset.node = problem.node || "";
    // On the graph: the node (or input) that caused it.
    const ids = blamed(problem, body);
    let first = null;
    for (const g of ui.graph.querySelectorAll('[data-testid="node"]')) {
      const id = g.dataset.nodeId;
      if (!id || !ids.has(id) || g.dataset.phase === "backward") continue;
      g.classList.add("error");
      g.dataset.error = "true";
      svg("text", { x: 0, y: BOX_H + 12, class: "error-note" }, g, clip(`⚠ ${problem.detail || problem.title || ""}`, 64));
      const tip = g.querySelector("title");
      if (tip) tip.textContent += `\n\n${problem.detail || ""}`;
      first = first || g;
    }
    if (first) first.scrollIntoView({ block: "nearest", inline: "center" });
  }

  // ------------------------------------------------------------ run
  function tensorText(t) {
    if (!t || typeof t !== "object") return String(t);
    const parts = [`${t.dtype} ${shapeText(plain(t.shape || []))}`];
    if (t.data !== undefined) parts.push(`= ${writeLossless(t.data, 4000)}`);
    else if (t.b64 !== undefined) parts.push(`b64 ${clip(String(t.b64), 200)}`);
    if (t.requires_grad !== undefined) parts.push(`requires_grad=${t.requires_grad}`);
    if (t.grad_fn !== undefined) parts.push(`grad_fn=${t.grad_fn}`);
    return parts.join("  ");
  }

  async function run() {
    const req = readRequest();
    if (!req) return;
    ui.run.disabled = true;
    try {
      if (plannedText !== req.text) await plan();
      const endpoint = endpointOf(req.body);
      let text = req.text;
      if (req.body.encoding === "binary") { // a binary answer cannot be shown as text
        const copy = Object.assign(Object.create(null), req.body, { encoding: "json" });
        text = writeLossless(copy);
      }
      setStatus(`Running POST /${endpoint}…`, "running");
      const t0 = performance.now();
      const r = await post(`/${endpoint}`, text);
      const ms = performance.now() - t0;
      if (!r.ok) {
        clearProblem();
        showProblem(r.problem, req.body);
        ui.results.textContent = `POST /${endpoint} → ${r.status} ${r.problem.title || ""}\n${r.problem.detail || ""}`;
        ui.results.dataset.status = String(r.status);
        setStatus(`POST /${endpoint} answered ${r.status}.`, "run-error");
        return;
      }
      clearProblem();
      const answer = parseLossless(r.raw);
      const lines = [`POST /${endpoint} → ${r.status}  (${ms.toFixed(1)} ms round trip)`, "", "outputs"];
      const name = (k) => `  ${k}: `;
      for (const k of Object.keys(answer.outputs || {})) lines.push(name(k) + tensorText(answer.outputs[k]));
      if (answer.gradients) {
        lines.push("", "gradients");
        const keys = Object.keys(answer.gradients);
        if (!keys.length) lines.push("  (none)");
        for (const k of keys) lines.push(name(k) + tensorText(answer.gradients[k]));
      }
      const meta = answer.meta ? plain(answer.meta) : {};
      if (meta.timings_ms) {
        lines.push("", "timings (ms)");
        for (const [phase, v] of Object.entries(meta.timings_ms)) lines.push(`  ${phase}: ${v}`);
      }
      lines.push("", "meta");
      for (const k of ["device", "no_grad", "nodes", "peak_bytes", "planned_peak_bytes", "compute_cost", "graph_id"]) {
        if (meta[k] !== undefined) lines.push(`  ${k}: ${meta[k]}`);
      }
      ui.results.textContent = lines.join("\n");
      ui.results.dataset.status = String(r.status);
      setStatus(`POST /${endpoint} answered ${r.status}.`, "ran");
    } catch (err) {
      setStatus(`Failed: ${err.message}`, "error");
    } finally {
      ui.run.disabled = false;
    }
  }

  // ------------------------------------------------------------ loading requests
  async function loadExamples() {
    const r = await fetch("/explorer/examples.json");
    const examples = await r.json();
    for (const [name, ex] of Object.entries(examples)) {
      ui.example.append(el("option", { value: name }, `${name}: ${ex.title}`));
    }
    return examples;
  }

  async function start() {
    ui.keyForm.addEventListener("submit", useKey);
    let examples = {};
    try {
      examples = await loadExamples();
    } catch (err) {
      setStatus(`The examples could not be loaded: ${err.message}`);
    }
    ui.example.addEventListener("change", () => {
      const ex = examples[ui.example.value];
      if (ex) { ui.request.value = ex.text; plan(); }
    });
    ui.upload.addEventListener("change", () => {
      const file = ui.upload.files && ui.upload.files[0];
      if (!file) return;
      file.text().then((text) => { ui.request.value = text; plan(); });
    });
    ui.plan.addEventListener("click", () => { plan(); });
    ui.run.addEventListener("click", () => { run(); });
    ui.endpoint.addEventListener("change", () => { plannedText = null; });
    ui.request.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); run(); }
    });
    const params = new URLSearchParams(window.location.search);
    const wanted = params.get("example");
    const given = params.get("request");
    let loaded = false;
    if (given !== null) {
      ui.request.value = given;
      loaded = true;
    } else if (wanted !== null) {
      if (examples[wanted]) {
        ui.example.value = wanted;
        ui.request.value = examples[wanted].text;
        loaded = true;
      } else {
        setStatus(`No example named "${wanted}" (there are: ${Object.keys(examples).join(", ")}).`);
      }
    }
    if (loaded) {
      const ok = await plan();
      if (ok && params.get("run") === "1") await run();
    } else if (document.body.dataset.state === "loading") {
      setStatus("Paste or upload a request, or choose an example.", "idle");
    }
  }

  start();
})();
