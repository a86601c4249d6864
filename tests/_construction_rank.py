"""One rank of the construction-memory test: set up as the trainer does, build this rank's
engine (`workers.trainer.train.build_engine`), and print, as one JSON line, its resident memory
(bytes) before the construction (`before`), at the peak of the model's build (`built_peak`, read as
`deepspeed.initialize` is entered) and at the peak of the whole construction (`peak`).
Usage: python tests/_construction_rank.py SPEC_JSON RANK WORLD PORT."""

from __future__ import annotations

import json
import sys

from workers.monitor.proc_status import reset_peak, status_kib
from workers.rank import script_rank


def main() -> None:
    spec_json, rank, world, port = sys.argv[1], *map(int, sys.argv[2:5])
    r = script_rank.start(spec_json, rank, world, port)
    from workers.trainer import train
    # Everything imported and the groups made: the peak from here is the construction's.
    if not reset_peak():
        raise OSError("/proc/self/clear_refs refused: the construction's peak is not readable")
    before = status_kib()["VmRSS"]
    from workers.runtime.deepspeed_import import deepspeed
    phases = {}
    initialize = deepspeed.initialize

    def timed_initialize(*args, **kwargs):
        phases["built_peak"] = status_kib()["VmHWM"] * 1024
        phases["built_rss"] = status_kib()["VmRSS"] * 1024
        return initialize(*args, **kwargs)

    deepspeed.initialize = timed_initialize
    engine = train.build_engine(r.spec, r.shape, r.ctx.plan, r.device, r.groups, r.ds_config)
    peak = status_kib()["VmHWM"]
    phases["end_rss"] = status_kib()["VmRSS"] * 1024
    kept = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
               for p in engine.module.parameters())
    print(json.dumps({"rank": rank, "before": before * 1024, "peak": peak * 1024,
                      "partition_params": kept, **phases}), flush=True)
    script_rank.stop()


if __name__ == "__main__":
    main()
