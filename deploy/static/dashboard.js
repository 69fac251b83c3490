// pdserve operator dashboard: polls <prefix>/v1/cluster/status every 2 s and renders it.
// No libraries: the DOM is built with textContent (never innerHTML with server data) and the
// charts are plain SVG paths. The latency series live only in this page (the ingress keeps
// percentiles over its own window, not a history).
(() => {
  "use strict";

  const POLL_MS = 2000;
  const TIMEOUT_MS = 8000;
  const HISTORY_MS = 10 * 60 * 1000;
  const MIN_SPAN_MS = 60 * 1000;
  const POOL_ORDER = ["prefill", "decode", "colocated"];
  const SVG_NS = "http://www.w3.org/2000/svg";

  // The page is served at <prefix>/dashboard (Serve route prefix, possibly empty); the API
  // lives next to it.
  const prefix = location.pathname.replace(/\/dashboard(\/.*)?$/, "");
  const STATUS_URL = `${prefix}/v1/cluster/status`;
  const apiKey = new URLSearchParams(location.search).get("key");
  const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};

  const history = [];          // {t, ttft: {p50,p90,p99}, itl: {...}, bw}
  let previous = null;         // {time, decodeBytes: Map(worker_id -> transfer_bytes)}

  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ formatting
  const fmtInt = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
  const fmtPct = (x) => (x == null ? "–" : `${(x * 100).toFixed(1)}%`);
  const fmtMs = (s) => (s == null ? "–" : `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms`);
  function fmtBytes(b) {
    if (b == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(b) >= 1024 && i < units.length - 1) { b /= 1024; i += 1; }
    return `${b.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
  }
  const fmtRate = (bps) => (bps == null ? "–" : `${fmtBytes(bps)}/s`);
  function fmtWindow(s) {
    if (s == null) return "–";
    return s >= 60 ? `${Math.round(s / 60)} min` : `${Math.round(s)} s`;
  }

  function setText(id, text, cls) {
    const el = $(id);
    el.textContent = text;
    if (cls !== undefined) el.className = cls;
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k === "testid") node.dataset.testid = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : String(c));
    return node;
  }

  // ------------------------------------------------------------------ derived figures
  const sum = (xs, f) => xs.reduce((acc, x) => acc + (Number(f(x)) || 0), 0);
  const healthyIn = (replicas) => (replicas || []).filter((r) => r.healthy);

  function bandwidth(status) {
    // bytes received by the decode pool since the last poll; a replica that restarted (new id or
    // a counter that went down) contributes nothing this round rather than a negative rate
    const decode = healthyIn(status.pools.decode);
    const bytes = new Map(decode.map((r) => [r.worker_id, r.transfer_bytes || 0]));
    let rate = null;
    if (previous && status.time > previous.time) {
      let delta = 0;
      for (const [id, b] of bytes) {
        const before = previous.decodeBytes.get(id);
        if (before != null && b >= before) delta += b - before;
      }
      rate = delta / (status.time - previous.time);
    }
    previous = { time: status.time, decodeBytes: bytes };
    return rate;
  }

  // ------------------------------------------------------------------ cards
  function renderTotals(status, rate) {
    const req = status.requests;
    setText("model", status.model);
    setText("mode", status.mode);
    setText("block-size", status.block_size);
    setText("requests-finished", fmtInt(req.finished));
    setText("requests-started", fmtInt(req.started));
    setText("requests-active", fmtInt(req.active));
    setText("requests-failed", fmtInt(req.failed), req.failed ? "bad" : "");
    setText("cluster-hit-rate", fmtPct(req.cluster_prefix_hit_rate));
    setText("cached-tokens", fmtInt(req.cached_prompt_tokens));
    setText("prompt-tokens", fmtInt(req.prompt_tokens));
    setText("window-s", fmtWindow(req.window_s));

    const decode = healthyIn(status.pools.decode);
    const prefill = healthyIn(status.pools.prefill);
    setText("transfer-bandwidth", status.pools.decode ? fmtRate(rate) : "n/a");
    setText("transfer-total", fmtBytes(sum(decode, (r) => r.transfer_bytes)));
    setText("transfer-count", fmtInt(sum(decode, (r) => r.transfers)));
    const failures = sum(decode, (r) => r.transfer_failures);
    setText("transfer-failures", fmtInt(failures), failures ? "bad" : "");
    setText("recomputed-prefills", fmtInt(sum(decode, (r) => r.recomputed_prefills)));
    setText("leases-expired", fmtInt(sum(prefill, (r) => r.leases_expired)));
    setText("skipped-prefills", fmtInt(status.routing ? status.routing.skipped_prefills : null));

    const index = status.index || {};
    if (!index.configured) {
      setText("index-health", "not configured", "value muted");
    } else {
      setText("index-health", index.healthy ? "healthy" : "unreachable",
              `value ${index.healthy ? "good" : "bad"}`);
    }
    setText("index-live-workers", fmtInt(index.live_workers));
    renderIndexWorkers(index.workers || {});
  }

  function renderIndexWorkers(workers) {
    const rows = Object.entries(workers).map(([id, w]) => el("tr", { testid: `index-worker-${id}` },
      el("td", { class: "mono" }, id), el("td", {}, w.role ?? "–"),
      el("td", { class: "num" }, `${fmtInt(w.free_blocks)} / ${fmtInt(w.total_blocks)}`),
      el("td", { class: "num" }, fmtInt(w.num_running)), el("td", { class: "num" }, fmtInt(w.num_waiting))));
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "5", class: "muted" }, "no live workers")));
    $("index-workers").replaceChildren(...rows);
  }

  // ------------------------------------------------------------------ pools
  function kvBar(usage) {
    const pct = Math.max(0, Math.min(1, usage || 0));
    const fill = el("div", { class: `fill${pct >= 0.95 ? " full" : pct >= 0.8 ? " high" : ""}` });
    fill.style.width = `${(pct * 100).toFixed(1)}%`;
    return el("div", { class: "kvbar" }, el("div", { class: "track" }, fill),
              el("span", { class: "pct", testid: "kv-usage" }, fmtPct(pct)));
  }

  function replicaRow(r) {
    const id = r.worker_id;
    if (!r.healthy) {
      return el("tr", { class: "down", testid: `replica-${id}`, "data-healthy": "false" },
        el("td", { class: "mono" }, id),
        el("td", {}, el("span", { class: "badge badge-bad", testid: "health" }, "down")),
        el("td", { colspan: "11", class: "error-text" }, r.error || "no answer"));
    }
    const hit = r.prompt_tokens ? r.cached_prompt_tokens / r.prompt_tokens : null;
    const cell = (text, testid) => el("td", { class: "num", testid }, text);
    const row = el("tr", { testid: `replica-${id}`, "data-healthy": "true", "data-role": r.role },
      el("td", { class: "mono" }, id),
      el("td", {}, el("span", { class: "badge badge-ok", testid: "health" }, "healthy")),
      el("td", {}, r.device ?? "–"),
      el("td", { title: `${fmtInt(r.free_blocks)} of ${fmtInt(r.total_blocks)} blocks free` }, kvBar(r.kv_usage)),
      cell(fmtInt(r.num_running), "running"),
      cell(fmtInt(r.num_waiting), "waiting"),
      cell(fmtInt(r.requests), "requests"),
      cell(fmtPct(hit), "hit-rate"),
      cell(fmtInt(r.transfers), "transfers"),
      cell(fmtBytes(r.transfer_bytes), "transfer-bytes"),
      cell(fmtInt(r.transfer_failures), "transfer-failures"),
      cell(fmtInt(r.recomputed_prefills), "recomputed"),
      cell(fmtInt(r.preemptions), "preemptions"));
    if (r.index && r.index.registered === false) row.title = "not registered in the prefix index";
    return row;
  }

  function renderPools(pools) {
    const names = [...POOL_ORDER.filter((p) => p in pools), ...Object.keys(pools).filter((p) => !POOL_ORDER.includes(p))];
    const sections = names.map((name) => {
      const replicas = pools[name] || [];
      const section = $("pool-template").content.firstElementChild.cloneNode(true);
      section.dataset.testid = `pool-${name}`;
      section.querySelector(".pool-name").textContent = `${name[0].toUpperCase()}${name.slice(1)} pool`;
      const healthy = replicas.filter((r) => r.healthy).length;
      section.querySelector(".pool-count").textContent =
        `${healthy} of ${replicas.length} replica${replicas.length === 1 ? "" : "s"} healthy`;
      section.querySelector("tbody").replaceChildren(...replicas.map(replicaRow));
      return section;
    });
    $("pools").replaceChildren(...sections);
  }

  // ------------------------------------------------------------------ charts
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  }

  // a tick step of 1, 2, 2.5 or 5 times a power of ten, four of them covering the largest value
  function niceStep(max) {
    const raw = max > 0 ? max / 4 : 0.25;
    const mag = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 2.5, 5, 10].map((m) => m * mag).find((step) => step >= raw);
  }

  function tickLabel(v, step) {
    // as many decimals as the step needs: 0.25 -> 2, 2.5 -> 1, 20 -> 0
    let decimals = 0;
    while (decimals < 4 && Math.abs(step * 10 ** decimals - Math.round(step * 10 ** decimals)) > 1e-9) decimals += 1;
    return v.toFixed(decimals);
  }

  // series: [{cls, values: [number|null per history point]}], already in display units; a null
  // breaks the line. Drawn at the element's pixel size so text and strokes keep their shape.
  function drawChart(id, series) {
    const chart = $(id);
    const W = Math.max(200, Math.round(chart.clientWidth || 640)), H = 200;
    const left = 46, right = 10, top = 10, bottom = 22;
    chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const nodes = [];
    const points = history.length;
    const end = points ? history[points - 1].t : 0;
    const span = points ? Math.max(MIN_SPAN_MS, Math.min(HISTORY_MS, end - history[0].t)) : MIN_SPAN_MS;
    const start = end - span;
    const step = niceStep(Math.max(0, ...series.flatMap((s) => s.values).filter((v) => v != null)));
    const ymax = step * 4;
    const x = (t) => left + ((t - start) / span) * (W - left - right);
    const y = (v) => top + (1 - v / ymax) * (H - top - bottom);

    for (let i = 0; i <= 4; i += 1) {
      const v = step * i;
      nodes.push(svg("line", { class: "gridline", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
      const label = svg("text", { class: "axis-label", x: left - 6, y: y(v) + 4, "text-anchor": "end" });
      label.textContent = tickLabel(v, step);
      nodes.push(label);
    }
    for (const ago of [0, span / 2, span]) {
      const label = svg("text", { class: "axis-label", x: x(end - ago), y: H - 5,
        "text-anchor": ago === 0 ? "end" : ago === span ? "start" : "middle" });
      label.textContent = ago === 0 ? "now" : `−${Math.round(ago / 1000)} s`;
      nodes.push(label);
    }
    let drawn = 0;
    for (const s of series) {
      let d = "";
      const dots = [];  // a point with no neighbour draws no line: mark it, and the newest one
      s.values.forEach((v, i) => {
        if (v == null) return;
        const pen = i > 0 && s.values[i - 1] != null;
        const [px, py] = [x(history[i].t).toFixed(1), y(v).toFixed(1)];
        d += `${pen ? "L" : "M"}${px},${py}`;
        const alone = !pen && (i + 1 >= s.values.length || s.values[i + 1] == null);
        if (alone || i === s.values.length - 1) dots.push([px, py]);
        drawn += 1;
      });
      if (d) nodes.push(svg("path", { class: s.cls, d }));
      for (const [cx, cy] of dots) nodes.push(svg("circle", { class: `dot-${s.cls}`, cx, cy, r: 3 }));
    }
    if (!drawn) {
      const empty = svg("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" });
      empty.textContent = "no data yet";
      nodes.push(empty);
    }
    chart.replaceChildren(...nodes);
    chart.dataset.points = String(drawn);
  }

  const inMs = (key) => ["p50", "p90", "p99"].map((p) => ({
    cls: `s-${p}`, values: history.map((h) => (h[key][p] == null ? null : h[key][p] * 1000)) }));

  function renderCharts() {
    drawChart("chart-ttft", inMs("ttft"));
    drawChart("chart-itl", inMs("itl"));
    // one unit for the whole series, picked by its largest rate
    const peak = Math.max(0, ...history.map((h) => h.bw || 0));
    const units = ["B/s", "KiB/s", "MiB/s", "GiB/s"];
    let k = 0;
    while (peak / 1024 ** k >= 1024 && k < units.length - 1) k += 1;
    setText("bw-unit", units[k]);
    drawChart("chart-bandwidth", [{ cls: "s-bw", values: history.map((h) => (h.bw == null ? null : h.bw / 1024 ** k)) }]);
    const last = history[history.length - 1];
    const trio = (p) => `p50 ${fmtMs(p.p50)} · p90 ${fmtMs(p.p90)} · p99 ${fmtMs(p.p99)}`;
    setText("ttft-now", last ? trio(last.ttft) : "");
    setText("itl-now", last ? trio(last.itl) : "");
    setText("bw-now", last && last.bw != null ? `now ${fmtRate(last.bw)}` : "");
  }

  // ------------------------------------------------------------------ polling
  function setConnection(ok, text) {
    $("conn-dot").className = `dot ${ok ? "dot-ok" : "dot-bad"}`;
    setText("conn-status", text);
  }

  async function poll() {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
    try {
      const resp = await fetch(STATUS_URL, { headers, cache: "no-store", signal: abort.signal });
      if (!resp.ok) {
        let message = `HTTP ${resp.status}`;
        try { message += `: ${(await resp.json()).error.message}`; } catch (_) { /* not an OpenAI error body */ }
        throw new Error(message);
      }
      const status = await resp.json();
      const rate = bandwidth(status);
      const t = status.time * 1000;
      history.push({ t, ttft: status.requests.ttft_s, itl: status.requests.itl_s, bw: rate });
      while (history.length && history[0].t < t - HISTORY_MS) history.shift();
      renderTotals(status, rate);
      renderPools(status.pools);
      renderCharts();
      setConnection(true, `updated ${new Date(t).toLocaleTimeString()}`);
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    } catch (err) {
      setConnection(false, `status unavailable (${err.name === "AbortError" ? "timed out" : err.message})`);
    } finally {
      clearTimeout(timer);
      setTimeout(poll, POLL_MS);  // after the answer, so a slow cluster never piles up requests
    }
  }

  poll();
})();
