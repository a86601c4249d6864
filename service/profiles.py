"""The one profile lookup: which hardware profile a job on this cluster is planned and judged
with. Called at submission and by `POST /plan` (planning) and by the controller (judging a
job's bandwidth probe), so that both see the same numbers.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from service.hardware import HardwareProfile, get_profile
from service.store import Store


def profile_from_store(stored: dict[str, Any] | None) -> HardwareProfile | None:
    """A calibrated profile as the store keeps it (extra bookkeeping keys dropped)."""
    if stored is None:
        return None
    names = {f.name for f in fields(HardwareProfile)}
    return HardwareProfile.from_json({k: v for k, v in stored.items() if k in names})


def profile_for(store: Store, name: str) -> HardwareProfile:
    """The profile `trident probe` calibrated under `name` on this cluster, else the built-in
    one of that name."""
    return profile_from_store(store.get_profile(name=name)) or get_profile(name)
