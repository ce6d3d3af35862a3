/* The redjax dashboard page: renders snapshots pushed over server-sent events.
   Data from Redis is inserted with textContent only, never as HTML. */
"use strict";

(function () {
  const base = document.body.dataset.base || "";
  const refreshS = Number(document.body.dataset.refreshS || "1");
  const charts = window.RedjaxCharts;
  const COLORS = { tokens: "#3b82f6", prompt: "#a78bfa", requests: "#10b981", p50: "#3b82f6", p99: "#f59e0b", ttft: "#3b82f6", tpot: "#8b5cf6", e2e: "#14b8a6" };
  const STALE_AFTER_MS = Math.max(5000, refreshS * 5000);

  let last = null; // the latest good snapshot, redrawn on resize
  let lastMessageAt = Date.now();

  /* ---------- formatting ---------- */
  const fmt = {
    int: (v) => (v === null || v === undefined ? "—" : Math.round(v).toLocaleString("en-US")),
    rate: (v) => {
      if (v === null || v === undefined) return "—";
      if (v >= 1000) return `${(v / 1000).toFixed(v >= 10000 ? 0 : 1)}k`;
      return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2).replace(/\.?0+$/, "") || "0";
    },
    dur: (s) => {
      if (s === null || s === undefined || !Number.isFinite(s)) return "—";
      if (s === 0) return "0";
      if (s < 0.001) return `${(s * 1e6).toFixed(0)} µs`;
      if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 2 : s < 0.1 ? 1 : 0)} ms`;
      if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
      return `${Math.floor(s / 60)}m ${Math.round(s % 60)}s`;
    },
    age: (s) => {
      if (s === null || s === undefined) return "—";
      if (s < 10) return `${s.toFixed(1)} s`;
      if (s < 120) return `${Math.round(s)} s`;
      if (s < 7200) return `${Math.round(s / 60)} min`;
      return `${Math.round(s / 3600)} h`;
    },
    pct: (f) => (f === null || f === undefined ? "—" : `${(f * 100).toFixed(f < 0.1 ? 1 : 0)}%`),
  };

  /* ---------- DOM helpers ---------- */
  const $ = (id) => document.getElementById(id);
  const setText = (id, text) => {
    const node = $(id);
    if (node && node.textContent !== text) node.textContent = text;
  };
  function cell(row, text, cls, title) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (title) td.title = title;
    row.appendChild(td);
    return td;
  }
  function badge(text, kind) {
    const span = document.createElement("span");
    span.className = `badge ${kind}`;
    span.textContent = text;
    return span;
  }
  function kvBar(fraction) {
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("div");
    fill.className = `fill ${fraction > 0.9 ? "hot" : fraction > 0.75 ? "warm" : ""}`;
    fill.style.width = `${Math.min(100, Math.max(0, fraction * 100)).toFixed(1)}%`;
    bar.appendChild(fill);
    return bar;
  }

  /* ---------- status ---------- */
  function setLive(state, text) {
    $("live-dot").className = `dot ${state}`;
    setText("live-text", text);
  }
  function banner(message) {
    const node = $("banner");
    if (message) {
      node.textContent = message;
      node.hidden = false;
    } else {
      node.hidden = true;
    }
  }

  /* ---------- rendering ---------- */
  function render(s) {
    lastMessageAt = Date.now();
    if (!s.ok) {
      const since = last ? ` Showing data from ${new Date(last.time * 1000).toLocaleTimeString()}.` : "";
      banner(`${s.error}. Retrying every ${refreshS} s.${since}`);
      setLive("down", "Redis down");
      document.body.classList.add("stale");
      return;
    }
    banner(null);
    document.body.classList.remove("stale");
    setLive("live", "Live");
    setText("updated", `updated ${new Date(s.time * 1000).toLocaleTimeString()}`);
    last = s;
    renderTiles(s);
    renderCharts(s);
    renderWorkers(s);
    renderRecent(s);
  }

  function renderTiles(s) {
    const q = s.queue;
    const f = s.fleet;
    setText("queue-waiting", fmt.int(q.waiting));
    setText("queue-in-flight", fmt.int(q.in_flight));
    setText("queue-oldest", q.oldest_waiting_age_s === null ? "—" : fmt.age(q.oldest_waiting_age_s));
    setText("queue-rejected", fmt.int(q.rejected));
    setText("queue-enqueued", `of ${fmt.int(q.enqueued)} enqueued`);
    setText("fleet-workers", `${f.workers_alive} alive`);
    const gone = f.workers_gone ? `${f.workers_gone} gone` : "none gone";
    setText("fleet-workers-gone", f.workers_starting ? `${f.workers_starting} starting · ${gone}` : gone);
    setText("fleet-tokens", fmt.rate(f.tokens_per_s));
    setText("fleet-requests", fmt.rate(f.requests_per_s));
    setText("fleet-kv", fmt.pct(f.kv_usage));
    $("fleet-kv-bar").style.width = `${((f.kv_usage || 0) * 100).toFixed(1)}%`;
    setText("fleet-prefix", f.prefix_cache_hit_rate == null ? "no prompts yet" : `prefix hits ${fmt.pct(f.prefix_cache_hit_rate)}`);
    $("queue-oldest").classList.toggle("warn-text", (q.oldest_waiting_age_s || 0) > 10);
    $("queue-rejected").classList.toggle("warn-text", q.rejected > 0);
  }

  function legend(id, items) {
    const node = $(id);
    node.replaceChildren(
      ...items.map(([label, color]) => {
        const span = document.createElement("span");
        const swatch = document.createElement("i");
        swatch.style.background = color;
        span.append(swatch, label);
        return span;
      })
    );
  }

  function renderCharts(s) {
    const t = s.throughput;
    charts.lineChart($("chart-tokens"), {
      bucketS: t.bucket_s,
      format: fmt.rate,
      series: [
        { label: "generated", color: COLORS.tokens, values: t.tokens_per_s, area: true },
        { label: "prompt", color: COLORS.prompt, values: t.prompt_tokens_per_s },
      ],
    });
    legend("legend-tokens", [["generated", COLORS.tokens], ["prompt", COLORS.prompt]]);
    charts.lineChart($("chart-requests"), {
      bucketS: t.bucket_s,
      format: fmt.rate,
      series: [{ label: "requests/s", color: COLORS.requests, values: t.requests_per_s, area: true }],
    });
    legend("legend-requests", [["finished", COLORS.requests]]);

    const l = s.latency;
    setText("latency-count", `${fmt.int(l.count)} requests`);
    for (const [key, color] of [["ttft", COLORS.ttft], ["tpot", COLORS.tpot], ["e2e", COLORS.e2e]]) {
      const p = l[`${key}_s`];
      charts.barChart($(`bars-${key}`), [
        { label: "p50", value: p.p50 },
        { label: "p90", value: p.p90 },
        { label: "p99", value: p.p99 },
      ], fmt.dur, color);
    }
    const ls = s.latency_series;
    for (const key of ["ttft", "tpot"]) {
      charts.lineChart($(`chart-${key}`), {
        bucketS: ls.bucket_s,
        format: fmt.dur,
        series: [
          { label: "p50", color: COLORS.p50, values: ls[`${key}_p50`] },
          { label: "p99", color: COLORS.p99, values: ls[`${key}_p99`] },
        ],
      });
      legend(`legend-${key}`, [["p50", COLORS.p50], ["p99", COLORS.p99]]);
    }
  }

  function renderWorkers(s) {
    const rows = s.workers.map((w) => {
      const tr = document.createElement("tr");
      tr.dataset.worker = w.name;
      const name = cell(tr, "", "name");
      name.append(badge("", w.alive ? "dot-ok" : "dot-gone"), document.createTextNode(w.name));
      if (!w.alive) {
        tr.className = "gone";
        cell(tr, "").appendChild(badge("gone", "muted-badge"));
        const rest = cell(tr, "heartbeat expired", "muted");
        rest.colSpan = 10;
        return tr;
      }
      cell(tr, "").appendChild(badge(w.state, w.state === "serving" ? "ok" : w.state === "draining" ? "warn" : "info"));
      cell(tr, w.model, "mono ellipsis", w.model);
      const kv = cell(tr, "", "kv-col");
      const wrap = document.createElement("div");
      wrap.className = "kv";
      const label = document.createElement("span");
      label.className = "kv-label";
      label.textContent = `${fmt.int(w.pages_used)} / ${fmt.int(w.pages_total)}`;
      wrap.append(kvBar(w.kv_usage || 0), label);
      kv.appendChild(wrap);
      cell(tr, `${w.running} / ${w.max_num_seqs}`, "num");
      cell(tr, fmt.int(w.waiting), "num");
      cell(tr, fmt.rate(w.tokens_per_s), "num");
      cell(tr, fmt.pct(w.prefix_cache_hit_rate), "num");
      cell(tr, fmt.int(w.preemptions), "num");
      cell(tr, fmt.int(w.step_compiles), `num ${w.compile_stall_s > 0 ? "warn-text" : ""}`,
        `${(w.compile_stall_s || 0).toFixed(1)} s of stalled streams` +
        (w.compiles_pending ? `; ${fmt.int(w.compiles_pending)} more compiling or queued` : ""));
      cell(tr, fmt.int(w.requests_finished), "num");
      cell(tr, fmt.age(w.heartbeat_age_s), `num ${w.heartbeat_age_s > 3 ? "warn-text" : ""}`);
      return tr;
    });
    if (!rows.length) rows.push(emptyRow(12, "No worker has registered yet."));
    $("workers").tBodies[0].replaceChildren(...rows);
    const alive = s.workers.filter((w) => w.alive).length;
    setText("workers-summary", `${alive} alive, ${s.workers.length - alive} gone`);
  }

  const REASON_KIND = { stop: "ok", length: "info", abort: "warn", error: "err" };

  function renderRecent(s) {
    const rows = s.recent.map((r) => {
      const tr = document.createElement("tr");
      cell(tr, r.id, "mono ellipsis", r.id);
      cell(tr, "").appendChild(badge(r.finish_reason, REASON_KIND[r.finish_reason] || "info"));
      cell(tr, r.worker || "—", "ellipsis", r.worker);
      cell(tr, fmt.int(r.prompt_tokens), "num");
      cell(tr, fmt.int(r.output_tokens), "num");
      cell(tr, fmt.dur(r.ttft_s), "num");
      cell(tr, fmt.dur(r.tpot_s), "num");
      cell(tr, fmt.dur(r.e2e_s), "num");
      cell(tr, r.finished_at ? `${fmt.age(Math.max(0, s.time - r.finished_at))} ago` : "—", "num muted");
      return tr;
    });
    if (!rows.length) rows.push(emptyRow(9, "No finished requests yet."));
    $("recent").tBodies[0].replaceChildren(...rows);
  }

  function emptyRow(span, text) {
    const tr = document.createElement("tr");
    const td = cell(tr, text, "empty");
    td.colSpan = span;
    return tr;
  }

  /* ---------- live updates ---------- */
  function connect() {
    const source = new EventSource(`${base}/api/stream`);
    source.addEventListener("snapshot", (e) => render(JSON.parse(e.data)));
    source.addEventListener("open", () => {
      if (last) setLive("live", "Live");
    });
    source.addEventListener("error", () => {
      setLive("down", "Reconnecting");
      banner("Lost the connection to the dashboard server; reconnecting…");
      document.body.classList.add("stale");
      fetch(`${base}/api/snapshot`, { credentials: "same-origin", cache: "no-store" })
        .then((r) => {
          if (r.status === 401) window.location.assign(`${base}/login`);
        })
        .catch(() => {});
      if (source.readyState === EventSource.CLOSED) setTimeout(connect, 2000);
    });
  }

  setInterval(() => {
    if (Date.now() - lastMessageAt > STALE_AFTER_MS) {
      setLive("down", "Stale");
      document.body.classList.add("stale");
    }
  }, 1000);

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => last && renderCharts(last), 100);
  });

  render(JSON.parse($("initial-snapshot").textContent));
  connect();
})();
