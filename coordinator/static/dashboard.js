// The coordinator dashboard: polls /api/status and draws it with plain SVG. No libraries, no build step.
//
// Every string that came from a node (display names, reasons) is set with textContent, never parsed
// as HTML. After each render the page publishes what it drew in `window.veriroll` and in `data-*`
// attributes on each chart, tile and table row, so a headless browser test can check what is shown.
// Every number on the page comes from one /api/status answer: a tile and a panel never disagree.
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const W = 640, H = 250;
  const M = { l: 54, r: 54, t: 26, b: 34 };
  const PALETTE = ["#2f6fdf", "#e0792b", "#2a9d6a", "#c5443b", "#7d58c2", "#8a6d3b", "#d35fa3", "#5f6b7a",
                   "#1fa4b5", "#a3a526", "#4b4fb8", "#b5651d"];
  const params = new URLSearchParams(window.location.search);
  const REFRESH_MS = Math.max(1, Number(params.get("refresh") || 5)) * 1000;

  const state = { renders: 0, drawn: false, error: null, charts: {}, nodes: 0, relays: 0, tiles: {}, tileValues: {},
                  reasons: {}, statusTime: null };
  window.veriroll = state;

  // --- small helpers -------------------------------------------------------------------------------

  function svgEl(tag, attrs, parent) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (parent) parent.appendChild(e);
    return e;
  }

  function htmlEl(tag, attrs, text, parent) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (parent) parent.appendChild(e);
    return e;
  }

  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1).replace(/\.0$/, "") + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(1).replace(/\.0$/, "") + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(1).replace(/\.0$/, "") + "k";
    if (a >= 100 || Number.isInteger(v)) return String(Math.round(v));
    if (a >= 0.01 || a === 0) return String(Number(v.toPrecision(3)));
    return v.toExponential(1);
  }

  function fmtTime(ms, spanMs) {
    const d = new Date(ms);
    const hh = String(d.getHours()).padStart(2, "0"), mm = String(d.getMinutes()).padStart(2, "0");
    if (spanMs > 2 * 86400e3) return `${d.getMonth() + 1}/${d.getDate()} ${hh}h`;
    if (spanMs < 10 * 60e3) return `${hh}:${mm}:${String(d.getSeconds()).padStart(2, "0")}`;
    return `${hh}:${mm}`;
  }

  function span(seconds) {
    if (seconds % 86400 === 0) return seconds === 86400 ? "24 h" : `${seconds / 86400} d`;
    if (seconds % 3600 === 0) return `${seconds / 3600} h`;
    if (seconds % 60 === 0) return `${seconds / 60} min`;
    return `${seconds} s`;
  }

  function sum(values) {
    return values.reduce((a, b) => a + b, 0);
  }

  function ago(ms, now) {
    if (!ms) return "never";
    const s = Math.max(0, (now - ms) / 1000);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
    return `${(s / 86400).toFixed(1)} d ago`;
  }

  function niceStep(raw) {
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }

  // Round ticks covering [lo, hi]; returns the widened domain too, so the data never touches the frame.
  function ticks(lo, hi, n) {
    if (!Number.isFinite(lo) || !Number.isFinite(hi)) { lo = 0; hi = 1; }
    if (lo === hi) { const d = Math.abs(lo) > 0 ? Math.abs(lo) * 0.1 : 1; lo -= d; hi += d; }
    const step = niceStep((hi - lo) / (n || 5));
    const start = Math.floor(lo / step) * step, end = Math.ceil(hi / step) * step;
    const out = [];
    for (let v = start; v <= end + step / 2; v += step) out.push(Number(v.toPrecision(12)));
    return { lo: start, hi: end, ticks: out };
  }

  // Ticks on round clock times (every 10 s, 1 min, 15 min, 1 h, ...), at most n of them.
  const TIME_STEPS_S = [1, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
  function timeTicks(x0, x1, n) {
    const span = (x1 - x0) / 1000;
    const stepS = TIME_STEPS_S.find((s) => span / s <= n) || Math.ceil(span / n / 86400) * 86400;
    const step = stepS * 1000;
    const out = [];
    // Align to local wall-clock boundaries for steps of a minute and more.
    const offset = stepS >= 60 ? new Date(x0).getTimezoneOffset() * 60e3 : 0;
    for (let v = Math.ceil((x0 - offset) / step) * step + offset; v <= x1; v += step) out.push(v);
    return out;
  }

  function reset(svg) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.setAttribute("viewBox", `0 0 ${svg.classList.contains("wide") ? W * 2 : W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
    return svg.classList.contains("wide") ? W * 2 : W;
  }

  function publish(svg, info) {
    for (const [k, v] of Object.entries(info)) svg.dataset[k] = String(v);
    svg.dataset.drawn = "1";
    state.charts[svg.id.replace(/^chart-/, "")] = info;
  }

  function empty(svg, text) {
    const width = reset(svg);
    svgEl("text", { x: width / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg).textContent = text;
    publish(svg, { points: 0, series: 0, bars: 0, total: 0, empty: 1 });
  }

  function legend(svg, width, items) {
    const g = svgEl("g", { class: "legend" }, svg);
    let x = width - M.r;
    for (let i = items.length - 1; i >= 0; i--) {
      const t = svgEl("text", { x: x, y: 14, "text-anchor": "end" }, g);
      t.textContent = items[i].name;
      // Measured once the text is in the document; the estimate covers a detached or hidden chart.
      const w = (t.getComputedTextLength && t.getComputedTextLength()) || items[i].name.length * 6.5;
      svgEl("rect", { x: x - w - 14, y: 6, width: 10, height: 10, rx: 2, fill: items[i].color }, g);
      x -= w + 30;
    }
  }

  function yAxis(svg, width, scale, side, label) {
    const x = side === "left" ? M.l : width - M.r;
    svgEl("line", { x1: x, x2: x, y1: M.t, y2: H - M.b, class: "axis" }, svg);
    for (const v of scale.ticks) {
      const y = scale.y(v);
      if (side === "left") svgEl("line", { x1: M.l, x2: width - M.r, y1: y, y2: y, class: "gridline" }, svg);
      const t = svgEl("text", { x: side === "left" ? x - 6 : x + 6, y: y + 4, "text-anchor": side === "left" ? "end" : "start" }, svg);
      t.textContent = fmt(v);
    }
    if (label) {
      const cx = side === "left" ? 12 : width - 8, cy = (M.t + H - M.b) / 2;
      const t = svgEl("text", { x: cx, y: cy, "text-anchor": "middle", transform: `rotate(-90 ${cx} ${cy})` }, svg);
      t.textContent = label;
    }
  }

  function makeScale(lo, hi) {
    const t = ticks(lo, hi, 5);
    return { ticks: t.ticks, y: (v) => H - M.b - ((v - t.lo) / (t.hi - t.lo)) * (H - M.t - M.b) };
  }

  // --- charts ---------------------------------------------------------------------------------------

  // series: [{name, color, axis: "left"|"right", points: [[x, y|null], ...]}]; x is a number (step or ms).
  function lineChart(svg, series, opts) {
    const drawable = series.filter((s) => s.points.some((p) => p[1] !== null && p[1] !== undefined));
    if (!drawable.length) return empty(svg, opts.emptyText || "no data yet");
    const width = reset(svg);
    const xs = [], ys = { left: [], right: [] };
    for (const s of drawable) for (const [x, y] of s.points) {
      if (y === null || y === undefined) continue;
      xs.push(x); ys[s.axis || "left"].push(y);
    }
    let x0 = Math.min(...xs), x1 = Math.max(...xs);
    if (x0 === x1) { x0 -= opts.time ? 30e3 : 1; x1 += opts.time ? 30e3 : 1; }
    const X = (x) => M.l + ((x - x0) / (x1 - x0)) * (width - M.l - M.r);
    const scales = {};
    for (const side of ["left", "right"]) {
      if (!ys[side].length) continue;
      let lo = Math.min(...ys[side]), hi = Math.max(...ys[side]);
      if (opts.zero !== false) { lo = Math.min(lo, 0); hi = Math.max(hi, 0); }
      scales[side] = makeScale(lo, hi);
      yAxis(svg, width, scales[side], side, side === "left" ? opts.yLabel : opts.y2Label);
    }
    if (!scales.left) yAxis(svg, width, scales.right, "left", opts.y2Label);
    // x axis
    svgEl("line", { x1: M.l, x2: width - M.r, y1: H - M.b, y2: H - M.b, class: "axis" }, svg);
    const xt = opts.time ? null : ticks(x0, x1, 6);
    const xticks = opts.time ? timeTicks(x0, x1, 6) : xt.ticks.filter((v) => v >= x0 && v <= x1 && Number.isInteger(v));
    for (const v of xticks) {
      const t = svgEl("text", { x: X(v), y: H - M.b + 16, "text-anchor": "middle" }, svg);
      t.textContent = opts.time ? fmtTime(v, x1 - x0) : fmt(v);
    }
    if (opts.xLabel) {
      svgEl("text", { x: (M.l + width - M.r) / 2, y: H - 4, "text-anchor": "middle" }, svg).textContent = opts.xLabel;
    }
    let total = 0;
    drawable.forEach((s) => {
      const scale = scales[s.axis || "left"] || scales.right;
      let d = "", pen = false;
      const pts = [];
      for (const [x, y] of s.points) {
        if (y === null || y === undefined) { pen = false; continue; }
        const px = X(x).toFixed(1), py = scale.y(y).toFixed(1);
        d += `${pen ? "L" : "M"}${px} ${py} `;
        pen = true;
        pts.push([px, py, x, y]);
      }
      total += pts.length;
      svgEl("path", { d: d.trim(), class: "series", stroke: s.color, "data-series": s.name, "data-points": pts.length }, svg);
      // Markers while points are few enough to tell apart; each carries its value as a native tooltip.
      if (pts.length <= 80) {
        for (const [px, py, x, y] of pts) {
          const c = svgEl("circle", { cx: px, cy: py, r: 2.8, fill: s.color, class: "pt" }, svg);
          svgEl("title", {}, c).textContent = `${s.name}: ${fmt(y)} @ ${opts.time ? new Date(x).toLocaleTimeString() : fmt(x)}`;
        }
      }
    });
    legend(svg, width, drawable.map((s) => ({ name: s.name, color: s.color })));
    publish(svg, { points: total, series: drawable.length, bars: 0, empty: 0 });
  }

  // bars: [{label, value}]
  function barChart(svg, bars, opts) {
    if (!bars.length || bars.every((b) => !b.value)) return empty(svg, opts.emptyText || "no data yet");
    const width = reset(svg);
    const scale = makeScale(0, Math.max(...bars.map((b) => b.value)));
    yAxis(svg, width, scale, "left", opts.yLabel);
    svgEl("line", { x1: M.l, x2: width - M.r, y1: H - M.b, y2: H - M.b, class: "axis" }, svg);
    const slot = (width - M.l - M.r) / bars.length;
    const bw = Math.min(60, slot * 0.7);
    let total = 0;
    bars.forEach((b, i) => {
      const x = M.l + slot * i + (slot - bw) / 2, y = scale.y(b.value);
      const r = svgEl("rect", { x: x, y: y, width: bw, height: Math.max(0, H - M.b - y), fill: opts.color || PALETTE[0],
                                rx: 2, class: "bar", "data-label": b.label, "data-value": b.value }, svg);
      svgEl("title", {}, r).textContent = `${b.label}: ${fmt(b.value)}`;
      svgEl("text", { x: x + bw / 2, y: H - M.b + 16, "text-anchor": "middle" }, svg).textContent = b.label;
      svgEl("text", { x: x + bw / 2, y: y - 4, "text-anchor": "middle" }, svg).textContent = fmt(b.value);
      total += b.value;
    });
    if (opts.xLabel) {
      svgEl("text", { x: (M.l + width - M.r) / 2, y: H - 4, "text-anchor": "middle" }, svg).textContent = opts.xLabel;
    }
    publish(svg, { points: 0, series: 1, bars: bars.length, total: total, empty: 0 });
  }

  // buckets: [{t_ms, counts: {key: n}}], keys: [key]; one stacked bar per time bucket.
  function stackedBars(svg, buckets, keys, opts) {
    const totals = buckets.map((b) => keys.reduce((a, k) => a + (b.counts[k] || 0), 0));
    if (!buckets.length || totals.every((t) => !t)) return empty(svg, opts.emptyText || "no data yet");
    const width = reset(svg);
    const scale = makeScale(0, Math.max(...totals));
    yAxis(svg, width, scale, "left", opts.yLabel);
    svgEl("line", { x1: M.l, x2: width - M.r, y1: H - M.b, y2: H - M.b, class: "axis" }, svg);
    const slot = (width - M.l - M.r) / buckets.length;
    const bw = Math.max(1, Math.min(40, slot * 0.8));
    const span = buckets[buckets.length - 1].t_ms - buckets[0].t_ms;
    let segments = 0, nonEmpty = 0, total = 0;
    const colors = Object.fromEntries(keys.map((k, i) => [k, PALETTE[i % PALETTE.length]]));
    buckets.forEach((b, i) => {
      const x = M.l + slot * i + (slot - bw) / 2;
      let acc = 0;
      if (totals[i]) nonEmpty += 1;
      for (const k of keys) {
        const n = b.counts[k] || 0;
        if (!n) continue;
        const yTop = scale.y(acc + n), yBot = scale.y(acc);
        const r = svgEl("rect", { x: x, y: yTop, width: bw, height: Math.max(0.5, yBot - yTop), fill: colors[k],
                                  class: "seg", "data-reason": k, "data-value": n }, svg);
        svgEl("title", {}, r).textContent = `${k}: ${n} (${fmtTime(b.t_ms, span)})`;
        acc += n; segments += 1; total += n;
      }
    });
    const every = Math.max(1, Math.ceil(buckets.length / 8));
    buckets.forEach((b, i) => {
      if (i % every) return;
      const t = svgEl("text", { x: M.l + slot * (i + 0.5), y: H - M.b + 16, "text-anchor": "middle" }, svg);
      t.textContent = fmtTime(b.t_ms, span);
    });
    legend(svg, width, keys.map((k) => ({ name: k, color: colors[k] })));
    publish(svg, { points: 0, series: keys.length, bars: nonEmpty, segments: segments, total: total, empty: 0 });
  }

  // --- the page ------------------------------------------------------------------------------------

  // `raw` is the number behind the shown (maybe abbreviated) value, published as data-value.
  function tile(parent, label, value, detail, raw) {
    const t = htmlEl("div", { class: "tile", "data-tile": label, "data-value": raw === undefined ? value : raw }, null, parent);
    htmlEl("div", { class: "label" }, label, t);
    htmlEl("div", { class: "value" }, value, t);
    if (detail) htmlEl("div", { class: "detail" }, detail, t);
    state.tiles[label] = String(value);
    state.tileValues[label] = raw === undefined ? value : raw;
    return t;
  }

  // Rejections per reason inside the timeline's window (events of identified nodes only).
  function rejectionsInWindow(rej) {
    const out = {};
    for (const b of rej.timeline.buckets) for (const [k, n] of Object.entries(b.counts)) out[k] = (out[k] || 0) + n;
    return out;
  }

  function renderTiles(data) {
    const box = document.getElementById("tiles");
    box.replaceChildren();
    const s = data.summary, ns = data.nodes_by_standing;
    const rejected = sum(Object.values(data.rejections.by_reason));
    const charted = sum(Object.values(rejectionsInWindow(data.rejections)));
    const relaysUp = data.relays.filter((r) => r.ok).length;
    const last = data.trainer_history.length ? data.trainer_history[data.trainer_history.length - 1] : null;
    // Verification first: "off" (intake.verify = false) means groups are checked for shape only.
    const verification = data.verification === "off" ? "off" : data.verification === "on" ? "on" : "–";
    const v = tile(box, "verification", verification,
      verification === "off" ? "OFF by configuration (intake.verify = false)" : "TOPLOC + sampling checks");
    v.setAttribute("data-verification", verification);
    tile(box, "policy version", data.policy.version, `s_max ${data.policy.s_max}`);
    tile(box, "trainer step", s.trainer_step, last && last.reward !== undefined ? `reward ${fmt(last.reward)}` : "");
    tile(box, "queue", s.unconsumed_groups, "groups waiting for the trainer");
    tile(box, "open leases", s.open_leases, "");
    tile(box, "accepted groups", fmt(s.accepted_groups), "", s.accepted_groups);
    tile(box, "nodes", s.nodes, `${ns.trusted || 0} trusted · ${ns.probation || 0} probation · ${ns.banned || 0} banned`);
    tile(box, "rejections", fmt(rejected), `all time · ${fmt(charted)} in the ${span(data.rejections.window_s)} chart`,
      rejected);
    tile(box, "relays", data.relays.length ? `${relaysUp}/${data.relays.length}` : "–", "answering", relaysUp);
  }

  function renderCharts(data) {
    const hist = data.trainer_history;
    const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
    const stepOf = (h, i) => (typeof h.step === "number" ? h.step : i);

    lineChart(document.getElementById("chart-reward"),
      [{ name: "reward", color: PALETTE[0], points: hist.map((h, i) => [stepOf(h, i), num(h.reward)]) }],
      { xLabel: "trainer step", emptyText: "no trainer steps yet", zero: false });

    const klSeries = [{ name: "approx KL", color: PALETTE[3], axis: "left", points: hist.map((h, i) => [stepOf(h, i), num(h.approx_kl)]) },
                      { name: "clip fraction", color: PALETTE[4], axis: "right", points: hist.map((h, i) => [stepOf(h, i), num(h.clipfrac)]) }];
    if (hist.some((h) => num(h.mismatch_kl) !== null)) {
      klSeries.push({ name: "mismatch KL", color: PALETTE[1], axis: "left", points: hist.map((h, i) => [stepOf(h, i), num(h.mismatch_kl)]) });
    }
    lineChart(document.getElementById("chart-kl"), klSeries, { xLabel: "trainer step", emptyText: "no trainer steps yet" });

    const st = data.staleness;
    const keys = Object.keys(st.histogram).map(Number).sort((a, b) => a - b);
    const full = keys.length ? Array.from({ length: keys[keys.length - 1] + 1 }, (_, i) => i) : [];
    document.getElementById("staleness-hint").textContent = st.source === "trainer"
      ? `samples in the last ${st.steps} trainer step${st.steps === 1 ? "" : "s"}, by versions behind`
      : st.source === "queue" ? "queued groups, by versions behind the newest policy" : "";
    barChart(document.getElementById("chart-staleness"),
      full.map((s) => ({ label: String(s), value: st.histogram[String(s)] || 0 })),
      { xLabel: "staleness (versions behind)", color: PALETTE[2], emptyText: "nothing trained or queued yet" });

    const tb = data.throughput.buckets, bs = data.throughput.bucket_s || 1;
    const tput = [
      { name: "tokens/s", color: PALETTE[0], axis: "left", points: tb.map((b) => [b.t_ms, b.tokens / bs]) },
      { name: "groups/min", color: PALETTE[1], axis: "right", points: tb.map((b) => [b.t_ms, (b.groups * 60) / bs]) },
    ];
    if (hist.some((h) => num(h.tokens_per_s) !== null && typeof h.time_ms === "number")) {
      tput.push({ name: "trained tokens/s", color: PALETTE[2], axis: "left",
                  points: hist.filter((h) => typeof h.time_ms === "number").map((h) => [h.time_ms, num(h.tokens_per_s)]) });
    }
    lineChart(document.getElementById("chart-throughput"), tput, { time: true, emptyText: "no accepted groups yet" });

    const rej = data.rejections, tl = rej.timeline;
    const total = sum(Object.values(rej.by_reason));
    document.getElementById("rejections-hint").textContent =
      `chart: identified nodes, last ${span(rej.window_s)}` + (tl.buckets.length ? `, per ${span(tl.bucket_s)}` : "") +
      " · table: every refusal counted";
    stackedBars(document.getElementById("chart-rejections"), tl.buckets, tl.reasons, {
      yLabel: "rejections",
      emptyText: total ? `none from identified nodes in the last ${span(rej.window_s)}; ${fmt(total)} counted in all (below)`
                       : "no rejections",
    });
    renderReasons(rej);
  }

  // The totals per reason: the same numbers as the "rejections" tile, split by whether the node was
  // identified (only those are kept as events, and so charted) and by what the chart's window holds.
  function renderReasons(rej) {
    const body = document.querySelector("#rejection-reasons tbody");
    body.replaceChildren();
    const charted = rejectionsInWindow(rej), before = rej.unattributed || {};
    const rows = Object.entries(rej.by_reason).filter(([, n]) => n > 0)
      .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    document.getElementById("rejections-window-head").textContent = `in the ${span(rej.window_s)} chart`;
    if (!rows.length) {
      const tr = htmlEl("tr", {}, null, body);
      htmlEl("td", { colspan: 5, class: "empty" }, "no rejections", tr);
    }
    state.reasons = {};
    for (const [reason, n] of rows) {
      const early = before[reason] || 0;
      const tr = htmlEl("tr", { "data-reason": reason, "data-total": n, "data-unattributed": early,
                                "data-charted": charted[reason] || 0 }, null, body);
      htmlEl("td", {}, reason, tr);
      htmlEl("td", { class: "num" }, fmt(n), tr);
      htmlEl("td", { class: "num" }, fmt(n - early), tr);
      htmlEl("td", { class: "num" }, fmt(early), tr);
      htmlEl("td", { class: "num" }, fmt(charted[reason] || 0), tr);
      state.reasons[reason] = { total: n, unattributed: early, charted: charted[reason] || 0 };
    }
  }

  function renderNodes(data) {
    const body = document.querySelector("#nodes tbody");
    body.replaceChildren();
    const nodes = data.nodes.slice().sort((a, b) => b.credits - a.credits || a.node_id.localeCompare(b.node_id));
    if (!nodes.length) {
      const tr = htmlEl("tr", {}, null, body);
      htmlEl("td", { colspan: 9, class: "empty" }, "no nodes registered yet", tr);
    }
    for (const n of nodes) {
      const tr = htmlEl("tr", { "data-node": n.node_id, "data-standing": n.standing }, null, body);
      htmlEl("td", { class: "mono", title: n.node_id }, n.node_id.slice(0, 12) + "…", tr);
      htmlEl("td", {}, n.display_name || "", tr);
      const st = htmlEl("td", {}, null, tr);
      htmlEl("span", { class: `badge ${n.standing}`, title: n.ban_reason || "" }, n.standing, st);
      htmlEl("td", { class: "num", "data-credits": n.credits }, fmt(n.credits), tr);
      htmlEl("td", { class: "num" }, fmt(n.accepted_groups), tr);
      htmlEl("td", { class: "num" }, n.strikes, tr);
      const reasons = Object.entries(n.rejections || {}).sort((a, b) => b[1] - a[1]);
      htmlEl("td", { title: reasons.map(([r, c]) => `${r}: ${c}`).join("\n") },
        reasons.length ? reasons.slice(0, 3).map(([r, c]) => `${r} ×${c}`).join(", ") + (reasons.length > 3 ? " …" : "") : "–", tr);
      htmlEl("td", { class: "num" }, n.loaded_version >= 0 ? n.loaded_version : "–", tr);
      htmlEl("td", {}, ago(n.last_seen_ms, data.time_ms), tr);
    }
    const unlisted = (data.nodes_total || 0) - nodes.length;
    if (unlisted > 0) {
      const tr = htmlEl("tr", {}, null, body);
      htmlEl("td", { colspan: 9, class: "empty" },
        `${unlisted} more node${unlisted === 1 ? "" : "s"} not listed (the ${nodes.length} most recently seen are shown)`, tr);
    }
    state.nodes = nodes.length;

    const rbody = document.querySelector("#relays tbody");
    rbody.replaceChildren();
    if (!data.relays.length) {
      const tr = htmlEl("tr", {}, null, rbody);
      htmlEl("td", { colspan: 4, class: "empty" }, "no relays announced", tr);
    }
    for (const r of data.relays) {
      const tr = htmlEl("tr", { "data-relay": r.url }, null, rbody);
      htmlEl("td", { class: "mono" }, r.url, tr);
      const s = htmlEl("td", {}, null, tr);
      const cls = r.ok === null ? "unknown" : r.ok ? "up" : "down";
      htmlEl("span", { class: `badge ${cls}`, title: r.error || "" }, r.ok === null ? "not polled yet" : r.ok ? "up" : "down", s);
      htmlEl("td", { class: "num" }, r.latest === null ? "–" : r.latest, tr);
      htmlEl("td", {}, (r.versions || []).join(", ") || "–", tr);
    }
    state.relays = data.relays.length;
  }

  function setConn(kind, text) {
    const c = document.getElementById("conn");
    c.dataset.state = kind;
    c.textContent = text;
  }

  async function load() {
    try {
      const resp = await fetch("/api/status", { cache: "no-store" });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      const data = await resp.json();
      renderTiles(data);
      renderCharts(data);
      renderNodes(data);
      state.statusTime = data.time_ms;
      state.error = null;
      state.renders += 1;
      state.drawn = true;
      document.body.dataset.renders = String(state.renders);
      setConn("ok", `updated ${new Date(data.time_ms).toLocaleTimeString()}`);
    } catch (err) {
      state.error = String(err);
      setConn("error", `cannot reach the coordinator (${err.message || err}); retrying`);
    }
    setTimeout(load, REFRESH_MS);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", load);
  else load();
})();
