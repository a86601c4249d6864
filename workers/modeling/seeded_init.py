"""The deterministic per-weight initialisation, drawn for one shard without the whole weight.

Every matrix of the model is a pure function of (seed, layer, name): its elements, taken in
their *draw order*, are normal(0, std) numbers (`torch.normal` on the CPU generator) drawn in
blocks of `BLOCK` elements (the last one shorter), block k from a generator seeded by a hash
of (seed, layer, name, k). The draw order is row-major over the dimension tensor parallelism
splits the weight on:

- a column-parallel weight (out, in), the embedding and the LM head (vocabulary, hidden) are
  split by rows: the draw order is the weight's own row-major order;
- a row-parallel weight (out, in) is split by input columns: the draw order is its transpose's
  (in, out) row-major order.

So every TP shard, even or not (the vocabulary's first `vocab % tp` slices are a row longer),
is a contiguous range of the draw order: a rank draws the blocks that range touches (at most
two blocks more than its shard) and writes them straight into its own parameter, whatever its
device and dtype. No rank ever holds the whole weight, and the numbers are the same whatever
tp, pp or dp is (layout invariance); `full_weight` draws the whole weight the same way (the
reference the tests slice).

Called by `workers.modeling.model` and `workers.modeling.tp`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

BLOCK = 1 << 14
"""Elements of the draw order drawn from one seeded generator (below torch's intra-op grain
size, so that drawing and writing a block stay serial: cheap on a busy host)."""

# Bound at import: deepspeed.zero.Init patches torch's factories inside its context.
_normal = torch.normal
_empty = torch.empty


def _generator(seed: int, layer: int, name: str, block: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{layer}/{name}/{block}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@dataclass(frozen=True)
class SeededInit:
    """The draw of one weight: `total_rows x cols` in draw order, normal(0, std)."""

    seed: int
    layer: int
    name: str
    std: float
    total_rows: int
    """Rows of the whole weight in draw order (the last block ends with them)."""

    def fill_rows(self, out: torch.Tensor, start: int) -> torch.Tensor:
        """Write rows [start, start + out.shape[0]) of the draw order into `out` (rows, cols),
        which may be a strided view (a row-parallel shard's transpose) of any device/dtype."""
        n_rows, cols = out.shape
        assert start >= 0 and start + n_rows <= self.total_rows, (start, n_rows, self)
        a, b = start * cols, (start + n_rows) * cols
        total = self.total_rows * cols
        with torch.no_grad():
            for block in range(a // BLOCK, -(-b // BLOCK)):
                lo = block * BLOCK
                # Each block is drawn whole, so a shard's numbers never depend on its bounds.
                values = _normal(0.0, self.std, (min(BLOCK, total - lo),), dtype=torch.float32,
                                 device="cpu",
                                 generator=_generator(self.seed, self.layer, self.name, block))
                s, e = max(lo, a), min(lo + BLOCK, b)
                _write(out, s - a, values[s - lo:e - lo])
        return out

    def rows(self, start: int, end: int, cols: int, *, dtype: torch.dtype | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
        """Rows [start, end) of the draw order as a new (end - start, cols) tensor."""
        return self.fill_rows(_empty(end - start, cols, dtype=dtype, device=device), start)

    def columns(self, out_features: int, start: int, end: int, *,
                dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> torch.Tensor:
        """Input columns [start, end) of a row-parallel (out_features, in) weight, whose draw
        order is its transpose's: a new contiguous (out_features, end - start) tensor."""
        out = _empty(out_features, end - start, dtype=dtype, device=device)
        self.fill_rows(out.t(), start)
        return out


def stacked(parts: list[tuple[SeededInit, int, int]], cols: int) -> torch.Tensor:
    """Rows [start, end) of each `(init, start, end)` stacked in one new (rows, cols) tensor,
    each drawn straight into its place (a fused projection's shard: `workers.modeling.tp`)."""
    out = _empty(sum(end - start for _, start, end in parts), cols)
    row = 0
    for init, start, end in parts:
        init.fill_rows(out[row:row + end - start], start)
        row += end - start
    return out


def _write(out: torch.Tensor, offset: int, piece: torch.Tensor) -> None:
    """Write `piece` at row-major positions [offset, offset + len) of the 2-D `out`."""
    cols = out.shape[1]
    n, i = piece.numel(), 0
    r, c = divmod(offset, cols)
    if c:
        k = min(cols - c, n)
        out[r, c:c + k] = piece[:k]
        i, r = k, r + 1
    full = (n - i) // cols
    if full:
        out[r:r + full] = piece[i:i + full * cols].view(full, cols)
        i, r = i + full * cols, r + full
    if i < n:
        out[r, :n - i] = piece[i:]


def full_weight(seed: int, layer: int, name: str, shape: tuple[int, int], std: float,
                transposed: bool = False) -> torch.Tensor:
    """The whole (unsharded) weight `name` of layer `layer`, fp32 on the CPU: what the TP
    shards are slices of (`transposed`: a row-parallel weight, drawn in its transpose's
    order). For tests and references; the model never builds it."""
    init = SeededInit(seed, layer, name, std, shape[1] if transposed else shape[0])
    if transposed:
        return init.columns(shape[0], 0, shape[1], dtype=torch.float32, device="cpu")
    return init.rows(0, shape[0], shape[1], dtype=torch.float32, device="cpu")
