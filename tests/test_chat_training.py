"""Supervised fine-tuning (`data.kind: chat`): a chat corpus made at test time
(`trident data prepare --chat`) trains from an `init.from_hf` Llama made by `transformers`;
the loss mask lines up with the tokens (only the assistant's train), and a step's loss is
the loss computed by hand from `transformers`' logits on the same samples: the cross entropy
summed over the assistant's tokens of the global batch over their count (the global-token
mean), whatever the micro-batches and DP replicas hold each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from service.contract import hf_config
from service.contract.spec import JobSpec
from service.files.chat_prepare import prepare_chat
from tests.hf_made import llama, saved
from tests.tokenizer_folders import CONVERSATIONS, make, vocab, write_chats
from tests.workers_spawn import TEST_SERVER, run_ranks
from workers.trainer import data

SEQ = 16
TOL = 1e-4
ANSWERS = ("fine", "thanks", "five", "no")
"""Words only the assistant says in `CONVERSATIONS`: every one of them trains (and "joke",
which the system says too, trains where the assistant says it)."""


def chat_corpus(tmp_path: Path) -> str:
    prefix = str(tmp_path / "sft")
    prepare_chat([write_chats(tmp_path / "c.jsonl", CONVERSATIONS * 12)],
                 str(make(tmp_path / "tok")), prefix)
    return prefix


def spec(prefix: str, folder: Path, parallel: dict, global_batch: int,
         micro_batch: int) -> JobSpec:
    raw = {"name": "sft", "model": {"hf_config": str(folder), "seq_len": SEQ},
           "init": {"from_hf": str(folder)},
           "data": {"kind": "chat", "train": [{"path": prefix}], "valid_fraction": 0.25,
                    "eval_every": 1, "eval_batches": 2},
           "train": {"steps": 1, "global_batch": global_batch, "micro_batch": micro_batch,
                     "precision": "fp32", "lr": 0.003, "grad_clip": 1.0},
           "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0, **parallel},
           "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}}
    with hf_config.reading(hf_config.local_reader):
        return JobSpec.model_validate(raw)


def test_the_loss_mask_lines_up_with_the_tokens(tmp_path: Path) -> None:
    s = spec(chat_corpus(tmp_path), saved(llama, tmp_path / "hf"), {}, 8, 2)
    assert s.data.document_mask  # a chat job's default
    source = data.open_source(s, 0, 0, server=TEST_SERVER)
    v = vocab()
    answers = {v[w] for w in ANSWERS}
    may_train = answers | {v["joke"], v["<|end|>"]}
    order = source.train_order
    trained = 0
    for j in range(len(order)):  # type: ignore[arg-type]
        tokens, mask = order.tokens(j), order.loss_mask(j)  # type: ignore[attr-defined]
        assert set(tokens[mask == 1].tolist()) <= may_train, j
        assert (mask[np.isin(tokens, list(answers))] == 1).all(), j
        trained += int(mask.sum())
    assert trained
    for (_, _), y in source.micro_batches(0):  # labels train only where the mask is 1
        kept = y[y != -100]
        assert kept.numel() and set(kept.tolist()) <= may_train


def by_hand(folder: Path, s: JobSpec) -> tuple[float, float]:
    """The global batch's loss from `transformers`' logits: each document of a window run
    alone (the document mask), the cross entropy summed over the labels that train (the
    predicted token's mask is 1), over how many they are; and the mean of the samples' own
    means (what averaging per micro-batch of one sample would give instead)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    source = data.open_source(s, 0, 0, server=TEST_SERVER)
    order = source.train_order
    total, count, means = 0.0, 0, []
    with torch.no_grad():
        for j in range(s.train.global_batch):
            tokens = torch.as_tensor(order.tokens(j))  # type: ignore[attr-defined]
            mask = torch.as_tensor(order.loss_mask(j))  # type: ignore[attr-defined]
            docs = torch.as_tensor(order.documents(j))  # type: ignore[attr-defined]
            x, y, d = tokens[:-1], tokens[1:], docs[:-1]
            logits = torch.cat([model(x[d == n][None]).logits[0]
                                for n in torch.unique_consecutive(d).tolist()])
            kept = mask[1:] == 1
            summed = F.cross_entropy(logits[kept], y[kept], reduction="sum").item()
            total += summed
            count += int(kept.sum())
            means.append(summed / int(kept.sum()))
    return total / count, sum(means) / len(means)


@pytest.mark.parametrize("parallel, micro_batch", [({}, 1), ({"dp": 2}, 1),
                                                   ({"tp": 2, "dp": 2, "zero": 1}, 1)],
                         ids=["dp1-gas4", "dp2-gas2", "tp2-dp2-gas2"])
def test_a_chat_steps_loss_is_the_assistant_tokens_mean(parallel: dict, micro_batch: int,
                                                         tmp_path: Path) -> None:
    folder = saved(llama, tmp_path / "hf")
    s = spec(chat_corpus(tmp_path), folder, parallel, 4, micro_batch)
    expected, per_sample = by_hand(folder, s)
    assert abs(expected - per_sample) > 10 * TOL  # the samples train unequal token counts
    rows = run_ranks(s, timeout=600)[0]
    assert rows[0]["first_sample"] == 0
    assert abs(rows[0]["loss"] - expected) < TOL, (rows[0]["loss"], expected)
    assert 0 < rows[0]["eval_loss"] < 20  # the held-out assistant tokens' mean
