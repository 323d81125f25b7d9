"""The bus the streamed update is bound by: what a streamed optimizer moves per step, and
the pinned host<->GPU copy bandwidth to set it against.

- :func:`bandwidth`: large pinned host buffers copied host->device and device->host in
  staging-sized pieces (:func:`copies`, the streamed update's own
  pattern), each direction alone and both at once on their own streams; GB/s each way.
- :func:`streamed_bytes`: the bytes one step of ours moves each way, read from the
  optimizer: the streamed engine's state (``opt.engine``: its slots' entries in the inner
  optimizer, and its format's ``state_bytes`` estimate), summed over the per-parameter
  optimizers of a run stepped in backward. Weights and gradients stay on the GPU; the state
  goes in and comes back whole every step.
- :func:`copy_window`: one step under torch.profiler: from the first copy to the last in
  each direction (the window in which the step is bound by the bus, if it is), and the
  time copies ran in it.
- :func:`use`: bytes each way / step time / the bandwidth both ways at once: the share of
  the bus a step used (1.0 where a step is nothing but transfers); with a copy window, the
  same over the window: the share of the bus used while the step transfers.

    python bench/bus.py --gib 4 --json /tmp/bus.json     # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # offload_plugin, installed or not


def copies(numel: int, chunk: int, tries: int = 3, only: tuple = ("h2d", "d2h", "both")) -> dict:
    """Two pinned bf16 host buffers of ``numel`` elements (a model's moments) copied host->device
    and device->host in ``chunk``-element pieces on their own streams, each direction alone and
    both at once: the best of ``tries`` runs of each, seconds and GB/s each way."""
    host = [torch.empty(numel, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
    dev = [torch.empty(chunk, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()

    def run(up: bool, down: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, a in enumerate(range(0, numel, chunk)):
            b = min(numel, a + chunk)
            for k in range(2):
                buf = dev[(2 * i + k) % 4][:b - a]
                if up:
                    with torch.cuda.stream(h2d):
                        buf.copy_(host[k][a:b], non_blocking=True)
                if down:
                    with torch.cuda.stream(d2h):
                        host[k][a:b].copy_(dev[(2 * i + k + 2) % 4][:b - a], non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(True, True)
    nbytes = 2 * numel * 2
    out = {}
    for name, up, down in (("h2d", True, False), ("d2h", False, True), ("both", True, True)):
        if name not in only:
            continue
        s = min(run(up, down) for _ in range(tries))
        out[name] = {"s": round(s, 4), "GB/s each way": round(nbytes / s / 1e9, 1)}
    return out


def bandwidth(gib: float = 4.0, chunk: Optional[int] = None) -> dict:
    """Pinned copy bandwidth on the current CUDA device: ``gib`` GiB each way (two bf16
    host buffers, as a model's two moments) in pieces of ``chunk`` elements (the streamed
    update's staging size by default); the best of three runs of each."""
    from offload_plugin.engines import streamed

    if not torch.cuda.is_available():
        raise RuntimeError("the copy bandwidth is measured on a CUDA device")
    chunk = chunk or streamed.config.stage_numel
    numel = int(gib * 2**30) // 4  # two bf16 buffers: 4 bytes per element each way
    got = copies(numel, chunk)
    both = got["both"]["GB/s each way"]
    return {"device_name": torch.cuda.get_device_name(), "gib_each_way": gib, "chunk_numel": chunk,
            "h2d_GBps": got["h2d"]["GB/s each way"], "d2h_GBps": got["d2h"]["GB/s each way"],
            "both_GBps_each_way": both, "both_GBps_total": round(2 * both, 1), "seconds": got}


def series(gib: float, chunk: Optional[int], count: int) -> list:
    """Both directions at once, ``count`` times, each on newly pinned host buffers (placed
    anew, as each run's optimizer state is): GB/s each way per try. The best-of-three of
    :func:`bandwidth` hides what a single placement gets."""
    from offload_plugin.engines import streamed

    out = []
    for _ in range(count):
        got = copies(int(gib * 2**30) // 4, chunk or streamed.config.stage_numel, tries=1, only=("both",))
        out.append(got["both"]["GB/s each way"])
    return out


def huge_page_gib():
    """GiB of this process's memory in transparent huge pages (/proc/self/smaps_rollup), or
    None off Linux: the optimizer's host state asks for them (host_buffers), and whether it
    got them decides how many pages each copy to or from the GPU walks."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def state_like(gib: float, blocks: int, count: int, method: str = "ours", chunk_bytes: int = 1 << 24) -> list:
    """Both directions at once over ``gib`` GiB of pinned host memory in ``blocks`` blocks,
    ``count`` times on new blocks: per try the GB/s each way and the process's huge-page GiB.
    ``method``: "ours", pinned as the optimizer pins its state (host_buffers.page_locked_block:
    a block advised to use huge pages, faulted in, then cudaHostRegister); "register", the
    same without the advice; "alloc", torch's pinned allocator (cudaHostAlloc, as
    :func:`bandwidth`'s buffers).
    Each process places its state anew: whether some placements copy slower is what this
    asks."""
    import time

    from offload_plugin.host import buffers as host_buffers

    out = []
    per = int(gib * 2**30) // blocks
    dev = [torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda") for _ in range(4)]
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(count):
        if method == "ours":
            host = [host_buffers.page_locked_block(per, torch.uint8, pin=True) for _ in range(blocks)]
        elif method == "register":
            host = [torch.empty(per, dtype=torch.uint8) for _ in range(blocks)]
            for b in host:
                host_buffers._pin(b)
        else:
            host = [torch.empty(per, dtype=torch.uint8, pin_memory=True) for _ in range(blocks)]
        pinned = all(b.is_pinned() for b in host)

        def run() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k, (b, a) in enumerate((b, a) for b in host for a in range(0, per, chunk_bytes)):
                n = min(per, a + chunk_bytes) - a
                with torch.cuda.stream(h2d):  # (contents do not matter: only the time)
                    dev[k % 2][:n].copy_(b[a:a + n], non_blocking=True)
                with torch.cuda.stream(d2h):
                    b[a:a + n].copy_(dev[2 + k % 2][:n], non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        run()
        seconds = run()
        out.append({"method": method, "GBps_each_way": round(per * blocks / seconds / 1e9, 1), "pinned": pinned,
                    "huge_page_gib": huge_page_gib()})
        del host  # (run's cell too: unpinned and freed before the next try's blocks)
    return out


def streamed_bytes(opt) -> Optional[dict]:
    """What one step of ``opt`` (ours, or bench_train's in-backward wrapper over ours) moves
    over the bus each way, or None where nothing of it is streamed (another optimizer, or
    ours on its host update). ``state_bytes_held``: every state tensor but the step count
    (what the stage copies in and back); ``state_bytes_format``: the format's estimate
    (``state_bytes(param)`` x numel)."""
    opts = list(opt.optimizers.values()) if hasattr(opt, "optimizers") else [opt]
    held = estimate = numel = streaming = hosted = 0
    kinds = set()
    for one in opts:
        engine = getattr(one, "engine", None)
        if engine is None:
            return None  # not ours
        if not engine.streams:
            hosted += 1
            continue
        streaming += 1
        kinds.add(engine.format.name or type(engine.format).__module__)
        for slot in engine.slots:
            n = slot.param.numel()
            numel += n
            estimate += engine.format.state_bytes(slot.param) * n
            entry = engine.inner.state.get(slot.master, {})
            held += sum(t.numel() * t.element_size() for k, t in entry.items()
                        if isinstance(t, torch.Tensor) and k != "step")
    if not streaming:
        return None
    each_way = held or estimate  # (before the first step the state may not exist yet)
    return {"bytes_h2d_per_step": each_way, "bytes_d2h_per_step": each_way,
            "state_bytes_held": held, "state_bytes_format": estimate, "streamed_numel": numel,
            "streamed_optimizers": streaming, "host_update_optimizers": hosted,
            "state_formats": sorted(kinds)}


def spans(intervals: list) -> dict:
    """(start, end) pairs in microseconds -> the window from the first start to the last
    end and the time at least one of them ran, in seconds."""
    if not intervals:
        return {}
    busy, reach = 0.0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            busy, reach = busy + (b - a), b
        elif b > reach:
            busy, reach = busy + (b - reach), b
    return {"window_s": (max(b for _, b in intervals) - min(a for a, _ in intervals)) / 1e6,
            "busy_s": busy / 1e6, "copies": len(intervals)}


def copy_window(step) -> dict:
    """``step()`` (one training step, synchronized) under torch.profiler: per direction the
    window from the first host<->device copy to the last and the time copies ran in it, and
    the same for the GPU's kernels (``kernel_*``: the time at least one kernel ran)."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
    out = {"profiled_step_s": time.perf_counter() - t0}
    out.update(device_spans(e for e in prof.events() if e.device_type == DeviceType.CUDA))
    return out


def device_spans(events) -> dict:
    """A profiled step's CUDA events -> :func:`spans` of its host->device copies (``h2d_*``),
    device->host copies (``d2h_*``) and kernels (``kernel_*``; other copies and memsets
    are none of these)."""
    found: dict = {"h2d": [], "d2h": [], "kernel": []}
    for e in events:
        if "HtoD" in e.name or "DtoH" in e.name:
            found["h2d" if "HtoD" in e.name else "d2h"].append((e.time_range.start, e.time_range.end))
        elif "Memcpy" not in e.name and "Memset" not in e.name:
            found["kernel"].append((e.time_range.start, e.time_range.end))
    out = {}
    for kind, intervals in found.items():
        names = {"copies": "launches"} if kind == "kernel" else {}
        out.update({f"{kind}_{names.get(k, k)}": v for k, v in spans(intervals).items()})
    return out


def use(result: dict, bus: Optional[dict]) -> dict:
    """The bus columns of one result: the transfers' floor (bytes each way over the
    bandwidth both ways at once), the share of the bus the step used, and with a copy
    window (:func:`copy_window`) the share used within it, each way."""
    each_way = result.get("bytes_h2d_per_step")
    gbps = (bus or {}).get("both_GBps_each_way")
    if not each_way or not gbps or not result.get("step_s"):
        return {}
    floor = max(each_way, result.get("bytes_d2h_per_step") or 0) / (gbps * 1e9)
    out = {"bus_floor_s": floor, "bus_use": floor / result["step_s"]}
    for kind in ("h2d", "d2h"):
        window, nbytes = result.get(f"{kind}_window_s"), result.get(f"bytes_{kind}_per_step")
        if window and nbytes:
            out[f"bus_use_{kind}_window"] = nbytes / window / (gbps * 1e9)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0, help="GiB copied each way per run")
    p.add_argument("--chunk", type=int, default=None, help="elements per copy (default: the staging size)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--series", type=int, default=0,
                   help="then this many single tries both ways at once, each on newly pinned buffers")
    p.add_argument("--state-like", default="",
                   help="GIB,BLOCKS,TRIES: then both ways at once over GIB GiB of pinned memory in BLOCKS blocks, "
                        "TRIES times on new blocks, per --pinning method (e.g. 15,580,3 for 8B's AdamW8bit state)")
    p.add_argument("--pinning", default="ours",
                   help="comma-separated methods for --state-like: ours (as the optimizer's state), register "
                        "(without the huge-page advice), alloc (cudaHostAlloc)")
    args = p.parse_args()
    got = bandwidth(args.gib, args.chunk)
    if args.series:
        got["series_both_GBps_each_way"] = series(args.gib, args.chunk, args.series)
        print("single tries on new buffers, both at once, GB/s each way:", got["series_both_GBps_each_way"])
    if args.state_like:
        gib, blocks, tries = args.state_like.split(",")
        got["state_like"] = []
        for method in args.pinning.split(","):
            got["state_like"] += state_like(float(gib), int(blocks), int(tries), method)
            print(f"{gib} GiB in {blocks} blocks pinned by {method}, both at once:", got["state_like"][-int(tries):],
                  flush=True)
    print(f"pinned copies, {args.gib} GiB each way in pieces of {got['chunk_numel']:,} elements: "
          f"h2d {got['h2d_GBps']} GB/s, d2h {got['d2h_GBps']} GB/s, both at once "
          f"{got['both_GBps_each_way']} GB/s each way ({got['both_GBps_total']} GB/s in all)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
