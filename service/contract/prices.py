"""What an hour of a node profile's devices costs: the operator's prices (`TRIDENT_PRICES`),
which the goodput ledger turns held seconds into money with (docs/goodput.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ProfilePrice(BaseModel):
    """What an hour of one device of a node profile costs (`TRIDENT_PRICES`), in the one
    currency the operator bills in."""

    model_config = ConfigDict(extra="forbid")

    gpu_hour: float | None = Field(default=None, ge=0, le=1e6)
    """The price of one GPU for an hour (None: not priced)."""
    cpu_hour: float | None = Field(default=None, ge=0, le=1e6)
    """The price of one CPU for an hour, paid by ranks without a GPU (None: not priced)."""
