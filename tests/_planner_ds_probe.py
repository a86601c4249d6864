"""Helper for tests/test_planner_deepspeed.py and bench/bench_cpu_constants.py.

Builds a small GPT-shaped model (the planner's GPT conventions) in a real DeepSpeed engine on
CPU (gloo), trains two steps, and counts the bytes of every live tensor at the peak of model
states (after backward, and inside the optimizer step).

Run as a spawned process per ZeRO stage; returns counts through a queue.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.heads = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """GPT conventions of service.planner.shape: biases, LayerNorm, learned positions, tied."""

    def __init__(self, layers: int, h: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
        self.ln = nn.LayerNorm(h)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.tok.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())


def live_tensor_bytes() -> int:
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                st = obj.untyped_storage()
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # noqa: BLE001 - some tensor subclasses refuse storage access
            continue
    return sum(seen.values())


def worker(rank: int, world: int, port: int, cfg: dict[str, Any], dims: dict[str, int],
           q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    from workers.runtime.deepspeed_import import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    base = live_tensor_bytes()
    model = GPT(dims["layers"], dims["hidden"], dims["vocab"], dims["seq"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    del model
    held = 0
    in_step: list[int] = []
    inner = engine.optimizer
    while hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    orig_step = inner.step

    def measured_step(*args: Any, **kwargs: Any) -> Any:
        # Inside the optimizer step: the fp32 gradient partition exists next to the states.
        in_step.append(live_tensor_bytes() - base)
        return orig_step(*args, **kwargs)

    inner.step = measured_step  # type: ignore[method-assign]
    gas = cfg.get("gradient_accumulation_steps", 1)
    for _ in range(2 * gas):
        idx = torch.randint(0, dims["vocab"], (cfg["train_micro_batch_size_per_gpu"],
                                               dims["seq"]))
        loss = engine(idx)
        engine.backward(loss)
        del loss, idx
        # The peak of model states: gradients reduced (or, between micro-steps of gradient
        # accumulation, held as the engine holds them), optimizer states from the last step.
        held = max(held, live_tensor_bytes() - base)
        engine.step()
    q.put((rank, held, max(in_step[1:] or [0])))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
