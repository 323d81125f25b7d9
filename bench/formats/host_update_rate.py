"""How fast the host update runs, next to torch's fused CPU AdamW on plain fp32 tensors.

Times offload_plugin's per-parameter update (bf16 gradient in, fp32 master + moments
updated, bf16 weight out) for several chunk sizes and thread counts, on one parameter of
--numel elements, and prints G params/s and the memory traffic that implies (28 bytes
per parameter when every byte is moved once: bf16 grad read, fp32 master/exp_avg/exp_avg_sq
read and written, bf16 weight written).

    python bench/formats/host_update_rate.py --numel 268435456

"one pass" is offload_plugin.formats.adamw.native's kernel (what the optimizer uses when it could
build and verify it); "torch, 3 passes" is the fallback through torch's fused kernel.
"accumulate add" times gradient accumulation into the host sum (bf16 += bf16): torch's
add_ against native_adam.add_, in G elements/s and GB/s at 6 bytes per element.
"""

import argparse
import threading
import time

import torch

from offload_plugin.formats.adamw import native as native_adam
from offload_plugin.host.buffers import HostSlot
import offload_plugin.host.inner_step as host_update

BYTES_PER_PARAM = 28


def _timed(fn, repeats):
    fn()  # first touch of the state pages
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def _in_thread(fn, threads):
    """Run fn on a fresh thread with its own intra-op thread count, as the optimizer does."""
    out = {}

    def run():
        torch.set_num_threads(threads)
        out["s"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["s"]


def memory_bandwidth(n, threads, repeats):
    """GB/s of a multi-threaded fp32 copy (bytes read + written): the ceiling to compare with."""
    a, b = torch.randn(n), torch.empty(n)
    return 8 * n / _in_thread(lambda: _timed(lambda: b.copy_(a), repeats), threads) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 28)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    n, cores = args.numel, torch.get_num_threads()
    rows = []

    def report(name, seconds, bytes_per_param=BYTES_PER_PARAM, unit="params"):
        rows.append((name, n / seconds / 1e9, n * bytes_per_param / seconds / 1e9))
        print(f"{name:58s} {rows[-1][1]:6.2f} G {unit}/s  {rows[-1][2]:6.1f} GB/s", flush=True)

    # Reference: torch's fused AdamW, fp32 everything (28 bytes per parameter too).
    w = torch.zeros(n)
    w.grad = torch.randn(n)
    ref = torch.optim.AdamW([w], lr=1e-3, fused=True)
    for threads in sorted({cores, max(1, cores - 1)}):
        report(f"torch AdamW(fused) fp32, {threads} threads",
               _in_thread(lambda: _timed(ref.step, args.repeats), threads))
    del w, ref

    master = torch.zeros(n)
    slot = HostSlot(param=torch.zeros(1), master=master,
                    grad=torch.randn(n).to(torch.bfloat16), weight_stage=torch.empty(n, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([master], lr=1e-3, fused=True)
    groups = {id(master): opt.param_groups[0]}
    threads = max(1, cores - 1)
    for native in (True, False):
        host_update.USE_NATIVE = native
        kernel = native_adam.kernel()
        how = "one pass" if native and kernel is not None and torch.float32 in kernel.dtypes else "torch, 3 passes"
        report(f"offload update bf16->fp32 master->bf16 ({how}), {threads} thr",
               _in_thread(lambda: _timed(lambda: host_update.update_slots(opt, groups, [slot]),
                                         args.repeats), threads))
    host_update.USE_NATIVE = True
    del master, slot, opt

    # master_weights=False: everything bf16 (2+2*2+2*2+2*2... = 14 bytes per parameter).
    wb = torch.zeros(n, dtype=torch.bfloat16)
    wb.grad = torch.randn(n).to(torch.bfloat16)
    refb = torch.optim.AdamW([wb], lr=1e-3, fused=True)
    report(f"torch AdamW(fused) bf16 (no master), {threads} threads",
           _in_thread(lambda: _timed(refb.step, args.repeats), threads), bytes_per_param=14)
    del wb, refb
    # Ours without master weights, gradient scale folded in (what overlap_next_step does).
    wb = torch.zeros(n, dtype=torch.bfloat16)
    slot = HostSlot(param=torch.zeros(1), master=wb, grad=torch.randn(n).to(torch.bfloat16),
                    weight_stage=None)
    opt = torch.optim.AdamW([wb], lr=1e-3, fused=True)
    groups = {id(wb): opt.param_groups[0]}
    for native in (True, False):
        host_update.USE_NATIVE = native
        kernel = native_adam.kernel()
        how = "one pass" if native and kernel is not None and torch.bfloat16 in kernel.dtypes else "torch, 2 passes"
        report(f"offload update bf16 no master, scaled ({how}), {threads} thr",
               _in_thread(lambda: _timed(lambda: host_update.update_slots(opt, groups, [slot], 1e-4),
                                         args.repeats), threads), bytes_per_param=14)
    host_update.USE_NATIVE = True
    del wb, slot, opt
    # Gradient accumulation: bf16 dst += src (6 bytes per element: 2 read + 2 read + 2 written).
    acc, inc = torch.randn(n).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    kernel = native_adam.kernel()
    adds = [("torch", lambda: acc.add_(inc))]
    if kernel is not None and kernel.can_add:
        adds.append(("one pass", lambda: native_adam.add_(acc, inc)))
    for how, fn in adds:
        report(f"accumulate add bf16 ({how}), {threads} thr",
               _in_thread(lambda: _timed(fn, args.repeats), threads), bytes_per_param=6,
               unit="elements")
    del acc, inc
    bw = memory_bandwidth(min(n, 1 << 28), threads, args.repeats)
    print(f"memory bandwidth (fp32 copy, {threads} threads): {bw:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
