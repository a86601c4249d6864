// A job's page: tabs, live state and events, charts (uPlot), ranks grid, communication,
// live rank logs (server-sent events), hangs, and the cancel / resubmit actions.
"use strict";
(function () {
  const root = document.getElementById("job");
  const jobId = root.dataset.job;
  const pollMs = Number(root.dataset.pollMs);
  const api = `/api/v1/jobs/${jobId}`;
  const stages = window.TRIDENT_STAGES || [];
  let terminal = root.dataset.terminal === "true";
  let current = "overview";
  const loaded = {};

  // --- tabs -------------------------------------------------------------------------------
  function show(tab) {
    if (!document.getElementById("tab-" + tab)) tab = "overview";
    current = tab;
    document.querySelectorAll("section.tab").forEach(s => { s.hidden = s.id !== "tab-" + tab; });
    document.querySelectorAll(".tabs a").forEach(a => a.classList.toggle("active", a.dataset.tab === tab));
    if (!loaded[tab]) { loaded[tab] = true; (OPEN[tab] || (() => {}))(); }
    if (tab === "metrics") Object.values(charts).forEach(c => c.setSize(chartSize()));
  }
  document.querySelectorAll(".tabs a").forEach(a => a.addEventListener("click", e => {
    e.preventDefault();
    history.replaceState(null, "", "#" + a.dataset.tab);
    show(a.dataset.tab);
  }));

  // --- state, events, actions -----------------------------------------------------------------
  let lastEvent = 0;
  const timeline = document.getElementById("events");
  async function pollJob() {
    try {
      const j = await getJSON(api);
      const st = document.getElementById("job-state");
      st.textContent = j.state;
      st.className = "state " + j.state;
      document.getElementById("job-attempts").textContent = j.attempts;
      // A NaN or infinite loss says so (its value is null), never as a number or a blank.
      const loss = document.getElementById("job-loss");
      loss.textContent = j.loss_nonfinite ? "NaN/inf" : j.loss === null || j.loss === undefined ? "-" : Number(j.loss).toPrecision(4);
      loss.className = j.loss_nonfinite ? "nonfinite" : "";
      if (loaded.logs) followLogs(j.attempts);
      const err = document.getElementById("job-error");
      err.hidden = !j.error;
      err.textContent = j.error || "";
      terminal = ["SUCCEEDED", "FAILED", "CANCELLED"].includes(j.state);
      document.getElementById("cancel").disabled = terminal;
      const evs = await getJSON(`${api}/events?after=${lastEvent}&limit=1000`);
      for (const ev of evs.items) {
        lastEvent = ev.id;
        const li = document.createElement("li");
        li.innerHTML = `<time>${esc(new Date(ev.time).toLocaleTimeString())}</time> ` +
          `<span class="kind">${esc(ev.kind)}</span>${esc(ev.message.split("\n")[0].slice(0, 300))}`;
        li.title = ev.message;
        timeline.appendChild(li);
      }
    } catch (e) { /* retried */ }
  }
  document.getElementById("cancel").addEventListener("click", async () => {
    const out = document.getElementById("action-status");
    try {
      const j = await getJSON(`${api}/cancel`, {method: "POST"});
      out.textContent = `cancel requested (${j.state})`;
    } catch (e) { out.textContent = "cancel refused: " + e.message; }
    pollJob();
  });
  document.getElementById("resubmit").addEventListener("click", async () => {
    const out = document.getElementById("action-status");
    try {  // on the server: the stored spec, and the job's secrets when its owner asks
      const fresh = await getJSON(`${api}/resubmit`, {method: "POST"});
      location.href = `/jobs/${fresh.id}`;
    } catch (e) { out.textContent = "resubmit refused: " + e.message; }
  });

  // --- metrics charts ---------------------------------------------------------------------------
  const charts = {};
  let series = null;
  const CHARTS = [
    {key: "loss", title: "Loss", unit: "loss (nats)", pred: null, scale: 1},
    {key: "step_time_s", title: "Step time", unit: "seconds per step", pred: "step_time_s", scale: 1},
    {key: "tokens_per_s", title: "Throughput", unit: "tokens per second", pred: "tokens_per_s", scale: 1},
    {key: "mfu", title: "MFU", unit: "model FLOPs utilisation (%)", pred: "mfu", scale: 100},
    // The recipe, on the steps that reported it; the rate is drawn as the schedule gave it.
    {key: "lr", title: "Learning rate", unit: "learning rate", pred: null, scale: 1,
     x: "recipe_step", raw: true},
    {key: "grad_norm", title: "Gradient norm", unit: "global norm before clipping", pred: null,
     scale: 1, x: "recipe_step"},
  ];
  function chartSize() {
    const w = Math.max(320, (document.getElementById("charts").clientWidth || 1100) / (innerWidth > 1200 ? 2 : 1) - 24);
    return {width: w, height: 260};
  }
  function smooth(ys, a) {
    if (!a) return ys;
    let m = null;
    return ys.map(y => (y === null ? null : (m = m === null ? y : a * m + (1 - a) * y)));
  }
  function chartData(c) {
    const a = c.raw ? 0 : Number(document.getElementById("smooth").value);
    const ys = smooth((series[c.key] || []).map(v => (v === null ? null : v * c.scale)), a);
    if (c.key === "loss" && series.eval_step && series.eval_step.length) {
      // The validation loss beside the training loss, on the union of their steps.
      const train = new Map(series.step.map((s, i) => [s, ys[i]]));
      const valid = new Map(series.eval_step.map((s, i) => [s, series.eval_loss[i]]));
      const xs = [...new Set([...series.step, ...series.eval_step])].sort((p, q) => p - q);
      return [xs, xs.map(s => (train.has(s) ? train.get(s) : null)),
              xs.map(s => (valid.has(s) ? valid.get(s) : null))];
    }
    const data = [series[c.x || "step"] || [], ys];
    if (c.pred && series.predicted[c.pred] !== null && series.predicted[c.pred] !== undefined) {
      data.push(series.step.map(() => series.predicted[c.pred] * c.scale));
    }
    return data;
  }
  // The training guard's events on the loss chart: a vertical line at each step it skipped
  // (orange), judged a spike after the update (red) or rolled back after (purple).
  const GUARD_COLOURS = {guard_skip: "#e69f00", guard_spike: "#d55e00", guard_rollback: "#cc79a7"};
  function drawGuardMarks(u) {
    const marks = (series && series.guard) || [];
    const ctx = u.ctx, top = u.bbox.top, bottom = u.bbox.top + u.bbox.height;
    ctx.save();
    ctx.lineWidth = 1.5 * devicePixelRatio;
    ctx.setLineDash([4 * devicePixelRatio, 3 * devicePixelRatio]);
    for (const m of marks) {
      const x = u.valToPos(m.step, "x", true);
      if (!Number.isFinite(x)) continue;
      ctx.strokeStyle = GUARD_COLOURS[m.kind] || "#999";
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, bottom); ctx.stroke();
    }
    ctx.restore();
  }
  function guardLegend(div) {
    const marks = (series && series.guard) || [];
    let box = div.querySelector(".guard-marks");
    if (!box) { box = document.createElement("div"); box.className = "guard-marks"; div.appendChild(box); }
    div.dataset.guardMarks = String(marks.length);
    box.innerHTML = marks.map(m =>
      `<span style="color:${GUARD_COLOURS[m.kind] || "#999"}" title="${esc(m.message)}">` +
      `${esc(m.kind.replace("guard_", ""))} @ ${m.step}</span>`).join(" ");
  }
  function buildCharts() {
    const box = document.getElementById("charts");
    box.innerHTML = "";
    const log = document.getElementById("logscale").checked;
    for (const c of CHARTS) {
      const div = document.createElement("div");
      div.className = "chart";
      div.id = "chart-" + c.key;
      div.innerHTML = `<h3>${esc(c.title)}</h3>`;
      box.appendChild(div);
      const data = chartData(c);
      const lines = [{}, {label: "measured", stroke: PALETTE[0], width: 1.5, spanGaps: true}];
      if (data.length > 2 && c.key === "loss") {
        lines[1].label = "training";
        lines.push({label: "validation", stroke: PALETTE[2], width: 2, spanGaps: true,
                    points: {show: true, size: 6}});
      } else if (data.length > 2) lines.push({label: "predicted", stroke: PALETTE[1], width: 2, dash: [6, 4]});
      charts[c.key] = new uPlot({
        ...chartSize(), series: lines,
        scales: {x: {time: false}, y: log ? {distr: 3} : {}},
        axes: [{label: "step"}, {label: c.unit, size: 70, values: yTicks(div)}],
        cursor: {drag: {x: true, y: false}},
        hooks: c.key === "loss" ? {draw: [drawGuardMarks]} : {},
      }, data, div);
      div.dataset.points = String(data[0].length);
      if (c.key === "loss") guardLegend(div);
    }
  }
  async function loadSeries(rebuild) {
    try {
      series = await getJSON(`${api}/series`);
      document.getElementById("job-step").textContent = series.step.length ? series.step[series.step.length - 1] : "-";
      document.getElementById("series-info").textContent =
        `${series.rows} steps stored, ${series.step.length} points drawn per series`;
      if (rebuild || !Object.keys(charts).length) buildCharts();
      else for (const c of CHARTS) {
        const data = chartData(c);
        if (charts[c.key].series.length !== data.length) { buildCharts(); break; }  // a new curve
        charts[c.key].setData(data);
        document.getElementById("chart-" + c.key).dataset.points = String(data[0].length);
        if (c.key === "loss") guardLegend(document.getElementById("chart-loss"));
      }
    } catch (e) { /* retried */ }
  }
  document.getElementById("logscale").addEventListener("change", () => series && buildCharts());
  document.getElementById("smooth").addEventListener("input", e => {
    document.getElementById("smooth-out").textContent = e.target.value;
    if (series) for (const c of CHARTS) charts[c.key].setData(chartData(c));
  });

  // --- ranks grid -----------------------------------------------------------------------------
  // Diverging blue (under) - grey (as predicted / as peers) - orange (over); ratio on a log2 scale.
  function ratioColour(r) {
    if (r === null || r === undefined) return "#e0e0e0";
    const t = Math.max(-1, Math.min(1, Math.log2(r)));
    const mix = (a, b, f) => Math.round(a + (b - a) * f);
    const grey = [238, 238, 238], lo = [86, 180, 233], hi = [230, 159, 0];
    const to = t < 0 ? lo : hi, f = Math.abs(t);
    return `rgb(${mix(grey[0], to[0], f)},${mix(grey[1], to[1], f)},${mix(grey[2], to[2], f)})`;
  }
  let ranks = null;
  function renderRanks() {
    if (!ranks) return;
    const by = document.querySelector("input[name=rank-colour]:checked").value;
    const grid = document.getElementById("ranks-grid");
    grid.innerHTML = "";
    const pp = ranks.layout.pp, dp = ranks.layout.dp;
    for (let s = 0; s < pp; s++) {
      const row = document.createElement("div");
      row.className = "stage-row";
      row.innerHTML = `<span class="barlabel">stage ${s}</span>`;
      for (let d = 0; d < dp; d++) {
        const group = document.createElement("div");
        group.className = "dp-group";
        group.title = `pipeline stage ${s}, data-parallel replica ${d}`;
        for (const c of ranks.cells.filter(c => c.pp === s && c.dp === d).sort((a, b) => a.tp - b.tp)) {
          const cell = document.createElement("div");
          const ratio = by === "memory" ? c.memory_ratio : c.compute_ratio;
          cell.className = "rank-cell" + (c.straggler ? " straggler" : "") + (c.hang_waits_for ? " hang" : "");
          cell.style.background = ratioColour(ratio);
          cell.dataset.rank = c.rank;
          const mark = c.hang_waits_for ? " hang" : c.straggler ? " slow" : "";
          cell.innerHTML = `<span class="mark">r${c.rank}${mark}</span><span>${ratio === null ? "n/a" : ratio.toFixed(2) + "×"}</span>`;
          const text = `rank ${c.rank} (tp ${c.tp}, pp ${c.pp}, dp ${c.dp}) on ${c.node || "?"}` +
            (c.gpu ? ` gpu ${c.gpu}` : "") + `: peak memory ${fmtBytes(c.memory_peak_bytes)} of ` +
            (c.memory_predicted_bytes === null ? "not planned" : `${fmtBytes(c.memory_predicted_bytes)} predicted`) + `; compute ${fmtSecs(c.compute_s)} against ` +
            `stage peers' ${fmtSecs(c.stage_compute_s)}` + (c.straggler ? "; straggler" : "") +
            (c.hang_waits_for ? "; a hang waits for this rank" : "") + (c.step ? `; step ${c.step}` : "") +
            `; last heartbeat ${c.heartbeat_age_s === null || c.heartbeat_age_s === undefined ? "not seen" : fmtSecs(c.heartbeat_age_s) + " ago"}`;
          cell.title = text;
          cell.addEventListener("mouseenter", () => { document.getElementById("rank-detail").textContent = text; });
          group.appendChild(cell);
        }
        row.appendChild(group);
      }
      grid.appendChild(row);
    }
    document.getElementById("rank-legend").innerHTML = [0.5, 0.75, 1, 1.5, 2].map(r =>
      `<span style="background:${ratioColour(r)}">${r}×</span>`).join("") +
      `<span style="background:#e0e0e0">n/a</span> <span class="rank-cell straggler" style="display:inline;width:auto">slow: straggler</span>` +
      ` <span class="rank-cell hang" style="display:inline;width:auto">hang: a hang waits for it</span>`;
  }
  async function loadRanks() {
    try { ranks = await getJSON(`${api}/ranks`); renderRanks(); } catch (e) { /* retried */ }
  }
  document.querySelectorAll("input[name=rank-colour]").forEach(i => i.addEventListener("change", renderRanks));

  // --- communication ----------------------------------------------------------------------------
  const PARTS = ["compute", "tp", "pp", "dp", "bubble"];
  function bar(label, parts, scale) {
    const total = PARTS.reduce((a, p) => a + (parts[p] || 0), 0);
    const spans = PARTS.filter(p => parts[p] > 0).map(p =>
      `<span style="width:${(100 * parts[p] / scale).toFixed(2)}%;background:${PALETTE[PARTS.indexOf(p)]}" title="${p}: ${fmtSecs(parts[p])}">${p} ${fmtSecs(parts[p])}</span>`).join("");
    return `<div class="barlabel">${esc(label)}: ${fmtSecs(total)}</div><div class="bar">${spans}</div>`;
  }
  // A command job's collectives are only those its script reports (docs/command.md).
  function unreported(r) {
    if (!r || !r.steps || r.comm_steps) return "";
    return r.source === "script"
      ? `<p id="comm-unreported">Collectives not reported: this job's script reported none in its ${r.steps} recent steps (a rank reports them in the <code>comm</code> field of its <code>TRIDENT_REPORT</code> lines).</p>`
      : `<p id="comm-unreported">Collectives not measured in the ${r.steps} recent steps.</p>`;
  }
  async function loadComm() {
    try {
      const c = await getJSON(`${api}/comm`);
      const steps = await getJSON(`${api}/comm/steps`);
      const predicted = steps.predicted;  // null: the job is not planned
      const max = Math.max(predicted ? predicted.step : 0, ...steps.steps.map(s => s.step_s));
      document.getElementById("comm-bars").innerHTML =
        `<p class="controls">${PARTS.map((p, i) => `<span class="chip" style="border-left:10px solid ${PALETTE[i]}">${p}</span>`).join("")}` +
        ` seconds per step; the measured bubble is the ranks' wait for neighbouring pipeline stages, taken out of pp</p>` +
        (predicted ? bar("predicted", predicted, max) : `<p id="comm-not-planned">Not planned: no predicted split.</p>`) +
        (steps.steps.length ? steps.steps.map(s => bar(`step ${s.step} measured (mean of ${s.ranks} ranks)`, s, max)).join("")
                            : unreported(c.reported) || "<p>No timed step measured yet.</p>");
      document.querySelector("#probe tbody").innerHTML = (c.probe || []).map(r =>
        `<tr><td>${esc(r.dim)}</td><td>${esc(r.op)}</td><td>${esc((r.group || []).join(","))}</td><td>${fmtBytes(r.bytes)}</td>` +
        `<td>${fmtBytes(r.busbw)}/s</td><td>${r.expected_busbw ? fmtBytes(r.expected_busbw) + "/s" : "-"}</td></tr>`).join("") ||
        `<tr><td colspan="6">No bandwidth probe (monitor.probe off, or one rank).</td></tr>`;
    } catch (e) { /* retried */ }
  }

  // --- logs -----------------------------------------------------------------------------------
  const logLines = [];  // {rank, text}; a line with rank null separates attempts
  let partial = {};
  let source = null;
  let logAttempt = 0;  // the attempt followed (0: none yet)
  function addChunk(c) {
    if (c.skipped) logLines.push({rank: c.rank, text: `... ${c.skipped} bytes dropped by the size cap`});
    const parts = ((partial[c.rank] || "") + c.text).split("\n");
    partial[c.rank] = parts.pop();
    for (const t of parts) logLines.push({rank: c.rank, text: t});
    if (logLines.length > 50000) logLines.splice(0, logLines.length - 50000);
  }
  function renderLogs() {
    const rank = document.getElementById("log-rank").value;
    const stage = document.getElementById("log-stage").value;
    const q = document.getElementById("log-search").value;
    const ctx = Math.max(0, Math.min(50, Number(document.getElementById("log-context").value) || 0));
    const pool = logLines.filter(l => l.rank === null || ((rank === "" || String(l.rank) === rank) &&
                                      (stage === "" || String(stages[l.rank]) === stage)));
    let keep = pool.map(() => !q);
    if (q) pool.forEach((l, i) => { if (l.text.includes(q)) for (let k = Math.max(0, i - ctx); k <= Math.min(pool.length - 1, i + ctx); k++) keep[k] = true; });
    const out = [];
    let gap = false;
    pool.forEach((l, i) => {
      if (!keep[i]) { gap = true; return; }
      if (gap && out.length) out.push(`<span class="sep">--</span>`);
      gap = false;
      if (l.rank === null) { out.push(`<span class="attempt">${esc(l.text)}</span>`); return; }
      let text = esc(l.text);
      if (q) text = text.split(esc(q)).join(`<mark>${esc(q)}</mark>`);
      out.push(`<span class="line" data-rank="${l.rank}">[rank ${l.rank}] ${text}</span>`);
    });
    const view = document.getElementById("log-view");
    const atEnd = view.scrollTop + view.clientHeight >= view.scrollHeight - 20;
    view.innerHTML = out.join("\n");
    if (atEnd) view.scrollTop = view.scrollHeight;
  }
  // Follows the newest attempt; `pollJob` calls it again when a newer attempt starts, and the
  // view goes on below a separator with that attempt's output.
  function followLogs(attempts) {
    const status = document.getElementById("log-status");
    const n = attempts === undefined ? Number(document.getElementById("job-attempts").textContent) || 0 : attempts;
    if (!n) { status.textContent = "waiting for the job to start"; return; }
    if (n <= logAttempt) return;
    if (source) source.close();
    for (const [r, t] of Object.entries(partial)) if (t) logLines.push({rank: Number(r), text: t});
    if (logAttempt) logLines.push({rank: null, text: `--- attempt ${n} ---`});
    logAttempt = n;
    partial = {};
    const es = source = new EventSource(`${api}/logs?follow=true&attempt=${n}`);
    status.textContent = `following attempt ${n}`;
    es.addEventListener("log", e => { addChunk(JSON.parse(e.data)); renderLogs(); });
    es.addEventListener("end", () => { status.textContent = "the job has ended: all output shown"; es.close(); });
    es.onerror = () => {
      if (es.readyState === EventSource.CLOSED) status.textContent = `not following attempt ${n}`;
    };
    renderLogs();
  }
  ["log-rank", "log-stage", "log-search", "log-context"].forEach(id =>
    document.getElementById(id).addEventListener("input", renderLogs));

  // --- hangs ----------------------------------------------------------------------------------
  async function loadHangs() {
    try {
      const h = await getJSON(`${api}/hangs`);
      if (!h.items.length) return;
      document.getElementById("hangs").innerHTML = h.items.map(x =>
        `<h3>Attempt ${x.attempt}: ${esc(x.summary)}</h3>` +
        `<table class="grid"><thead><tr><th>group</th><th>collective</th><th>step</th><th>waiting</th><th>never arrived</th></tr></thead><tbody>` +
        (x.diagnosis.waiting || []).map(w => `<tr><td>${esc(w.dim || "")} [${esc(w.group.join(","))}]</td><td>${esc(w.collective)}</td>` +
          `<td>${w.step}</td><td>${esc(w.waiting.join(","))}</td><td>${esc(w.missing.join(","))}</td></tr>`).join("") +
        `</tbody></table><p>Root cause ranks: <strong>${esc((x.diagnosis.never_arrived || []).join(", ") || "none")}</strong></p>` +
        x.stacks.map(s => `<details><summary>ranks ${esc(s.ranks.join(", "))} (identical stacks)</summary><pre class="scroll">${esc(s.text)}</pre></details>`).join("")
      ).join("");
    } catch (e) { /* retried */ }
  }

  // --- profiles (`trident profile`) -----------------------------------------------------------
  async function loadProfiles() {
    try {
      const p = await getJSON(`${api}/profile`);
      document.getElementById("profile-bytes").textContent = `${fmtBytes(p.stored_bytes)} stored` +
        ` (at most ${fmtBytes(p.max_trace_bytes)} a file, ${fmtBytes(p.max_job_bytes)} a job: the oldest are dropped).`;
      if (!p.items.length) return;
      document.getElementById("profiles").innerHTML = `<table class="grid"><thead><tr><th>#</th><th>asked</th>` +
        `<th>status</th><th>steps</th><th>files</th><th>notes</th></tr></thead><tbody>` +
        p.items.map(r => {
          const steps = Object.entries(r.profiled_steps).map(([k, s]) => `rank ${esc(k)}: ${s[0]}-${s[1]}`).join("; ");
          const files = r.files.map(f => `<a href="${api}/profile/${r.id}/files/${encodeURIComponent(f.name)}" download>` +
            `${esc(f.name)}</a> (${fmtBytes(f.bytes)})`).join("<br>");
          const notes = [r.dropped, r.error, ...r.missing.map(m => `rank ${m.rank}: ${m.reason}`),
                         ...r.left_out.map(o => `${o.name} left out: ${o.why}`)].filter(Boolean).map(esc).join("<br>");
          return `<tr><td>${r.id}</td><td>${esc(r.steps)} step(s) of rank(s) ${esc(r.ranks.join(","))}` +
            `${r.memory ? " with memory" : ""}${r.requested_by ? ` by ${esc(r.requested_by)}` : ""}</td>` +
            `<td>${esc(r.status)}</td><td>${steps || "-"}</td><td>${files || "-"}</td><td>${notes}</td></tr>`;
        }).join("") + `</tbody></table>`;
    } catch (e) { /* retried */ }
  }

  // --- what each tab does when first opened, and while open -----------------------------------
  const OPEN = {metrics: () => loadSeries(true), ranks: loadRanks, comm: loadComm, logs: () => followLogs(), hangs: loadHangs, profiles: loadProfiles};
  const LIVE = {metrics: () => loadSeries(false), ranks: loadRanks, comm: loadComm, hangs: loadHangs, profiles: loadProfiles};
  setInterval(() => {
    if (terminal && loaded["final-" + current]) return;
    if (terminal) loaded["final-" + current] = true;  // one more refresh after the end
    pollJob();
    (LIVE[current] || (() => {}))();
  }, pollMs);
  addEventListener("resize", () => Object.values(charts).forEach(c => c.setSize(chartSize())));
  addEventListener("hashchange", () => show((location.hash || "#overview").slice(1)));
  pollJob();
  loadSeries(false);
  show((location.hash || "#overview").slice(1));
})();
