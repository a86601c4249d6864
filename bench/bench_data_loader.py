"""The data loader against what training consumes, and a rank's memory over a large corpus.

1. Writes a corpus of `--gb` GiB (default 2.1) of uint16 tokens in Megatron's indexed dataset
   layout (documents of 200 to 4,000 tokens), in `--dir` (default a temporary folder).
2. Builds the job's global sample order once (rank 0's work at start:
`workers.trainer.sample_order`),
   into a sample-order cache in the same folder, and times it.
3. Reads the micro-batches of one DP rank of a GPT-3 125M job (seq_len 2048, global batch 512,
   dp 8: 64 samples a step) step after step through `workers.trainer.data.TokenSource`, the
   trainer's own path, and reports its tokens per second against the tokens per second the planner
   predicts one A100 rank trains at for that job (goal: 100x), and against a measured CPU step
   of gpt-tiny (2 ranks) for scale.
   Both per wall-clock second and per CPU second of the loader's process: on a shared machine
   the first moves with the load.
4. Samples the process's resident memory (anonymous, and file-backed: mapped corpus pages the
   kernel may drop) every 500 steps while the rank reads its way through the corpus (goal:
   anonymous memory flat within 50 MB).

Run: python bench/bench_data_loader.py [--gb 2.1] [--steps 3000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

from service.contract.spec import JobSpec
from service.files.order_cache import OrderCache, ServerData
from service.planner import evaluate
from workers.monitor.proc_status import status_kib
from workers.trainer import data, sample_order

SEQ_LEN, GLOBAL_BATCH, DP, MICRO = 2048, 512, 8, 4


def write_corpus(prefix: str, gib: float) -> tuple[int, int]:
    """A random corpus of about `gib` GiB; (documents, tokens)."""
    rng = np.random.default_rng(0)
    target = int(gib * (1 << 30)) // 2
    lengths = []
    total = 0
    with open(prefix + ".bin", "wb") as f:
        while total < target:
            sizes = rng.integers(200, 4000, 4096)
            chunk = rng.integers(0, 50257, int(sizes.sum()), dtype=np.uint16)
            f.write(chunk.tobytes())
            lengths.extend(sizes.tolist())
            total += int(sizes.sum())
    n = len(lengths)
    lens = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(n, np.int64)
    np.cumsum(lens[:-1].astype(np.int64) * 2, out=pointers[1:])
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
        f.write(lens.tobytes() + pointers.tobytes() + np.arange(n + 1, dtype=np.int64).tobytes())
    return n, total


def rss() -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB of this process."""
    kib = status_kib()
    return kib["RssAnon"] / 1024, kib["RssFile"] / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.1)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--reuse", action="store_true", help="keep a corpus already in --dir")
    args = ap.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="trident-bench-data-")
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, "corpus")
    t0 = time.perf_counter()
    if args.reuse and os.path.exists(prefix + ".idx"):
        from service.files.corpus import read_header
        h = read_header(prefix)
        docs, tokens = h.documents, h.tokens
    else:
        docs, tokens = write_corpus(prefix, args.gb)
    size = os.path.getsize(prefix + ".bin") / (1 << 30)
    print(f"corpus: {docs} documents, {tokens} tokens, {size:.2f} GiB .bin"
          f" (written in {time.perf_counter() - t0:.1f} s)")

    spec = JobSpec.model_validate({
        "name": "bench", "model": {"preset": "gpt3-125m", "seq_len": SEQ_LEN},
        "train": {"steps": args.steps, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO},
        "parallel": {"dp": DP}, "resources": {"gpus_per_worker": 1},
        "cluster": {"gpu": "a100-80gb", "nodes": 1, "gpus_per_node": DP},
        "data": {"kind": "tokens", "train": [{"path": prefix}]}})
    rank_tokens_per_s = evaluate(spec).tokens_per_s / DP
    t0 = time.perf_counter()
    parts = [sample_order.Part(prefix, None)]
    samples = args.steps * GLOBAL_BATCH
    server = ServerData(OrderCache.of(Path(folder), 1 << 40, 1 << 40), data_roots=(folder,))
    sample_order.build(server.orders, "bench", parts, spec.train.seed, SEQ_LEN, samples).close()
    print(f"sample order: {samples} samples built in {time.perf_counter() - t0:.1f} s")
    anon0, file0 = rss()
    source = data.open_source(spec, dp_rank=3, rank=0, server=server, user="bench")
    steps, read = 0, 0
    marks = []
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        for x, _ in source.micro_batches(step):
            read += x.numel()
        source.progress((step + 1) * GLOBAL_BATCH)
        steps += 1
        if step % 500 == 0 or step == args.steps - 1:
            marks.append((step, *rss()))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    rate = read / dt
    print(f"loader: {steps} steps of one dp rank ({GLOBAL_BATCH // DP} samples of"
          f" {SEQ_LEN + 1} tokens), {read} tokens in {dt:.1f} s = {rate:,.0f} tokens/s")
    print(f"  on {cpu:.1f} s of CPU: {read / cpu:,.0f} tokens per CPU second (the machine is"
          " shared: wall-clock figures move with its load)")
    print(f"GPT-3 125M step on an A100 rank (planner): {rank_tokens_per_s:,.0f} tokens/s ->"
          f" loader / step = {rate / rank_tokens_per_s:.0f}x wall-clock,"
          f" {read / cpu / rank_tokens_per_s:.0f}x per CPU second")
    print(f"resident memory (MiB) before the loader: anon {anon0:.0f}, file {file0:.0f}")
    for step, anon, file_ in marks:
        print(f"  after step {step:5d}: anon {anon:7.1f}  file {file_:7.1f}")
    anons = [m[1] for m in marks]
    print(f"anonymous resident memory over the run: {min(anons):.1f} .. {max(anons):.1f} MiB"
          f" (spread {max(anons) - min(anons):.1f} MiB); load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
