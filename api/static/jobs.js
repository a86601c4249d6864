// The jobs list: live rows (polled fragment), selection, bulk cancel and compare.
"use strict";
(function () {
  const table = document.getElementById("jobs");
  const body = document.getElementById("job-rows");
  const bulk = document.getElementById("bulk-cancel");
  const compareBtn = document.getElementById("compare-selected");
  const status = document.getElementById("bulk-status");
  const MAX_COMPARED = 8;
  const selected = new Map();  // job id -> whether it has ended (nothing to cancel)

  function active() { return [...selected].filter(([, ended]) => !ended).map(([id]) => id); }

  function sync() {
    body.querySelectorAll("input.sel").forEach(cb => {
      cb.checked = selected.has(cb.value);
      if (cb.checked) selected.set(cb.value, cb.dataset.ended === "true");
    });
    const live = active().length;
    bulk.disabled = live === 0;
    bulk.textContent = live ? `Cancel selected (${live})` : "Cancel selected";
    compareBtn.disabled = selected.size < 2 || selected.size > MAX_COMPARED;
    compareBtn.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
  }
  body.addEventListener("change", e => {
    if (!e.target.classList.contains("sel")) return;
    if (e.target.checked) selected.set(e.target.value, e.target.dataset.ended === "true");
    else selected.delete(e.target.value);
    sync();
  });
  document.getElementById("select-all").addEventListener("change", e => {
    body.querySelectorAll("input.sel").forEach(cb => {
      if (e.target.checked) selected.set(cb.value, cb.dataset.ended === "true");
      else selected.delete(cb.value);
    });
    sync();
  });
  bulk.addEventListener("click", async () => {
    const ids = active();
    const results = await Promise.all(ids.map(id =>
      fetch(`/api/v1/jobs/${id}/cancel`, {method: "POST"}).then(r => [id, r.status])));
    const failed = results.filter(([, s]) => s !== 202);
    status.textContent = `cancel requested for ${results.length - failed.length} job(s)` +
      (failed.length ? `; refused: ${failed.map(([id, s]) => `${id} (${s})`).join(", ")}` : "");
    for (const id of ids) selected.delete(id);
    sync();
    refresh();
  });
  compareBtn.addEventListener("click", () => {
    const ids = [...selected.keys()].sort((a, b) => Number(a) - Number(b));
    location.href = "/compare?" + ids.map(id => "jobs=" + encodeURIComponent(id)).join("&");
  });

  async function refresh() {
    try {
      const r = await fetch(table.dataset.poll);
      if (r.ok) { body.innerHTML = await r.text(); sync(); }
    } catch (e) { /* retried on the next tick */ }
  }
  setInterval(refresh, Number(table.dataset.pollMs));
})();
