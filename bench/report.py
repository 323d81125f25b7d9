"""Turn every JSON under bench/results/ (a folder per table, read with its subfolders) into
markdown: bench_train.py's and bench_fsdp2.py's runs, then the runs of one table (bench_train.py
--label) side by side as the results page shows them, bench_stock.py's (torchtune's stock
recipes), qlora_ab.py's, bench_hf.py's (HF's Trainer) and what_fits.py's.

    python bench/report.py                # prints markdown for the README
    python bench/report.py --results DIR  # another folder (read with its subfolders)
    python bench/report.py --results bench/results/stock  # one table's folder
    python bench/report.py --only '*-issue42.json'  # the files whose names match, in any folder
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fsdp2  # noqa: E402
import bench_hf  # noqa: E402
import bench_stock  # noqa: E402
import bus  # noqa: E402
import what_fits  # noqa: E402
from bench_train import bus_line, describe, markdown_table, reference_line, window_use  # noqa: E402

ORDER = {"tiny": 0, "llama3_2_1b": 1, "llama3_1_8b": 2}


def sort_key(run):
    a = run["args"]
    model = "tiny" if a["tiny"] else a["model"]
    # FSDP2 runs ("kind": "fsdp2", no --job) after the single-GPU ones of their model.
    return (ORDER.get(model, 9), a.get("job", "full"), run.get("kind", ""), a["tokens_per_step"],
            a["grad_accum"], run["date"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--only", default="*.json", help="a file name pattern (default every JSON)")
    args = parser.parse_args()
    # Every folder below --results (a folder per table); files in name (date) order, named without their folder.
    saved = {p.name: json.loads(p.read_text()) for p in sorted(args.results.rglob(args.only), key=lambda p: p.name)}
    # bench_train.py's and bench_fsdp2.py's training runs (not bench/pinning.py's, nor bench_hf.py's)
    runs = [dict(run, _file=name) for name, run in saved.items() if "args" in run and run.get("kind") != "hf"]
    print("## Benchmarks\n")
    print("Random-init torchtune models in bf16, random tokens, torchtune's chunked "
          "cross-entropy; step time is the synchronized mean after warm-up steps, peak GPU "
          "memory is `torch.cuda.max_memory_allocated`, host RSS is the process peak. "
          "Produced by `bench/bench_train.py`; the FSDP2 tables by `bench/bench_fsdp2.py` "
          "(peak GPU memory of the fullest rank, host memory summed over ranks).\n")
    if not runs:
        print(f"(no results in {args.results})")
    for run in sorted(runs, key=sort_key):
        v = run["versions"]
        fsdp2 = run.get("kind") == "fsdp2"
        print(f"### {(bench_fsdp2.describe if fsdp2 else describe)(run)}\n")
        print((bench_fsdp2.markdown_table(run["results"]) if fsdp2
               else markdown_table(run["results"], base_name=run.get("base"))) + "\n")
        ref = run.get("cpu_adamw_reference")
        if ref:
            print(reference_line(ref, run.get("trainable_params", ref["numel"])) + "\n")
        notes = [f"{r['optimizer']}: {n}" for r in run["results"] for n in r.get("notes", [])]
        if notes:
            print("Notes: " + "; ".join(notes) + "\n")
        print(f"<sub>torch {v.get('torch')}, torchtune {v.get('torchtune')}, torchao "
              f"{v.get('torchao')}, bitsandbytes {v.get('bitsandbytes', '-')}; "
              f"commit {(run.get('git_commit') or '?')[:10]}"
              + (f" ({run['code_note']})" if run.get("code_note") else "")
              + (f"; {run['machine']}" if run.get("machine") else "") + "</sub>\n")
    print_labelled_tables(runs)
    print_stock_runs(saved)
    print_hf_runs(saved)
    print_fits(saved)


# bench_train.py's entry -> how a results table names it
NAMES = {"gpu_adamw_in_bwd": "torch AdamW (fused), GPU", "gpu_adamw": "torch AdamW (fused), GPU",
         "offload_in_bwd": "ours, default options (exact)", "offload_default": "ours, default options, step after backward",
         "adamw8bit_in_bwd": "ours, `AdamW8bit`", "adamw8bit": "ours, `AdamW8bit`, step after backward",
         "compact_in_bwd": "ours, `CompactAdamW`"}


def labelled_table(group: list) -> str:
    """The runs of one --label (each a number of tokens per step) in one table: tokens/s
    against the base of its own invocation, the target, and the bus columns."""
    lines = ["| tokens per step | run | GPU cap | tokens/s | vs GPU AdamW | target | peak GPU GiB | step s | "
             "H2D GB/step | D2H GB/step | bus floor s | bus use | copy window s | bus use while copying (h2d / d2h) |",
             "|" + "---|" * 14]
    for run in sorted(group, key=lambda r: r["args"]["tokens_per_step"]):
        base = next((r for r in run["results"] if r["optimizer"] == run.get("base") and r.get("tokens_per_s")), {})
        first = True
        for r in run["results"]:
            tokens = f"{run['args']['tokens_per_step']:,}" if first else ""
            first = False
            name = NAMES.get(r["optimizer"], r["optimizer"])
            if not r.get("tokens_per_s"):
                why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r.get('error')}"
                lines.append(f"| {tokens} | {name} | {why[:200]} |" + " |" * 11)
                continue
            cap = r.get("gpu_memory_limit_gib")
            ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else None
            target = r.get("target_vs_base")
            met = "" if target is None or ratio is None else (" (met)" if ratio >= target else " (**not met**)")
            use = dict(r, **bus.use(r, run.get("bus")))
            gb = lambda k: f"{use[k] / 1e9:.2f}" if use.get(k) else "-"  # noqa: E731
            cells = [tokens, name, "none" if cap is None else f"{cap:g} GiB", f"{r['tokens_per_s']:,.0f}",
                     "-" if ratio is None else f"{ratio:.2f}x", "-" if target is None else f">= {target:.2f}x{met}",
                     f"{r['peak_gpu_gib']:.1f}" if r.get("peak_gpu_gib") is not None else "-", f"{r['step_s']:.3f}",
                     gb("bytes_h2d_per_step"), gb("bytes_d2h_per_step"),
                     f"{use['bus_floor_s']:.3f}" if use.get("bus_floor_s") else "-",
                     f"{100 * use['bus_use']:.0f}%" if use.get("bus_use") else "-",
                     f"{use['h2d_window_s']:.3f}" if use.get("h2d_window_s") else "-", window_use(use)]
            lines.append("| " + " | ".join(cells) + " |")
    bandwidth = next((run["bus"] for run in group if run.get("bus")), None)
    if bandwidth:
        lines += ["", bus_line(bandwidth)]
    return "\n".join(lines)


def print_labelled_tables(runs: list) -> None:
    """bench_train.py runs that share a --label (and a date): one table each."""
    groups: dict = {}
    for run in runs:
        label = run["args"].get("label")
        if label:
            groups.setdefault((label, run["date"]), []).append(run)
    for (label, date), group in sorted(groups.items()):
        a = group[0]["args"]
        tokens = " and ".join(f"{r['args']['tokens_per_step']:,}" for r in sorted(
            group, key=lambda r: r["args"]["tokens_per_step"]))
        print(f"### {label}: {'tiny' if a['tiny'] else a['model']} {a['job']}, {tokens} tokens per step, seq "
              f"{a['seq_len']}{', activation checkpointing' if a['activation_checkpointing'] else ''}"
              f" ({group[0].get('gpu') or a['device']}, {date})\n")
        print(labelled_table(group) + "\n")
        print("Files: " + ", ".join(f"`{r['_file']}`" for r in group) + "\n")


def print_kind(saved: dict, kind: str, heading: str, intro: str, section) -> None:
    """One table per file of the runs whose ``kind`` is ``kind``: ``section(name, run)``
    gives each one's title and table."""
    runs = {name: run for name, run in saved.items() if isinstance(run, dict) and run.get("kind") == kind}
    if not runs:
        return
    print(f"## {heading}\n")
    print(intro + "\n")
    for name, run in runs.items():
        title, table = section(name, run)
        print(f"### {title}\n")
        print(table + "\n")


def print_hf_runs(saved: dict) -> None:
    """bench_hf.py's tables, one per file."""
    print_kind(saved, "hf", "Hugging Face's Trainer",
               "Produced by `bench/bench_hf.py`: a random-init Llama under `transformers.Trainer` with "
               "gradient checkpointing, HF's own optimizers against ours, each in a process of its own.",
               lambda name, run: (f"{name}: {run['args']['model']}, {run['args']['tokens_per_step']} tokens per "
                                  f"step, max_grad_norm {run['args']['max_grad_norm']}",
                                  bench_hf.table(run["results"], run["args"]["base"])))


def print_fits(saved: dict) -> None:
    """what_fits.py's tables, one per file."""
    print_kind(saved, "fits", "What fits where",
               "Produced by `bench/what_fits.py`: per GPU cap and mode, the largest torchtune model (random "
               "init, bf16) that trains under the cap with its host peak RSS within the host budget.",
               lambda name, run: (f"{name}: {what_fits.describe(run)}", what_fits.markdown(run)))


def print_stock_runs(saved: dict) -> None:
    """bench_stock.py's tables (one per file, in name order) and qlora_ab.py's ratios."""
    print("## torchtune's stock recipes\n")
    print("Produced by `bench/bench_stock.py`: torchtune's recipes run by `tune run` with "
          "random-init checkpoints and local data; tokens/s is the recipe's own, averaged "
          "after the warmup steps over the repeats; the per-step ratio pairs each step with "
          "the baseline's same step.\n")
    for name, saved_run in saved.items():
        if not isinstance(saved_run, dict) or saved_run.get("kind") != "stock":
            continue
        settings, results = saved_run["settings"], saved_run["results"]
        base = bench_stock.baseline(settings["job"], results)
        if all("repeats" in r for r in results.values()):
            bench_stock.summarize(results, base, int(settings.get("warmup", 2)))
        cap = f", GPU capped at {settings['gpu_gib']} GiB" if settings.get("gpu_gib") not in (None, "None") else ""
        print(f"### {name}: {settings['job']}, {settings['model']}, {settings['steps']} steps, "
              f"warmup {settings['warmup']}, repeats {settings.get('repeats', 1)}{cap}\n")
        print(bench_stock.markdown_table(results, base) + "\n")
    turns = {name: r for name, r in saved.items() if "blocks" in r and "ours" in r}
    if turns:
        print("## 1B QLoRA, both optimizers taking turns in one process\n")
        print("Produced by `bench/qlora_ab.py`: mean step of each, and ours' speed against "
              "torch's fused AdamW on the GPU.\n")
        print("| file | turns | torch AdamW, mean step ms | ours, mean step ms | ours vs torch (speed) |")
        print("|---|---|---|---|---|")
        for name, r in turns.items():
            print(f"| {name} | {len(r['ours']['turn_time_ratios'])} | {r['torch_adamw']['mean_step_s'] * 1e3:.1f} | "
                  f"{r['ours']['mean_step_s'] * 1e3:.1f} | {r['ours']['speed_vs_torch_adamw']:.3f}x |")
        print()


if __name__ == "__main__":
    main()
