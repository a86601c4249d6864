// The comparison page: several jobs' figures, the spec fields that differ, and one chart per
// figure with every job's curve on it (uPlot), by step or by wall time. Reads GET /compare.
"use strict";
(function () {
  const root = document.getElementById("compare");
  const ids = root.dataset.jobs.split(",");
  const TITLES = {loss: "Loss", eval_loss: "Eval loss", step_time_s: "Step time (s)",
                  tokens_per_s: "Tokens per second"};
  let cmp = null;
  const charts = {};

  const num = (v, p = 4) => (v === null || v === undefined ? "-" : Number(v).toPrecision(p));
  const pct = v => (v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%");

  function renderRuns() {
    document.getElementById("run-rows").innerHTML = cmp.runs.map((r, i) => {
      const pm = r.predicted_vs_measured;
      return `<tr data-job="${r.id}"><td><span class="swatch" style="background:${PALETTE[i % PALETTE.length]}"></span>` +
        `<a href="/jobs/${r.id}">${r.id}</a></td><td>${esc(r.name)}</td><td>${esc(r.owner)}</td>` +
        `<td class="state ${esc(r.state)}">${esc(r.state)}</td><td>${esc(r.layout)}</td>` +
        `<td>${r.step ?? "-"} / ${r.total_steps}</td><td>${r.loss_nonfinite ? '<span class="nonfinite" title="the loss of this step was NaN or infinite">NaN/inf</span>' : num(r.loss)}</td><td>${num(r.eval_loss)}</td>` +
        `<td>${fmtSecs(pm.step_s.predicted)}</td><td>${fmtSecs(pm.step_s.measured)}</td>` +
        `<td>${num(pm.tokens_per_s.predicted)}</td><td>${num(pm.tokens_per_s.measured)}</td>` +
        `<td>${pct(r.mfu_predicted)}</td><td>${pct(r.mfu)}</td>` +
        `<td class="ettr" data-value="${r.ettr ?? ""}">${pct(r.ettr)}</td></tr>`;
    }).join("");
  }

  function renderDifferences() {
    const body = document.querySelector("#differences tbody");
    if (!cmp.differences.length) {
      body.innerHTML = `<tr><td colspan="${ids.length + 1}">The specs are the same.</td></tr>`;
      return;
    }
    body.innerHTML = cmp.differences.map(d => `<tr data-field="${esc(d.field)}"><td>${esc(d.field)}</td>` +
      d.values.map(v => `<td>${v === null ? "<em>unset</em>" : esc(typeof v === "string" ? v : JSON.stringify(v))}</td>`).join("") +
      "</tr>").join("");
  }

  function chartSize() {
    const w = Math.max(320, (document.getElementById("charts").clientWidth || 1100) / (innerWidth > 1200 ? 2 : 1) - 24);
    return {width: w, height: 260};
  }

  // uPlot draws series over one x array: the runs' x values merged, each run's y where it has one.
  function aligned(key, axis) {
    const xs = [...new Set(cmp.curves.flatMap(c => c[axis]))].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const ys = cmp.curves.map(c => {
      const out = new Array(xs.length).fill(null);
      (c.metrics[key] || []).forEach((v, i) => { out[at.get(c[axis][i])] = v; });
      return out;
    });
    return [xs, ...ys];
  }

  function buildCharts() {
    const box = document.getElementById("charts");
    box.innerHTML = "";
    const axis = document.querySelector("input[name=x-axis]:checked").value;
    const log = document.getElementById("logscale").checked;
    for (const key of cmp.charted) {
      const div = document.createElement("div");
      div.className = "chart";
      div.id = "chart-" + key.replace(/[^A-Za-z0-9_-]/g, "_");
      div.dataset.metric = key;
      div.innerHTML = `<h3>${esc(TITLES[key] || key)}</h3>`;
      box.appendChild(div);
      const data = aligned(key, axis);
      const drawn = data.slice(1).filter(ys => ys.some(v => v !== null)).length;
      div.dataset.series = String(drawn);
      if (!drawn) {
        div.insertAdjacentHTML("beforeend", `<p class="reason">No job has stored ${esc(key)}.</p>`);
        continue;
      }
      const series = [{}, ...cmp.runs.map((r, i) => ({
        label: `job ${r.id} ${r.name}`, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true}))];
      charts[key] = new uPlot({
        ...chartSize(), series,
        scales: {x: {time: false}, y: log ? {distr: 3} : {}},
        axes: [{label: axis === "step" ? "step" : "seconds since the job started"}, {label: key, size: 70, values: yTicks(div)}],
        cursor: {drag: {x: true, y: false}},
      }, data, div);
    }
  }

  async function load() {
    const q = ids.map(i => "jobs=" + encodeURIComponent(i)).join("&");
    try {
      cmp = await getJSON(`/api/v1/compare?${q}`);
    } catch (e) {
      document.getElementById("run-rows").innerHTML = `<tr><td colspan="14" class="error">${esc(e.message)}</td></tr>`;
      return;
    }
    renderRuns();
    renderDifferences();
    buildCharts();
    root.dataset.loaded = "true";
  }
  document.querySelectorAll("input[name=x-axis]").forEach(r => r.addEventListener("change", () => cmp && buildCharts()));
  document.getElementById("logscale").addEventListener("change", () => cmp && buildCharts());
  load();
})();
