"""The fixed cost of one optimizer step over a few hundred small tensors (LoRA adapters).

Llama-3.2-1B's LoRA adapters on q, v, output and the three MLP projections of its 16
layers (192 tensors), bf16 on the device, at rank 8 by default: about 5.3M elements, so
that the step's cost per tensor shows. ``--rank 64`` gives torchtune's own 1B QLoRA
config (42.5M elements, 85 MB of gradients each way). Times ``step()`` (until the updated
weights are on the device) for ours with default options against torch's fused AdamW on
the device, gradients set beforehand, median over ``--steps``. On a GPU ours with default
options is the streamed update; ``ours_host_update`` times the host update instead. ``--cold`` reads 512 MiB
of other host memory and sleeps 0.2 s before each step, as a training loop does between
steps (that config steps every 1.4 s): the update's state is then out of the CPU's
caches and its cores idle, which back-to-back steps do not show. Run on the GPU machine:

    python bench/investigations/step_overhead.py
    python bench/investigations/step_overhead.py --rank 64 --cold
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.engines import streamed

DIM, HIDDEN, LAYERS = 2048, 8192, 16
# (in, out) of each adapted linear; LoRA adds A (rank x in) and B (out x rank).
LINEARS = [(DIM, DIM), (DIM, 512), (DIM, DIM), (DIM, HIDDEN), (DIM, HIDDEN), (HIDDEN, DIM)]


def adapters(device, rank: int = 8) -> list:
    shapes = []
    for _ in range(LAYERS):
        for fan_in, fan_out in LINEARS:
            shapes += [(rank, fan_in), (fan_out, rank)]
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, torch.bfloat16) * 0.01) for s in shapes]


def time_steps(params, opt, steps: int, device, cold: bool = False) -> float:
    times = []
    other = torch.ones(1 << 27) if cold else None  # 512 MiB: more than any host's caches
    for i in range(steps + 3):
        for p in params:
            p.grad = torch.full_like(p, 1e-3 * (i + 1))
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        if cold:
            other.sum()
            time.sleep(0.2)
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    return statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="also print where ours_default's step spends its time")
    p.add_argument("--only", default=None, help="time only this variant (e.g. under a sampling profiler)")
    p.add_argument("--cold", action="store_true", help="evict the caches and idle before each step")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (torchtune's 1B QLoRA config: 64)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name, make in {
        "torch_adamw_on_device": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
        "ours_default": lambda ps: CPUOffloadOptimizer(ps, lr=1e-4),
        "ours_offload_gradients": lambda ps: CPUOffloadOptimizer(ps, lr=1e-4, offload_gradients=True),
        "ours_host_update": lambda ps: CPUOffloadOptimizer(ps, lr=1e-4),  # streamed update off
    }.items():
        if args.only is not None and name != args.only:
            continue
        streamed.config.enabled = name != "ours_host_update"
        params = adapters(device, args.rank)
        results[name] = time_steps(params, make(params), args.steps, device, args.cold) * 1e3
    if args.profile:
        import cProfile
        import pstats

        params = adapters(device, args.rank)
        opt = CPUOffloadOptimizer(params, lr=1e-4)
        time_steps(params, opt, 3, device)
        with cProfile.Profile() as prof:
            time_steps(params, opt, args.steps, device)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    shapes = adapters("cpu", args.rank)
    print(json.dumps({"tensors": len(shapes), "elements": sum(x.numel() for x in shapes), "rank": args.rank,
                      "cold": args.cold, "median_step_ms": results}, indent=1))


if __name__ == "__main__":
    main()
