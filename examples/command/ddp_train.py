"""A plain `torch.distributed` DDP training script, as a team would run it under torchrun:
Trident runs it unchanged as a `command:` job (`docs/command.md`, `examples/command/ddp.yaml`).

It reads torchrun's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, through
`init_process_group`'s `env://`), trains a small regression on gloo (or NCCL on GPUs) and
prints `step N loss X` on rank 0, the line the job's `progress.regex` reads. With
`TRIDENT_CHECKPOINT_DIR` it saves every `--save-every` steps as Trident's tags are laid out:
`step<N>/` with the state, then a `COMPLETE` file holding N, written last, by rank 0, once
every rank is past the save; and it resumes from `TRIDENT_RESUME_STEP` when Trident sets it
(the newest such tag, on a retry). Under plain torchrun (no Trident) it trains from scratch.

`--fail-at STEP:RANK:CODE` and `--hang-at STEP` are for trying the monitor: the first
attempt (`TORCHELASTIC_RESTART_COUNT` 0) exits with CODE on RANK at STEP, or every rank
sleeps forever at STEP.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def hang_here() -> None:
    """Sleeps for good: the stack the monitor's `py-spy dump` shows."""
    while True:
        time.sleep(1.0)


def save(directory: str, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    tag = os.path.join(directory, f"step{step}")
    if dist.get_rank() == 0:
        os.makedirs(tag, exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                   os.path.join(tag, "state.pt"))
    dist.barrier()
    if dist.get_rank() == 0:  # the marker last: a tag without it is never resumed from
        with open(os.path.join(tag, "COMPLETE.tmp"), "w") as f:
            f.write(f"{step}\n")
        os.replace(os.path.join(tag, "COMPLETE.tmp"), os.path.join(tag, "COMPLETE"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--step-s", type=float, default=0.0, help="sleep per step (seconds)")
    ap.add_argument("--fail-at", default="", help="STEP:RANK:CODE, first attempt only")
    ap.add_argument("--hang-at", type=int, default=0)
    args = ap.parse_args()

    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else "cpu"
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = 1
    resume = int(os.environ.get("TRIDENT_RESUME_STEP", "0"))
    ckpt = os.environ.get("TRIDENT_CHECKPOINT_DIR")
    if resume and ckpt:
        state = torch.load(os.path.join(ckpt, f"step{resume}", "state.pt"), map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = resume + 1
        print(f"rank {rank}: resumed from step {resume} (restart"
              f" {os.environ.get('TORCHELASTIC_RESTART_COUNT')})", flush=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fail = [int(x) for x in args.fail_at.split(":")] if args.fail_at else None
    true_w = torch.arange(16, dtype=torch.float32, device=device) / 16
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(first, args.steps + 1):
        if args.hang_at and step == args.hang_at and restart == 0:
            print(f"rank {rank}: hanging at step {step}", flush=True)
            hang_here()
        if fail and step == fail[0] and rank == fail[1] and restart == 0:
            print(f"rank {rank}: exiting with code {fail[2]} at step {step}", flush=True)
            os._exit(fail[2])
        x = torch.randn(32, 16, generator=gen).to(device)
        y = x @ true_w
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        if rank == 0:
            print(f"step {step} loss {mean.item():.6f}", flush=True)
        if ckpt and args.save_every and step % args.save_every == 0:
            save(ckpt, step, model, opt)
        if args.step_s:
            time.sleep(args.step_s)
    dist.barrier()
    # DDP's reducer holds the process group and its last works: dropped here, while the
    # interpreter is whole, so that gloo's threads do not release them during its exit.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
