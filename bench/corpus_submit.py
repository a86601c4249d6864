"""Submission latency against the size of the corpus it names: `POST /api/v1/jobs` naming a
corpus of at least 20 GB against one naming a small corpus, both on the same server (the
real app, `api.app.create_app`, on a SQLite store of its own), alternated
(`bench.harness.alternate`), so drift in the load of a shared machine falls on both alike.

`python -m bench.corpus_submit [--gb 20] [--n 40] [--dir DIR]`

The large corpus is made here: a `.bin` of `--gb` GiB of uint16 zeros as a sparse file (a
few blocks on disk), with a valid `.idx` describing it in documents of 2,048 tokens (its
arrays real: tens of MB). It has no `PREFIX.meta.json`, as a corpus prepared by Megatron's
own tool: it is scanned once, as `trident data inspect --index` (or the controller before
admission) would, and that scan is timed and recorded under the server's data directory;
the small one (10 k tokens) is recorded by its first submission. Then each submission reads
the records, never a `.bin`. Also timed once, for comparison: what the check of the large
corpus cost a request before (`service.files.corpus.check`: every `.idx` array and the whole
`.bin`). Every file is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from bench.harness import alternate, dist

DOC = 2048
SPEC = {"name": "bench", "model": {"preset": "gpt-tiny"},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5},
        "monitor": {"probe": False}}


def make_corpus(prefix: Path, tokens: int, sparse: bool) -> None:
    """A uint16 corpus of `tokens` tokens in documents of `DOC`: zeros in a sparse `.bin`, or
    small ids written out."""
    n = -(-tokens // DOC)
    lengths = np.full(n, DOC, np.int32)
    lengths[-1] = tokens - DOC * (n - 1)
    pointers = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        if sparse:
            f.truncate(tokens * 2)
        else:
            f.write((np.arange(tokens) % 200).astype(np.uint16).tobytes())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=20.0, help="GiB of the large corpus's .bin")
    ap.add_argument("--n", type=int, default=40, help="submissions of each corpus")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp)")
    args = ap.parse_args(argv)

    from api.app import create_app
    from service.files import corpus, corpus_scan
    from service.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="corpus-submit-", dir=args.dir))
    try:
        corpora, data = work / "corpora", work / "data"
        corpora.mkdir()
        data.mkdir()
        big, small = corpora / "big", corpora / "small"
        tokens = int(args.gb * (1 << 30)) // 2
        make_corpus(big, tokens, sparse=True)
        make_corpus(small, 10_000, sparse=False)
        st = os.stat(f"{big}.bin")
        figures: dict[str, object] = {
            "big_bin_bytes": st.st_size, "big_bin_on_disk": st.st_blocks * 512,
            "big_idx_bytes": os.path.getsize(f"{big}.idx"), "big_tokens": tokens}

        t0 = time.perf_counter()
        corpus.check(str(big), 256)
        figures["before_check_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        corpus_scan.scan_once(str(big), data)  # `trident data inspect --index`
        figures["scan_once_s"] = time.perf_counter() - t0

        os.environ["TRIDENT_DATA_DIR"] = str(data)
        settings = Settings(data_dir=data, data_roots=str(corpora),
                            database_url=f"sqlite:///{data / 't.db'}")
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = \
                f"Bearer {(data / 'admin.token').read_text().strip()}"

            def submit(prefix: Path) -> float:
                body = {**SPEC, "data": {"kind": "tokens", "train": [{"path": str(prefix)}]}}
                t = time.perf_counter()
                r = client.post("/api/v1/jobs", json=body)
                took = time.perf_counter() - t
                assert r.status_code == 201, r.text
                return took

            for _ in range(3):  # warm: imports, the small corpus's first (recording) scan
                submit(small)
                submit(big)
            xb, xs = alternate(lambda: submit(big), lambda: submit(small), args.n)
        figures["big_s"], figures["small_s"] = dist(xb), dist(xs)
        figures["ratio_median"] = figures["big_s"]["median"] / figures["small_s"]["median"]
        print(json.dumps(figures, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
