"""Where an in-backward step's time goes: the host time our optimizers' step() calls take
inside the gradient hooks (torchtune's optimizer_in_bwd: one optimizer per parameter), against
the step's wall time and the time with no update at all.

Builds Llama-3.1-8B's shapes with ``--layers`` decoder layers (random init, bf16, activation
checkpointing, on the GPU), steps each parameter from its gradient's hook (as
``torchtune.training.register_optim_in_bwd_hooks`` does), and reports per optimizer the median
step seconds after two warm-up steps, the host seconds spent inside step() per training
step (the hooks run on the thread that launches backward's kernels: while they run, no
backward kernel is launched), and the number of step() calls.

    python bench/inbwd_host_time.py --layers 8 --json /tmp/inbwd_host_time.json   # on the GPU machine
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_plugin import CPUOffloadOptimizer  # noqa: E402

OPTIMIZERS = {
    "none": None,
    "default": {},
    "adamw8bit": dict(optimizer_cls="offload_plugin.AdamW8bit"),
    "compact": dict(optimizer_cls="offload_plugin.CompactAdamW"),
}


def build(layers: int) -> torch.nn.Module:
    from torchtune.models.llama3_1 import llama3_1
    from torchtune.training import set_activation_checkpointing
    from torchtune.modules import TransformerSelfAttentionLayer

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = llama3_1(vocab_size=128_256, num_layers=layers, num_heads=32, num_kv_heads=8, embed_dim=4096,
                         max_seq_len=8192, intermediate_dim=14336).to(torch.bfloat16)
    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    return model


def measure(name: str, layers: int, tokens: int, steps: int) -> dict:
    model = build(layers)
    host = {"s": 0.0, "calls": 0}
    if OPTIMIZERS[name] is not None:
        optims = {p: CPUOffloadOptimizer([p], lr=1e-5, **OPTIMIZERS[name]) for p in model.parameters()}

        def hook(p, optimizer):
            start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            host["s"] += time.perf_counter() - start
            host["calls"] += 1

        for p, opt in optims.items():
            p.register_post_accumulate_grad_hook(functools.partial(hook, optimizer=opt))
    else:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    batch = tokens // 2048
    times, host_s = [], []
    for i in range(steps + 2):
        ids = torch.randint(0, 128_256, (batch, 2048), device="cuda")
        torch.cuda.synchronize()
        host["s"], host["calls"] = 0.0, 0
        start = time.perf_counter()
        logits = model(ids)
        loss = logits.float().logsumexp(-1).mean()  # (a stand-in loss with the logits' cost)
        del logits
        loss.backward()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
            host_s.append(host["s"])
    out = {"optimizer": name, "layers": layers, "tokens": tokens, "step_s": statistics.median(times),
           "host_in_step_s": statistics.median(host_s), "step_calls": host["calls"]}
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = [measure(name, args.layers, args.tokens, args.steps) for name in args.optimizers.split(",")]
    print("| optimizer | step s | host s in step() per step | step() calls |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['step_s']:.3f} | {r['host_in_step_s']:.3f} | {r['step_calls']} |")
    if args.json:
        args.json.write_text(json.dumps({"kind": "inbwd_host_time", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
