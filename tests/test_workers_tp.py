"""Megatron tensor parallelism on two gloo ranks: the collectives one block issues, counted
through the collective observer, and the block's output equal to the unsharded block's."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from service.contract.parallel import ParallelDims
from service.contract.spec import ModelSpec
from service.planner.shape import ModelShape
from tests import forked
from tests.workers_spawn import free_port
from workers.modeling import tp
from workers.modeling.model import Block

CFG = ModelShape.from_spec(ModelSpec(preset="gpt-tiny"))


def _rank(rank: int, port: int, sequence_parallel: bool, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        groups = tp.build_groups(ParallelDims(tp=2), rank)
        block = Block(1, CFG, 3, groups, sequence_parallel=sequence_parallel)
        x = torch.randn(2, CFG.seq_len, CFG.hidden, generator=torch.Generator().manual_seed(0))
        x_in = x.chunk(2, dim=1)[rank] if sequence_parallel else x
        counts: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}
        phase = "forward"

        @contextlib.contextmanager
        def observer(dim: str, op: str, nbytes: int):
            counts[phase][(dim, op)] += 1
            yield

        tp.set_collective_observer(observer)
        y = block(x_in.clone().requires_grad_())
        phase = "backward"
        y.sum().backward()
        tp.set_collective_observer(None)
        out[rank] = ({k: dict(v) for k, v in counts.items()}, y.detach())
    finally:
        dist.destroy_process_group()


def _run(sequence_parallel: bool, rank_fn=None) -> dict:
    """Two forked ranks of `rank_fn` (default `_rank`): what they put in the shared dict."""
    ctx = forked.context()
    with ctx.Manager() as manager:
        out = manager.dict()
        port = free_port()
        procs = [forked.process(ctx, rank_fn or _rank, (r, port, sequence_parallel, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0
        return dict(out)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_one_block_issues_megatrons_collectives_and_matches_the_unsharded_block(
        sequence_parallel):
    out = _run(sequence_parallel)
    x = torch.randn(2, CFG.seq_len, CFG.hidden, generator=torch.Generator().manual_seed(0))
    expected = Block(1, CFG, 3, None)(x).detach()
    if sequence_parallel:
        # all-gather before attention and MLP, reduce-scatter after; the mirror in backward,
        # plus the LayerNorm weight and bias gradients summed over TP (two LayerNorms)
        want = {"forward": {("tp", "all_gather"): 2, ("tp", "reduce_scatter"): 2},
                "backward": {("tp", "all_gather"): 2, ("tp", "reduce_scatter"): 2,
                             ("tp", "all_reduce"): 4}}
        got = torch.cat([out[r][1] for r in range(2)], dim=1)
    else:
        # one all-reduce for attention and one for the MLP, in each direction
        want = {"forward": {("tp", "all_reduce"): 2}, "backward": {("tp", "all_reduce"): 2}}
        got = out[0][1]
        assert torch.equal(out[0][1], out[1][1]), "TP output is replicated"
    for rank in range(2):
        assert out[rank][0] == want
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _vocab_rank(rank: int, port: int, sequence_parallel: bool, out: dict) -> None:
    from workers.modeling.model import Embedding, Head, loss_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        groups = tp.build_groups(ParallelDims(tp=2), rank)
        emb, head = (Embedding(CFG, 3, groups, sequence_parallel),
                     Head(CFG, 3, groups, sequence_parallel))
        tokens, labels = _tokens()
        counts: Counter = Counter()

        @contextlib.contextmanager
        def observer(dim: str, op: str, nbytes: int):
            counts[(dim, op)] += 1
            yield

        tp.set_collective_observer(observer)
        logits = head(emb(tokens))
        loss = loss_for(CFG, groups)(logits, labels)
        fwd = dict(counts)
        loss.backward()
        tp.set_collective_observer(None)
        out[rank] = (fwd, float(loss), tuple(logits.shape), emb.tok.grad, head.weight.grad,
                     head.ln.weight.grad, emb.pos.grad)
    finally:
        dist.destroy_process_group()


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, CFG.vocab, (2, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab, (2, CFG.seq_len), generator=g))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_vocabulary_parallel_embedding_head_and_loss_match_the_unsharded_ones(
        sequence_parallel):
    from workers.modeling.model import Embedding, Head, loss_for

    out = _run(sequence_parallel, _vocab_rank)
    emb, head = Embedding(CFG, 3), Head(CFG, 3)
    tokens, labels = _tokens()
    loss = loss_for(CFG, None)(head(emb(tokens)), labels)
    loss.backward()
    for rank in range(2):
        fwd, got, shape, *_ = out[rank]
        # each rank holds half the logits; the loss needs the max, the sum of exponentials
        # and the target logit all-reduced, and nothing else gathers the vocabulary
        assert shape == (2, CFG.seq_len, CFG.vocab // 2)
        assert got == pytest.approx(float(loss), abs=1e-6)
        if sequence_parallel:
            assert fwd == {("tp", "reduce_scatter"): 1, ("tp", "all_gather"): 1,
                           ("tp", "all_reduce"): 3}
        else:
            assert fwd == {("tp", "all_reduce"): 4}  # the embedding's sum, then the loss's
    # the halves of the split tables' gradients are the unsharded gradients' rows; the
    # replicated norm and position table get the whole gradient on every rank
    for i, full in ((3, emb.tok.grad), (4, head.weight.grad)):
        torch.testing.assert_close(torch.cat([out[0][i], out[1][i]]), full, rtol=1e-5,
                                   atol=1e-7)
    for i, full in ((5, head.ln.weight.grad), (6, emb.pos.grad)):
        for rank in range(2):
            torch.testing.assert_close(out[rank][i], full, rtol=1e-5, atol=1e-7)
