"""How long it takes to page-lock host memory for the GPU, by method (the optimizer's setup).

An 8B model's setup pins ~32 GB (bf16 weights and gradients). This times, per method, a
fresh block of --gib GiB (each on fresh pages):

- ``register``: torch.empty + cudaHostRegister (pages faulted in by the driver, one thread)
- ``fill+register``: torch.empty, a parallel zero_() that faults the pages in on all
  intra-op threads, then cudaHostRegister (what HostArena does)
- ``hugepage+fill+register``: the same after madvise(MADV_HUGEPAGE) on the block
- ``cudaHostAlloc``: torch.empty(pin_memory=True), torch's pinned allocator

    python bench/pinning.py --gib 16 --json out.json
"""

import argparse
import json
import time
from pathlib import Path

import torch

from offload_plugin.host.buffers import _advise_huge_pages


def _register(block):
    err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def _unregister(block):
    torch.cuda.cudart().cudaHostUnregister(block.data_ptr())


def time_method(method, nbytes):
    """Seconds per phase for one fresh block pinned by ``method``."""
    phases = {}
    t0 = time.perf_counter()
    if method == "cudaHostAlloc":
        block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        phases["alloc+pin"] = time.perf_counter() - t0
        del block
        return phases
    block = torch.empty(nbytes, dtype=torch.uint8)
    if method.startswith("hugepage"):
        phases["madvise_ok"] = _advise_huge_pages(block)  # the optimizer's own call
    t1 = time.perf_counter()
    if "fill" in method:
        block.zero_()
        phases["fill"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    _register(block)
    phases["register"] = time.perf_counter() - t2
    phases["total"] = time.perf_counter() - t0
    # A copy to the GPU (up to 1 GiB), to see that the pinned block reaches full speed.
    size = min(1 << 30, nbytes)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    dev.copy_(block[:size], non_blocking=True)
    torch.cuda.synchronize()
    phases["h2d_GBps"] = size / (time.perf_counter() - t3) / 1e9
    _unregister(block)
    return phases


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--methods", default="register,fill+register,hugepage+fill+register,cudaHostAlloc")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.cuda.init()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    out = {"gib": args.gib, "threads": torch.get_num_threads(),
           "thp": thp.read_text().strip() if thp.exists() else None, "results": {}}
    print(f"THP: {out['thp']}; {out['threads']} threads; {args.gib} GiB per block")
    for method in args.methods.split(","):
        phases = time_method(method, int(args.gib * 2**30))
        total = phases.get("total", phases.get("alloc+pin"))
        phases["GBps"] = args.gib * 2**30 / total / 1e9
        out["results"][method] = phases
        print(f"{method:28s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in phases.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
