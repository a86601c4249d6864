"""A job's checkpoint tag as a tar of a Hugging Face model folder, for the API's
`GET /jobs/{id}/export`: which tag (the one asked for, or the newest complete one), the
folder written on the server's disk and packed.

The conversion itself (reading DeepSpeed's files with torch, joining shards, stages and
ZeRO-3 partitions) is the ranks' package's (`workers.hf_export`), run here as a process of its
own (`python -m workers.hf_export`): the service never imports `workers` or torch, and the
memory a large model's tensors take while they are joined is given back when that process
ends, not kept by the API process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass

from service.checkpoints import MARKER, ExportRefused, newest_complete_step, tag
from service.planner.shape import ModelShape

EXPORT_SHARD_BYTES = 5 * 2**30
"""The export's safetensors files are at most this big (transformers' default)."""


class NoCompleteTag(LookupError):
    """The job has no complete tag of the step asked for (or none at all)."""


@dataclass(frozen=True)
class Exported:
    """A tag exported: the tar `archive`, named `filename` for the client, inside the
    temporary folder `work` that the caller deletes once it is sent."""

    archive: str
    filename: str
    work: str
    step: int


def export_tar(folder: str, step: int | None, shape: ModelShape, job_id: int,
               max_shard_bytes: int = EXPORT_SHARD_BYTES) -> Exported:
    """Tag `step` (None: the newest complete one) of the job's checkpoint folder `folder`
    as a tar of the folder `job-<id>-step<N>-hf/` (`config.json`, safetensors sharded above
    `max_shard_bytes`) in a new temporary folder. NoCompleteTag when there is no such
    complete tag; `service.checkpoints.ExportRefused` (nothing left behind) when its layout
    or model is not exported."""
    step = step or newest_complete_step(folder)
    if not step or not os.path.exists(os.path.join(folder, tag(step), MARKER)):
        raise NoCompleteTag(f"job {job_id} has no complete checkpoint tag"
                            f" {'of step ' + str(step) if step else 'yet'}")
    work = tempfile.mkdtemp(prefix=f"trident-export-{job_id}-")
    name = f"job-{job_id}-step{step}-hf"
    try:
        _convert(folder, step, shape, os.path.join(work, name), max_shard_bytes)
        archive = os.path.join(work, name + ".tar")
        with tarfile.open(archive, "w") as tar:
            tar.add(os.path.join(work, name), arcname=name)
        shutil.rmtree(os.path.join(work, name))
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Exported(archive=archive, filename=name + ".tar", work=work, step=step)


def _convert(folder: str, step: int, shape: ModelShape, out: str, max_shard_bytes: int) -> None:
    """`workers.hf_export` in a process of its own; ExportRefused with its reason, or
    RuntimeError with the end of its output when it failed otherwise."""
    run = subprocess.run(
        [sys.executable, "-m", "workers.hf_export", folder, str(step), out,
         "--shape", json.dumps(dataclasses.asdict(shape)),
         "--max-shard-bytes", str(max_shard_bytes)],
        capture_output=True, text=True, check=False)
    lines = run.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if run.returncode == 3 and "refused" in answer:
        raise ExportRefused(answer["refused"])
    if run.returncode != 0 or "files" not in answer:
        raise RuntimeError(f"the export of {folder} step {step} failed (exit status"
                           f" {run.returncode}): {run.stderr.strip()[-2000:]}")
