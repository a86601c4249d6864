"""Sums of goodput ledgers: a ledger's categories from its segments, a ledger clipped to a
window, a group's totals, and the money of held seconds at a profile's prices."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from client.ledger import (
    CATEGORIES,
    CategoryTotal,
    GroupTotals,
    Ledger,
    ProfilePrice,
    QueueReason,
    Segment,
)


def lost_s(ledger: Ledger) -> float:
    return sum(ledger.total(c).seconds for c in ("lost", "recovery", "stall"))


def cost_of(gpu_s: float, cpu_s: float, price: ProfilePrice) -> float | None:
    if price.gpu_hour is None and price.cpu_hour is None:
        return None
    return gpu_s / 3600 * (price.gpu_hour or 0.0) + cpu_s / 3600 * (price.cpu_hour or 0.0)


def totals(key: str, ledgers: Sequence[Ledger]) -> GroupTotals:
    """The sum of `ledgers`."""
    cats = {c: CategoryTotal(category=c) for c in CATEGORIES}
    for ledger in ledgers:
        for c in ledger.categories:
            t = cats[c.category]
            t.seconds += c.seconds
            t.rank_seconds += c.rank_seconds
            t.gpu_seconds += c.gpu_seconds
            t.cpu_seconds += c.cpu_seconds
            if c.cost is not None:
                t.cost = (t.cost or 0.0) + c.cost
    wall = sum(x.wall_s for x in ledgers)
    known = [x for x in ledgers if x.tokens is not None]
    priced = [x.cost for x in ledgers if x.cost is not None]
    cost = sum(priced) if priced else None
    # Per billion tokens: the money of the jobs both priced and of known tokens, over those
    # tokens; a job whose tokens nobody measured is in neither side.
    both = [(x.cost, x.tokens or 0) for x in known if x.cost is not None]
    both_tokens = sum(t for _, t in both)
    return GroupTotals(
        key=key, jobs=len(ledgers), wall_s=wall, categories=list(cats.values()),
        ettr=cats["training"].seconds / wall if wall > 0 else None,
        gpu_seconds=sum(c.gpu_seconds for c in cats.values()),
        cpu_seconds=sum(c.cpu_seconds for c in cats.values()),
        tokens=sum(x.tokens or 0 for x in known), jobs_tokens_unknown=len(ledgers) - len(known),
        cost=cost, cost_per_billion_tokens=(sum(c for c, _ in both) / both_tokens * 1e9
                                            if both_tokens else None))


def clip(ledger: Ledger, since: datetime | None, until: datetime | None) -> Ledger:
    """The part of `ledger` inside [since, until]: each segment cut to it, its categories'
    seconds scaled with it."""
    lo = max(ledger.start, since) if since is not None else ledger.start
    hi = min(ledger.end, until) if until is not None else ledger.end
    if lo == ledger.start and hi == ledger.end:
        return ledger
    kept: list[Segment] = []
    for seg in ledger.segments:
        a, b = max(seg.start, lo), min(seg.end, hi)
        if b <= a:
            continue
        share = (b - a) / (seg.end - seg.start)
        kept.append(seg.model_copy(update={
            "start": a, "end": b, "seconds": {k: v * share for k, v in seg.seconds.items()}}))
    share_training = 0.0
    full_training = ledger.total("training").seconds
    out = summed(ledger, kept, start=lo, end=max(lo, hi))
    if full_training > 0:
        share_training = out.total("training").seconds / full_training
    return out.model_copy(update={
        "tokens": None if ledger.tokens is None else int(ledger.tokens * share_training),
        "steps_counted": int(round(ledger.steps_counted * share_training))})


def summed(base: Ledger, segments: list[Segment], *, start: datetime,
            end: datetime) -> Ledger:
    cats = {c: CategoryTotal(category=c) for c in CATEGORIES}
    reasons: dict[QueueReason, float] = {}
    per_gpu, per_cpu = base.gpus_per_rank, base.cpus_per_rank if not base.gpus_per_rank else 0.0
    for seg in segments:
        for name, sec in seg.seconds.items():
            t = cats[name]
            t.seconds += sec
            t.rank_seconds += sec * seg.ranks
            t.gpu_seconds += sec * seg.ranks * per_gpu
            t.cpu_seconds += sec * seg.ranks * per_cpu
        if seg.reason is not None:
            reasons[seg.reason] = reasons.get(seg.reason, 0.0) + (seg.end - seg.start) \
                .total_seconds()
    wall = (end - start).total_seconds()
    training = cats["training"].seconds
    return base.model_copy(update={
        "start": start, "end": end, "wall_s": wall, "categories": list(cats.values()),
        "queued_reasons": reasons, "segments": segments,
        "ettr": training / wall if wall > 0 else None,
        "goodput_tokens_per_s": (base.tokens / wall if wall > 0 and base.tokens is not None
                                 else None)})
