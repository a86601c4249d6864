// Shared helpers of the dashboard's pages (no framework, no build step).
"use strict";

// A request that changes something, authenticated by the session cookie, carries the
// session's CSRF token (the server refuses it otherwise).
const CSRF = document.querySelector('meta[name="csrf-token"]')?.content || "";
const plainFetch = window.fetch.bind(window);
window.fetch = (url, opts = {}) => {
  const method = (opts.method || "GET").toUpperCase();
  if (CSRF && method !== "GET" && method !== "HEAD") {
    opts = {...opts, headers: {...(opts.headers || {}), "X-CSRF-Token": CSRF}};
  }
  return plainFetch(url, opts);
};

// Okabe-Ito: distinguishable with the common colour-vision deficiencies.
const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"];

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toPrecision(3) : n.toFixed(0)) + " " + units[i];
}

function fmtSecs(s) {
  if (s === null || s === undefined) return "-";
  return s < 1 ? (s * 1000).toPrecision(3) + " ms" : s.toPrecision(3) + " s";
}

// A chart's tick label: as many decimals as the ticks' spacing `incr` has, in exponent form
// below 0.001 and from a million up (uPlot's own labels keep at most three decimals: the
// learning rate's ticks, 1e-4 apart, all read 0).
function decimals(x) {
  const s = Math.abs(x).toPrecision(6);
  return s.includes(".") ? s.replace(/0+$/, "").split(".")[1].length : 0;
}
function tickText(v, incr) {
  const a = Math.abs(v);
  if (a < incr * 1e-6) return "0";
  if (a < 1e-3 || a >= 1e6) {
    const e = Math.floor(Math.log10(a) + 1e-9);
    return v.toExponential(Math.min(6, decimals(incr / 10 ** e))).replace("e+", "e");
  }
  return v.toFixed(Math.min(12, decimals(incr)));
}

// uPlot's `values` of a y axis, with tickText; the labels drawn, with their ticks, are left in
// `el.dataset.ticks` (JSON [[tick, label], ...]) for whoever reads the page. On a log scale
// the ticks are not evenly spaced: each is labelled to its own first digit.
function yTicks(el) {
  return (u, splits, axisIdx, space, incr) => {
    const log = u.scales[u.axes[axisIdx].scale || "y"].distr === 3;
    const labels = splits.map(v => tickText(v, log ? Math.abs(v) || 1 : incr));
    el.dataset.ticks = JSON.stringify(splits.map((v, i) => [v, labels[i]]));
    return labels;
  };
}

async function getJSON(url, opts) {
  const r = await fetch(url, opts);
  if (!r.ok) {
    let detail = r.statusText;
    try { detail = JSON.stringify((await r.json()).detail); } catch (e) { /* not JSON */ }
    throw new Error(r.status + ": " + detail);
  }
  return r.json();
}

// Poll `url` (a page or fragment) every `ms` and replace the element `selector` with the one
// of the same selector in the answer.
function liveReplace(selector, url, ms) {
  const tick = async () => {
    try {
      const r = await fetch(url, {headers: {"Accept": "text/html"}});
      if (r.ok) {
        const doc = new DOMParser().parseFromString(await r.text(), "text/html");
        const fresh = doc.querySelector(selector);
        const el = document.querySelector(selector);
        if (fresh && el) el.innerHTML = fresh.innerHTML;
      }
    } catch (e) { /* the next poll retries */ }
    setTimeout(tick, ms);
  };
  setTimeout(tick, ms);
}
