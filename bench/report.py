"""Turn every bench/results/*.json into markdown: bench_train.py's and bench_fsdp2.py's runs,
then bench_stock.py's (torchtune's stock recipes) and qlora_ab.py's.

    python bench/report.py                # prints markdown for the README
    python bench/report.py --results DIR  # another folder
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fsdp2  # noqa: E402
import bench_stock  # noqa: E402
from bench_train import describe, markdown_table, reference_line  # noqa: E402

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
    args = parser.parse_args()
    saved = {p.name: json.loads(p.read_text()) for p in sorted(args.results.glob("*.json"))}
    runs = [run for run in saved.values() if "args" in run]  # training runs (not bench/pinning.py's)
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
        print((bench_fsdp2.markdown_table if fsdp2 else markdown_table)(run["results"]) + "\n")
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
    print_stock_runs(saved)


def print_stock_runs(saved: dict) -> None:
    """bench_stock.py's tables (one per file, in name order) and qlora_ab.py's ratios."""
    print("## torchtune's stock recipes\n")
    print("Produced by `bench/bench_stock.py`: torchtune's recipes run by `tune run` with "
          "random-init checkpoints and local data; tokens/s is the recipe's own, averaged "
          "after the warmup steps over the repeats; the per-step ratio pairs each step with "
          "the baseline's same step.\n")
    for name, saved_run in saved.items():
        if saved_run.get("kind") != "stock":
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
