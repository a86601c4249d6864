"""Checkpoints at the largest size this machine trains on 2 CPU ranks (gpt3-350m, fp32, Adam):
`python -m bench.checkpoint_scale [--preset gpt3-350m] [--rounds 1] [--quick]`.

1. **Blocked**: the time the step loop waits for a save, synchronous against
   `checkpoint.async`, alternated in this process (`bench.checkpoint_blocking.waits`: rank 0's
   wait at the save's step), dp 2, ZeRO-1; goal: async at most a quarter of sync.
2. **Peak memory** of every process during a save (each rank, from the save's start to its
   tag marked), during a resume under another layout (each rank of the new layout, over
   `saving.load`; `relayout._converted` alone too; and the per-rank form's own records of
   each rank's conversion and load, `meta.json` and `load-rank<r>.json`, since its `rss_peak`
   resets the same high-water mark inside the load) and during
   an export (`python -m workers.checkpoint.hf_export`, its own process). Each rank resets
   its high-water mark (`/proc/self/clear_refs`) when a phase starts and reads `VmHWM` when it
   ends; a rank's peak counts what it holds to train (its engine) too. Each is printed against
   the process's own shard (the bytes it wrote into the tag: each rank's `torch.save`s
   recorded; an export's: the largest shard of the tag it reads) as a ratio, and against the
   goal: 2 x the largest shard + the largest tensor.
3. **Resume under another layout**: tp 2 -> 1 (dp 1 -> 2), pp 1 -> 2 (dp 2 -> 1), ZeRO-1 ->
   ZeRO-3 (dp 2): the first step's `load_s` (the slowest rank's), with the layout-free
   conversion's own seconds where it wrote them (`step<N>.full/meta.json`). Each resume saves
   once under its new layout, for its ranks' own shards (and ZeRO-3's tag is exported).

Printed as JSON lines, the summary last. `--quick`: a 4-layer GPT of hidden 64, seconds
(tests/test_bench.py). One module because it is one benchmark: its three parts measure the
same trained tag and its moves, in one process that alternates them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.checkpoint_blocking import spec, waits
from service.files.checkpoint_tags import tag
from service.planner.shape import ModelShape
from tests.workers_spawn import run_ranks
from workers.monitor.proc_status import reset_peak, status_kib

ROOT = Path(__file__).resolve().parent.parent
SIZES: dict[str, dict[str, Any]] = {
    "full": {"preset": "gpt3-350m", "seq_len": 64},
    # gpt-tiny's shape as GPT-2's family (biases, tied head): a model the export writes.
    "quick": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}}
SOURCE = {"dp": 2, "zero": 1}
"""The layout of the saves measured, and the source of the pp and ZeRO moves."""
MOVES: list[tuple[str, dict[str, int], dict[str, int]]] = [
    ("tp 2 -> 1", {"tp": 2, "dp": 1, "zero": 1}, {"dp": 2, "zero": 1}),
    ("pp 1 -> 2", SOURCE, {"pp": 2, "dp": 1, "zero": 1}),
    ("ZeRO-1 -> 3", SOURCE, {"dp": 2, "zero": 3})]
STEPS, EVERY = 4, 2
"""The saves measured: 2 per run, the second at the end (`--steps 2`: the one at the end)."""
MEMORY = "trident-bench-memory"
"""Each rank's phases and files, written beside the checkpoint folder (`_measured_rank`)."""


# --- in each rank's process -------------------------------------------------------------------

def _status(key: str) -> int:
    """`key` (VmHWM, VmRSS) of this process, in bytes."""
    return status_kib().get(key, 0) * 1024


class _Phases:
    """Peak resident bytes per phase of this process; phases may nest (a conversion inside a
    load): the outer phase's peak takes the inner's before the mark is reset."""

    def __init__(self) -> None:
        self.open: list[dict[str, Any]] = []
        self.done: list[dict[str, Any]] = []

    def start(self, name: str) -> None:
        hwm = _status("VmHWM")
        for p in self.open:
            p["peak_bytes"] = max(p["peak_bytes"], hwm)
        if not reset_peak():  # the high-water mark restarts from the resident size now
            raise OSError("/proc/self/clear_refs refused: a phase's peak is not readable")
        rss = _status("VmRSS")
        self.open.append({"phase": name, "rss_before_bytes": rss, "peak_bytes": rss})

    def end(self, name: str) -> None:
        hwm = _status("VmHWM")
        for p in self.open:
            p["peak_bytes"] = max(p["peak_bytes"], hwm)
        mine = next(p for p in reversed(self.open) if p["phase"] == name)
        self.open.remove(mine)
        self.done.append(mine)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.end(name)


def _wrap(owner: Any, attr: str, around: Callable[[Callable[..., Any]], Callable[..., Any]]
          ) -> None:
    setattr(owner, attr, around(getattr(owner, attr)))


def _measured_rank(spec_json: str, rank: int, world: int, ports: list[int], ckpt: str,
                   *rest: Any) -> None:
    """`tests.workers_spawn`'s rank, its phases measured (see the module) and its files
    recorded; written to `<ckpt>/../trident-bench-memory/rank<r>.json` when it ends."""
    import torch

    from tests.workers_spawn import _rank_main
    from workers.checkpoint import background, relayout, saving
    from workers.trainer import train

    phases = _Phases()
    written: list[tuple[str, int]] = []

    def recording(save: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(obj: Any, f: Any, *a: Any, **k: Any) -> Any:
            out = save(obj, f, *a, **k)
            if isinstance(f, (str, os.PathLike)):
                written.append((os.fspath(f), os.path.getsize(f)))
            return out
        return wrapped

    def within(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def around(fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*a: Any, **k: Any) -> Any:
                with phases.phase(name):
                    return fn(*a, **k)
            return wrapped
        return around

    def opening(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            phases.start("save")
            return fn(*a, **k)
        return wrapped

    def closing(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            try:
                return fn(*a, **k)
            finally:
                phases.end("save")
        return wrapped

    _wrap(torch, "save", recording)
    _wrap(train.checkpoint, "save", within("save"))  # synchronous: the save is the call
    _wrap(background, "begin", opening)  # async: from the snapshot to the tag marked
    _wrap(background.Pending, "finish", closing)
    _wrap(saving, "load", within("resume"))
    if hasattr(relayout, "_converted"):  # rank 0's conversion of the whole tag, if any
        _wrap(relayout, "_converted", within("convert"))
    try:
        _rank_main(spec_json, rank, world, ports, ckpt, *rest)
    finally:
        out = Path(ckpt).parent / MEMORY
        out.mkdir(exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "phases": phases.done, "written": written}))


# --- in the bench's process -------------------------------------------------------------------

def _run(size: dict[str, Any], parallel: dict[str, int], folder: Path, *, background: bool,
         steps: int, every: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One job on 2 CPU ranks with its checkpoints in `folder/ckpt`: every rank's reports
    and its measured phases and files."""
    shutil.rmtree(folder / MEMORY, ignore_errors=True)
    job = spec("", 0, background, parallel=parallel, steps=steps, every=every, model=size)
    (reports,) = run_ranks(job, checkpoint_dir=str(folder / "ckpt"), timeout=3600,
                           target=_measured_rank)
    ranks = [json.loads((folder / MEMORY / f"rank{r}.json").read_text())
             for r in range(job.world_size)]
    return reports, ranks


def shards(ranks: list[dict[str, Any]], step: int) -> list[int]:
    """Each rank's bytes in tag `step`: the files it wrote there."""
    name = f"{os.sep}{tag(step)}{os.sep}"
    return [sum(b for path, b in r["written"] if name in path) for r in ranks]


def _rows(what: str, ranks: list[dict[str, Any]], phase: str, own: list[int],
          goal: int) -> list[dict[str, Any]]:
    """One row per rank: its peak in `phase` (the highest of its phases of that name)."""
    out = []
    for r, mine in zip(ranks, own, strict=True):
        seen = [p for p in r["phases"] if p["phase"] == phase]
        if not seen:
            continue
        top = max(seen, key=lambda p: p["peak_bytes"])
        out.append(_row(what, f"rank {r['rank']}", phase, top["peak_bytes"],
                        top["rss_before_bytes"], mine, goal))
    return out


def _row(what: str, process: str, phase: str, peak: int, before: int, own: int,
         goal: int) -> dict[str, Any]:
    """A process's peak in a phase against its own shard; `added`: the peak less what the
    process held when the phase started (a rank's engine, an export's imports), judged
    against the goal."""
    added = peak - before
    return {"what": what, "process": process, "phase": phase, "peak_bytes": peak,
            "added_bytes": added, "own_shard_bytes": own,
            "peak_over_own_shard": round(peak / own, 2) if own else None,
            "added_over_own_shard": round(added / own, 2) if own else None,
            "goal_bytes": goal, "within_goal": added <= goal}


def label(layout: dict[str, int]) -> str:
    return " ".join(f"{k}{v}" for k, v in layout.items())


def largest_tensor(folder: Path) -> int:
    """The bytes of the largest tensor of an exported folder's safetensors files."""
    top = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        top = max([top, *(v["data_offsets"][1] - v["data_offsets"][0]
                          for k, v in header.items() if k != "__metadata__")])
    return top


def export(folder: Path, step: int, shape: ModelShape, out: Path) -> dict[str, Any]:
    """`hf_export` in its own process, as the API runs it; its peak resident bytes."""
    code = ("import json, sys\nfrom workers.checkpoint.hf_export import main\n"
            "from workers.monitor.proc_status import status_kib\n"
            "before = status_kib()['VmRSS'] * 1024\nrc = main(sys.argv[1:])\n"
            "assert rc == 0, rc\n"
            "print(json.dumps({'peak_bytes': status_kib()['VmHWM'] * 1024,"
            " 'before_bytes': before}))")
    proc = subprocess.run([sys.executable, "-c", code, str(folder), str(step), str(out),
                           "--shape", json.dumps(dataclasses.asdict(shape))],
                          capture_output=True, text=True, cwd=ROOT, timeout=3600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"export failed: {proc.stdout[-1000:]} {proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def blocked(size: dict[str, Any], rounds: int, work: Path, steps: int = STEPS
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    """Part 1 and the saves' memory: sync and async runs alternated (ABBA); the folder of
    the last synchronous run is kept as the source of the moves."""
    runs, memory = [], []
    kept = work / "source"
    order = [b for i in range(rounds) for b in ((False, True) if i % 2 == 0 else (True, False))]
    for i, background in enumerate(order):
        folder = work / f"save{i}"
        reports, ranks = _run(size, SOURCE, folder, background=background, steps=steps,
                              every=EVERY)
        runs.append({"async": background, **waits(reports, background, EVERY, steps // EVERY)})
        own = shards(ranks, steps)
        memory.append({"async": background, "own": own, "ranks": ranks})
        print(json.dumps(runs[-1]), flush=True)
        if background:
            shutil.rmtree(folder)
        else:
            shutil.rmtree(kept, ignore_errors=True)
            folder.rename(kept)
    return runs, memory, kept


def moved(size: dict[str, Any], name: str, source: dict[str, int], target: dict[str, int],
          source_folder: Path | None, work: Path, steps: int = STEPS) -> dict[str, Any]:
    """Part 3 and the resume's memory: a tag of `source`'s layout (the one kept, or written
    now) resumed under `target`, which then saves once."""
    folder = work / name.replace(" ", "").replace(">", "")
    if source_folder is None:
        _, src_ranks = _run(size, source, folder, background=False, steps=EVERY, every=EVERY)
        src_step = EVERY
    else:  # the kept tag, linked: the conversion is written beside it, in this folder only
        shutil.copytree(source_folder / "ckpt", folder / "ckpt", copy_function=os.link)
        src_ranks = [json.loads((source_folder / MEMORY / f"rank{r}.json").read_text())
                     for r in range(2)]
        src_step = steps
    src_own = shards(src_ranks, src_step)
    reports, ranks = _run(size, target, folder, background=False, steps=src_step + 1, every=1)
    own = shards(ranks, src_step + 1)
    form = folder / "ckpt" / f"{tag(src_step)}.full"
    meta = form / "meta.json"
    first = [r for r in reports if r.get("load_s") is not None]
    # The per-rank form's own records of each rank's peak growth (`rss_peak`, which resets
    # the same high-water mark, so the conversion's peak is read from them, not the phases).
    recorded = json.loads(meta.read_text()).get("ranks", []) if meta.exists() else []
    loads = [json.loads(p.read_text()) for p in sorted(form.glob("load-rank*.json"))]
    return {"move": name, "from": source, "to": target, "folder": folder,
            "source_step": src_step, "source_shards": src_own, "own": own, "ranks": ranks,
            "resume_s": max(r["load_s"] or 0.0 for r in first),
            "convert_s": json.loads(meta.read_text()).get("seconds") if meta.exists() else None,
            "recorded": {"conversion": [r.get("peak_growth") for r in recorded],
                         "load": [r.get("peak_growth") for r in loads]},
            "tag_bytes": sum(src_own)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=STEPS, choices=(2, 4),
                        help="steps of each measured run (a save every 2)")
    parser.add_argument("--quick", action="store_true", help="a 4-layer GPT of hidden 64: seconds")
    parser.add_argument("--work", help="the folder for the checkpoints (default: a temporary"
                                       " one, removed)")
    args = parser.parse_args()
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.preset and not args.quick:
        size["preset"] = args.preset
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        summary = measure(size, args.rounds, Path(tmp), args.steps)
    print(json.dumps(summary), flush=True)


def largest_of(shape: ModelShape) -> int:
    """The bytes of the model's largest fp32 tensor: the embedding, the fused q, k, v or the
    feed-forward's first matrix (fused gate and up with SwiGLU)."""
    kv = shape.kv_heads * shape.head_dim
    return 4 * max(shape.vocab * shape.hidden, (shape.q_dim + 2 * kv) * shape.hidden,
                   shape.ffn_hidden * shape.hidden * (2 if shape.swiglu else 1))


def _printed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def measure(size: dict[str, Any], rounds: int, work: Path, steps: int = STEPS
            ) -> dict[str, Any]:
    """Parts 1-3 (see the module), each part's rows printed as soon as measured (a move that
    fails, a rank killed for memory, is printed as its error and the rest goes on); the
    summary."""
    from service.contract.spec import ModelSpec

    shape = ModelShape.from_spec(ModelSpec.model_validate(size))
    tensor = largest_of(shape)
    runs, saves, kept = blocked(size, rounds, work, steps)
    memory: list[dict[str, Any]] = []
    for s in saves:
        memory += _printed(_rows("save (async)" if s["async"] else "save (sync)", s["ranks"],
                                 "save", s["own"], 2 * max(s["own"]) + tensor))
    moves, failed = [], []
    for name, src, dst in MOVES:
        try:
            m = moved(size, name, src, dst, kept if src is SOURCE else None, work, steps)
        except Exception as exc:  # noqa: BLE001 - one move's failure is a figure too
            failed.append({"move": name, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
            print(json.dumps(failed[-1]), flush=True)
            continue
        moves.append(m)
        print(json.dumps({k: m[k] for k in ("move", "resume_s", "convert_s", "tag_bytes",
                                            "source_shards", "own")}), flush=True)
        goal = 2 * max(max(m["own"]), max(m["source_shards"])) + tensor
        for phase in ("resume", "convert"):
            memory += _printed(_rows(f"{m['move']} {phase}", m["ranks"], phase, m["own"],
                                     goal))
        for phase, growths in m["recorded"].items():
            for rank, (growth, own) in enumerate(zip(growths, m["own"], strict=False)):
                if growth is not None:
                    memory += _printed([_row(f"{m['move']} {phase} (its record)",
                                             f"rank {rank}", phase, growth, 0, own, goal)])
    exported = 0
    for m in moves:
        if m["move"] not in ("tp 2 -> 1", "ZeRO-1 -> 3"):
            continue
        # tp 2's source tag, and ZeRO-3's tag saved after the move: the two joining paths.
        step, own = ((m["source_step"], m["source_shards"]) if m["move"] == "tp 2 -> 1"
                     else (m["source_step"] + 1, m["own"]))
        out = work / f"export-{exported}"
        exported += 1
        got = export(m["folder"] / "ckpt", step, shape, out)
        assert largest_tensor(out) <= tensor, (largest_tensor(out), tensor)
        shutil.rmtree(out, ignore_errors=True)
        what = label(m["to"] if step > m["source_step"] else m["from"])
        memory += _printed([_row(f"export of a {what} tag", "hf_export", "export",
                                 got["peak_bytes"], got["before_bytes"], max(own),
                                 2 * max(own) + tensor)])
    sync = statistics.median(r["at_save_step_s"] for r in runs if not r["async"])
    background = statistics.median(r["at_save_step_s"] for r in runs if r["async"])
    return {"model": size, "parameters": shape.total_params,
            "blocked_sync_s": sync, "blocked_async_s": background,
            "async_over_sync": round(background / sync, 3) if sync else None,
            "step_s": statistics.median(r["step_s"] for r in runs),
            "end_wait_async_s": statistics.median(r["end_s"] for r in runs if r["async"]),
            "largest_tensor_bytes": tensor,
            "resume": {m["move"]: {"resume_s": m["resume_s"], "convert_s": m["convert_s"],
                                   "tag_bytes": m["tag_bytes"]} for m in moves},
            "failed": failed,
            "memory_within_goal": all(r["within_goal"] for r in memory),
            "memory_worst_added_over_goal": round(max(r["added_bytes"] / r["goal_bytes"]
                                                      for r in memory), 2)}


if __name__ == "__main__":
    main()
