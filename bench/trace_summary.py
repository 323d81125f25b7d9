"""Where a profiled step's time goes: a text summary of torch.profiler chrome traces.

For each trace (``*.json`` or ``*.json.gz`` under the given paths, e.g. torchtune's
``output_dir/profiling_outputs`` after ``profiler.enabled=True``): the step's wall time;
per CPU thread, the time spent in the CUDA runtime calls that wait (synchronizes) and the
count of launches and copies; per GPU stream, the time busy with kernels and with copies
each way; and the compute stream's idle time inside the step, with its longest gaps and
what ran on the CPU during them.

    python bench/trace_summary.py /tmp/offload-plugin/stock/full-1b/ours_stock/profiling_outputs
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ",
         "cudaHostAlloc", "cudaFreeHost", "cudaMalloc", "cudaFree")


def _load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(path: Path, gaps: int = 8) -> str:
    events = [e for e in _load(path) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    lo = min((e["ts"] for e in steps), default=min(e["ts"] for e in events))
    hi = max((e["ts"] + e["dur"] for e in steps), default=max(e["ts"] + e["dur"] for e in events))
    inside = [e for e in events if lo <= e["ts"] < hi]
    out = [f"step(s) {', '.join(e['name'] for e in steps) or '(none marked)'}: "
                         f"{(hi - lo) / 1e3:.1f} ms"]

    runtime = collections.defaultdict(lambda: collections.Counter())
    counts = collections.defaultdict(lambda: collections.Counter())
    for e in inside:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            name = e["name"]
            key = next((w.strip() for w in WAITS if name.startswith(w.strip())), None)
            if key:
                runtime[e["tid"]][key] += e["dur"]
            counts[e["tid"]][name] += 1
    out.append("CPU threads (CUDA calls that wait, ms; launches and copies queued):")
    for tid in sorted(counts, key=lambda t: -sum(counts[t].values())):
        waits = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in runtime[tid].most_common()) or "none"
        launches = sum(v for k, v in counts[tid].items() if "Launch" in k)
        copies = sum(v for k, v in counts[tid].items() if k.startswith("cudaMemcpy"))
        out.append(f"  thread {tid}: waits {waits}; {launches} launches, {copies} copies")

    gpu = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in inside:
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kind = cat if cat != "gpu_memcpy" else e["name"].split(" ")[1] if " " in e["name"] else cat
            gpu[e["args"].get("stream", e["tid"])][kind].append((e["ts"], e["ts"] + e["dur"]))
    out.append("GPU streams (busy ms by kind):")
    for stream, kinds in sorted(gpu.items(), key=lambda kv: -sum(_union(v) for v in kv[1].values())):
        out.append(f"  stream {stream}: " + ", ".join(
            f"{k} {_union(v) / 1e3:.1f} ({len(v)})" for k, v in sorted(kinds.items())))
    if gpu:
        compute = max(gpu, key=lambda s: _union(gpu[s].get("kernel", [])))
        spans = sorted(gpu[compute].get("kernel", []))
        holes, end = [], lo
        for a, b in spans:
            if a > end:
                holes.append((a - end, end, a))
            end = max(end, b)
        if hi > end:
            holes.append((hi - end, end, hi))
        idle = sum(h[0] for h in holes)
        out.append(f"compute stream {compute}: idle {idle / 1e3:.1f} ms of {(hi - lo) / 1e3:.1f} "
                   f"in {len(holes)} gaps; longest:")
        cpu_ops = [e for e in inside if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
        for length, a, b in sorted(holes, reverse=True)[:gaps]:
            during = collections.Counter()
            for e in cpu_ops:
                overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
                if overlap > 0 and not e["name"].startswith("ProfilerStep"):
                    during[e["name"][:60]] += overlap
            top = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in during.most_common(4))
            out.append(f"  {length / 1e3:.2f} ms at +{(a - lo) / 1e3:.1f}: {top}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--gaps", type=int, default=8, help="longest compute-stream gaps to show")
    args = p.parse_args()
    for root in args.paths:
        files = [root] if root.is_file() else sorted(
            f for f in root.rglob("*") if f.name.endswith((".json", ".json.gz")))
        if not files:
            print(f"== {root}: no trace (*.json, *.json.gz) there\n", flush=True)
        for f in files:  # (a 1B training step's trace takes a minute or more to read)
            print(f"== {f} ({f.stat().st_size / 2**20:.0f} MiB)", flush=True)
            print(summarize(f, args.gaps) + "\n", flush=True)


if __name__ == "__main__":
    main()
