// The goodput ledger drawn (docs/goodput.md): where a job's wall time went, as one stacked
// bar of its categories with a legend of their seconds and shares, its timeline of them over
// wall time (attempts marked), and its figures (ETTR, goodput, steps, predicted training time,
// cost); on the cluster page the ledgers' totals over a window (`GET /api/v1/goodput`). The
// seconds drawn are left in `data-seconds` as the API gave them, for whoever reads the page.
"use strict";
const GOODPUT = (function () {
  // One fixed colour per category (Okabe-Ito first, then Tol's muted scheme); the categories of
  // time not spent on steps that count (lost, recovery, stall) are hatched as well, so that
  // they read without colour. The legend always writes each category out.
  const COLOURS = {
    queued: "#BBBBBB", placement: "#DDCC77", start: "#F0E442", checkpoint_load: "#56B4E9",
    training: "#009E73", evaluation: "#332288", checkpoint_save: "#0072B2", lost: "#D55E00",
    recovery: "#E69F00", stall: "#CC79A7", stopping: "#666666", finishing: "#999933",
  };
  const ORDER = Object.keys(COLOURS);  // client.ledger.CATEGORIES
  const HATCHED = new Set(["lost", "recovery", "stall"]);
  const REASONS = {quota: "its project's quota", room: "room in the cluster",
                   preempted: "its turn after a preemption"};

  function label(c) { return c.replace("_", " "); }
  function fill(c) {
    const base = COLOURS[c] || "#000";
    return HATCHED.has(c)
      ? `repeating-linear-gradient(135deg, ${base} 0 6px, rgba(255,255,255,.55) 6px 8px), ${base}`
      : base;
  }
  function swatch(c) {
    return `<span class="swatch gp-${c}" style="background:${fill(c)}" aria-hidden="true"></span>`;
  }
  function dur(s) {
    if (s === null || s === undefined) return "-";
    const a = Math.abs(s);
    if (a === 0) return "0 s";
    if (a < 1) return (s * 1000).toPrecision(3) + " ms";
    if (a < 120) return s.toPrecision(3) + " s";
    if (a < 7200) return (s / 60).toFixed(1) + " min";
    if (a < 3 * 86400) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  }
  function pct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + " %"; }
  function money(x) {
    if (x === null || x === undefined) return "-";
    return x >= 100 ? x.toFixed(0) : x >= 1 || x === 0 ? x.toFixed(2) : x.toPrecision(3);
  }
  function hours(s) { return s ? (s / 3600).toPrecision(3) : "0"; }

  // The stacked bar: each category with seconds, as wide as its share of `wall`.
  function bar(categories, wall, name) {
    const shown = categories.filter(c => c.seconds > 0);
    const said = shown.map(c => `${label(c.category)} ${pct(wall ? c.seconds / wall : 0)}`).join(", ");
    return `<div class="gp-bar" role="img" aria-label="${esc(name)}: ${esc(said || "no time yet")}">` +
      shown.map(c => `<span data-category="${c.category}" data-seconds="${c.seconds}" ` +
        `style="width:${(100 * c.seconds / (wall || 1)).toFixed(3)}%;background:${fill(c.category)}" ` +
        `title="${label(c.category)}: ${dur(c.seconds)} (${pct(c.seconds / (wall || 1))})"></span>`).join("") +
      `</div>`;
  }

  // The legend: every category, its seconds and share, and what the ranks held meanwhile.
  function legend(categories, wall, priced) {
    const gpu = categories.some(c => c.gpu_seconds > 0), cpu = categories.some(c => c.cpu_seconds > 0);
    const head = `<tr><th scope="col">category</th><th scope="col">time</th><th scope="col">share</th>` +
      (gpu ? `<th scope="col">GPU-hours</th>` : "") + (cpu ? `<th scope="col">CPU-hours</th>` : "") +
      (priced ? `<th scope="col">cost</th>` : "") + `</tr>`;
    const rows = categories.map(c =>
      `<tr data-category="${c.category}" data-seconds="${c.seconds}"${c.seconds > 0 ? "" : ` class="gp-none"`}>` +
      `<th scope="row">${swatch(c.category)}${label(c.category)}</th><td>${dur(c.seconds)}</td>` +
      `<td>${pct(wall ? c.seconds / wall : 0)}</td>` +
      (gpu ? `<td>${hours(c.gpu_seconds)}</td>` : "") + (cpu ? `<td>${hours(c.cpu_seconds)}</td>` : "") +
      (priced ? `<td>${c.seconds ? money(c.cost) : "0"}</td>` : "") + `</tr>`).join("");
    return `<table class="grid gp-legend"><thead>${head}</thead><tbody>${rows}</tbody></table>`;
  }

  // The timeline: the segments over wall time in one row, each coloured by what it was mostly
  // spent on (its title gives its split), a mark where each attempt begins, elapsed-time ticks.
  function timeline(ledger) {
    const t0 = Date.parse(ledger.start), t1 = Date.parse(ledger.end);
    const span = Math.max(1, t1 - t0);
    const at = t => (100 * (Date.parse(t) - t0) / span).toFixed(3);
    let lastAttempt = null, lastLeft = -100;
    const marks = [], lines = [];
    const segs = ledger.segments.map(s => {
      if (s.attempt !== null && s.attempt !== undefined && s.attempt !== lastAttempt) {
        lastAttempt = s.attempt;
        const left = Number(at(s.start));
        // Attempts close together: their numbers alone, so that the marks' labels do not overlap.
        const text = left - lastLeft < 8 ? `${s.attempt}` : `attempt ${s.attempt}`;
        lastLeft = left;
        marks.push(`<span class="gp-attempt" data-attempt="${s.attempt}" title="attempt ${s.attempt}" style="left:${left}%">${text}</span>`);
        lines.push(`<span class="gp-line" style="left:${at(s.start)}%"></span>`);
      }
      const secs = Object.entries(s.seconds).filter(([, v]) => v > 0)
        .map(([k, v]) => `${label(k)} ${dur(v)}`).join(", ");
      const title = `${new Date(s.start).toLocaleTimeString()}-${new Date(s.end).toLocaleTimeString()}: ` +
        `${label(s.category)}${s.reason ? ` (waiting for ${REASONS[s.reason] || s.reason})` : ""}` +
        `${s.attempt ? `, attempt ${s.attempt}` : ""}, ${s.ranks} ranks held; ${secs}`;
      return `<span class="gp-seg" data-category="${s.category}" style="left:${at(s.start)}%;` +
        `width:${(100 * (Date.parse(s.end) - Date.parse(s.start)) / span).toFixed(3)}%;background:${fill(s.category)}" ` +
        `title="${esc(title)}"></span>`;
    }).join("");
    const ticks = [0, 0.25, 0.5, 0.75, 1].map(f =>
      `<span class="gp-tick" style="left:${100 * f}%">${f ? "+" + dur(f * span / 1000) : new Date(t0).toLocaleTimeString()}</span>`).join("");
    const rows = ledger.segments.map(s => `<tr data-category="${s.category}"><td>${esc(new Date(s.start).toLocaleTimeString())}</td>` +
      `<td>${dur((Date.parse(s.end) - Date.parse(s.start)) / 1000)}</td><td>${label(s.category)}${s.reason ? ` (${esc(s.reason)})` : ""}</td>` +
      `<td>${s.attempt ?? "-"}</td><td>${s.ranks}</td></tr>`).join("");
    return `<div class="gp-marks">${marks.join("")}</div>` +
      `<div class="gp-timeline" role="img" aria-label="${ledger.segments.length} stretches from ` +
      `${esc(new Date(t0).toLocaleString())} to ${esc(new Date(t1).toLocaleString())}, listed below">${segs}${lines.join("")}</div>` +
      `<div class="gp-ticks">${ticks}</div>` +
      `<details><summary>the stretches as a table (${ledger.segments.length})</summary>` +
      `<table class="grid"><thead><tr><th>from</th><th>for</th><th>category</th><th>attempt</th><th>ranks</th></tr></thead>` +
      `<tbody>${rows}</tbody></table></details>`;
  }

  // A job's figures beside its bar.
  function figures(l) {
    const training = l.categories.find(c => c.category === "training").seconds;
    const held = l.categories.some(c => c.rank_seconds > 0);
    const rows = [
      ["ettr", "ETTR (training / wall time)", pct(l.ettr), l.ettr],
      ["goodput", "goodput", l.goodput_tokens_per_s === null ? "-" :
        `${l.goodput_tokens_per_s.toPrecision(4)} tokens/s (${l.tokens} tokens of steps that count)`, l.goodput_tokens_per_s],
      ["steps", "steps counted / lost", `${l.steps_counted} / ${l.steps_lost}`, `${l.steps_counted}/${l.steps_lost}`],
      ["training", "training time, measured / predicted", `${dur(training)} / ${dur(l.predicted_training_s)}` +
        (l.predicted_training_s && l.steps_counted ? ` (${training >= l.predicted_training_s ? "+" : ""}` +
         `${(100 * (training / l.predicted_training_s - 1)).toFixed(0)} %)` : ""), l.predicted_training_s],
      ["wall", "wall time", `${dur(l.wall_s)}${l.ended ? "" : " so far"}`, l.wall_s],
    ];
    if (l.queued_reasons && Object.keys(l.queued_reasons).length) {
      rows.push(["queued", "queued, waiting for", Object.entries(l.queued_reasons)
        .map(([k, v]) => `${REASONS[k] || k}: ${dur(v)}`).join("; "), null]);
    }
    if (l.cost !== null && l.cost !== undefined && held) {
      rows.push(["cost", "cost", money(l.cost) + (l.cost_per_billion_tokens ? ` (${money(l.cost_per_billion_tokens)} per billion tokens)` : "") +
        (l.planned_cost !== null && l.planned_cost !== undefined ? `; ${money(l.planned_cost)} at its plan` : ""), l.cost]);
    } else if (l.planned_cost !== null && l.planned_cost !== undefined) {
      rows.push(["cost", "cost", `would cost ${money(l.planned_cost)} at its plan`, l.planned_cost]);
    }
    return `<table class="kv gp-figures">` + rows.map(([k, name, text, v]) =>
      `<tr id="gp-${k}"${v !== null && v !== undefined ? ` data-value="${esc(v)}"` : ""}><th scope="row">${name}</th><td>${text}</td></tr>`).join("") +
      `</table>`;
  }

  // --- the job page -----------------------------------------------------------------------------
  function job(box) {
    const url = `/api/v1/jobs/${box.dataset.job}/goodput`;
    const pollMs = Number(box.dataset.pollMs) || 2000;
    // An ended job's ledger still takes in its last stored steps for a minute (its store keeps
    // it from then on): the page follows it until then.
    const SETTLED_MS = 65_000;
    async function load() {
      let l;
      try { l = await getJSON(url); } catch (e) { setTimeout(load, pollMs); return; }
      box.querySelector(".gp-body").innerHTML = bar(l.categories, l.wall_s, "Job time by category") +
        `<div class="gp-cols">${legend(l.categories, l.wall_s, l.cost !== null && l.cost !== undefined)}` +
        `${figures(l)}</div><h3>Timeline</h3>` + timeline(l);
      box.dataset.wall = String(l.wall_s);
      box.dataset.ended = String(l.ended);
      if (!l.ended || Date.now() - Date.parse(l.end) < SETTLED_MS) setTimeout(load, pollMs);
    }
    load();
  }

  // --- the cluster page -------------------------------------------------------------------------
  const WINDOWS = {"24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400, "all": null};
  function groups(title, id, rows, priced) {
    if (!rows.length) return `<h3>${title}</h3><p>No job in this window.</p>`;
    return `<h3>${title}</h3><div class="wide"><table class="grid" id="${id}"><thead><tr>` +
      `<th scope="col">${id === "gp-projects" ? "project" : "owner"}</th><th scope="col">jobs</th>` +
      `<th scope="col">wall time</th><th scope="col">ETTR</th><th scope="col">GPU-hours</th>` +
      `<th scope="col">CPU-hours</th>${priced ? `<th scope="col">cost</th>` : ""}` +
      `<th scope="col">where the time went</th></tr></thead><tbody>` +
      rows.map(g => `<tr data-key="${esc(g.key)}" data-wall="${g.wall_s}" data-ettr="${g.ettr ?? ""}" ` +
        `data-gpu-seconds="${g.gpu_seconds}" data-cpu-seconds="${g.cpu_seconds}" data-cost="${g.cost ?? ""}">` +
        `<th scope="row">${esc(g.key || "(none)")}</th><td>${g.jobs}</td><td>${dur(g.wall_s)}</td><td>${pct(g.ettr)}</td>` +
        `<td>${hours(g.gpu_seconds)}</td><td>${hours(g.cpu_seconds)}</td>${priced ? `<td>${money(g.cost)}</td>` : ""}` +
        `<td class="gp-mini">${bar(g.categories, g.wall_s, `${g.key || "no project"}: time by category`)}</td></tr>`).join("") +
      `</tbody></table></div>`;
  }
  // Each project's budget and what its jobs spent of it since it was set; 80 % and more is
  // said in words as well as by the meter.
  function budgets(list) {
    if (!list || !list.length) return "";
    const of = (spent, limit, f) => limit === null || limit === undefined ? "-" : `${f(spent)} of ${f(limit)}`;
    const h = x => (x ?? 0).toPrecision(3);
    return `<h3>Budgets</h3><table class="grid" id="gp-budgets"><thead><tr><th scope="col">project</th>` +
      `<th scope="col">since</th><th scope="col">GPU-hours</th><th scope="col">CPU-hours</th>` +
      `<th scope="col">cost</th><th scope="col">used</th></tr></thead><tbody>` +
      list.map(b => `<tr data-project="${esc(b.project)}" data-used="${b.used}">` +
        `<th scope="row">${esc(b.project)}</th><td>${b.since ? esc(new Date(b.since).toLocaleString()) : "-"}</td>` +
        `<td>${of(b.spent_gpu_hours, b.gpu_hours, h)}</td><td>${of(b.spent_cpu_hours, b.cpu_hours, h)}</td>` +
        `<td>${of(b.spent_cost, b.cost, money)}</td>` +
        `<td><meter min="0" max="1" low="0.8" high="0.999" optimum="0" value="${Math.min(1, b.used)}"></meter> ` +
        `${pct(b.used)}${b.used >= 1 ? " <strong>spent: new jobs are refused</strong>" : b.used >= 0.8 ? " <strong>over 80 %</strong>" : ""}</td></tr>`).join("") +
      `</tbody></table>`;
  }
  function cluster(box) {
    const select = box.querySelector("#gp-window");
    const wanted = new URLSearchParams(location.search).get("window");
    if (wanted in WINDOWS) select.value = wanted;
    async function load() {
      const w = WINDOWS[select.value];
      const q = w === null ? "" : "?since=" + encodeURIComponent(new Date(Date.now() - w * 1000).toISOString());
      const out = box.querySelector(".gp-body");
      let s;
      try { s = await getJSON("/api/v1/goodput" + q); } catch (e) {
        out.textContent = "The totals could not be read: " + e.message;
        return;
      }
      const c = s.cluster, priced = c.cost !== null && c.cost !== undefined;
      box.dataset.since = s.since || "";
      box.dataset.until = s.until;
      out.innerHTML =
        `<p class="summary" id="gp-cluster" data-wall="${c.wall_s}" data-ettr="${c.ettr ?? ""}">${c.jobs} jobs, ` +
        `${dur(c.wall_s)} of wall time, ETTR ${pct(c.ettr)}, ${hours(c.gpu_seconds)} GPU-hours, ` +
        `${hours(c.cpu_seconds)} CPU-hours${priced ? `, cost ${money(c.cost)}` : ""} ` +
        `(${s.since ? "since " + esc(new Date(s.since).toLocaleString()) : "all time"}, ` +
        `to ${esc(new Date(s.until).toLocaleString())})</p>` +
        bar(c.categories, c.wall_s, "Cluster time by category") + legend(c.categories, c.wall_s, priced) +
        groups("Per project", "gp-projects", s.projects, priced) +
        groups("Per owner", "gp-owners", s.owners, priced) + budgets(s.budgets) +
        `<h3>Jobs that lost the most time</h3>` + (s.top_lost.length
          ? `<table class="grid" id="gp-top-lost"><thead><tr><th scope="col">job</th><th scope="col">project</th>` +
            `<th scope="col">owner</th><th scope="col">lost work, recovery and stalls</th><th scope="col">ETTR</th></tr></thead><tbody>` +
            s.top_lost.map(j => `<tr data-job="${j.job_id}" data-lost="${j.lost_s}"><td><a href="/jobs/${j.job_id}">${j.job_id}: ${esc(j.name)}</a></td>` +
              `<td>${esc(j.project || "-")}</td><td>${esc(j.owner)}</td><td>${dur(j.lost_s)}</td><td>${pct(j.ettr)}</td></tr>`).join("") +
            `</tbody></table>`
          : `<p>No job lost time in this window.</p>`);
    }
    select.addEventListener("change", () => {
      const u = new URL(location.href);
      u.searchParams.set("window", select.value);
      history.replaceState(null, "", u);
      load();
    });
    load();
  }

  const jobBox = document.getElementById("goodput");
  if (jobBox && jobBox.dataset.job) job(jobBox);
  const clusterBox = document.getElementById("cluster-goodput");
  if (clusterBox) cluster(clusterBox);
  return {bar, legend, timeline, COLOURS};
})();
