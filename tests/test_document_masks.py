"""Document masks and sliding windows (`data.document_mask`, `data.eod_loss_mask`,
`model.sliding_window`): a packed window's logits equal each of its documents' logits computed
alone, in this process and on gloo ranks at tp 2 with sequence parallelism and under DeepSpeed's
pipeline engine (the documents travel between its stages); a training step's loss under a
pipeline (DeepSpeed's, and the interleaved one) is the loss computed by hand from the documents
alone; `eod_loss_mask` takes exactly the EOD tokens' predictions out of the loss; a Mistral and
a Qwen2 model with a window shorter than the sequence, loaded through `init.from_hf`, give
`transformers`' logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from service.contract import hf_config
from service.contract.spec import JobSpec
from service.planner.shape import ModelShape
from tests.corpora import write_corpus
from tests.workers_spawn import TEST_SERVER, run_ranks
from workers.checkpoint.full_state import gather_full
from workers.checkpoint.hf_weights import load_init, save_hf
from workers.modeling.model import GPT
from workers.modeling.positions import attention_bias, document_positions
from workers.modeling.vocab import IGNORE, make_loss
from workers.trainer import data

EOD = 1
VOCAB, SEQ = 64, 16
TOL = 1e-5


def corpus(where: Path) -> Path:
    """Documents of 3 to 12 tokens, each ending with EOD: every window holds several."""
    gen = torch.Generator().manual_seed(3)
    docs = []
    for _ in range(40):
        n = int(torch.randint(2, 12, (1,), generator=gen))
        docs.append([*torch.randint(2, VOCAB, (n,), generator=gen).tolist(), EOD])
    prefix = where / "docs"
    write_corpus(prefix, docs)
    return prefix


def spec(prefix: Path, out: Path, parallel: dict, *, entrypoint: bool = True,
         activation: str = "swiglu", global_batch: int = 2, **data_over: Any) -> JobSpec:
    raw: dict[str, Any] = {
        "name": "masks",
        "model": {"layers": 4, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": VOCAB,
                  "seq_len": SEQ, "activation": activation},
        "data": {"kind": "tokens", "train": [{"path": str(prefix)}], "document_mask": True,
                 **data_over},
        "train": {"steps": 1, "global_batch": global_batch, "micro_batch": 2,
                  "precision": "fp32", "lr": 0.003, "grad_clip": 1.0},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0, **parallel},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5},
        "env": {"TRIDENT_TEST_OUT": str(out)}}
    if entrypoint:
        raw["entrypoint"] = "tests.mask_ranks:logits"
    return JobSpec.model_validate(raw)


def first_batch(s: JobSpec) -> data.Batch:
    source = data.open_source(s, 0, 0, server=TEST_SERVER)
    return next(iter(source.micro_batches(0)))


def alone(model: GPT, tokens: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """Each row's logits with each of its documents run by itself, joined again."""
    rows = []
    for x, d in zip(tokens, documents, strict=True):
        cuts = [0, *((d[1:] != d[:-1]).nonzero().flatten() + 1).tolist(), len(d)]
        spans = zip(cuts, cuts[1:], strict=False)
        rows.append(torch.cat([model(x[None, a:b])[0] for a, b in spans]))
    return torch.stack(rows)


def test_positions_restart_and_the_mask_keeps_to_documents_and_the_window() -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0]]
    seen = attention_bias(6, 2, docs, torch.device("cpu"), torch.float32)[0, 0] == 0
    # query 4 (document 1): itself and token 3 (window 2, same document), not token 2
    assert seen[4].tolist() == [False, False, False, True, True, False]
    assert seen[2].tolist() == [False, True, True, False, False, False]
    assert attention_bias(6, 6, None, torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])  # rotary and learned positions
def test_a_packed_window_gives_each_documents_logits_alone(activation: str,
                                                            tmp_path: Path) -> None:
    s = spec(corpus(tmp_path), tmp_path, {}, activation=activation)
    (x, docs), _ = first_batch(s)
    assert all(len(set(row.tolist())) > 1 for row in docs)  # windows cross documents
    model = GPT(ModelShape.from_spec(s.model), s.train.seed).eval()
    with torch.no_grad():
        packed, expected, crossing = model((x, docs)), alone(model, x, docs), model(x)
    assert (packed - expected).abs().max().item() < TOL
    assert (crossing - expected).abs().max().item() > 1e-3  # without the mask: not equal


def test_eod_loss_mask_takes_exactly_the_eod_predictions_out(tmp_path: Path) -> None:
    prefix = corpus(tmp_path)
    (x, docs), y = first_batch(spec(prefix, tmp_path, {}, eod_loss_mask=True))
    (x0, _), y0 = first_batch(spec(prefix, tmp_path, {}))
    assert torch.equal(x, x0) and (x == EOD).any()
    assert torch.equal(y == IGNORE, x == EOD)  # the EOD inputs' predictions, and only those
    assert torch.equal(y[y != IGNORE], y0[x != EOD])
    logits = torch.randn(*x.shape, VOCAB)
    by_hand = F.cross_entropy(logits[x != EOD], y0[x != EOD])
    assert abs(make_loss(0, None)(logits, y).item() - by_hand.item()) < 1e-6


def test_masks_for_synthetic_data_and_windowless_full_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="data.document_mask"):
        JobSpec.model_validate({"name": "x", "model": {"preset": "gpt-tiny"},
                                "data": {"document_mask": True}})
    for model, why in [({"full_attention_layers": 1}, "needs a sliding_window"),
                       ({"sliding_window": 4, "full_attention_layers": 9}, "> layers")]:
        with pytest.raises(ValueError, match=why):
            JobSpec.model_validate({"name": "x", "model": {"preset": "gpt-tiny", **model}})


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tp": 2, "sequence_parallel": True}, {"pp": 2}],
                         ids=["tp2-sp", "pp2"])
def test_ranks_give_each_documents_logits_alone(parallel: dict, tmp_path: Path) -> None:
    s = spec(corpus(tmp_path), tmp_path, parallel)
    (x, docs), _ = first_batch(s)
    model = GPT(ModelShape.from_spec(s.model), s.train.seed).eval()
    with torch.no_grad():
        expected = alone(model, x, docs)
    run_ranks(s, timeout=600)
    got = torch.load(tmp_path / "logits.pt")
    assert (got - expected).abs().max().item() < TOL


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [
    {"tp": 2, "pp": 2}, {"pp": 2, "virtual_stages": 2},
    {"tp": 2, "sequence_parallel": True, "recompute": "full"},
    {"dp": 2, "recompute": "selective"}],
    ids=["tp2-pp2", "pp2-interleaved", "tp2-sp-full-recompute", "dp2-selective"])
def test_a_steps_loss_is_the_documents_loss_alone(parallel: dict, tmp_path: Path) -> None:
    s = spec(corpus(tmp_path), tmp_path, parallel, entrypoint=False, eod_loss_mask=True,
             global_batch=4)  # two micro-batches: the interleaved schedule needs pp of them
    model = GPT(ModelShape.from_spec(s.model), s.train.seed).eval()
    losses = []
    with torch.no_grad():
        for replica in range(s.layout.dp):
            source = data.open_source(s, replica, 0, server=TEST_SERVER)
            for (x, docs), y in source.micro_batches(0):
                kept = y != IGNORE
                losses.append(F.cross_entropy(alone(model, x, docs)[kept], y[kept]).item())
    expected = sum(losses) / len(losses)  # the step's loss: the micro-batches' mean
    rows = run_ranks(s, timeout=600)[0]
    assert abs(rows[0]["loss"] - expected) < TOL


def mistral() -> MistralForCausalLM:
    return MistralForCausalLM(MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
        sliding_window=5, tie_word_embeddings=False))


def qwen2() -> Qwen2ForCausalLM:  # the first layer attends fully, the second slides
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
        use_sliding_window=True, sliding_window=5, max_window_layers=1))


@pytest.mark.parametrize("make", [mistral, qwen2], ids=["mistral", "qwen2"])
def test_a_sliding_window_model_gives_transformers_logits(make: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = make()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    raw = {"name": "hf", "model": {"hf_config": str(tmp_path), "seq_len": SEQ},
           "init": {"from_hf": str(tmp_path)},
           "train": {"steps": 1, "global_batch": 2, "micro_batch": 2, "precision": "fp32"},
           "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}}
    with hf_config.reading(hf_config.local_reader):
        s = JobSpec.model_validate(raw)
    shape = ModelShape.from_spec(s.model)
    assert shape.sliding_window == 5
    assert [shape.window(i) for i in range(2)] == ([5, 5] if make is mistral else [None, 5])
    model = GPT(shape, s.train.seed).eval()
    load_init(model, s, None)
    with torch.no_grad():
        expected = hf(x).logits
        got = model(x)
        full = GPT(ModelShape.from_spec(s.model.model_copy(update={"sliding_window": None})),
                   s.train.seed).eval()
        load_init(full, s, None)
        unwindowed = full(x)
    assert (got - expected).abs().max().item() < 1e-4
    assert (unwindowed - expected).abs().max().item() > 1e-3  # the window matters here
    # exported, the window goes with the weights: transformers builds the same model again
    save_hf(shape, gather_full(model), str(tmp_path / "export"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert type(back) is type(hf)
    with torch.no_grad():
        assert (back.eval()(x).logits - expected).abs().max().item() < 1e-4


def test_the_planner_counts_the_masks_a_stage_holds(tmp_path: Path) -> None:
    from service.planner.memory import stage_memory
    from service.planner.plan import scenario_for

    masked = spec(corpus(tmp_path), tmp_path, {"pp": 2}, global_batch=4)
    plain = masked.model_copy(update={"data": masked.data.model_copy(
        update={"document_mask": False})})
    windowed = plain.model_copy(update={"model": plain.model.model_copy(
        update={"sliding_window": 5, "full_attention_layers": 3})})
    s2 = SEQ * SEQ * 4  # fp32 mask elements of one sample

    def activations(s: JobSpec, stage: int) -> float:
        return stage_memory(scenario_for(s, s.layout), stage).activations

    # 1F1B over 2 micro-batches of 2 samples: stage 0 holds 2 in flight, stage 1 one
    assert activations(masked, 0) - activations(plain, 0) == 2 * 2 * s2
    assert activations(masked, 1) - activations(plain, 1) == 1 * 2 * s2
    # blocks 0-1 attend fully (no mask), blocks 2-3 slide: one shared mask on stage 1
    assert activations(windowed, 0) == activations(plain, 0)
    assert activations(windowed, 1) - activations(plain, 1) == s2
