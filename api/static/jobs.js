// The jobs list: live rows (polled fragment), selection and bulk cancel.
"use strict";
(function () {
  const table = document.getElementById("jobs");
  const body = document.getElementById("job-rows");
  const bulk = document.getElementById("bulk-cancel");
  const status = document.getElementById("bulk-status");
  const selected = new Set();

  function sync() {
    body.querySelectorAll("input.sel").forEach(cb => { cb.checked = selected.has(cb.value); });
    bulk.disabled = selected.size === 0;
    bulk.textContent = selected.size ? `Cancel selected (${selected.size})` : "Cancel selected";
  }
  body.addEventListener("change", e => {
    if (!e.target.classList.contains("sel")) return;
    if (e.target.checked) selected.add(e.target.value); else selected.delete(e.target.value);
    sync();
  });
  document.getElementById("select-all").addEventListener("change", e => {
    body.querySelectorAll("input.sel:not(:disabled)").forEach(cb => {
      if (e.target.checked) selected.add(cb.value); else selected.delete(cb.value);
    });
    sync();
  });
  bulk.addEventListener("click", async () => {
    const ids = [...selected];
    const results = await Promise.all(ids.map(id =>
      fetch(`/api/v1/jobs/${id}/cancel`, {method: "POST"}).then(r => [id, r.status])));
    const failed = results.filter(([, s]) => s !== 202);
    status.textContent = `cancel requested for ${results.length - failed.length} job(s)` +
      (failed.length ? `; refused: ${failed.map(([id, s]) => `${id} (${s})`).join(", ")}` : "");
    selected.clear();
    sync();
    refresh();
  });

  async function refresh() {
    try {
      const r = await fetch(table.dataset.poll);
      if (r.ok) { body.innerHTML = await r.text(); sync(); }
    } catch (e) { /* retried on the next tick */ }
  }
  setInterval(refresh, Number(table.dataset.pollMs));
})();
