"""One rank of `bench.models_hf`: build a model (Trident's, or the `transformers` model of the
same config), wrap it in DeepSpeed with the job's own config, time the construction and the
steps (wall and this process's CPU time, median step, the first left out), and print one
JSON line.

Usage: python bench/_hf_rank.py trident|hf SPEC_JSON STEPS RANK WORLD PORT
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from workers.monitor.proc_status import reset_peak, status_kib
from workers.rank import script_rank


def hf_config(shape):
    """The `transformers` Llama config of a Llama-style Trident shape (RMSNorm, SwiGLU, rotary,
    untied head, no biases)."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn_hidden,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                       max_position_embeddings=shape.seq_len, rope_theta=shape.rope_theta,
                       tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                       attn_implementation="sdpa")


def main() -> None:
    which, spec_json = sys.argv[1], sys.argv[2]
    steps, rank, world, port = map(int, sys.argv[3:7])
    r = script_rank.start(spec_json, rank, world, port)
    import torch

    from workers.modeling.model import loss_for
    from workers.runtime.deepspeed_import import deepspeed
    from workers.trainer import data, recipe, train

    spec, groups, shape, ds_config = r.spec, r.groups, r.shape, r.ds_config
    t = spec.train
    if not reset_peak():  # the peak resident set from here on is the construction's
        raise OSError("/proc/self/clear_refs refused: the construction's peak is not readable")
    before = status_kib()["VmRSS"]
    t0 = time.perf_counter()
    if which == "trident":
        engine = train.build_engine(spec, shape, r.ctx.plan, r.device, groups, ds_config)
        loss_fn = loss_for(shape, groups)

        def forward_loss(x, y):
            return loss_fn(engine(x), y)
    else:
        from transformers import LlamaForCausalLM
        torch.manual_seed(t.seed)
        model = LlamaForCausalLM(hf_config(shape))
        engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                          model_parameters=recipe.param_groups(model, t))

        def forward_loss(x, y):
            logits = engine(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     y.reshape(-1))
    built_s = time.perf_counter() - t0
    peak = status_kib()["VmHWM"]
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                 for p in engine.module.parameters())
    times, cpu = [], []
    for step in range(steps):
        s0, c0 = time.perf_counter(), time.process_time()
        for x, y in data.micro_batches(seed=t.seed, step=step, dp_rank=groups.dp_rank,
                                       dp=spec.layout.dp, global_batch=t.global_batch,
                                       micro_batch=t.micro_batch, seq_len=shape.seq_len,
                                       vocab=shape.vocab):
            loss = forward_loss(x, y)
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - s0)
        cpu.append(time.process_time() - c0)
    step_s = statistics.median(times[1:] if len(times) > 1 else times)
    cpu_s = statistics.median(cpu[1:] if len(cpu) > 1 else cpu)
    print(json.dumps({"which": which, "rank": rank, "params": params,
                      "construction_s": built_s, "construction_peak_bytes":
                      (peak - before) * 1024, "step_s": step_s,
                      "tokens_per_s": t.global_batch * shape.seq_len / step_s,
                      "cpu_step_s": cpu_s,
                      "last_loss": float(loss)}), flush=True)
    engine.destroy()
    script_rank.stop()


if __name__ == "__main__":
    main()
