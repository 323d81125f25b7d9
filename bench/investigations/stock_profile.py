"""Where a step of torchtune's stock recipe goes, from torch.profiler's trace: runs
``bench/bench_stock.py``'s runs (same checkpoint, data and overrides) with the recipe's own
profiler switched on, and prints per profiled step its wall time, the training thread's time
in our optimizer's step/zero_grad and in torchtune's backward, and per GPU stream the busy
time and the span of its work.

    # on the GPU machine, after bench/bench_stock.py made the checkpoint and data
    python bench/investigations/stock_profile.py --runs ours_stock,ours_stock_no_in_bwd
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: bench_stock.py
import bench_stock  # noqa: E402


def summarize(trace_file: str) -> list[dict]:
    opener = gzip.open if trace_file.endswith(".gz") else open
    with opener(trace_file, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = []
    for s in steps:
        a, b = s["ts"], s["ts"] + s["dur"]
        cpu = defaultdict(float)
        count = defaultdict(int)
        for e in events:
            if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and a <= e["ts"] < b:
                for key in ("Optimizer.step", "Optimizer.zero_grad", "autograd::engine::evaluate_function",
                            "cudaStreamSynchronize", "cudaEventSynchronize", "aten::item", "aten::_local_scalar_dense"):
                    if e["name"].startswith(key):
                        cpu[key] += e["dur"] / 1e3
                        count[key] += 1
        streams = defaultdict(lambda: [0.0, None, None, 0])
        for e in gpu:
            if a <= e["ts"] < b + 500_000:  # (GPU work of this step may end after its CPU span)
                st = streams[e.get("args", {}).get("stream", e.get("tid"))]
                st[0] += e["dur"] / 1e3
                st[1] = (e["ts"] - a) / 1e3 if st[1] is None else min(st[1], (e["ts"] - a) / 1e3)
                st[2] = (e["ts"] + e["dur"] - a) / 1e3 if st[2] is None else max(st[2], (e["ts"] + e["dur"] - a) / 1e3)
                st[3] += 1
        out.append({"step": s["name"], "wall_ms": round(s["dur"] / 1e3, 2),
                    "cpu_ms": {k: [round(v, 2), count[k]] for k, v in cpu.items()},
                    "streams(busy_ms,first_ms,last_ms,n)": {str(k): [round(v[0], 2), round(v[1], 2), round(v[2], 2), v[3]]
                                                             for k, v in streams.items()}})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="ours_stock,ours_stock_no_in_bwd")
    p.add_argument("--job", default="full")
    p.add_argument("--model", default="1b")
    p.add_argument("--work", type=Path, default=Path("/tmp/offload-plugin/stock"))
    args = p.parse_args()
    ns = argparse.Namespace(job=args.job, model=args.model, work=args.work, steps=9, batch_size=4, seq_len=1024,
                            checkpoint=args.work / f"random-{args.model}")
    for name in args.runs.split(","):
        prof_dir = bench_stock.run_dir(ns, name) / "profile"
        cmd = bench_stock.command(ns, name) + [
            "profiler.enabled=True", f"profiler.output_dir={prof_dir}", "profiler.cpu=True", "profiler.cuda=True",
            "profiler.record_shapes=False", "profiler.with_stack=False", "profiler.profile_memory=False",
            "profiler.wait_steps=4", "profiler.warmup_steps=2", "profiler.active_steps=2", "profiler.num_cycles=1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=bench_stock.REPO, timeout=600,
                              env=dict(os.environ, **bench_stock.RUN_ENV.get(name, {})))
        traces = glob.glob(f"{prof_dir}/**/*.json*", recursive=True)
        print(f"== {name}: rc {proc.returncode}, traces {traces}", flush=True)
        if proc.returncode or not traces:
            print((proc.stdout + proc.stderr)[-2000:])
            continue
        for row in summarize(sorted(traces)[-1]):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
