// idem status page: asks for the admin token, then fetches /status.json
// with it every REFRESH_MS and redraws in place. No data is in the page
// itself; the token stays in this tab's sessionStorage.
"use strict";

(function () {
  const REFRESH_MS = 2000;
  const WINDOW_MS = 15 * 60 * 1000;
  const TOKEN_KEY = "idem-admin-token";
  const OUTCOME_COLORS = {
    executed: "#1f77b4", released: "#bcbd22", replayed: "#2ca02c", in_flight: "#ff7f0e",
    mismatch: "#d62728", rejected: "#9467bd", store_error: "#8c564b", passthrough: "#8c8c8c",
    failed_open: "#e377c2",
  };
  const OPS_ORDER = ["begin", "complete", "release", "extend", "get"];
  const $ = (id) => document.getElementById(id);
  // The keys of `obj` in `order` first, then any others.
  function ordered(obj, order) {
    const keys = order.filter((k) => k in obj);
    for (const k of Object.keys(obj)) if (!keys.includes(k)) keys.push(k);
    return keys;
  }
  let timer = null;
  let lastGood = null;

  // ------------------------------------------------------------ format
  function num(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (digits === undefined) digits = Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2;
    return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
  }
  function msText(v) { return v === null || v === undefined ? "–" : num(v) + " ms"; }
  function ago(ms) {
    const s = Math.round(ms / 1000);
    if (Math.abs(s) < 90) return s >= 0 ? "in " + s + " s" : -s + " s ago";
    const m = Math.round(s / 60);
    return m >= 0 ? "in " + m + " min" : -m + " min ago";
  }
  function duration(s) {
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.round(s / 60) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function setText(id, text) { const e = $(id); if (e.textContent !== text) e.textContent = text; }
  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }
  function fillRows(tbody, rows) {
    const frag = document.createDocumentFragment();
    for (const r of rows) frag.appendChild(r);
    tbody.replaceChildren(frag);
  }

  // ------------------------------------------------------------ charts
  // series: [{name, color, values: [[t_ms, v|null], ...]}]
  function drawChart(canvas, series, opts) {
    const dpr = window.devicePixelRatio || 1;
    const cssW = canvas.clientWidth || 560, cssH = canvas.clientHeight || 200;
    if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
      canvas.width = Math.round(cssW * dpr);
      canvas.height = Math.round(cssH * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, cssW, cssH);
    const left = 48, right = 8, top = 8, bottom = 20;
    const w = cssW - left - right, h = cssH - top - bottom;
    const now = opts.now;
    const span = opts.span;
    const t0 = now - span;
    let max = 0, points = 0;
    for (const s of series) for (const [t, v] of s.values) if (v !== null && t >= t0) { max = Math.max(max, v); points++; }
    const yMax = niceMax(max || opts.minMax || 1);
    // grid + labels
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#6b7380";
    ctx.strokeStyle = "#e3e6eb";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = top + h - (h * i) / 4;
      ctx.beginPath(); ctx.moveTo(left, Math.round(y) + 0.5); ctx.lineTo(left + w, Math.round(y) + 0.5); ctx.stroke();
      ctx.fillText(num((yMax * i) / 4), left - 4, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const f of [1, 2 / 3, 1 / 3, 0]) {
      const x = left + w - w * f;
      const ago = (span * f) / 1000;
      const label = f === 0 ? "now" : ago >= 120 ? "-" + Math.round(ago / 60) + " min" : "-" + Math.round(ago) + " s";
      ctx.fillText(label, Math.min(Math.max(x, left + 14), left + w - 12), top + h + 4);
    }
    // series
    const xOf = (t) => left + (w * (t - t0)) / span;
    const yOf = (v) => top + h - (h * v) / yMax;
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      // A point with no drawn neighbour (a sample between two gaps) is a dot.
      const vs = s.values.filter(([t]) => t >= t0);
      const lone = [];
      let pen = false;
      for (let i = 0; i < vs.length; i++) {
        const [t, v] = vs[i];
        if (v === null) { pen = false; continue; }
        const x = xOf(t), y = yOf(v);
        if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        const next = vs[i + 1];
        if (!pen && (!next || next[1] === null)) lone.push([x, y]);
        pen = true;
      }
      ctx.stroke();
      for (const [x, y] of lone) { ctx.beginPath(); ctx.arc(x, y, 3, 0, 2 * Math.PI); ctx.fill(); }
    }
    canvas.dataset.points = String(points);
    canvas.dataset.max = String(max);
  }
  function niceMax(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }
  function legend(id, series) {
    const box = $(id);
    const frag = document.createDocumentFragment();
    for (const s of series) {
      const item = document.createElement("span");
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.background = s.color;
      item.appendChild(sw);
      item.appendChild(document.createTextNode(s.name));
      frag.appendChild(item);
    }
    box.replaceChildren(frag);
  }

  // ------------------------------------------------------------ render
  function render(d) {
    const outcomes = ordered(d.outcomes, Object.keys(OUTCOME_COLORS));
    let rate = 0;
    for (const o of outcomes) rate += d.outcomes[o].rate;
    setText("meta", "v" + d.version + " · store " + d.store.kind + " · up " + duration(d.uptime_s) +
      " · charts: a sample every " + d.sample_every_s + " s, the last " + Math.round(d.history_points * d.sample_every_s / 60) + " min kept" +
      " · updated " + new Date(d.now_ms).toLocaleTimeString());
    setText("tile-rate", num(rate));
    setText("tile-replays", num(d.outcomes.replayed ? d.outcomes.replayed.last_minute : null, 0));
    const minute = outcomes.reduce((a, o) => a + d.outcomes[o].last_minute, 0);
    setText("tile-replays-sub", "of " + num(minute, 0) + " requests in the last " + Math.round(d.minute_window_s) + " s");
    setText("tile-p99", msText(d.latency_ms.p99));
    setText("tile-p50", "p50 " + msText(d.latency_ms.p50) + " · p95 " + msText(d.latency_ms.p95) + " · last minute");
    setText("tile-inflight", num(d.in_flight, 0));
    const ready = d.store.ready;
    const storeTile = $("tile-store");
    storeTile.classList.toggle("good", ready.ok);
    storeTile.classList.toggle("bad", !ready.ok);
    setText("tile-store-state", ready.ok ? "ready" : "failing");
    setText("tile-store-sub", d.store.kind + (ready.ok ? " · probe " + msText(ready.probe_ms) : " · " + (ready.detail || "")));

    // tables
    fillRows($("outcomes").tBodies[0], outcomes.map((o) => {
      const r = document.createElement("tr");
      const v = d.outcomes[o];
      r.dataset.outcome = o;
      const name = cell(r, "");
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.display = "inline-block"; sw.style.width = ".6rem"; sw.style.height = ".6rem";
      sw.style.marginRight = ".4rem"; sw.style.background = OUTCOME_COLORS[o] || "#444";
      name.appendChild(sw);
      name.appendChild(document.createTextNode(o));
      cell(r, num(v.total, 0), "total");
      cell(r, num(v.last_minute, 0), "last-minute");
      cell(r, num(v.rate), "rate");
      cell(r, num(v.p50_ms), "p50");
      cell(r, num(v.p99_ms), "p99");
      return r;
    }));
    fillRows($("store-ops").tBodies[0], ordered(d.store_ops, OPS_ORDER).map((op) => {
      const r = document.createElement("tr");
      const v = d.store_ops[op];
      r.dataset.op = op;
      cell(r, op);
      cell(r, num(v.calls, 0), "calls");
      cell(r, num(v.errors, 0), v.errors > 0 ? "errors bad" : "errors");
      cell(r, num(v.last_minute_calls, 0), "last-minute");
      cell(r, num(v.p99_ms), "p99");
      return r;
    }));
    const keys = d.in_flight_keys;
    const note = !keys.supported ? "listing not supported by this store"
      : keys.error ? "listing failed: " + keys.error
      : keys.records.length === 0 ? "no key in flight"
      : keys.records.length + (keys.more ? "+" : "") + " in flight (newest first where the store can order them)";
    setText("keys-note", note);
    fillRows($("keys").tBodies[0], keys.records.map((k) => {
      const r = document.createElement("tr");
      const c = cell(r, "");
      const code = document.createElement("code");
      code.textContent = k.key_hash;
      c.appendChild(code);
      if (k.held) c.appendChild(document.createTextNode(" held: " + k.held));
      cell(r, String(k.fence));
      const left = k.lease_until_ms - d.now_ms;
      cell(r, new Date(k.lease_until_ms).toLocaleTimeString() + " (" + (left >= 0 ? ago(left) : "ended " + ago(left) + ", next begin takes it over") + ")");
      return r;
    }));

    // charts
    const h = d.history;
    // The x axis spans the history kept, at least 2 minutes, at most 15.
    const oldest = h.length ? h[0].t_ms : d.now_ms;
    const span = Math.min(WINDOW_MS, Math.max(2 * 60 * 1000, d.now_ms - oldest));
    const rateSeries = outcomes.map((o) => ({
      name: o, color: OUTCOME_COLORS[o] || "#444", values: h.map((p) => [p.t_ms, p.rates[o]]),
    })).filter((s) => s.values.some(([, v]) => v > 0) || s.name === "executed" || s.name === "replayed");
    drawChart($("chart-rates"), rateSeries, { now: d.now_ms, span });
    legend("legend-rates", rateSeries);
    const latSeries = [
      { name: "p50", color: "#2ca02c", values: h.map((p) => [p.t_ms, p.p50_ms]) },
      { name: "p95", color: "#ff7f0e", values: h.map((p) => [p.t_ms, p.p95_ms]) },
      { name: "p99", color: "#d62728", values: h.map((p) => [p.t_ms, p.p99_ms]) },
    ];
    drawChart($("chart-latency"), latSeries, { now: d.now_ms, span });
    legend("legend-latency", latSeries);
    const inflSeries = [{ name: "in flight", color: "#ff7f0e", values: h.map((p) => [p.t_ms, p.in_flight]) }];
    drawChart($("chart-inflight"), inflSeries, { now: d.now_ms, span });
    legend("legend-inflight", inflSeries);
    const storeSeries = [
      { name: "store call p99, ms", color: "#1f77b4", values: h.map((p) => [p.t_ms, p.store_p99_ms]) },
      { name: "store errors / s", color: "#d62728", values: h.map((p) => [p.t_ms, p.store_errors_per_s]) },
    ];
    drawChart($("chart-store"), storeSeries, { now: d.now_ms, span });
    legend("legend-store", storeSeries);
    document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
  }

  // ------------------------------------------------------------ fetch loop
  function showLogin(message) {
    if (timer) { clearTimeout(timer); timer = null; }
    $("status").hidden = true;
    $("signout").hidden = true;
    $("login").hidden = false;
    setText("login-error", message || "");
    $("token").focus();
  }
  function showStatus() {
    setText("login-error", "");
    $("login").hidden = true;
    $("status").hidden = false;
    $("signout").hidden = false;
  }
  async function refresh() {
    timer = null;
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (!token) { showLogin(""); return; }
    try {
      const resp = await fetch("/status.json", {
        headers: { Authorization: "Bearer " + token }, cache: "no-store", credentials: "omit",
      });
      if (resp.status === 401 || resp.status === 404) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin(resp.status === 401 ? "That token was refused." : "This gateway has no admin token configured.");
        return;
      }
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      const d = await resp.json();
      showStatus();
      $("error").hidden = true;
      lastGood = d;
      render(d);
    } catch (e) {
      showStatus();
      const err = $("error");
      err.hidden = false;
      err.textContent = "Cannot reach the admin listener (" + e.message + ")" +
        (lastGood ? "; showing data from " + new Date(lastGood.now_ms).toLocaleTimeString() : "");
    }
    timer = setTimeout(refresh, REFRESH_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const t = $("token").value.trim();
      if (!t) return;
      sessionStorage.setItem(TOKEN_KEY, t);
      $("token").value = "";
      refresh();
    });
    $("signout").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin("");
    });
    window.addEventListener("resize", () => { if (lastGood) render(lastGood); });
    refresh();
  });
})();
