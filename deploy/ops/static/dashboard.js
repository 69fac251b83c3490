// pdserve operator dashboard: draws the ingress's server-side window (<prefix>/v1/cluster/history,
// one sample every 5 s over the last 10 minutes) at once, then every 2 s polls
// <prefix>/v1/cluster/status for the figures and the history's newer samples for the charts.
// No libraries: the DOM is built with textContent (never innerHTML with server data) and the
// charts are plain SVG paths.
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
  const HISTORY_URL = `${prefix}/v1/cluster/history`;
  const apiKey = new URLSearchParams(location.search).get("key");
  const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};

  // the server's samples (deploy/ops/status_history.py), t in ms: {t, ttft: {p50,p90,p99}, itl,
  // output_tokens_per_s, failed_per_s, refused_per_s, aborted_per_s, transfer_bytes_per_s, …}
  const history = [];
  let latest = null;           // the last status answer

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
  const fmtPerS = (x, unit, digits = 1) => (x == null ? "–" : `${Number(x).toFixed(digits)} ${unit}/s`);
  const perS = (x) => (x == null ? "–" : `${Number(x).toFixed(2)}/s`);
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

  // ------------------------------------------------------------------ cards
  function renderTotals(status) {
    const req = status.requests;
    setText("model", status.model);
    setText("model-weights", status.model_weights || "");
    document.getElementById("model-weights").classList.toggle("warn", /^RANDOM/.test(status.model_weights || ""));
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

    const rates = status.throughput || {};
    setText("throughput-tokens", fmtPerS(rates.output_tokens_per_s, "tok"));
    setText("throughput-requests", fmtPerS(rates.requests_per_s, "req", 2));
    setText("throughput-window", rates.window_s ? `over ${fmtWindow(rates.window_s)}` : "no window yet");
    setText("error-rate", fmtPct(rates.error_fraction), `value${rates.error_fraction ? " bad" : ""}`);
    setText("failed-rate", perS(rates.failed_per_s));
    setText("refused-rate", perS(rates.refused_per_s));
    const http = status.http || {};
    setText("requests-refused", fmtInt(http.refused), http.refused ? "bad" : "");
    setText("client-errors", fmtInt(http.client_errors));
    $("aborted-wrap").hidden = req.aborted == null;
    setText("requests-aborted", fmtInt(req.aborted));

    const decode = healthyIn(status.pools.decode);
    const prefill = healthyIn(status.pools.prefill);
    setText("transfer-bandwidth", status.pools.decode ? fmtRate(rates.transfer_bytes_per_s) : "n/a");
    setText("transfer-total", fmtBytes(sum(decode, (r) => r.transfer_bytes)));
    setText("transfer-count", fmtInt(sum(decode, (r) => r.transfers)));
    const failures = sum(decode, (r) => r.transfer_failures);
    setText("transfer-failures", fmtInt(failures), failures ? "bad" : "");
    setText("recomputed-prefills", fmtInt(sum(decode, (r) => r.recomputed_prefills)));
    setText("leases-expired", fmtInt(sum(prefill, (r) => r.leases_expired)));
    setText("skipped-prefills", fmtInt(status.routing ? status.routing.skipped_prefills : null));
    setText("migrations", fmtInt(status.routing ? status.routing.migrations : null));

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

  // Blocks in the host and disk KV tiers, and blocks loaded back from them ("–": no tiers).
  function tiersCell(r) {
    if (!r.host_capacity && !r.disk_capacity) return el("td", { class: "num", testid: "kv-tiers" }, "–");
    const title = `host ${fmtInt(r.host_blocks)} of ${fmtInt(r.host_capacity)} blocks, ` +
      `disk ${fmtInt(r.disk_blocks)} of ${fmtInt(r.disk_capacity)}; spills ${fmtInt(r.host_spills)} / ` +
      `${fmtInt(r.disk_spills)}; ${fmtInt(r.tier_loads)} loads, ${fmtMs(r.tier_loads ? r.tier_load_s / r.tier_loads : null)} each`;
    return el("td", { class: "num", testid: "kv-tiers", title },
      `${fmtInt(r.host_blocks)} / ${fmtInt(r.disk_blocks)} · hits ${fmtInt(r.host_hits)} / ${fmtInt(r.disk_hits)}`);
  }

  function replicaRow(r) {
    const id = r.worker_id;
    if (!r.healthy) {
      return el("tr", { class: "down", testid: `replica-${id}`, "data-healthy": "false" },
        el("td", { class: "mono" }, id),
        el("td", {}, el("span", { class: "badge badge-bad", testid: "health" }, "down")),
        el("td", { colspan: "12", class: "error-text" }, r.error || "no answer"));
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
      cell(fmtInt(r.preemptions), "preemptions"),
      tiersCell(r));
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

  // ------------------------------------------------------------------ prefill -> decode pairs
  function renderPairs(status) {
    const pairs = status.pairs || [];
    const cell = (text, testid) => el("td", { class: "num", testid }, text);
    const rows = pairs.map((p) => {
      const prefill = el("td", { class: "mono" }, p.prefill);
      if (p.prefill_live === false) prefill.append(" ", el("span", { class: "badge badge-bad" }, "gone"));
      return el("tr", { testid: `pair-${p.prefill}-${p.decode}`, "data-prefill": p.prefill, "data-decode": p.decode },
        prefill, el("td", { class: "mono" }, p.decode),
        cell(fmtInt(p.transfers), "transfers"),
        cell(fmtBytes(p.transfer_bytes), "transfer-bytes"),
        cell(fmtMs(p.transfer_p50_s), "p50"),
        cell(fmtMs(p.transfer_p99_s), "p99"),
        cell(fmtInt(p.transfer_failures), "failures"),
        cell(fmtInt(p.recomputed_prefills), "recomputed"));
    });
    if (!rows.length) {
      const text = status.pools.decode ? "no transfers yet" : "no decode pool (colocated mode)";
      rows.push(el("tr", {}, el("td", { colspan: "8", class: "muted" }, text)));
    }
    $("pairs").replaceChildren(...rows);
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
    let peak = 0;
    for (const s of series) {
      let d = "";
      const dots = [];  // a point with no neighbour draws no line: mark it, and the newest one
      s.values.forEach((v, i) => {
        if (v == null) return;
        const pen = i > 0 && s.values[i - 1] != null;
        const [px, py] = [x(history[i].t).toFixed(1), y(v).toFixed(1)];
        d += `${pen ? "L" : "M"}${px},${py}`;
        peak = Math.max(peak, v);
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
    chart.dataset.max = String(peak);
  }

  const inMs = (key) => ["p50", "p90", "p99"].map((p) => ({
    cls: `s-${p}`, values: history.map((h) => (h[key] && h[key][p] != null ? h[key][p] * 1000 : null)) }));
  const field = (key, scale = 1) => history.map((h) => (h[key] == null ? null : h[key] / scale));

  function renderCharts() {
    drawChart("chart-ttft", inMs("ttft"));
    drawChart("chart-itl", inMs("itl"));
    drawChart("chart-throughput", [{ cls: "s-tok", values: field("output_tokens_per_s") }]);
    const errors = [{ cls: "s-failed", values: field("failed_per_s") }, { cls: "s-refused", values: field("refused_per_s") }];
    if (history.some((h) => h.aborted_per_s != null)) errors.push({ cls: "s-aborted", values: field("aborted_per_s") });
    drawChart("chart-errors", errors);
    // one unit for the whole series, picked by its largest rate
    const peak = Math.max(0, ...history.map((h) => h.transfer_bytes_per_s || 0));
    const units = ["B/s", "KiB/s", "MiB/s", "GiB/s"];
    let k = 0;
    while (peak / 1024 ** k >= 1024 && k < units.length - 1) k += 1;
    setText("bw-unit", units[k]);
    drawChart("chart-bandwidth", [{ cls: "s-bw", values: field("transfer_bytes_per_s", 1024 ** k) }]);
    const last = history[history.length - 1];
    // latency percentiles: the freshest status when there is one, else the newest sample
    const now = latest ? { ttft: latest.requests.ttft_s, itl: latest.requests.itl_s } : last;
    const trio = (p) => `p50 ${fmtMs(p.p50)} · p90 ${fmtMs(p.p90)} · p99 ${fmtMs(p.p99)}`;
    setText("ttft-now", now && now.ttft ? trio(now.ttft) : "");
    setText("itl-now", now && now.itl ? trio(now.itl) : "");
    setText("throughput-now", last && last.output_tokens_per_s != null
      ? `now ${fmtPerS(last.output_tokens_per_s, "tok")} · ${fmtPerS(last.requests_per_s, "req", 2)}` : "");
    setText("errors-now", last && last.failed_per_s != null
      ? `now ${perS(last.failed_per_s)} failed · ${perS(last.refused_per_s)} refused` : "");
    setText("bw-now", last && last.transfer_bytes_per_s != null ? `now ${fmtRate(last.transfer_bytes_per_s)}` : "");
  }

  // ------------------------------------------------------------------ autoscaling (pd policy)
  // status.autoscaling (deploy/pools/autoscaler.py): budget, bounds, targets, the last round's signals,
  // recent changes ({time, prefill, decode, from, line}) and a timeline [t, prefill, decode, ...]
  function drawReplicas(timeline, budget) {
    const chart = $("chart-replicas");
    const W = Math.max(200, Math.round(chart.clientWidth || 640)), H = 140;
    const left = 46, right = 10, top = 10, bottom = 22;
    chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const nodes = [];
    const end = timeline.length ? timeline[timeline.length - 1][0] : 0;
    const start = timeline.length ? Math.min(timeline[0][0], end - MIN_SPAN_MS / 1000) : 0;
    const x = (t) => left + ((t - start) / Math.max(1, end - start)) * (W - left - right);
    const y = (v) => top + (1 - v / budget) * (H - top - bottom);
    for (let v = 0; v <= budget; v += 1) {
      nodes.push(svg("line", { class: "gridline", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
      const label = svg("text", { class: "axis-label", x: left - 6, y: y(v) + 4, "text-anchor": "end" });
      label.textContent = String(v);
      nodes.push(label);
    }
    const ago = svg("text", { class: "axis-label", x: left, y: H - 5, "text-anchor": "start" });
    ago.textContent = timeline.length ? `−${Math.round(end - start)} s` : "";
    nodes.push(ago);
    [["s-prefill", 1], ["s-decode", 2]].forEach(([cls, k]) => {
      let d = "";
      timeline.forEach((row, i) => {  // steps: a count holds until the next sample
        d += i === 0 ? `M${x(row[0]).toFixed(1)},${y(row[k]).toFixed(1)}`
          : `H${x(row[0]).toFixed(1)}V${y(row[k]).toFixed(1)}`;
      });
      if (d) nodes.push(svg("path", { class: cls, d }));
    });
    chart.replaceChildren(...nodes);
    chart.dataset.points = String(timeline.length);
  }

  function renderAutoscaling(a) {
    $("autoscaling").hidden = !a;
    if (!a) return;
    setText("autoscaling-error", a.error || "");
    if (!a.targets) return;
    const b = a.bounds;
    setText("autoscaling-summary", `budget ${a.budget} replicas · prefill ${a.targets.prefill} ` +
      `(${b.prefill[0]}–${b.prefill[1]}) · decode ${a.targets.decode} (${b.decode[0]}–${b.decode[1]}) · ` +
      `targets TTFT ${fmtMs(a.ttft_target_s)}, TPOT ${fmtMs(a.tpot_target_s)}`);
    const last = a.last;
    if (last) {
      const p = last.prefill, d = last.decode;
      setText("autoscaling-now", `now: prefill ${fmtInt(p.queued_prompt_tokens)} queued prompt tokens, ` +
        `need ${last.prefill_need.toFixed(2)} · decode ${d.running_seqs} running, ${d.waiting_seqs} waiting, ` +
        `KV ${fmtPct(d.kv_usage)}, TPOT ${fmtMs(d.tpot_s)}, need ${last.decode_need.toFixed(2)}` +
        (last.held ? ` · waiting: ${last.held}` : ""));
    }
    drawReplicas(a.timeline || [], a.budget);
    const rows = (a.decisions || []).slice(-10).reverse().map((c) => el("tr", {},
      el("td", {}, new Date(c.time * 1000).toLocaleTimeString()),
      el("td", { class: "num" }, `${c.from.prefill} → ${c.prefill}`),
      el("td", { class: "num" }, `${c.from.decode} → ${c.decode}`),
      el("td", { class: "mono" }, c.line.split(" | ").slice(1).join(" | "))));
    $("autoscaling-decisions").replaceChildren(...(rows.length ? rows
      : [el("tr", {}, el("td", { colspan: "4", class: "muted" }, "no change yet"))]));
  }

  // ------------------------------------------------------------------ polling
  function setConnection(ok, text) {
    $("conn-dot").className = `dot ${ok ? "dot-ok" : "dot-bad"}`;
    setText("conn-status", text);
  }

  async function getJson(url) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
    try {
      const resp = await fetch(url, { headers, cache: "no-store", signal: abort.signal });
      if (!resp.ok) {
        let message = `HTTP ${resp.status}`;
        try { message += `: ${(await resp.json()).error.message}`; } catch (_) { /* not an OpenAI error body */ }
        throw new Error(message);
      }
      return await resp.json();
    } catch (err) {
      throw err.name === "AbortError" ? new Error("timed out") : err;
    } finally {
      clearTimeout(timer);
    }
  }

  function addSamples(answer) {
    for (const s of answer.samples || []) {
      const t = s.t * 1000;
      if (history.length && t <= history[history.length - 1].t) continue;
      history.push({ ...s, t });
    }
    const end = history.length ? history[history.length - 1].t : 0;
    while (history.length && history[0].t < end - HISTORY_MS) history.shift();
    if (answer.window_s) setText("history-window", fmtWindow(answer.window_s));
    if (answer.interval_s) setText("history-interval", fmtWindow(answer.interval_s));
    setText("history-samples", fmtInt(history.length));
  }

  async function poll() {
    // the status and the history's newer samples side by side: either can fail on its own
    const since = history.length ? `?since=${history[history.length - 1].t / 1000}` : "";
    const [status, samples] = await Promise.allSettled([getJson(STATUS_URL), getJson(HISTORY_URL + since)]);
    try {
      if (samples.status === "fulfilled") {
        const first = !document.body.dataset.historyLoaded;
        addSamples(samples.value);
        if (first) document.body.dataset.historyLoaded = String(history.length);
      }
      if (status.status === "fulfilled") {
        latest = status.value;
        renderTotals(latest);
        renderPools(latest.pools);
        renderPairs(latest);
        renderAutoscaling(latest.autoscaling);
        setConnection(true, `updated ${new Date(latest.time * 1000).toLocaleTimeString()}`);
        document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
      } else {
        setConnection(false, `status unavailable (${status.reason.message})`);
      }
      renderCharts();
    } catch (err) {
      setConnection(false, `dashboard error (${err.message})`);
      throw err;
    } finally {
      setTimeout(poll, POLL_MS);  // after the answers, so a slow cluster never piles up requests
    }
  }

  poll();
})();
