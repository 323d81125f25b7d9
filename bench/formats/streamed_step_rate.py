"""How close the streamed update comes to the bus: one optimizer step over bf16 weights
shaped like Llama-3.1-8B's layers, with no model around it (the step is nothing but
transfers and kernels), against the pinned copy bandwidth measured in the same process.

For each optimizer: CPUOffloadOptimizer with default options (the exact default, bf16
moments), with ``optimizer_cls=offload_plugin.CompactAdamW`` and with
``optimizer_cls=offload_plugin.AdamW8bit``; gradients are random bf16 on the GPU; the
step time is the median of ``--steps`` after two warm-up steps, each ended by
``torch.cuda.synchronize()``. Reports bytes moved each way per step (bench/bus.py reads them
from the optimizer), the step time, the transfers' floor at the measured bandwidth (both
directions at once) and the share of the bus the step used.

    python bench/formats/streamed_step_rate.py --layers 8 --json /tmp/step_rate.json   # on the GPU machine
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: offload_plugin, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: bus.py

import bus  # noqa: E402
from offload_plugin import CPUOffloadOptimizer  # noqa: E402

# One Llama-3.1-8B decoder layer's weights (q, k, v, o, gate, up, down) and its two norms.
LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
         (4096, 14336), (4096,), (4096,)]
OPTIMIZERS = {
    "default": {},
    "compact": dict(optimizer_cls="offload_plugin.CompactAdamW"),
    "adamw8bit": dict(optimizer_cls="offload_plugin.AdamW8bit"),
}


def measure(name: str, layers: int, steps: int, host_profile: bool = False) -> dict:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(layers) for s in LAYER]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = CPUOffloadOptimizer(params, lr=1e-5, **OPTIMIZERS[name])
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    out = {"optimizer": name, "numel": sum(p.numel() for p in params), "step_s": statistics.median(times),
           "step_s_all": times, **(bus.streamed_bytes(opt) or {})}
    if host_profile:  # one more step's host time under cProfile: where step()'s Python goes
        import cProfile
        import io
        import pstats

        torch.cuda.synchronize()
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        opt.step()
        prof.disable()
        out["host_s"] = time.perf_counter() - start
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        out["host_profile"] = text.getvalue()
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="Llama-3.1-8B layers' worth of weights (0.22 G each)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--host-profile", action="store_true",
                   help="profile one more step's host time (cProfile) and print where it goes")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    link = bus.bandwidth(4.0)
    rows = [measure(name, args.layers, args.steps, args.host_profile) for name in args.optimizers.split(",")]
    for row in rows:
        if "host_profile" in row:
            print(f"## {row['optimizer']}: host {row['host_s']:.4f} s in one step()\n{row['host_profile']}")
    print(f"pinned copies both ways at once: {link['both_GBps_each_way']} GB/s each way "
          f"(h2d alone {link['h2d_GBps']}, d2h alone {link['d2h_GBps']})")
    print("| optimizer | parameters | bytes each way per step | step s | bus floor s | bus used |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        row.update(bus.use(row, link))
        print(f"| {row['optimizer']} | {row['numel'] / 1e9:.2f} G | {row.get('bytes_h2d_per_step', 0) / 1e9:.2f} GB "
              f"| {row['step_s']:.4f} | {row.get('bus_floor_s', float('nan')):.4f} | {row.get('bus_use', float('nan')):.0%} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bus": link, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
