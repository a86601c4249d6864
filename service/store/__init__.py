"""Persistence: the only package that reads or writes the database.

`Store` (`service.store.store`) is the job store and the front door: one instance per process,
owning the engine. The tables are declared in `service.store.tables`; the other modules here
keep their own rows' queries (metrics, identity, the lease, heartbeats, stack requests, the
trackers' cursors, the dashboard's reads and its charts) and take a `Store`. Callers get the
immutable views of `service.store.views` back, never ORM rows.
"""

from service.store.store import (
    Attempt,
    AttemptStatus,
    CalibratedProfile,
    Event,
    Fence,
    Job,
    KeyTaken,
    Metric,
    Node,
    NotFound,
    NotHolder,
    Probe,
    ProbeStatus,
    Store,
)

__all__ = ["Attempt", "AttemptStatus", "CalibratedProfile", "Event", "Fence", "Job", "KeyTaken",
           "Metric", "Node", "NotFound", "NotHolder", "Probe", "ProbeStatus", "Store"]
