"""torchtune's stock recipes and configs as users run them, with each optimizer they might pick.

Every run is ``tune run <recipe> --config <torchtune's own config>`` on a random-init
checkpoint (``bench/random_checkpoint.py``) and local alpaca data
(``python -m offload_plugin.demo prepare``), with only the optimizer overridden, plus our
recipe with our config as shipped. Each run is a fresh process; tokens/s is the mean of
torchtune's ``tokens_per_second_per_gpu`` over the steps after ``--warmup``, peak GPU memory
torchtune's ``peak_memory_alloc``, host memory the process's peak RSS. With ``--repeats``
the runs alternate, and each run's per-step ratio to the baseline pairs steps that saw the
same batches (see ``summarize``).

    # on the GPU machine, from the repository root (pip install -e . done)
    python bench/bench_stock.py --job full --model 1b
    python bench/bench_stock.py --job full --model 1b --runs ours_stock,torch_adamw --steps 4  # a subset
    python bench/bench_stock.py --job qlora --model 1b --runs stock_as_shipped,ours_stock --repeats 3 --steps 30 --warmup 5
    python bench/bench_stock.py --job lora --model 8b --runs stock_as_shipped,ours_stock --steps 6  # bf16 base weights
    python bench/bench_stock.py --job full --model 8b --gpu-gib 24 --runs ours_stock,torchao_offload_grads --steps 5
    python bench/bench_stock.py --job qlora --model 3b --runs ours_stock,ours_recipe --repeats 2 --steps 12 --warmup 3
    python bench/bench_stock.py --job qlora --model mistral_7b --runs ours_stock,ours_recipe --steps 10 --warmup 3
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {  # model -> torchtune builder, and per job: (torchtune's stock config, our config);
    #            the checkpoint's files are as the configs name them (CHECKPOINTS)
    "1b": ("torchtune.models.llama3_2.llama3_2_1b", {
        "full": ("llama3_2/1B_full_single_device", "configs/llama3_2/1B_full_offload_single_device.yaml"),
        "qlora": ("llama3_2/1B_qlora_single_device", "configs/llama3_2/1B_qlora_offload_single_device.yaml"),
        "lora": ("llama3_2/1B_lora_single_device", "configs/llama3_2/1B_lora_offload_single_device.yaml"),
    }),
    "3b": ("torchtune.models.llama3_2.llama3_2_3b", {  # (we ship no 3B LoRA config)
        "full": ("llama3_2/3B_full_single_device", "configs/llama3_2/3B_full_offload_single_device.yaml"),
        "qlora": ("llama3_2/3B_qlora_single_device", "configs/llama3_2/3B_qlora_offload_single_device.yaml"),
    }),
    "8b": ("torchtune.models.llama3_1.llama3_1_8b", {
        "full": ("llama3_1/8B_full_single_device", "configs/llama3_1/8B_full_offload_single_device.yaml"),
        "qlora": ("llama3_1/8B_qlora_single_device", "configs/llama3_1/8B_qlora_offload_single_device.yaml"),
        "lora": ("llama3_1/8B_lora_single_device", "configs/llama3_1/8B_lora_offload_single_device.yaml"),
    }),
    "gemma2_2b": ("torchtune.models.gemma2.gemma2_2b", {
        "qlora": ("gemma2/2B_qlora_single_device", "configs/gemma2/2B_qlora_offload_single_device.yaml"),
    }),
    "gemma2_9b": ("torchtune.models.gemma2.gemma2_9b", {
        "qlora": ("gemma2/9B_qlora_single_device", "configs/gemma2/9B_qlora_offload_single_device.yaml"),
    }),
    "mistral_7b": ("torchtune.models.mistral.mistral_7b", {
        "qlora": ("mistral/7B_qlora_single_device", "configs/mistral/7B_qlora_offload_single_device.yaml"),
    }),
    # torchtune ships no Qwen2.5 QLoRA config: the stock run is its LoRA config with NF4 base
    # weights (STOCK_OVERRIDES), as ours is derived from it.
    "qwen2_5_7b": ("torchtune.models.qwen2_5.qwen2_5_7b_instruct", {
        "qlora": ("qwen2_5/7B_lora_single_device", "configs/qwen2_5/7B_qlora_offload_single_device.yaml"),
    }),
}
# model -> (files the configs' checkpointer lists, the tokenizer its builder reads, whether
# the files are pytorch_model-*.bin): what bench/random_checkpoint.py writes
CHECKPOINTS = {"1b": (1, "tiktoken", False), "3b": (2, "tiktoken", False), "8b": (4, "tiktoken", False),
               "gemma2_2b": (3, "sentencepiece", False), "gemma2_9b": (8, "sentencepiece", False),
               "mistral_7b": (2, "sentencepiece", True), "qwen2_5_7b": (4, "qwen", False)}
STOCK_OVERRIDES = {"qwen2_5_7b": ["model.quantize_base=True"]}  # on every stock-recipe run of the model


def tokenizer_files(model: str, checkpoint: Path) -> dict:
    """The configs' tokenizer options, pointing at the random checkpoint's folder."""
    if CHECKPOINTS[model][1] == "qwen":
        return {"path": checkpoint / "vocab.json", "merges_file": checkpoint / "merges.txt"}
    return {"path": checkpoint / "original" / "tokenizer.model"}


OURS = "optimizer._component_=offload_plugin.CPUOffloadOptimizer"
ACCUM_CLIP = ["gradient_accumulation_steps=2", "clip_grad_norm=1.0"]
# name -> (recipe: "stock" or "ours", overrides). Stock full configs ship PagedAdamW8bit with
# optimizer_in_bwd: True; stock QLoRA configs torch's AdamW(fused=True).
RUNS = {
    "full": {
        "stock_as_shipped": ("stock", []),
        "torch_adamw": ("stock", ["optimizer._component_=torch.optim.AdamW", "optimizer.fused=True",
                                  "optimizer_in_bwd=False"]),
        "torchao": ("stock", ["optimizer._component_=torchao.optim.CPUOffloadOptimizer",
                              "optimizer_in_bwd=False"]),
        # torchao with its gradients moved to the host in backward (what fits a small GPU).
        "torchao_offload_grads": ("stock", ["optimizer._component_=torchao.optim.CPUOffloadOptimizer",
                                            "optimizer_in_bwd=False", "optimizer.offload_gradients=True"]),
        "ours_stock": ("stock", [OURS]),
        # The drop-in with bitsandbytes' 8-bit AdamW update (what the stock config ships), its
        # state in host memory: the two overrides, nothing else.
        "ours_stock_adamw8bit": ("stock", [OURS, "optimizer.optimizer_cls=offload_plugin.AdamW8bit"]),
        "ours_stock_no_in_bwd": ("stock", [OURS, "optimizer_in_bwd=False"]),
        "ours_stock_in_flight_4g": ("stock", [OURS]),  # (RUN_ENV: another in-backward bound)
        "ours_stock_flush_4m": ("stock", [OURS]),
        "ours_stock_flush_128m": ("stock", [OURS]),
        "ours_recipe": ("ours", []),
        # Gradients kept on the GPU until step(): the streamed update (state through the GPU),
        # what the 1B config ships.
        "ours_recipe_grads_on_gpu": ("ours", ["optimizer_in_bwd=False", "optimizer.offload_gradients=False",
                                              "early_forward=False",
                                              "optimizer.accumulate_on_device=False"]),
        # Gradients to the host during backward, the host update overlapping the next forward.
        "ours_recipe_host": ("ours", ["optimizer_in_bwd=False", "optimizer.offload_gradients=True",
                                      "early_forward=True"]),
        # torchtune's optimizer_in_bwd in our recipe: the streamed update as each gradient lands
        # (what our 3B and 8B full configs ship).
        "ours_recipe_in_bwd": ("ours", ["optimizer_in_bwd=True", "optimizer.offload_gradients=False",
                                        "early_forward=False", "optimizer.accumulate_on_device=False"]),
        # fp32 master weights (opt-in): 16 bytes per parameter on the host instead of 8.
        "ours_stock_masters": ("stock", [OURS, "optimizer.master_weights=True"]),
        "ours_recipe_masters": ("ours", ["optimizer.master_weights=True"]),
        # Gradient accumulation and clipping (the stock recipe then needs optimizer_in_bwd off).
        "ours_stock_accum_clip": ("stock", [OURS, "optimizer_in_bwd=False", *ACCUM_CLIP]),
        "ours_recipe_accum_clip": ("ours", ["optimizer_in_bwd=False", *ACCUM_CLIP]),
    },
    "qlora": {
        "stock_as_shipped": ("stock", []),
        "torchao": ("stock", ["optimizer._component_=torchao.optim.CPUOffloadOptimizer",
                              "~optimizer.fused"]),
        "ours_stock": ("stock", [OURS]),
        "ours_stock_host_update": ("stock", [OURS]),  # (RUN_ENV: the streamed update off)
        "ours_recipe": ("ours", []),
        "ours_recipe_offload_host_accum": ("ours", ["optimizer.offload_gradients=True"]),
        "ours_recipe_offload_device_accum": ("ours", ["optimizer.offload_gradients=True",
                                                      "optimizer.accumulate_on_device=True"]),
    },
}
RUNS["lora"] = dict(RUNS["qlora"])  # the same runs with bf16 base weights instead of NF4
# Runs that differ from another only in their environment: the host update where the streamed
# one would run, to compare the two on one machine.
RUN_ENV = {"ours_stock_host_update": {"OFFLOAD_PLUGIN_STREAMED": "0"},
           # Under optimizer_in_bwd the hooks wait once this many MiB of gradients wait for
           # the bus (streamed.config.in_flight_bytes, 1024 by default): a larger bound.
           "ours_stock_in_flight_4g": {"OFFLOAD_PLUGIN_IN_FLIGHT_MIB": "4096"},
           # Steps queued in backward sent to the GPU in batches of 4 M elements (an earlier
           # default) or 128 M instead of 32 M (streamed.config.flush_numel).
           "ours_stock_flush_4m": {"OFFLOAD_PLUGIN_FLUSH_NUMEL": str(1 << 22)},
           "ours_stock_flush_128m": {"OFFLOAD_PLUGIN_FLUSH_NUMEL": str(1 << 27)}}
LAUNCH = (  # tune in this process, so that its peak RSS is the recipe's
    "import resource, runpy, sys\n"
    "try:\n"
    "    runpy.run_module('torchtune._cli.tune', run_name='__main__')\n"
    "finally:\n"
    "    print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
)


def run_dir(args, name: str) -> Path:
    """Where one run writes: its own per job and model (torchtune's DiskLogger appends to
    log.txt, so a run in a reused folder would be read with the steps of an earlier one)."""
    return args.work / f"{args.job}-{args.model}" / name


def command(args, name: str) -> list[str]:
    stock_config, our_config = MODELS[args.model][1][args.job]
    recipe, overrides = RUNS[args.job][name]
    recipe_name = "full_finetune_single_device" if args.job == "full" else "lora_finetune_single_device"
    if recipe == "stock":
        target = [recipe_name, "--config", stock_config, *STOCK_OVERRIDES.get(args.model, [])]
    else:
        target = [f"offload_plugin/recipes/{recipe_name}.py", "--config", our_config]
    out = run_dir(args, name)
    data = args.work / "demo" / "alpaca_tiny.json"
    common = [
        f"checkpointer.checkpoint_dir={args.checkpoint}",
        *(f"tokenizer.{k}={v}" for k, v in tokenizer_files(args.model, args.checkpoint).items()),
        f"tokenizer.max_seq_len={args.seq_len}", f"batch_size={args.batch_size}",
        "dataset.source=json", f"dataset.data_files={data}", "dataset.split=train",
        f"max_steps_per_epoch={args.steps}", "epochs=1",
        f"output_dir={out}", "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs", "metric_logger.filename=log.txt",
        "log_every_n_steps=1", "log_peak_memory_stats=True",
        # The same batches in the same order for every run: the configs ship seed null,
        # and a step's tokens/s depends on its samples' lengths (padded per batch).
        "seed=0",
    ]
    return [sys.executable, "-c", LAUNCH, "run", *target, *common, *overrides]


def parse(out: Path, stdout: str, warmup: int) -> dict:
    steps = {}
    for log in (out / "logs").glob("*.txt"):
        for line in log.read_text().splitlines():
            m = re.match(r"Step (\d+) \| (.*)", line)
            if m:
                steps[int(m.group(1))] = {k: float(v) for k, v in (kv.split(":") for kv in m.group(2).split())}
    timed = [m for s, m in sorted(steps.items()) if s > warmup]
    rss = re.findall(r"PEAK_RSS_KIB (\d+)", stdout)
    return {
        "steps": len(steps),
        "tokens_per_s": sum(m["tokens_per_second_per_gpu"] for m in timed) / len(timed) if timed else None,
        "peak_gpu_gib": max((m.get("peak_memory_alloc", 0) for m in steps.values()), default=None),
        "host_peak_rss_gib": int(rss[-1]) / 2**20 if rss else None,
        "losses": [m["loss"] for _, m in sorted(steps.items())],
        "step_tokens_per_s": [m["tokens_per_second_per_gpu"] for _, m in sorted(steps.items())],
    }


def one_run(args, name: str, env: dict) -> dict:
    cmd = command(args, name)
    print(f"== {name}: tune {' '.join(cmd[3:])}", flush=True)
    shutil.rmtree(run_dir(args, name) / "logs", ignore_errors=True)  # (see run_dir)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, **RUN_ENV.get(name, {})),
                              cwd=REPO, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    # What the recipe saved at the end goes at once (the logs stay): an 8B model's weights
    # are 16 GB a run, and the GPU machine's 64 GB disk filled up after three runs.
    for saved in run_dir(args, name).glob("*"):
        if saved.name != "logs":
            shutil.rmtree(saved) if saved.is_dir() else saved.unlink()
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    # Steps our optimizer reports skipped for an inf or NaN gradient: a run that is not clean.
    return dict(parse(run_dir(args, name), proc.stdout, args.warmup),
                nonfinite_reports=(proc.stdout + proc.stderr).count("inf or NaN"))


def summarize(results: dict, base_name: str, warmup: int) -> dict:
    """Each run's mean over its repeats (tokens/s; peak memory: the largest), and its
    per-step ratio to ``base_name``: step k of repeat j against the base's step k of repeat
    j (the same batches: seed=0), averaged over the steps after ``warmup``. Run-to-run
    variation (a 1B QLoRA step's tokens/s varies by +-10% between runs of one config) then
    weighs less than in a ratio of means."""
    base = results.get(base_name, {}).get("repeats", [])
    for r in results.values():
        done = [x for x in r["repeats"] if "error" not in x and x.get("tokens_per_s") is not None]
        if not done:
            r["error"] = r["repeats"][0].get("error", "no step after --warmup")
            continue
        r.pop("error", None)
        r["tokens_per_s"] = sum(x["tokens_per_s"] for x in done) / len(done)
        for key in ("peak_gpu_gib", "host_peak_rss_gib"):
            r[key] = max((x[key] for x in done if x[key] is not None), default=None)
        pairs = [(mine, theirs) for x, b in zip(r["repeats"], base) if "error" not in x and "error" not in b
                 for mine, theirs in list(zip(x["step_tokens_per_s"], b["step_tokens_per_s"]))[warmup:]]
        r["paired_ratio"] = sum(m / t for m, t in pairs) / len(pairs) if pairs else None
    return results


def baseline(job: str, names) -> str:
    """The run the others are compared with: torch's AdamW on the GPU (full fine-tuning) or
    the stock config as shipped (LoRA, QLoRA: its AdamW on the GPU), else the first run."""
    names = list(names)
    preferred = "torch_adamw" if job == "full" else "stock_as_shipped"
    return preferred if preferred in names or not names else names[0]


def markdown_table(results: dict, base_name: str) -> str:
    """The summarized runs as a markdown table (bench/report.py prints every saved one).
    Results saved before --repeats existed hold one run's numbers without "repeats"."""
    base = results.get(base_name, {}).get("tokens_per_s")
    lines = [f"| run | tokens/s | vs {base_name} | per-step ratio | peak GPU GiB | host peak RSS GiB |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        if r.get("tokens_per_s") is None:
            lines.append(f"| {name} | FAILED | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        paired = f"{r['paired_ratio']:.3f}" if r.get("paired_ratio") is not None else "-"
        each = [x["tokens_per_s"] for x in r.get("repeats", []) if x.get("tokens_per_s") is not None]
        spread = f" ({', '.join(f'{t:,.0f}' for t in each)})" if len(each) > 1 else ""
        gib = [f"{r[key]:.1f}" if r.get(key) is not None else "-" for key in ("peak_gpu_gib", "host_peak_rss_gib")]
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f}{spread} | {ratio} | {paired} | {gib[0]} | {gib[1]} |")
    for name, r in results.items():
        skips = sum(x.get("nonfinite_reports", 0) for x in r.get("repeats", []))
        if skips:
            lines.append(f"\nwarning: {name}: {skips} steps reported skipped for an inf or NaN gradient (not a clean run)")
    return "\n".join(lines)


def save(args, results: dict) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kind": "stock", "settings": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", choices=sorted(RUNS), default="full")
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument("--runs", default=None, help="comma-separated subset of the job's runs")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--work", type=Path, default=Path("/tmp/offload-plugin/stock"))
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="random-init checkpoint dir (made with bench/random_checkpoint.py if absent)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole list this many times, interleaved (a, b, a, b); tokens/s is "
                        "the mean over repeats, each kept in 'repeats'")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--gpu-gib", type=float, default=None,
                   help="cap each run's GPU memory at this many GiB (the caching allocator's "
                        "per_process_memory_fraction), as on a smaller GPU")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default: bench/results/stock/<date>-stock-<model>-<job>.json)")
    args = p.parse_args()
    if args.job not in MODELS[args.model][1]:
        p.error(f"--model {args.model} has no {args.job} configs here; it has {', '.join(MODELS[args.model][1])}")
    args.out = args.out or REPO / "bench" / "results" / "stock" / f"{datetime.date.today()}-stock-{args.model}-{args.job}.json"
    names = args.runs.split(",") if args.runs else list(RUNS[args.job])
    args.checkpoint = args.checkpoint or args.work / f"random-{args.model}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.gpu_gib:
        import torch

        fraction = args.gpu_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory
        env["PYTORCH_CUDA_ALLOC_CONF"] = f"per_process_memory_fraction:{fraction:.4f}"
    if not (args.work / "demo" / "alpaca_tiny.json").exists():
        subprocess.run([sys.executable, "-m", "offload_plugin.demo", "prepare",
                        "--output-dir", str(args.work / "demo")], check=True, env=env, cwd=REPO)
    if not all(f.exists() for f in tokenizer_files(args.model, args.checkpoint).values()):  # (written last)
        shards, tokenizer, bin_files = CHECKPOINTS[args.model]
        subprocess.run([sys.executable, str(REPO / "bench" / "random_checkpoint.py"), "--model",
                        MODELS[args.model][0], "--output-dir", str(args.checkpoint), "--shards", str(shards),
                        "--tokenizer", tokenizer, *(["--bin"] if bin_files else [])], check=True, env=env)
    results = {}
    base_name = baseline(args.job, names)
    for repeat in range(args.repeats):
        for name in names:
            res = one_run(args, name, env)
            print(json.dumps({k: v for k, v in res.items() if k not in ("losses", "step_tokens_per_s")}), flush=True)
            results.setdefault(name, {"repeats": []})["repeats"].append(res)
            # After every run, summarized so far: a call cut short keeps these and their means.
            save(args, summarize(copy.deepcopy(results), base_name, args.warmup))
    summarize(results, base_name, args.warmup)
    print("\n" + markdown_table(results, base_name))
    save(args, results)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
