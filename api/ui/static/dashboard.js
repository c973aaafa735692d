// StaleFlow run dashboard: renders the panels from the JSON of /v1/runs/{id}/dashboard,
// live from its server-sent events stream, or once from data inlined in a static report.
// Hand-rolled SVG, no dependencies.
"use strict";
(function () {
  const COLORS = ["#2563eb", "#9333ea", "#0891b2", "#d97706", "#16a34a", "#db2777", "#4b5563", "#65a30d"];
  const STALE = ["#16a34a", "#65a30d", "#ca8a04", "#ea580c", "#dc2626", "#7f1d1d"];
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const num = (x, d = 1) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(d));
  const big = (x) => (x === null || x === undefined ? "–" : Math.round(x).toLocaleString("en-US"));
  const kv = (items) => `<div class="kv">${items.map(([k, v, label]) => `<span data-k="${k}"><b>${v}</b> ${esc(label)}</span>`).join("")}</div>`;
  const empty = (what) => `<p class="empty">${esc(what)}</p>`;
  const legend = (items) => `<div class="legend">${items.map(([n, c]) => `<span><i style="background:${c}"></i>${esc(n)}</span>`).join("")}</div>`;

  function ticks(lo, hi, n, integer) {
    if (hi <= lo) hi = lo + 1;
    const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    let s = [1, 2, 5, 10].map((m) => m * step).find((m) => (hi - lo) / m <= n) || step * 10;
    if (integer) s = Math.max(1, Math.round(s));
    const out = [];
    for (let t = Math.ceil(lo / s) * s; t <= hi + 1e-9; t += s) out.push(+t.toFixed(10));
    return out;
  }

  // series: [{name, color, points: [[x, y]], band: [[x, lo, hi]], step}]
  function lineChart(series, opts = {}) {
    const W = 380, H = 180, L = 46, R = 8, T = 8, B = 34;
    const xs = [], ys = [];
    for (const s of series) {
      for (const [x, y] of s.points) if (y !== null) { xs.push(x); ys.push(y); }
      for (const [x, lo, hi] of s.band || []) { xs.push(x); ys.push(lo, hi); }
    }
    if (!xs.length) return empty(opts.none || "no data yet");
    let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys, opts.y0 ?? Infinity), y1 = Math.max(...ys);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { y0 -= 1; y1 += 1; }
    const pad = (y1 - y0) * 0.05; y1 += pad; if (opts.y0 === undefined) y0 -= pad;
    const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    let g = "";
    for (const t of ticks(y0, y1, 4)) g += `<line class="axis" x1="${L}" x2="${W - R}" y1="${Y(t)}" y2="${Y(t)}"/><text x="${L - 4}" y="${Y(t) + 4}" text-anchor="end">${+t.toPrecision(4)}</text>`;
    for (const t of ticks(x0, x1, 6, opts.integer)) g += `<text x="${X(t)}" y="${H - 20}" text-anchor="middle">${+t.toPrecision(4)}</text>`;
    for (const s of series) {
      if (s.band && s.band.length) {
        const up = s.band.map(([x, , hi]) => `${X(x)},${Y(hi)}`), down = s.band.slice().reverse().map(([x, lo]) => `${X(x)},${Y(lo)}`);
        g += `<polygon points="${up.concat(down).join(" ")}" fill="${s.color}" opacity="0.15"/>`;
      }
      const pts = s.points.filter((p) => p[1] !== null);
      let d = "";
      pts.forEach(([x, y], i) => {
        if (i && s.step) d += ` H${X(x)}`;
        d += `${i ? (s.step ? " V" : " L") : "M"}${i && s.step ? Y(y) : X(x) + "," + Y(y)}`;
      });
      if (s.step && pts.length && opts.xEnd !== undefined) d += ` H${X(opts.xEnd)}`;
      g += `<path d="${d}" fill="none" stroke="${s.color}" stroke-width="2"/>`;
      if (pts.length <= 40) for (const [x, y] of pts) g += `<circle cx="${X(x)}" cy="${Y(y)}" r="2.5" fill="${s.color}"/>`;
    }
    if (opts.xLabel) g += `<text x="${(L + W - R) / 2}" y="${H - 4}" text-anchor="middle">${esc(opts.xLabel)}</text>`;
    return `<svg viewBox="0 0 ${W} ${H}" role="img">${g}</svg>`;
  }

  // bars: [{label, parts: [[value, color, title]]}]; vline: index of a dashed marker line
  function barChart(bars, opts = {}) {
    if (!bars.length) return empty(opts.none || "nothing yet");
    const W = 380, H = opts.height || 160, L = 40, R = 8, T = 8, B = 34;
    const top = Math.max(1, ...bars.map((b) => b.parts.reduce((a, p) => a + p[0], 0)));
    const bw = (W - L - R) / bars.length;
    const Y = (y) => T + (1 - y / top) * (H - T - B);
    let g = "";
    for (const t of ticks(0, top, 4)) g += `<line class="axis" x1="${L}" x2="${W - R}" y1="${Y(t)}" y2="${Y(t)}"/><text x="${L - 4}" y="${Y(t) + 4}" text-anchor="end">${+t.toPrecision(4)}</text>`;
    const every = Math.ceil(bars.length / 16);
    bars.forEach((b, i) => {
      let acc = 0;
      const x = L + i * bw + bw * 0.12, w = bw * 0.76;
      for (const [v, color, title] of b.parts) {
        if (v > 0) g += `<rect x="${x}" y="${Y(acc + v)}" width="${w}" height="${Y(acc) - Y(acc + v)}" fill="${color}"><title>${esc(title || "")} ${v}</title></rect>`;
        acc += v;
      }
      if (i % every === 0) g += `<text x="${x + w / 2}" y="${H - 20}" text-anchor="middle">${esc(b.label)}</text>`;
    });
    if (opts.vline !== undefined) {
      const x = L + (opts.vline + 1) * bw;
      g += `<line class="eta" x1="${x}" x2="${x}" y1="${T}" y2="${H - B}"/><text x="${x + 3}" y="${T + 10}" text-anchor="start" style="fill:#dc2626">η = ${opts.eta}</text>`;
    }
    if (opts.xLabel) g += `<text x="${(L + W - R) / 2}" y="${H - 4}" text-anchor="middle">${esc(opts.xLabel)}</text>`;
    return `<svg viewBox="0 0 ${W} ${H}" role="img">${g}</svg>`;
  }

  const chart = (title, svg) => `<div class="chart"><h3>${esc(title)}</h3>${svg}</div>`;
  const set = (panel, html) => { const el = document.querySelector(`[data-panel="${panel}"] .body`); if (el) el.innerHTML = html; };

  function steps(run, p) {
    const s = p.steps;
    const last = s[s.length - 1] || {};
    const head = kv([
      ["steps", s.length ? last.step + 1 : 0, "steps trained"],
      ["reward", s.length ? `${num(last.reward_mean, 3)} ± ${num(last.reward_std, 3)}` : "–", "reward (last step)"],
      ["tokens_per_s", s.length ? big(last.tokens_per_s) : "–", "trained tokens/s"],
      ["step_s", s.length ? num(last.step_s, 2) : "–", "s step time"],
    ]);
    const reward = lineChart([{ name: "reward", color: COLORS[0], points: s.map((r) => [r.step, r.reward_mean]),
      band: s.filter((r) => r.reward_mean !== null).map((r) => [r.step, r.reward_mean - r.reward_std, r.reward_mean + r.reward_std]) }], { xLabel: "step", integer: true });
    const tps = lineChart([{ name: "tokens/s", color: COLORS[2], points: s.map((r) => [r.step, r.tokens_per_s]) }], { xLabel: "step", y0: 0, integer: true });
    const st = lineChart([{ name: "step time", color: COLORS[3], points: s.map((r) => [r.step, r.step_s]) }], { xLabel: "step", y0: 0, integer: true });
    // versions over time: the run's (each publish) and each instance's (registration, pulls)
    const t0 = Date.parse(run.created_at);
    const sec = (at) => (Date.parse(at) - t0) / 1000;
    const byInst = new Map();
    for (const e of p.instance_versions) { if (!byInst.has(e.instance_id)) byInst.set(e.instance_id, []); byInst.get(e.instance_id).push([sec(e.at), e.version]); }
    const series = [{ name: "run", color: "#111827", step: true, points: [[0, 0]].concat(s.filter((r) => r.consumed_at).map((r) => [sec(r.consumed_at), r.step + 1])) }];
    let i = 0;
    for (const [id, pts] of byInst) series.push({ name: `instance ${id}`, color: COLORS[i++ % COLORS.length], step: true, points: pts });
    const xEnd = Math.max(0, ...series.flatMap((x) => x.points.map((q) => q[0])));
    const versions = lineChart(series, { xLabel: "seconds since the run started", y0: 0, xEnd }) + legend(series.slice(0, 9).map((x) => [x.name, x.color]));
    return head + `<div class="charts">${chart("reward: mean ± std per step", reward)}${chart("trained tokens/s per step", tps)}`
      + `${chart("step time (s)", st)}${chart("version over time: run (black), each rollout instance", versions)}</div>`
      + rewardMetrics(p.reward_metrics || []);
  }

  // the mean of each reward metric per step (the latest 10 steps), when rewards carry metrics
  function rewardMetrics(rows) {
    if (!rows.length) return "";
    const names = [...new Set(rows.map((r) => r.metric))].sort().slice(0, 8);
    const stepsSeen = [...new Set(rows.map((r) => r.step))].sort((a, b) => a - b).slice(-10);
    const at = new Map(rows.map((r) => [`${r.step} ${r.metric}`, r.mean]));
    const body = stepsSeen.map((st) => `<tr data-step="${st}"><td>${st}</td>${names.map((m) => `<td class="num" data-metric="${esc(m)}">${num(at.get(`${st} ${m}`), 3)}</td>`).join("")}</tr>`).join("");
    return `<div class="chart"><h3>reward metrics: mean per step</h3></div><table class="reward-metrics"><thead><tr><th>step</th>${names.map((m) => `<th class="num">${esc(m)}</th>`).join("")}</tr></thead><tbody>${body}</tbody></table>`;
  }

  function staleness(run, p) {
    const eta = run.eta, hist = p.histogram;
    const top = Math.max(eta + 1, ...hist.map((h) => h.staleness));
    const total = Array.from({ length: top + 1 }, () => 0);
    for (const h of hist) total[h.staleness] += h.n;
    const n = total.reduce((a, b) => a + b, 0);
    const over = total.slice(eta + 1).reduce((a, b) => a + b, 0);
    const head = kv([["trained", big(n), "trained samples"], ["eta", eta, "η"], ["over_eta", over, "beyond η"],
      ["mean_staleness", n ? num(total.reduce((a, v, k) => a + v * k, 0) / n, 2) : "–", "mean staleness"]]);
    const color = (k) => (k > eta ? "#7f1d1d" : STALE[Math.min(k, STALE.length - 2)]);
    const histo = barChart(total.map((v, k) => ({ label: String(k), parts: [[v, color(k), `staleness ${k}:`]] })), { vline: eta, eta, xLabel: "staleness" });
    const stepsSeen = [...new Set(hist.map((h) => h.step))].sort((a, b) => a - b).slice(-40);
    const per = barChart(stepsSeen.map((st) => ({ label: String(st),
      parts: hist.filter((h) => h.step === st).map((h) => [h.n, color(h.staleness), `staleness ${h.staleness}:`]) })), { xLabel: "step" });
    return head + `<div class="charts" style="grid-template-columns:1fr 1fr">${chart("trained samples by staleness", histo)}${chart("per step, coloured by staleness", per)}</div>`
      + legend(total.map((_, k) => [String(k), color(k)]));
  }

  function buffers(run, p) {
    const b = p.buffers;
    if (!b.length) return empty("no open buffer");
    const bars = barChart(b.map((x) => ({ label: String(x.idx), parts: [[x.occupied, "#16a34a", "occupied"], [x.reserved, "#f59e0b", "reserved"], [x.capacity - x.occupied - x.reserved, "#e5e7eb", "free"]] })), { xLabel: "buffer" });
    const rows = b.map((x) => `<tr data-buffer="${x.idx}"><td>${x.idx}</td><td class="num">${x.occupied}</td><td class="num">${x.reserved}</td><td class="num">${x.batch_size}</td><td class="num">${x.capacity}</td></tr>`).join("");
    return bars + legend([["occupied", "#16a34a"], ["reserved", "#f59e0b"], ["free", "#e5e7eb"]])
      + `<table><thead><tr><th>buffer</th><th class="num">occupied</th><th class="num">reserved</th><th class="num">batch</th><th class="num">capacity</th></tr></thead><tbody>${rows}</tbody></table>`;
  }

  function instances(run, p) {
    const inst = p.instances;
    if (!inst.length) return empty("no active instance");
    const rows = inst.map((i) => {
      const s = i.snapshot || {};
      const running = s.running ?? i.routed, waiting = s.waiting ?? 0;
      const kvCap = s.capacity?.kv_capacity;
      const kvUse = kvCap ? s.kv_used / kvCap : null;
      const state = s.pulling ? "pulling" : running + waiting === 0 ? "idle" : waiting > 0 || (kvUse !== null && kvUse > 0.9) ? "overloaded" : "busy";
      return `<tr class="${state}" data-instance="${i.id}"><td>${i.id}</td><td>${esc(i.name)}</td><td class="num" data-k="version">${i.version}</td>`
        + `<td><span class="tag ${state}">${state}</span></td><td class="num" data-k="running">${running}</td><td class="num" data-k="waiting">${waiting}</td>`
        + `<td>${kvUse === null ? "–" : `<span class="meter"><span style="width:${Math.min(100, kvUse * 100)}%"></span></span> ${num(kvUse * 100, kvUse < 0.1 ? 1 : 0)}%`}</td>`
        + `<td class="num">${big(s.throughput)}</td><td class="num">${num(i.heartbeat_age_s, 1)}</td><td class="num">${num(i.lease_left_s, 1)}</td><td>${s.pulling ? "yes" : "no"}</td></tr>`;
    }).join("");
    return kv([["active", inst.length, "active instances"], ["versions", [...new Set(inst.map((i) => i.version))].sort((a, b) => a - b).map((v) => "v" + v).join(", "), "in use"]])
      + `<table><thead><tr><th>id</th><th>name</th><th class="num">version</th><th>state</th><th class="num">running</th><th class="num">waiting</th><th>KV use</th><th class="num">tokens/s</th><th class="num">heartbeat age (s)</th><th class="num">lease left (s)</th><th>pulling</th></tr></thead><tbody>${rows}</tbody></table>`;
  }

  function queue(run, p) {
    const q = p.levels, total = q.reduce((a, r) => a + r.n, 0);
    const states = Object.entries(p.samples).filter(([k]) => k !== "queued").map(([k, v]) => [`samples_${k}`, big(v), k]);
    return kv([["queued", total, "queued samples"]].concat(states))
      + barChart(q.map((r) => ({ label: r.level === null ? "fresh" : String(r.level), parts: [[r.n, "#2563eb", "queued"]] })), { none: "the queue is empty", xLabel: "V_traj" })
      + `<table><tbody>${q.map((r) => `<tr data-level="${r.level ?? "fresh"}"><td>${r.level === null ? "fresh" : "V_traj " + r.level}</td><td class="num">${r.n}</td></tr>`).join("")}</tbody></table>`;
  }

  function coordinator(run, p) {
    const c = p.cycles;
    const ms = (r) => r.snapshot_ms + r.decide_ms + r.write_ms;
    const sum = (k) => c.reduce((a, r) => a + r[k], 0);
    const head = kv([["cycles", c.length, "recent cycles"], ["cycle_ms", c.length ? num(c.reduce((a, r) => a + ms(r), 0) / c.length, 1) : "–", "ms mean cycle"],
      ["routed", sum("routed"), "routed"], ["interrupted", sum("interrupted"), "interrupts"], ["pulled", sum("pulled"), "pulls"], ["migrated", sum("migrated"), "migrations"]]);
    const times = lineChart([
      { name: "snapshot", color: COLORS[0], points: c.map((r, i) => [i - c.length + 1, r.snapshot_ms]) },
      { name: "decide", color: COLORS[1], points: c.map((r, i) => [i - c.length + 1, r.decide_ms]) },
      { name: "write", color: COLORS[3], points: c.map((r, i) => [i - c.length + 1, r.write_ms]) },
    ], { y0: 0, integer: true, xLabel: "cycle (0: the latest)", none: "no coordinator cycle recorded" });
    const cmds = p.commands.slice(0, 8).map((k) => `<tr><td>${k.id}</td><td>${esc(k.kind)}</td><td>${k.instance_id}</td><td>${k.sample_id ?? (k.target_version !== null ? "→ v" + k.target_version : "")}</td><td>${esc(k.state)}</td></tr>`).join("");
    return head + chart("cycle time (ms)", times) + legend([["snapshot", COLORS[0]], ["decide", COLORS[1]], ["write", COLORS[3]]])
      + (cmds ? `<table><thead><tr><th>command</th><th>kind</th><th>instance</th><th>sample / target</th><th>state</th></tr></thead><tbody>${cmds}</tbody></table>` : empty("no command sent"));
  }

  function drops(run, p) {
    const r = p.reasons, total = r.reduce((a, x) => a + x.n, 0);
    return kv([["dropped", total, "dropped samples"]])
      + barChart(r.map((x) => ({ label: x.reason, parts: [[x.n, "#ea580c", x.reason]] })), { none: "nothing dropped" })
      + `<table><tbody>${r.map((x) => `<tr data-reason="${esc(x.reason)}"><td>${esc(x.reason)}</td><td class="num">${x.n}</td></tr>`).join("")}</tbody></table>`;
  }

  function audit(run, p) {
    if (!p) return `<div class="verdict wait">audit pending…</div>`;
    if (p.ok) return `<div class="verdict ok" data-k="audit">✓ audit clean: no violation</div><p class="empty">The complete audit (staleness bounds, buffer capacity, contiguity, segment versions) finds nothing.</p>`;
    return `<div class="verdict bad" data-k="audit">✗ ${p.violations.length} violation(s)</div><table><tbody>${p.violations.map((v) => `<tr><td>${esc(v.invariant)}</td><td>${esc(v.subject)}</td><td>${esc(v.detail)}</td></tr>`).join("")}</tbody></table>`;
  }

  function render(d) {
    const run = d.run;
    document.getElementById("summary").innerHTML = `version <b data-k="run_version">${run.version}</b> · η ${run.eta} · batch ${run.batch_size} · buffer ${run.buffer_capacity} · group ${run.group_size}`;
    set("steps", steps(run, d.steps));
    set("staleness", staleness(run, d.staleness));
    set("buffers", buffers(run, d.staleness));
    set("instances", instances(run, d.instances));
    set("queue", queue(run, d.queue));
    set("coordinator", coordinator(run, d.coordinator));
    set("drops", drops(run, d.drops));
    set("audit", audit(run, d.audit));
    window.SF.rendered = (window.SF.rendered || 0) + 1;
  }

  const live = document.getElementById("live");
  if (!window.SF.live) {
    live.textContent = "report"; render(window.SF.data); return;
  }
  const source = new EventSource(`/v1/runs/${window.SF.run}/dashboard/stream`);
  source.onmessage = (e) => {
    render(JSON.parse(e.data));
    live.className = "live on"; live.textContent = "live · " + new Date().toLocaleTimeString();
  };
  source.onerror = () => { live.className = "live off"; live.textContent = "disconnected"; };
})();
