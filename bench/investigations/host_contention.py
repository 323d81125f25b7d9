"""What slows the host update down while a training step runs beside it (GPU machine).

During an overlapped step the host worker updated 8B parameters at ~2/3 of the rate it
reaches alone. This times the same work, the no-master bf16 update (what the 8B runs use)
plus its finiteness check, on a worker thread, alone and next to each thing training adds:

- ``dma``: gradient and weight copies in both directions at full PCIe rate (pinned
  buffers, two streams), as offload_gradients does during backward;
- ``launcher``: a Python thread launching small GPU kernels and syncing now and then,
  as the training loop does (it holds the GIL between launches and spins in syncs);
- ``python``: a thread running pure Python (never releases the GIL by itself);

for several worker thread counts. Prints G params/s per case.

    python bench/investigations/host_contention.py --numel 268435456 --threads 15,14,12
"""

import argparse
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # host_update_rate.py
from host_update_rate import _in_thread, _timed  # noqa: E402
from offload_plugin.formats.adamw import native as native_adam  # noqa: E402
from offload_plugin.host.grad_checks import all_finite  # noqa: E402


def _on_worker(fn, threads):
    """Seconds for one call of fn (after one warm-up call) on a fresh thread with its own
    intra-op thread count, as the host worker runs."""
    return _in_thread(lambda: _timed(fn, 1), threads)


def _update_pass(kernel, tensors, threads, check):
    for weight, grad, m, v in tensors:
        if check and not all_finite([grad]):
            raise RuntimeError("unexpected non-finite gradient")
        kernel.step(weight, grad, m, v, None, lr=1e-5, beta1=0.9, beta2=0.999, weight_decay=0.01,
                    eps=1e-8, step=2.0, adamw=True, maximize=False, grad_scale=1e-4,
                    num_threads=threads)


class Load:
    """A background activity that runs until stopped."""

    def __init__(self, kind: str, chunk_bytes: int = 1 << 30):
        self.kind, self.stop, self.count = kind, threading.Event(), 0
        if kind == "dma":
            self.host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.dev = [torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
            self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        elif kind == "launcher":
            self.x = torch.randn(256, 256, device="cuda")
        self.thread = threading.Thread(target=getattr(self, "_" + kind), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def _dma(self):
        d2h, h2d = self.streams
        while not self.stop.is_set():
            with torch.cuda.stream(d2h):
                self.host[0].copy_(self.dev[0], non_blocking=True)
            with torch.cuda.stream(h2d):
                self.dev[1].copy_(self.host[1], non_blocking=True)
            d2h.synchronize()
            h2d.synchronize()
            self.count += 2

    def _launcher(self):
        y = self.x
        while not self.stop.is_set():
            for _ in range(50):
                y = torch.tanh(y @ self.x)
            torch.cuda.synchronize()
            self.count += 50

    def _python(self):
        while not self.stop.is_set():
            sum(i * i for i in range(1000))
            self.count += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 28, help="elements in all, split in 16 tensors")
    p.add_argument("--threads", default="15,14,12")
    args = p.parse_args()
    kernel = native_adam.kernel()
    if kernel is None or torch.bfloat16 not in kernel.dtypes:
        raise SystemExit(f"native bf16 kernel not available: {native_adam._state.get('reason')}")
    per = args.numel // 16 // 64 * 64
    tensors = [tuple(torch.randn(per).to(torch.bfloat16) for _ in range(4)) for _ in range(16)]
    n = per * 16
    check = torch.cat([t[1] for t in tensors[:4]])
    print(f"{n} params in 16 tensors; bf16 no-master update (14 B/param) + finiteness check")
    for threads in [int(t) for t in args.threads.split(",")]:
        s = _on_worker(lambda: all_finite([check]), threads)
        print(f"  check alone, {threads} thr: {check.numel() / s / 1e9:6.2f} G elem/s")
        s = _on_worker(lambda: _update_pass(kernel, tensors, threads, False), threads)
        print(f"  update alone (no check), {threads} thr: {n / s / 1e9:6.2f} G params/s")
        for loads in ([], ["dma"], ["launcher"], ["python"], ["dma", "launcher"]):
            if loads and not torch.cuda.is_available() and loads != ["python"]:
                continue
            ctx = [Load(k) for k in loads]
            for c in ctx:
                c.__enter__()
            try:
                s = _on_worker(lambda: _update_pass(kernel, tensors, threads, True), threads)
            finally:
                for c in ctx:
                    c.__exit__()
            done = ", ".join(f"{c.kind} {c.count}" for c in ctx)
            print(f"  update+check, {threads} thr, with {'+'.join(loads) or 'nothing'}: "
                  f"{n / s / 1e9:6.2f} G params/s ({done})", flush=True)


if __name__ == "__main__":
    main()
