"""Where the host's time goes in a `bench_train.py --trace` run.

    python bench/investigations/trace_report.py bench/results/train/2026-11-30-x2-s6-llama3_1_8b-full-4096.json

For each traced optimizer of ours: the main thread's marks over the last two steps (host
time, and when the GPU reached them), then the host update jobs grouped by the mark they
started after: how many, how many parameters, and the seconds spent waiting for gradient
copies, updating (with the rate), issuing weight copies, and idle between jobs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def phase_of(start: float, marks: list) -> str:
    """The last main-thread mark at or before ``start``, as "index:name"."""
    name = "before"
    for index, (what, host_s, _) in enumerate(marks):
        if host_s <= start:
            name = f"{index}:{what}"
    return name


def summarize(trace: dict) -> list[dict]:
    """Per phase: job count, elements, and seconds waiting / updating / pushing / idle."""
    phases: dict[str, dict] = {}
    previous_end = None
    for start, landed, updated, pushed, numel, _order in trace["jobs"]:
        row = phases.setdefault(phase_of(start, trace["marks"]),
                                dict(jobs=0, numel=0, wait=0.0, update=0.0, push=0.0, idle=0.0))
        row["jobs"] += 1
        row["numel"] += numel
        row["wait"] += landed - start
        row["update"] += updated - landed
        row["push"] += pushed - updated
        if previous_end is not None:
            row["idle"] += max(0.0, start - previous_end)
        previous_end = pushed
    return [dict(phase=name, **row) for name, row in phases.items()]


def report(path: Path) -> str:
    run = json.loads(path.read_text())
    lines = [f"## {path.name}"]
    for result in run["results"]:
        trace = result.get("trace")
        if not trace or "jobs" not in trace:
            continue
        lines.append(f"### {result['optimizer']}: step {result['step_s']:.3f} s, host busy "
                     f"{result.get('host_busy_s', 0):.3f} s/step, host update alone "
                     f"{result.get('host_update_s') or 0:.3f} s")
        lines.append("| mark | host s | GPU s |\n|---|---|---|")
        for what, host_s, gpu_s in trace["marks"]:
            gpu = "-" if gpu_s is None else f"{gpu_s:.4f}"
            lines.append(f"| {what} | {host_s:.4f} | {gpu} |")
        lines.append("\n| jobs started after | jobs | G params | wait s | update s | G params/s "
                     "| push s | idle s |\n|---|---|---|---|---|---|---|---|")
        for row in summarize(trace):
            rate = row["numel"] / row["update"] / 1e9 if row["update"] > 0 else 0.0
            lines.append(f"| {row['phase']} | {row['jobs']} | {row['numel'] / 1e9:.3f} | "
                         f"{row['wait']:.4f} | {row['update']:.4f} | {rate:.2f} | "
                         f"{row['push']:.4f} | {row['idle']:.4f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="bench_train.py --trace result files")
    for path in p.parse_args(argv).results:
        print(report(path))


if __name__ == "__main__":
    main()
