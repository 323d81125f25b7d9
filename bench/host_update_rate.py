"""How fast the host update runs, next to torch's fused CPU AdamW on plain fp32 tensors.

Times offload_plugin's per-parameter update (bf16 gradient in, fp32 master + moments
updated, bf16 weight out) for several chunk sizes and thread counts, on one parameter of
--numel elements, and prints G params/s and the memory traffic that implies (28 bytes
per parameter when every byte is moved once: bf16 grad read, fp32 master/exp_avg/exp_avg_sq
read and written, bf16 weight written).

    python bench/host_update_rate.py --numel 268435456 [--compiled]
"""

import argparse
import threading
import time

import torch

import offload_plugin.host_update as host_update
from offload_plugin.host_buffers import HostSlot

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


def _adamw_single_pass(p, g_bf16, m, v, out_bf16, lr, beta1, beta2, eps, wd, bc1, bc2_sqrt):
    """AdamW on an fp32 master from a bf16 gradient, writing the bf16 weight: one expression
    graph, so torch.compile can emit a single loop that reads and writes each byte once."""
    g = g_bf16.float()
    p_new = p * (1 - lr * wd)
    m_new = m + (g - m) * (1 - beta1)
    v_new = v * beta2 + g * g * (1 - beta2)
    p_new = p_new - (lr / bc1) * m_new / (v_new.sqrt() / bc2_sqrt + eps)
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)
    out_bf16.copy_(p_new)


def report_compiled(n, threads, repeats, report):
    """Experimental: the single-pass update through torch.compile (needs a C++ compiler).

    Not used by the optimizer yet: its rounding differs from torch's fused kernel by a few
    ulps, so it would be an opt-in mode. Also prints that difference after one step.
    """
    kernel = torch.compile(_adamw_single_pass, dynamic=False)
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    hyper = [torch.tensor(x) for x in (lr, b1, b2, eps, wd, 1 - b1, (1 - b2) ** 0.5)]
    ref_p = p.clone()
    ref_p.grad = g.float()
    ref = torch.optim.AdamW([ref_p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, fused=True)
    t0 = time.perf_counter()
    _in_thread(lambda: kernel(p, g, m, v, out, *hyper), threads)  # step 1, compiles
    print(f"torch.compile of the single-pass update: {time.perf_counter() - t0:.1f} s", flush=True)
    ref.step()
    diff = (p - ref_p).abs().max().item()
    print(f"after one step, max |compiled - torch fused| = {diff:.3g}", flush=True)
    report(f"compiled single pass bf16->fp32 master->bf16, {threads} thr (experimental)",
           _in_thread(lambda: _timed(lambda: kernel(p, g, m, v, out, *hyper), repeats), threads))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 28)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compiled", action="store_true",
                   help="also time the experimental torch.compile single-pass update")
    args = p.parse_args()
    n, cores = args.numel, torch.get_num_threads()
    rows = []

    def report(name, seconds, bytes_per_param=BYTES_PER_PARAM):
        rows.append((name, n / seconds / 1e9, n * bytes_per_param / seconds / 1e9))
        print(f"{name:58s} {rows[-1][1]:6.2f} G params/s  {rows[-1][2]:6.1f} GB/s", flush=True)

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
    groups = {master: opt.param_groups[0]}
    threads = max(1, cores - 1)
    for chunk in (1 << 18, 1 << 20, 1 << 21, 1 << 23, 1 << 25, n):
        host_update.CHUNK_NUMEL = chunk
        report(f"offload update bf16->fp32 master->bf16, chunk {chunk:>11,}, {threads} thr",
               _in_thread(lambda: _timed(lambda: host_update.update_slots(opt, groups, [slot]),
                                         args.repeats), threads))
    del master, slot, opt

    if args.compiled:
        report_compiled(n, threads, args.repeats, report)

    # master_weights=False: everything bf16 (2+2*2+2*2+2*2... = 14 bytes per parameter).
    wb = torch.zeros(n, dtype=torch.bfloat16)
    wb.grad = torch.randn(n).to(torch.bfloat16)
    refb = torch.optim.AdamW([wb], lr=1e-3, fused=True)
    report(f"torch AdamW(fused) bf16 (no master), {threads} threads",
           _in_thread(lambda: _timed(refb.step, args.repeats), threads), bytes_per_param=14)


if __name__ == "__main__":
    main()
