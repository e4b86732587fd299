// shardcache status page: reads /-/stats, /-/plans, /-/downloads and /-/entries and
// refreshes itself. Every text from the JSON goes into the page as text (textContent,
// attribute values), never as markup: URLs are chosen by clients.
"use strict";

(function () {
  const params = new URLSearchParams(location.search);
  const INTERVAL = Math.min(Math.max(Number(params.get("interval")) || 2, 0.5), 60);
  const WINDOW = 300; // seconds of samples kept for the chart
  const SVG = "http://www.w3.org/2000/svg";
  const samples = []; // {t, hits, misses, served, fetched}
  let refreshes = 0;
  let paused = false;
  let token = sessionStorage.getItem("shardcache-admin-token") || "";
  let busy = false;

  const $ = (id) => document.getElementById(id);

  // -- formatting ----------------------------------------------------------------------
  function bytes(n) {
    if (n === null || n === undefined) return "?";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let v = Number(n), i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? String(v) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
  }
  function pct(x) { return (100 * x).toFixed(1) + " %"; }
  function secs(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return Number(s).toFixed(s < 10 ? 1 : 0) + " s";
    if (s < 3600) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function when(at) {
    if (at === null || at === undefined || at === "") return "";
    if (typeof at === "number") return new Date(at * 1000).toISOString().replace(".000Z", "Z");
    return String(at);
  }
  function ago(epoch) {
    if (!epoch) return "never";
    return secs(Math.max(0, Date.now() / 1000 - epoch)) + " ago";
  }

  // -- DOM helpers (text only) ---------------------------------------------------------
  function setFigure(id, value, text) {
    const el = $(id);
    el.dataset.value = value === null || value === undefined ? "" : String(value);
    el.textContent = text === undefined ? String(value) : text;
  }
  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "" : String(text);
    if (cls) td.className = cls;
    return td;
  }
  function fillTable(id, rows, columns, emptyText) {
    const body = $(id).tBodies[0];
    const out = [];
    for (const row of rows) {
      const tr = document.createElement("tr");
      for (const col of columns) tr.appendChild(col(row));
      out.push(tr);
    }
    if (out.length === 0) {
      const tr = document.createElement("tr");
      const td = cell(emptyText, "empty");
      td.colSpan = $(id).tHead.rows[0].cells.length;
      tr.appendChild(td);
      out.push(tr);
    }
    body.replaceChildren(...out);
  }

  // -- sections ------------------------------------------------------------------------
  function showStats(s) {
    $("version").textContent = "v" + s.version;
    $("pid").textContent = String(s.pid);
    $("workers").textContent = String(s.workers);
    $("policy").textContent = String(s.policy);
    const limit = s.limit || 0;
    const fill = limit ? s.bytes / limit : 0;
    setFigure("bytes", s.bytes, bytes(s.bytes));
    setFigure("limit", s.limit, bytes(s.limit));
    setFigure("fill", fill, pct(fill));
    setFigure("entries", s.entries, String(s.entries));
    $("fill-meter").value = Math.min(fill, 1);
    const st = s.store || {};
    setFigure("effective-limit", st.effective_limit, bytes(st.effective_limit));
    setFigure("reserved", s.reserved, bytes(s.reserved));
    setFigure("free", st.free_bytes, bytes(st.free_bytes));
    setFigure("min-free", st.min_free_bytes, bytes(st.min_free_bytes));
    $("store-state").textContent = st.writable === false
      ? "not writable: " + (st.error || "?") + " (serving from the upstream uncached)"
      : "writable";
    const ram = s.ram_tier || {};
    $("ram-tier").textContent = (ram.entries || 0) + " entries, " + bytes(ram.bytes || 0);
    setFigure("hits", s.hits);
    setFigure("misses", s.misses);
    setFigure("hit-ratio", s.hit_ratio, pct(s.hit_ratio));
    setFigure("served-bytes", s.served_bytes, bytes(s.served_bytes));
    setFigure("upstream-bytes", s.upstream_bytes, bytes(s.upstream_bytes));
    setFigure("evictions", s.evictions);
    setFigure("evicted-before-reuse", s.evicted_before_reuse);
    setFigure("in-flight", s.in_flight, "(" + s.in_flight + ")");
    setFigure("downloads-all", s.downloads_all_processes);
    showUpstreams(s.upstream_health, s.upstreams || []);
  }

  function showUpstreams(health, names) {
    // /-/stats "upstream_health": [{upstream, state, last_error: {reason, message, at},
    // last_ok, failures: {reason: n}}]; without it, "upstreams" (a string each)
    const rows = Array.isArray(health) && health.length
      ? health.map((h) => ({
          url: String(h.upstream) + (h.state === "down" ? " (down)" : ""),
          last_error: h.last_error,
          failures: h.failures,
        }))
      : names.map((u) => (typeof u === "string" ? { url: u } : u || {}));
    fillTable("upstreams", rows, [
      (u) => cell(u.url, "url"),
      (u) => {
        const e = u.last_error;
        if (!e) return cell("none");
        const td = cell("");
        const b = document.createElement("strong");
        b.textContent = String(e.reason || "error");
        td.append(b, " " + String(e.message || ""));
        if (e.at !== undefined) {
          const small = document.createElement("div");
          small.className = "dim";
          small.textContent = when(e.at);
          td.appendChild(small);
        }
        return td;
      },
      (u) => {
        const f = u.failures || {};
        const parts = Object.keys(f).sort().map((k) => k + ": " + f[k]);
        const td = cell(parts.length ? parts.join(", ") : "none");
        td.dataset.failures = String(Object.values(f).reduce((a, b) => a + Number(b), 0));
        return td;
      },
    ], "no upstream configured");
  }

  function showDownloads(list) {
    fillTable("downloads", list, [
      (d) => cell(d.url, "url"),
      (d) => cell(d.reason),
      (d) => cell(d.state),
      (d) => {
        const td = cell("");
        td.dataset.written = String(d.written);
        const p = document.createElement("progress");
        if (d.size) { p.max = d.size; p.value = d.written; }
        td.append(p, " " + bytes(d.written) + " of " + (d.size ? bytes(d.size) : "?"));
        return td;
      },
      (d) => cell(bytes(d.bytes_per_second) + "/s"),
      (d) => cell(d.clients),
    ], "none");
    $("downloads").dataset.count = String(list.length);
  }

  function showPlans(list) {
    fillTable("plans", list, [
      (p) => cell(p.name ? p.name + " (" + p.id + ")" : p.id),
      (p) => {
        const td = cell(p.position + " / " + p.shards);
        td.dataset.position = String(p.position);
        td.dataset.shards = String(p.shards);
        return td;
      },
      (p) => {
        const td = cell(p.ready_ahead_shards + " shards, " + bytes(p.ready_ahead_bytes));
        td.dataset.readyAhead = String(p.ready_ahead_shards);
        return td;
      },
      (p) => cell(p.downloading),
      (p) => cell(p.read_bytes_per_second === null ? "–" : bytes(p.read_bytes_per_second) + "/s"),
      (p) => cell(secs(p.wait_seconds)),
      (p) => cell(secs(p.idle_seconds)),
    ], "no read plan registered");
    setFigure("plan-count", list.length, "(" + list.length + ")");
  }

  function showEntries(e) {
    for (const which of ["largest", "hottest"]) {
      fillTable(which, e[which] || [], [
        (x) => cell(x.url, "url"),
        (x) => { const td = cell(bytes(x.size)); td.dataset.value = String(x.size); return td; },
        (x) => { const td = cell(x.hits); td.dataset.value = String(x.hits); return td; },
        (x) => cell(ago(x.last_access)),
        (x) => {
          const td = document.createElement("td");
          td.className = "admin-only";
          td.hidden = !token;
          if (token) {
            const b = document.createElement("button");
            b.type = "button";
            b.textContent = "purge";
            b.addEventListener("click", () => purge(x.url));
            td.appendChild(b);
          }
          return td;
        },
      ], "the cache is empty");
    }
    for (const th of document.querySelectorAll("th.admin-only")) th.hidden = !token;
  }

  // -- chart: rates between samples taken while this page is open ----------------------
  function sample(s) {
    const t = Date.now() / 1000;
    samples.push({ t, hits: s.hits, misses: s.misses, served: s.served_bytes, fetched: s.upstream_bytes });
    while (samples.length > 2 && t - samples[0].t > WINDOW) samples.shift();
  }

  function drawChart() {
    const svg = $("chart");
    const W = 600, H = 200, L = 56, R = 40, T = 10, B = 22;
    const parts = [];
    const mk = (name, attrs, text) => {
      const el = document.createElementNS(SVG, name);
      for (const k in attrs) el.setAttribute(k, String(attrs[k]));
      if (text !== undefined) el.textContent = text;
      parts.push(el);
      return el;
    };
    mk("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" });
    mk("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" });
    const rates = [];
    for (let i = 1; i < samples.length; i++) {
      const a = samples[i - 1], b = samples[i], dt = Math.max(b.t - a.t, 1e-3);
      const reqs = (b.hits - a.hits) + (b.misses - a.misses);
      rates.push({
        t: b.t,
        served: Math.max(0, b.served - a.served) / dt,
        fetched: Math.max(0, b.fetched - a.fetched) / dt,
        ratio: reqs > 0 ? (b.hits - a.hits) / reqs : null,
      });
    }
    const top = Math.max(1, ...rates.map((r) => Math.max(r.served, r.fetched)));
    mk("text", { x: 4, y: T + 10 }, bytes(Math.round(top)) + "/s");
    mk("text", { x: 4, y: H - B }, "0");
    mk("text", { x: W - R + 4, y: T + 10 }, "100 %");
    mk("text", { x: W - R + 4, y: H - B }, "0 %");
    if (rates.length > 0) {
      const t1 = rates[rates.length - 1].t, t0 = Math.min(rates[0].t, t1 - 10);
      const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
      const y = (v, max) => H - B - (v / max) * (H - T - B);
      const line = (key, max, cls) => {
        const pts = rates.filter((r) => r[key] !== null).map((r) => x(r.t).toFixed(1) + "," + y(r[key], max).toFixed(1));
        if (pts.length) mk("polyline", { points: pts.join(" "), class: cls });
      };
      line("served", top, "served");
      line("fetched", top, "fetched");
      line("ratio", 1, "ratio");
      mk("text", { x: L, y: H - 6 }, secs(t1 - t0) + " ago");
      mk("text", { x: W - R - 24, y: H - 6 }, "now");
    }
    svg.replaceChildren(...parts);
    svg.dataset.samples = String(samples.length);
  }

  // -- admin (only with a token) -------------------------------------------------------
  async function purge(url) {
    const r = await fetch("/-/cache?url=" + encodeURIComponent(url), {
      method: "DELETE",
      headers: { Authorization: "Bearer " + token },
    });
    const text = await r.text();
    $("admin-result").textContent = r.ok ? "purged " + url : "purge refused (" + r.status + "): " + text;
    refresh();
  }

  function setToken(value) {
    token = value;
    if (token) sessionStorage.setItem("shardcache-admin-token", token);
    else sessionStorage.removeItem("shardcache-admin-token");
    $("token").value = "";
    $("admin-result").textContent = token ? "token set: purge buttons shown" : "no token";
    refresh();
  }

  // -- the loop ------------------------------------------------------------------------
  async function getJSON(path) {
    const r = await fetch(path, { cache: "no-store", headers: { Accept: "application/json" } });
    if (!r.ok) throw new Error(path + ": " + r.status + " " + (await r.text()).trim());
    return r.json();
  }

  async function refresh() {
    if (busy) return;
    busy = true;
    try {
      const [stats, plans, downloads, entries] = await Promise.all([
        getJSON("/-/stats"), getJSON("/-/plans"), getJSON("/-/downloads"), getJSON("/-/entries"),
      ]);
      showStats(stats);
      showPlans(plans.plans || []);
      showDownloads(downloads.downloads || []);
      showEntries(entries);
      sample(stats);
      drawChart();
      $("error").hidden = true;
      $("state").textContent = "updated " + new Date().toLocaleTimeString();
      refreshes++;
      document.body.dataset.refreshes = String(refreshes);
    } catch (err) {
      $("error").hidden = false;
      $("error").textContent = "cannot read the proxy's status: " + err.message;
    } finally {
      busy = false;
    }
  }

  function start() {
    $("interval").textContent = String(INTERVAL);
    $("chart-window").textContent = secs(WINDOW);
    $("pause").addEventListener("click", () => {
      paused = !paused;
      $("pause").textContent = paused ? "resume" : "pause";
    });
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      setToken($("token").value.trim());
    });
    $("token-clear").addEventListener("click", () => setToken(""));
    refresh();
    setInterval(() => { if (!paused && !document.hidden) refresh(); }, INTERVAL * 1000);
  }

  start();
})();
