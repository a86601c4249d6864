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


def run_cost(price: ProfilePrice | None, *, step_s: float, steps: int, ranks: int,
             gpus_per_rank: float, cpus_per_rank: float) -> float | None:
    """What `steps` steps of `step_s` seconds on `ranks` ranks cost at `price`: a GPU rank
    pays its GPUs' hours, a CPU rank its CPUs' (None: no price set), as the goodput ledger
    prices a job's planned and held seconds."""
    if price is None or (price.gpu_hour is None and price.cpu_hour is None):
        return None
    per_rank_hour = gpus_per_rank * (price.gpu_hour or 0.0) if gpus_per_rank else \
        cpus_per_rank * (price.cpu_hour or 0.0)
    return step_s * steps * ranks / 3600 * per_rank_hour


def money(v: float | None) -> str:
    """An amount as the CLI prints it: two decimals (`1,234.50`), two significant digits
    below 1 (`0.00028`); `-` for none."""
    if v is None:
        return "-"
    return f"{v:,.2f}" if abs(v) >= 1 or v == 0 else f"{v:.2g}"
