"""Step reports for Trident from a script of your own: copy this file beside the script.

    from trident_report import report
    report(step=step, loss=loss.item(), memory={"process_peak_bytes": peak})

Appends one JSON line per call to the file named by TRIDENT_REPORT (the fields of Trident's
step report, docs/command.md); does nothing where that variable is unset. Needs only Python.
"""

import json
import os


def report(step: int, **fields: object) -> None:
    path = os.environ.get("TRIDENT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **fields}) + "\n")
            f.flush()
