// The what-if planner: POST /api/v1/plan on every edit, render the splits; rank layouts
// (parallel: "auto"); submit.
"use strict";
(function () {
  const $ = id => document.getElementById(id);
  const LAYOUT = ["tp", "pp", "dp", "zero"];
  // The spec as edited: the layout fields over the JSON; a cluster only when one is given
  // (`forSearch`: the layout's world size on one node when none is).
  function spec(forSearch) {
    const s = JSON.parse($("spec").value);
    s.parallel = {...(typeof s.parallel === "object" ? s.parallel : {})};
    for (const k of LAYOUT) s.parallel[k] = Number($("f-" + k).value);
    s.train = {...(s.train || {}), micro_batch: Number($("f-micro_batch").value)};
    const nodes = $("f-nodes").value, per = $("f-gpus_per_node").value, gpu = $("f-gpu").value;
    delete s.cluster;
    if (nodes || per || gpu || forSearch) {
      s.cluster = {nodes: Number(nodes || 1),
                   gpus_per_node: Number(per || s.parallel.tp * s.parallel.pp * s.parallel.dp)};
      if (gpu) s.cluster.gpu = gpu;
    }
    return s;
  }
  function split(parts, fmt) {
    const total = Object.values(parts).reduce((a, b) => a + b, 0) || 1;
    return `<div class="bar">` + Object.entries(parts).filter(([, v]) => v > 0).map(([k, v], i) =>
      `<span style="width:${(100 * v / total).toFixed(2)}%;background:${PALETTE[i % PALETTE.length]}" title="${k}: ${fmt(v)}">${k}</span>`).join("") +
      `</div><table class="kv">` + Object.entries(parts).map(([k, v]) => `<tr><td>${k}</td><td>${fmt(v)}</td></tr>`).join("") + `</table>`;
  }
  let seq = 0;
  async function update() {
    const mine = ++seq;
    const status = $("plan-status");
    let s;
    try { s = spec(); } catch (e) { status.textContent = "the spec is not valid JSON: " + e.message; return; }
    try {
      const p = await getJSON("/api/v1/plan", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(s)});
      if (mine !== seq) return;
      status.textContent = "";
      $("headline").textContent = `${p.layout.tp}×${p.layout.pp}×${p.layout.dp} zero${p.layout.zero}: ` +
        `${fmtSecs(p.time.step_s)} per step, ${Math.round(p.tokens_per_s).toLocaleString()} tokens/s`;
      $("n-fits").textContent = p.fits ? "yes" : "no: " + (p.reasons || []).join("; ");
      $("n-world").textContent = p.world_size;
      $("n-memory").textContent = `${fmtBytes(p.memory.total)} of ${fmtBytes(p.capacity_bytes)}`;
      $("n-step").textContent = fmtSecs(p.time.step_s);
      $("n-tokens").textContent = Math.round(p.tokens_per_s).toLocaleString();
      $("n-mfu").textContent = (100 * p.mfu).toFixed(1) + "%";
      const m = p.memory;
      $("memory-split").innerHTML = split({params: m.params, grads: m.grads, optimizer: m.optimizer,
        activations: m.activations, logits: m.logits, zero_buffers: m.zero_buffers, reserved: m.reserved}, fmtBytes);
      const t = p.time;
      $("time-split").innerHTML = split({compute: t.compute_s, recompute: t.recompute_s, bubble: t.bubble_s,
        tp: t.tp_comm_s, pp: t.pp_comm_s, dp: t.dp_comm_s, zero3_gather: t.zero3_gather_s, offload: t.offload_s,
        optimizer: t.optimizer_s, overhead: t.overhead_s}, fmtSecs);
      $("explanation").textContent = p.explanation;
      $("constants").tBodies[0].innerHTML = Object.entries(p.constants || {}).map(([name, c]) => {
        const v = typeof c.value === "object" ? Object.entries(c.value).map(([k, x]) => `${k} ${x}`).join(", ")
          : Number(c.value).toPrecision(4);
        return `<tr data-constant="${esc(name)}"><td>${esc(name)}</td><td>${esc(v)}</td>` +
          `<td class="${c.status === "measured" ? "ok" : "reason"}">${esc(c.status)}</td><td>${esc(c.source)}</td></tr>`;
      }).join("");
    } catch (e) {
      if (mine !== seq) return;
      status.textContent = "cannot plan this: " + e.message;
      for (const id of ["n-fits", "n-world", "n-memory", "n-step", "n-tokens", "n-mfu"]) $(id).textContent = "-";
      $("headline").textContent = "-";
    }
  }
  async function rank() {
    const s = spec(true);
    s.parallel = "auto";
    $("ranked").innerHTML = "<p>searching…</p>";
    try {
      const r = await getJSON("/api/v1/plan?top=10", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(s)});
      $("ranked").innerHTML = `<p>${esc(r.explanation.split(". ")[0])}.</p><table class="grid"><thead><tr><th>#</th><th>layout</th><th>memory</th><th>step</th><th>tokens/s</th><th>MFU</th><th></th></tr></thead><tbody>` +
        r.ranked.map((x, i) => `<tr><td>${i + 1}</td><td>${esc(x.name)}</td><td>${fmtBytes(x.memory_total)}</td><td>${fmtSecs(x.step_s)}</td>` +
          `<td>${Math.round(x.tokens_per_s).toLocaleString()}</td><td>${(100 * x.mfu).toFixed(1)}%</td>` +
          `<td><button type="button" data-layout='${esc(JSON.stringify(x.layout))}'>use</button></td></tr>`).join("") +
        `</tbody></table><details><summary>${r.rejected.length} rejected layouts and why</summary><ul>` +
        r.rejected.slice(0, 200).map(x => `<li>tp${x.layout.tp} pp${x.layout.pp} dp${x.layout.dp} zero${x.layout.zero}: ${esc(x.reason)}</li>`).join("") + `</ul></details>`;
    } catch (e) { $("ranked").innerHTML = `<p class="error">${esc(e.message)}</p>`; }
  }
  $("ranked").addEventListener("click", e => {
    const b = e.target.closest("button[data-layout]");
    if (!b) return;
    const l = JSON.parse(b.dataset.layout);
    for (const k of LAYOUT) $("f-" + k).value = l[k];
    $("f-micro_batch").value = l.micro_batch;
    update();
  });
  $("rank-layouts").addEventListener("click", rank);
  $("submit-plan").addEventListener("click", async () => {
    try {
      const j = await getJSON("/api/v1/jobs", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(spec())});
      location.href = `/jobs/${j.id}`;
    } catch (e) { $("plan-status").textContent = "not submitted: " + e.message; }
  });
  let timer = null;
  document.querySelectorAll("#layout input, #layout select, #spec").forEach(el =>
    el.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(update, 200); }));
  update();
})();
