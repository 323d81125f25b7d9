"""Host update rate of the compact AdamW state against the exact one and bitsandbytes'.

On one parameter of --numel elements, at the same thread count, times in alternating rounds
(so that a host whose speed drifts slows each alike):

* the exact one-pass update (offload_plugin.formats.adamw.native: bf16 gradient, fp32 master and
  moments, bf16 weight out): 28 bytes per parameter (2 grad + 3 x 8 read and written
  + 2 weight streamed out);
* the compact update (offload_plugin.formats.compact.native: bf16 weight + int16 remainder,
  8-bit moments): 14 bytes per parameter (2 grad + 2 x 4 read and written for weight and
  remainder + 2 x 2 for the codes; the absmax add 1/16 byte), and without the remainder
  (no master), 10 bytes;
* bitsandbytes' AdamW8bit on its CPU backend (bf16 parameter, 8-bit moments: 10 bytes of
  state it must touch; it makes several passes), on --bnb-numel elements (it is slow);

and prints G params/s, the GB/s each one's bytes per parameter imply, the ratio to the
exact update, and the host's bandwidth measured two ways: torch's fp32 copy (the figure
bench/formats/host_update_rate.py prints) and native_adam.add_ on bf16 (one read-modify-write
stream plus one read stream, as the updates are).

    python bench/formats/compact_update_rate.py --numel 268435456            # the GPU host
    python bench/formats/compact_update_rate.py --numel 16777216 --repeats 3  # a laptop
"""

import argparse
import statistics
import time

import torch

from offload_plugin.formats.adamw import native as native_adam
from offload_plugin.formats.compact import native as compact_adam
from host_update_rate import _in_thread, _timed  # the same timing as the exact update's bench


def _grad(n):
    return (torch.randn(n) * 1e-3).to(torch.bfloat16)


def exact_step(n, threads):
    """One exact update of n elements, as a function (None without the native kernel)."""
    k = native_adam.kernel()
    if k is None or torch.float32 not in k.dtypes:
        return None
    master, m, v = torch.randn(n) * 0.02, torch.zeros(n), torch.zeros(n)
    grad, out = _grad(n), torch.empty(n, dtype=torch.bfloat16)
    count = [0]

    def step():
        count[0] += 1
        k.step(master, grad, m, v, out, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01,
               eps=1e-8, step=float(count[0]), adamw=True, maximize=False, grad_scale=None,
               num_threads=threads)

    return step


def compact_step(n, threads, master_weights, native=True):
    state = compact_adam.CompactAdamState.zeros((torch.randn(n) * 0.02).to(torch.bfloat16),
                                                master_weights=master_weights)
    grad = _grad(n)
    return lambda: compact_adam.step_(state, grad, lr=1e-4, weight_decay=0.01,
                                      num_threads=threads, native=native)


def alternating_rounds(steps, threads, repeats, rounds):
    """Seconds per call of each step function, timed in turn within each round (the order
    reversed every other round), so that a host whose speed drifts slows all alike:
    {name: [seconds per call, one per round]}."""
    def run():
        for step in steps.values():
            step()  # first touch of the state pages
        times = {name: [] for name in steps}
        for r in range(rounds):
            for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
                t0 = time.perf_counter()
                for _ in range(repeats):
                    steps[name]()
                times[name].append((time.perf_counter() - t0) / repeats)
        return times
    return _in_thread(run, threads)


def _print_row(label, rate, nbytes=None, note=""):
    """One line of the table: G params/s (and GB/s at nbytes per parameter), or unavailable."""
    if rate is None:
        print(f"{label:46s}   unavailable", flush=True)
        return
    gbs = f" {rate * nbytes / 1e9:7.1f} GB/s" if nbytes else ""
    print(f"{label:46s} {rate / 1e9:7.3f} G params/s{gbs} {note}", flush=True)


def bnb_update(n, threads, repeats):
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    p = torch.nn.Parameter((torch.randn(n) * 0.02).to(torch.bfloat16))
    p.grad = _grad(n)
    opt = bnb.optim.AdamW8bit([p], lr=1e-4, weight_decay=0.01)
    return _in_thread(lambda: _timed(opt.step, repeats), threads)


def bandwidth(n, threads, repeats):
    a, b = torch.randn(n), torch.empty(n)
    copy = 8 * n / _in_thread(lambda: _timed(lambda: b.copy_(a), repeats), threads) / 1e9
    add = None
    k = native_adam.kernel()
    if k is not None and k.can_add:
        x, y = torch.randn(2 * n).to(torch.bfloat16), torch.randn(2 * n).to(torch.bfloat16)
        add = 6 * 2 * n / _in_thread(lambda: _timed(lambda: k.add_(x, y, threads), repeats), threads) / 1e9
    return copy, add


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 26)
    p.add_argument("--bnb-numel", type=int, default=1 << 22)
    p.add_argument("--repeats", type=int, default=5, help="calls per timing")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the three updates")
    p.add_argument("--threads", type=int, nargs="*",
                   help="thread counts (default: all cores, and all but one)")
    p.add_argument("--reference", action="store_true",
                   help="also time compact_adam's pure-torch reference (the no-compiler fallback)")
    args = p.parse_args()
    n, cores = args.numel, torch.get_num_threads()
    thread_counts = args.threads or sorted({max(1, cores - 1), cores})
    kc = compact_adam.kernel()
    print(f"numel {n}, bnb numel {args.bnb_numel}, {cores} cores; compact kernel "
          f"{'native' if kc else 'unavailable: ' + str(compact_adam._state.get('reason'))}", flush=True)
    for threads in thread_counts:
        print(f"== {threads} threads, {args.rounds} alternating rounds of {args.repeats} calls "
              "(median seconds per call; ratios: median of the rounds' ratios)", flush=True)
        steps = {"exact": exact_step(n, threads),
                 "compact": compact_step(n, threads, True),
                 "compact, no master": compact_step(n, threads, False)}
        steps = {name: step for name, step in steps.items() if step is not None}
        times = alternating_rounds(steps, threads, args.repeats, args.rounds)
        rows = [("exact one pass (fp32 master)", "exact", 28, n),
                ("compact (bf16 + remainder, 8-bit moments)", "compact", 14, n),
                ("compact, no master (bf16, 8-bit moments)", "compact, no master", 10, n)]
        for label, name, nbytes, numel in rows:
            if name not in times:
                _print_row(label, None)
                continue
            note = ""
            if "exact" in times:
                ratios = sorted(e / c for e, c in zip(times["exact"], times[name]))
                note = f"{statistics.median(ratios):5.2f}x exact (rounds {ratios[0]:.2f}-{ratios[-1]:.2f})"
            _print_row(label, numel / statistics.median(times[name]), nbytes, note)
        compact_rate = n / statistics.median(times["compact"])
        if args.reference:
            m = min(n, 1 << 22)
            s_ref = _in_thread(lambda: _timed(compact_step(m, threads, True, native=False), 1), threads)
            _print_row("compact torch reference", m / s_ref, 14)
        bnb_n = min(n, args.bnb_numel)
        bnb = bnb_update(bnb_n, threads, 1)
        bnb_rate = None if bnb is None else bnb_n / bnb
        _print_row("bitsandbytes AdamW8bit (CPU backend)", bnb_rate, 10,
                   f" compact is {compact_rate / bnb_rate:6.1f}x" if bnb_rate else "")
        copy, add = bandwidth(min(n, 1 << 27), threads, args.repeats)
        add_txt = f", bf16 add (native_adam.add_) {add:.1f} GB/s" if add else ""
        print(f"memory bandwidth: fp32 copy {copy:.1f} GB/s{add_txt}", flush=True)


if __name__ == "__main__":
    main()
