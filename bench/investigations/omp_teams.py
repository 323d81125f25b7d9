"""Does a second OpenMP team slow the host update? The native update timed in a host thread,
before and after the training thread has run a parallel op of its own.

Each thread that runs a parallel region gets a libgomp team of its own. Once libgomp
manages more threads than there are cores (the training thread's team of all cores plus
the host worker's), it stops spinning between regions in every team, so each region
first wakes its threads. On the CPU that made the training thread's small regions 2.5-3x
slower (parameters on the CPU now update in the training thread: offload_plugin/host/worker.py).
On a GPU machine the host worker keeps its thread, and an 8B step runs about 2,000
native calls of 4 Mi elements there; this measures what each costs with and without the
training thread's team. Run on the GPU machine (or anywhere):

    python bench/investigations/omp_teams.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from offload_plugin.formats.adamw import native as native_adam

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # host_update_rate.py
from host_update_rate import _in_thread  # noqa: E402  (a fresh thread with its own thread count, as the host worker)


def time_calls(kernel, tensors, calls: int, threads: int, gap_s: float) -> float:
    """Mean seconds per native update call (bf16 weight and moments, no master)."""
    weight, grad, exp_avg, exp_avg_sq = tensors
    kw = dict(lr=1e-6, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, step=1.0, adamw=True,
              maximize=False, grad_scale=None, num_threads=threads)
    for _ in range(5):
        kernel.step(weight, grad, exp_avg, exp_avg_sq, None, **kw)
    total = 0.0
    for _ in range(calls):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        kernel.step(weight, grad, exp_avg, exp_avg_sq, None, **kw)
        total += time.perf_counter() - start
    return total / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 22, help="elements per call (the host worker's batch)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each call")
    args = p.parse_args()
    kernel = native_adam.kernel()
    if kernel is None:
        raise SystemExit("the native kernel is not available here (no C++ compiler?)")
    cores = torch.get_num_threads()
    threads = max(1, cores - 1)  # the host worker's default with a GPU
    n = args.numel - args.numel % kernel.align(torch.bfloat16)
    tensors = []  # filled by the first host thread: the training thread runs no parallel op before

    def worker():
        if not tensors:
            tensors.extend(torch.zeros(n, dtype=torch.bfloat16) for _ in range(4))
            tensors[1].fill_(1e-3)
        return time_calls(kernel, tensors, args.calls, threads, args.gap_ms / 1e3)

    results = {"host thread, training thread without a team": _in_thread(worker, threads)}
    torch.ones(1 << 24).add_(1)  # the training thread's own team, over all its threads
    results["host thread, training thread with its team"] = _in_thread(worker, threads)
    results["training thread itself"] = time_calls(kernel, tensors, args.calls, threads, args.gap_ms / 1e3)
    print(json.dumps({"numel": n, "calls": args.calls, "gap_ms": args.gap_ms, "cores": cores,
                      "host_threads": threads,
                      "us_per_call": {k: v * 1e6 for k, v in results.items()},
                      "g_params_per_s": {k: n / v / 1e9 for k, v in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
