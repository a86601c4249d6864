"""The one profile lookup: which hardware profile a job on this cluster is planned and judged
with. Called at submission and by `POST /plan` (planning) and by the controller (judging a
job's bandwidth probe), so that both see the same numbers.
"""

from __future__ import annotations

from service.contract.hardware import HardwareProfile, get_profile
from service.store import Store


def profile_for(store: Store, name: str) -> HardwareProfile:
    """The profile `trident probe` calibrated under `name` on this cluster, else the built-in
    one of that name."""
    calibrated = store.get_profile(name=name)
    return calibrated.profile if calibrated is not None else get_profile(name)
