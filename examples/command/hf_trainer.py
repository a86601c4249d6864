"""A Hugging Face `Trainer` script as a team would have it: a small causal LM trained on CPU,
one process per rank under torchrun (or Trident's `command:`), DDP over gloo.

    torchrun --nproc-per-node 2 examples/command/hf_trainer.py --steps 4

The model is GPT-2's architecture at a tiny size, randomly initialised from its config; the
data is a few hundred random token sequences made in memory (the same on every rank, from the
seed). The Trainer prints its log dict every `--logging-steps` steps
(`{'loss': ..., 'grad_norm': ..., 'learning_rate': ..., 'epoch': ...}`), which Trident's
`progress: {preset: hf-trainer}` reads. With `--report`, a callback also writes each logged
step, with the process's peak memory, to `TRIDENT_REPORT` through `trident_report.py`.

With `--save-steps N` the Trainer saves `checkpoint-<step>/` every N steps to
`TRIDENT_CHECKPOINT_DIR` (`hf-trainer-out` outside Trident), and a callback marks each save
complete as Trident's tags are (`step<step>/COMPLETE` holding the step, written by rank 0 once
every rank is past the save), so that a retry is given `TRIDENT_RESUME_STEP` and resumes from
that checkpoint.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trident_report import report  # noqa: E402


class RandomTokens(torch.utils.data.Dataset):
    """`n` random sequences of `seq_len` tokens, each its own label (causal LM)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class ReportSteps(TrainerCallback):
    """Each logged step to the report file, with the peak resident memory of this rank."""

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            report(step=state.global_step, loss=float(logs["loss"]),
                   lr=float(logs.get("learning_rate", 0.0)),
                   memory={"process_peak_bytes": peak})


class MarkComplete(TrainerCallback):
    """After each save, the marker that makes it a complete tag for Trident."""

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank has written its part (its RNG state)
        if state.is_world_process_zero:
            tag = os.path.join(args.output_dir, f"step{state.global_step}")
            os.makedirs(tag, exist_ok=True)
            with open(os.path.join(tag, "COMPLETE.tmp"), "w") as f:
                f.write(f"{state.global_step}\n")
            os.replace(os.path.join(tag, "COMPLETE.tmp"), os.path.join(tag, "COMPLETE"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--report", action="store_true", help="also write TRIDENT_REPORT lines")
    p.add_argument("--no-tqdm", action="store_true",
                   help="print the log dicts (PrinterCallback) instead of a progress bar")
    args = p.parse_args()

    set_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=32, n_layer=2,
                        n_head=2)
    model = GPT2LMHeadModel(config)
    out = os.environ.get("TRIDENT_CHECKPOINT_DIR") or "hf-trainer-out"  # one for every rank
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-3, logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to="none", use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=args.no_tqdm, seed=0)
    data = RandomTokens(64 * args.batch, args.seq_len, config.vocab_size, seed=0)
    callbacks: list[TrainerCallback] = []
    if args.report:
        callbacks.append(ReportSteps())
    if args.save_steps:
        callbacks.append(MarkComplete())
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    resume = os.environ.get("TRIDENT_RESUME_STEP")
    checkpoint = os.path.join(out, f"checkpoint-{resume}") if resume else None
    trainer.train(resume_from_checkpoint=checkpoint
                  if checkpoint and os.path.isdir(checkpoint) else None)


if __name__ == "__main__":
    main()
