// The built-in dashboard: polls /v1/stats (same origin) and draws it with uPlot (vendored).
"use strict";

// one colour per domain, in the order of the sorted domain names (tests read this list)
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#bcbd22", "#0f766e", "#393b79", "#637939"];
const MARK = { publish: "#16a34a", rollback: "#dc2626" };

let key = new URLSearchParams(location.hash.slice(1)).get("key") || localStorage.getItem("osd_key") || "";
let plots = {};
window.osdPlots = plots;  // uPlot instances by panel (operators' console, tests)
let shape = {};

document.getElementById("key").addEventListener("submit", (e) => {
  e.preventDefault();
  key = document.getElementById("keyinput").value;
  localStorage.setItem("osd_key", key);
  refresh();
});

function fmt(x, digits = 2) {
  return x === null || x === undefined ? "-" : (typeof x === "number" ? x.toFixed(digits) : String(x));
}

function esc(text) {
  const span = document.createElement("span");
  span.textContent = text;
  return span.innerHTML;
}

function width(id) {
  return Math.max(360, document.getElementById(id).clientWidth || 520);
}

// vertical ticks at publish / rollback events on the acceptance plot
function eventTicks(events) {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        for (const e of events) {
          if (!(e.kind in MARK)) continue;
          const x = u.valToPos(e.t, "x", true);
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.save();
          ctx.strokeStyle = MARK[e.kind];
          ctx.setLineDash([4, 3]);
          ctx.beginPath();
          ctx.moveTo(x, u.bbox.top);
          ctx.lineTo(x, u.bbox.top + u.bbox.height);
          ctx.stroke();
          ctx.restore();
        }
      }],
    },
  };
}

function draw(id, series, data, opts = {}) {
  const sig = series.map((s) => s.label).join("|");
  if (plots[id] && shape[id] === sig) {
    plots[id].setData(data);
    return;
  }
  if (plots[id]) plots[id].destroy();
  shape[id] = sig;
  plots[id] = new uPlot({
    width: width(id), height: 240, series: [{}, ...series],
    scales: opts.scales || {}, axes: opts.axes || [{}, { size: 50 }], plugins: opts.plugins || [],
  }, data, document.getElementById(id));
}

function render(s) {
  const t = s.series.t;
  document.getElementById("scope").textContent = "scope: " + s.scope;
  document.getElementById("updated").textContent = "updated " + new Date(s.t * 1000).toLocaleTimeString();
  const domains = Object.keys(s.series.acceptance).sort();
  const color = (d) => PALETTE[domains.indexOf(d) % PALETTE.length] || "#94a3b8";
  const names = s.domain_names || {};
  // a discovered domain by its readable name (its id after it), a named one by itself
  const label = (d) => (names[d] ? `${names[d]} (${d})` : d);

  const tiles = [["requests", s.totals.requests, 0], ["errors", s.totals.errors, 0],
                 ["output tokens", s.totals.generation_tokens, 0]];
  if (s.running) {
    tiles.push(["running", s.running.ingress, 0], ["target queue", s.running.target_queue, 0],
               ["KV caches", s.running.kv_caches, 0]);
  }
  if (s.learner) {
    tiles.push(["published", s.learner.published, 0], ["rejected", s.learner.rejected, 0],
               ["learner", s.learner.paused ? "paused" : "active", 0]);
  }
  document.getElementById("tiles").innerHTML = tiles.map(([n, v, d]) =>
    `<div class="tile">${n}<b>${fmt(v, d)}</b></div>`).join("");

  const events = s.events || [];
  // each line's legend says how many draft tokens its latest point stands on
  draw("acceptance", domains.map((d) => ({ label: label(d), stroke: color(d), width: 2, spanGaps: true,
                                           value: (u, v, si, i) => (v === null || v === undefined ? "-" :
                                             `${v.toFixed(2)} of ${fmt((s.series.drafted[d] || [])[i], 0)}`) })),
       [t, ...domains.map((d) => s.series.acceptance[d])],
       { scales: { y: { range: [-0.03, 1.03] } }, plugins: [eventTicks(events)] });
  draw("rates", [{ label: "requests/s", stroke: "#334155", width: 2, scale: "r" },
                 { label: "tokens/s", stroke: "#0ea5e9", width: 2 }],
       [t, s.series.requests_per_s, s.series.tokens_per_s],
       { axes: [{}, { size: 50 }, { scale: "r", side: 1, size: 50, grid: { show: false } }] });
  draw("latency", [{ label: "p50", stroke: "#334155", width: 2, spanGaps: true },
                   { label: "p95", stroke: "#f59e0b", width: 2, spanGaps: true },
                   { label: "TTFT p50", stroke: "#a855f7", width: 2, spanGaps: true }],
       [t, s.series.latency_p50_s, s.series.latency_p95_s, s.series.ttft_p50_s]);

  const per = s.domains || {};
  const PROPOSERS = ["suffix", "ngram", "draft", "feature"].filter((p) => Object.values(per).some((x) => x.proposers[p]));
  // a proposer's share of the domain's draft tokens, and its acceptance
  const share = (d, p) => {
    const x = per[d] && per[d].proposers[p];
    return x ? `${fmt(100 * x.share, 0)}% @ ${fmt(x.alpha, 2)}` : "-";
  };
  document.getElementById("domains").innerHTML = "<tr><th>domain</th><th>alpha</th><th>drafted</th><th>accepted</th>" +
    "<th>tokens / step</th><th>est. speed-up</th>" + PROPOSERS.map((p) => `<th>${p === "draft" || p === "feature" ? "learned " + p : p}</th>`).join("") + "</tr>" +
    Object.entries(s.acceptance).map(([d, a]) =>
      `<tr><td><span class="swatch" style="background:${domains.includes(d) ? color(d) : "#e2e8f0"}"></span>` +
      `${esc(label(d))}</td><td>${fmt(a.alpha, 3)}</td>` +
      `<td>${fmt(a.drafted, 0)}</td><td>${fmt(a.accepted, 0)}</td>` +
      `<td>${fmt(per[d] && per[d].tokens_per_step, 2)}</td><td>${per[d] && per[d].speedup != null ? fmt(per[d].speedup, 2) + "x" : "-"}</td>` + PROPOSERS.map((p) => `<td>${share(d, p)}</td>`).join("") +
      "</tr>").join("");
  if (s.drafts) {
    const loss = (s.learner && s.learner.loss) || {};
    document.getElementById("drafts").innerHTML = "<tr><th>draft</th><th>version</th><th>last loss</th></tr>" +
      Object.entries(s.drafts).map(([d, v]) => `<tr><td>${d}</td><td>v${v.version}</td><td>${fmt(loss[d], 4)}</td></tr>`).join("") +
      `<tr><td colspan="3">learner: ${fmt(s.learner.rounds, 0)} rounds, ${fmt(s.learner.records, 0)} records, ` +
      `step ${fmt(s.learner.step_seconds, 3)} s</td></tr>`;
    document.getElementById("events").innerHTML = "<tr><th>time</th><th>event</th><th>draft</th><th>detail</th></tr>" +
      events.slice(-12).reverse().map((e) =>
        `<tr><td>${new Date(e.t * 1000).toLocaleTimeString()}</td><td>${e.kind}</td><td>${e.draft || ""}</td>` +
        `<td>${e.version !== undefined ? "v" + e.version : ""} ${e.reason || ""}</td></tr>`).join("");
  }
}

async function refresh() {
  const headers = key ? { Authorization: "Bearer " + key } : {};
  try {
    const r = await fetch("/v1/stats", { headers });
    if (r.status === 401) {
      document.getElementById("key").style.display = "inline";
      document.getElementById("error").textContent = "this server needs an API key";
      return;
    }
    const s = await r.json();
    if (!r.ok) throw new Error(s.error ? s.error.message : r.statusText);
    document.getElementById("error").textContent = "";
    render(s);
    window.osdStats = s;
  } catch (e) {
    document.getElementById("error").textContent = String(e);
  }
}

refresh();
window.osdRefresh = setInterval(refresh, 2000);
