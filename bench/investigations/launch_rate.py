"""Does our optimizer slow the training thread's kernel launches between steps?

A QLoRA forward at small batch is bound by the training thread launching kernels. After
our step() the host worker's thread and its OpenMP team are still there (their threads
spin for a while after each parallel region); if they took the training thread's core or
its GIL, the next forward would launch more slowly. This times a launch-bound burst (many
small kernels, the host's launch time alone, no waiting on the device) right after a step
of each optimizer over Llama-3.2-1B's LoRA adapters (``step_overhead.adapters``), and
after a step with no optimizer at all, alternating the variants round by round. Run on
the GPU machine (on the CPU the "launches" are small CPU ops):

    python bench/investigations/launch_rate.py
    python bench/investigations/launch_rate.py --rank 64 --gap-ms 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from offload_plugin import CPUOffloadOptimizer
from step_overhead import adapters


def burst_us_per_launch(x: torch.Tensor, launches: int) -> float:
    """Host microseconds per launch of ``launches`` small element-wise kernels."""
    start = time.perf_counter()
    for _ in range(launches // 2):
        x = x.mul(1.0001).add_(1e-4)
    return (time.perf_counter() - start) / launches * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--launches", type=int, default=2000, help="kernels per burst")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of the adapters stepped")
    p.add_argument("--gap-ms", type=float, default=0.0, help="sleep between step() and the burst")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    variants = {
        "no_optimizer": None,
        "torch_adamw_on_device": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
        "ours_default": lambda ps: CPUOffloadOptimizer(ps, lr=1e-4),
    }
    setups = {}
    for name, make in variants.items():
        params = adapters(device, args.rank)
        setups[name] = (params, make(params) if make is not None else None)
    x = torch.ones(1024, device=device)
    times: dict = {name: [] for name in variants}
    for r in range(args.rounds + 2):
        for name, (params, opt) in setups.items():
            for p_ in params:
                p_.grad = torch.full_like(p_, 1e-3 * (r + 1))
            sync()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if args.gap_ms:
                time.sleep(args.gap_ms / 1e3)
            us = burst_us_per_launch(x, args.launches)
            sync()
            if r >= 2:  # (the first rounds build kernels and caches)
                times[name].append(us)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "device": str(device), "rank": args.rank, "launches": args.launches, "rounds": args.rounds,
        "gap_ms": args.gap_ms, "median_us_per_launch": medians,
        "vs_no_optimizer": {name: us / medians["no_optimizer"] for name, us in medians.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
