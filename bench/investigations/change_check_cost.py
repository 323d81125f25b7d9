"""What noticing weights changed outside the optimizer costs per training step.

Trains a random-init torchtune model (bf16, on the GPU) with CPUOffloadOptimizer and times
every check of the parameters' version counters (``changed_slots``, and ``adopt_weight``
should one have changed) against the whole step. Also times one check over Llama-3.1-8B's parameter count (291
tensors; built small, since the check reads no data).

    python bench/investigations/change_check_cost.py --model llama3_2_1b --steps 8
    python bench/investigations/change_check_cost.py --tiny --device cpu --steps 3      # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: offload_plugin, installed or not
from offload_plugin import CPUOffloadOptimizer  # noqa: E402
from offload_plugin.engines import host as engine_module  # noqa: E402

TOTALS: dict = {}  # seconds spent in each timed method since the last clear
TINY = dict(vocab_size=512, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128,
            intermediate_dim=256, max_seq_len=256)


def _timed(module, name, totals=TOTALS):
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
    setattr(module, name, wrapper)


def build(args):
    from torchtune.models.llama3 import llama3
    from torchtune.models.llama3_2 import llama3_2_1b

    torch.manual_seed(0)
    with torch.device(args.device):
        model = llama3(**TINY) if args.tiny else llama3_2_1b()
    return model.to(torch.bfloat16)


def run(args, label, **options):
    model = build(args)
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-5, **options)
    totals = TOTALS
    totals.clear()
    vocab = TINY["vocab_size"] if args.tiny else 128_256
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), device=args.device)
    overlap = options.get("offload_gradients", False)
    times = []
    for step in range(args.steps):
        if step == 1:  # time from the second step on (first-step setup left out)
            totals.clear()
        start = time.perf_counter()
        if overlap:
            opt.overlap_next_step(grad_scale=1.0 / tokens[:, 1:].numel(), early_forward=True)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        loss.backward()
        if not overlap:
            for p in model.parameters():
                p.grad.mul_(1.0 / tokens[:, 1:].numel())
        opt.step()
        opt.zero_grad()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del logits, loss
    opt.finish_step()
    steps = len(times) - 1
    check = sum(totals.values()) / steps
    row = dict(label=label, options=options, tensors=len(opt.engine.slots),
               step_s=sum(times[1:]) / steps, check_s_per_step=check,
               check_share=check / (sum(times[1:]) / steps))
    print(json.dumps(row))
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.tiny:
        args.seq_len = min(args.seq_len, 128)
    _timed(engine_module.HostEngine, "changed_slots")  # every check goes through these
    _timed(engine_module, "adopt_weight")
    rows = [run(args, "default"), run(args, "offload_gradients+early_forward", offload_gradients=True)]
    # 8B's tensor count: 32 layers x 9 tensors + embedding, final norm, output.
    params = [torch.nn.Parameter(torch.zeros(16, device=args.device)) for _ in range(32 * 9 + 3)]
    opt = CPUOffloadOptimizer(params, lr=1e-5)
    opt.engine.adopt_changed_weights()
    start = time.perf_counter()
    for _ in range(100):
        opt.engine.adopt_changed_weights()
    rows.append(dict(label="one check over 291 tensors (Llama-3.1-8B's count)",
                     check_s=(time.perf_counter() - start) / 100))
    print(json.dumps(rows[-1]))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
