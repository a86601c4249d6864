"""The long-running processes' heap: what start-up built is kept out of garbage collection.

CPython's full (generation 2) collection walks every tracked object. The API server starts
with about 116,000 of them (modules, classes, pydantic and SQLAlchemy schemas), the
controller with more (Ray), and a full collection over them took 40 ms or more on a 2-CPU
machine: a request or a controller pass that met one waited that long. None of those objects
is garbage, so after start-up they are moved to the permanent generation (`gc.freeze`), and
full collections walk only what requests and passes create.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object alive now; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
