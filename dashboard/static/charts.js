/* Small SVG charts for the redjax dashboard: a time-series line chart and a horizontal bar chart.
   No dependencies; everything is drawn with DOM calls (never innerHTML), sized to the element. */
"use strict";

(function (global) {
  const NS = "http://www.w3.org/2000/svg";

  function el(tag, attrs, parent, text) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  function clear(svg) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
  }

  /* The smallest 1, 2, 2.5 or 5 times a power of ten that is >= v. */
  function niceCeil(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    const f = v / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * p;
  }

  function size(svg, fallbackH) {
    const w = Math.max(svg.clientWidth || 0, 120);
    const h = Math.max(svg.clientHeight || 0, fallbackH);
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    return [w, h];
  }

  function minutesLabel(secondsAgo) {
    if (secondsAgo <= 0) return "now";
    return secondsAgo % 60 === 0 ? `-${secondsAgo / 60}m` : `-${secondsAgo}s`;
  }

  /* opts: {series: [{label, color, values: [number|null], area}], bucketS, format(v) -> string}
     values are oldest first; the last value is the bucket that ended most recently. */
  function lineChart(svg, opts) {
    const [w, h] = size(svg, 160);
    clear(svg);
    const m = { l: 52, r: 14, t: 10, b: 24 };
    const iw = w - m.l - m.r;
    const ih = h - m.t - m.b;
    const n = Math.max(1, ...opts.series.map((s) => s.values.length));
    const all = opts.series.flatMap((s) => s.values).filter((v) => v !== null && Number.isFinite(v));
    const top = 4 * niceCeil((Math.max(0, ...all) * 1.08) / 4); // four gridlines at round values
    const x = (i) => m.l + (iw * (i + 1)) / n;
    const y = (v) => m.t + ih - (ih * v) / top;

    const grid = el("g", { class: "grid" }, svg);
    for (let i = 0; i <= 4; i++) {
      const v = (top * i) / 4;
      el("line", { x1: m.l, x2: w - m.r, y1: y(v), y2: y(v) }, grid);
      el("text", { x: m.l - 8, y: y(v) + 4, class: "axis", "text-anchor": "end" }, svg, opts.format(v));
    }
    const span = n * opts.bucketS;
    const step = span >= 600 ? 120 : span >= 120 ? 60 : 10;
    for (let ago = 0; ago <= span; ago += step) {
      const xi = m.l + iw * (1 - ago / span);
      el("line", { x1: xi, x2: xi, y1: m.t + ih, y2: m.t + ih + 4, class: "tick" }, svg);
      const anchor = ago === 0 ? "end" : ago === span ? "start" : "middle";
      el("text", { x: xi, y: h - 6, class: "axis", "text-anchor": anchor }, svg, minutesLabel(ago));
    }
    el("line", { x1: m.l, x2: w - m.r, y1: m.t + ih, y2: m.t + ih, class: "baseline" }, svg);

    for (const s of opts.series) {
      const runs = [];
      let run = [];
      s.values.forEach((v, i) => {
        if (v === null || !Number.isFinite(v)) {
          if (run.length) runs.push(run);
          run = [];
        } else {
          run.push([x(i + (n - s.values.length)), y(v)]);
        }
      });
      if (run.length) runs.push(run);
      for (const r of runs) {
        const d = r.map(([px, py], i) => `${i ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`).join("");
        if (s.area && r.length > 1) {
          const base = y(0).toFixed(1);
          el("path", { d: `${d}L${r[r.length - 1][0].toFixed(1)},${base}L${r[0][0].toFixed(1)},${base}Z`, fill: s.color, class: "area" }, svg);
        }
        if (r.length === 1) el("circle", { cx: r[0][0], cy: r[0][1], r: 2.5, fill: s.color }, svg);
        el("path", { d, stroke: s.color, class: "line", "data-series": s.label }, svg);
      }
    }
    hover(svg, opts, { m, iw, ih, n, x, y, w, h });
  }

  /* Crosshair and readout under the pointer; survives redraws by remembering the pointer. */
  function hover(svg, opts, g) {
    const layer = el("g", { class: "hover" }, svg);
    const capture = el("rect", { x: g.m.l, y: g.m.t, width: g.iw, height: g.ih, fill: "transparent" }, svg);
    const draw = () => {
      clear(layer);
      if (svg._pointerX === undefined) return;
      const i = Math.min(g.n - 1, Math.max(0, Math.round(((svg._pointerX - g.m.l) / g.iw) * g.n) - 1));
      const px = g.x(i);
      el("line", { x1: px, x2: px, y1: g.m.t, y2: g.m.t + g.ih, class: "crosshair" }, layer);
      const ago = (g.n - 1 - i) * opts.bucketS;
      const lines = [ago === 0 ? "latest" : `${ago} s ago`].concat(
        opts.series.map((s) => `${s.label}: ${s.values[i] === null || s.values[i] === undefined ? "—" : opts.format(s.values[i])}`)
      );
      const boxW = 12 + 7 * Math.max(...lines.map((l) => l.length));
      const boxX = px + boxW + 10 > g.w ? px - boxW - 8 : px + 8;
      el("rect", { x: boxX, y: g.m.t + 2, width: boxW, height: 8 + 15 * lines.length, rx: 4, class: "tooltip" }, layer);
      lines.forEach((line, k) => el("text", { x: boxX + 6, y: g.m.t + 16 + 15 * k, class: "tooltip-text" }, layer, line));
      opts.series.forEach((s) => {
        const v = s.values[i];
        if (v !== null && v !== undefined) el("circle", { cx: px, cy: g.y(v), r: 3, fill: s.color }, layer);
      });
    };
    capture.addEventListener("mousemove", (e) => {
      const box = svg.getBoundingClientRect();
      svg._pointerX = ((e.clientX - box.left) / box.width) * g.w;
      draw();
    });
    capture.addEventListener("mouseleave", () => {
      svg._pointerX = undefined;
      draw();
    });
    draw();
  }

  /* items: [{label, value|null}] drawn as horizontal bars against a shared, rounded scale. */
  function barChart(svg, items, format, color) {
    const rowH = 20;
    const [w] = size(svg, items.length * rowH + 4);
    clear(svg);
    const labelW = 34;
    const valueW = 74;
    const top = niceCeil(Math.max(0, ...items.map((it) => it.value || 0)));
    items.forEach((it, k) => {
      const yy = 2 + k * rowH;
      el("text", { x: 0, y: yy + 13, class: "axis" }, svg, it.label);
      el("rect", { x: labelW, y: yy + 3, width: w - labelW - valueW, height: rowH - 8, rx: 3, class: "track" }, svg);
      const bw = it.value ? ((w - labelW - valueW) * it.value) / top : 0;
      el("rect", { x: labelW, y: yy + 3, width: Math.max(bw, it.value ? 2 : 0), height: rowH - 8, rx: 3, fill: color, class: "bar-fill" }, svg);
      el("text", { x: w, y: yy + 13, class: "value-label", "text-anchor": "end" }, svg, it.value === null ? "—" : format(it.value));
    });
  }

  global.RedjaxCharts = { lineChart, barChart };
})(window);
