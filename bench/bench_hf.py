"""Hugging Face Trainer with each optimizer: step time, tokens/s and memory, one process each.

A random-init Llama (bf16, built on the GPU, no download) trains on random tokens under
``transformers.Trainer`` as a user would run it: gradient checkpointing, 2048-token
sequences, HF's own loss, ``max_grad_norm`` as given (HF's default is 1.0; with 0 HF still
takes the norm to log it). Ours comes in through ``optimizer_cls_and_kwargs``
(``integrations.hf.trainer_optimizer``), HF's own optimizers through ``optim``. Each run is a fresh subprocess (``--single``), its GPU capped
with ``torch.cuda.set_per_process_memory_fraction`` where asked.

    # on the GPU machine, from the repository root (transformers and accelerate installed)
    python bench/bench_hf.py --model llama3_1_8b --tokens-per-step 4096 \\
        --runs ours_grads:24,ours_8bit_grads:24,paged_adamw_8bit,adamw_torch_fused --max-grad-norm 1.0
    # without clipping: ours updating during backward (OptimizerInBackward)
    python bench/bench_hf.py --model llama3_1_8b --tokens-per-step 4096 --max-grad-norm 0 \\
        --runs adamw_torch_fused,ours_8bit_inbwd:24,ours_inbwd:24,ours_8bit_grads:24
    # smoke test on a CPU machine
    python bench/bench_hf.py --model tiny --device cpu --tokens-per-step 256 --seq-len 128 \\
        --steps 2 --warmup 1 --runs ours,ours_grads,adamw_torch_fused

Prints a markdown table; writes JSON with every run's step times (``--out``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bus.py
MARKER = "BENCH_HF_RESULT "
PROGRESS = "BENCH_HF_PROGRESS "
GIB = 2**30
LR = 1e-5

MODELS = {  # LlamaConfig fields (the released models' shapes)
    "llama3_1_8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                        max_position_embeddings=8192),
    "llama3_2_3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, rope_theta=500000.0,
                        max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}
# run name -> (HF optim name, or our optimizer's kwargs)
RUNS = {
    "adamw_torch_fused": ("adamw_torch_fused", None),
    "paged_adamw_8bit": ("paged_adamw_8bit", None),
    "ours": (None, {}),
    "ours_grads": (None, {"offload_gradients": True}),
    "ours_8bit": (None, {"optimizer_cls": "offload_plugin.AdamW8bit"}),
    "ours_8bit_grads": (None, {"optimizer_cls": "offload_plugin.AdamW8bit", "offload_gradients": True}),
    # each parameter updated during backward (OptimizerInBackward): needs --max-grad-norm 0
    "ours_inbwd": (None, {"in_backward": True}),
    "ours_8bit_inbwd": (None, {"in_backward": True, "optimizer_cls": "offload_plugin.AdamW8bit"}),
    # HF's own offload route: DeepSpeed ZeRO-2 with the optimizer (DeepSpeedCPUAdam, fp32 masters and
    # moments) in host memory, HF's config keys left at "auto" as its docs show
    "deepspeed_offload": ("deepspeed", None),
}
DEEPSPEED = {
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
}


class _Timer:
    """A TrainerCallback (built lazily: transformers is imported in the child only) that
    times each optimizer step from its first micro-batch to its end, synchronized."""

    def __init__(self, device):
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                # (the optimizer exists now: HF builds it as training starts)
                outer.progress("optimizer built", time.perf_counter() - outer.begun)

            def on_step_begin(self, args, state, control, **kw):
                _sync(device)
                outer.start = time.perf_counter()

            # where a step's time goes: forward, backward and HF's clip; optimizer.step()
            def on_pre_optimizer_step(self, args, state, control, **kw):
                _sync(device)
                outer.backward_end = time.perf_counter()
                outer.backward.append(outer.backward_end - outer.start)

            def on_optimizer_step(self, args, state, control, **kw):
                _sync(device)
                outer.optimizer_step.append(time.perf_counter() - outer.backward_end)

            def on_step_end(self, args, state, control, **kw):
                _sync(device)
                outer.steps.append(time.perf_counter() - outer.start)
                split = f" (to optimizer.step {outer.backward[-1]:.2f} s, in it {outer.optimizer_step[-1]:.2f} s)" \
                    if len(outer.optimizer_step) == len(outer.steps) else ""
                outer.progress(f"step {len(outer.steps)}{split}", outer.steps[-1])

        self.steps: list[float] = []
        self.backward: list[float] = []  # step begin to HF's optimizer.step(), clip included
        self.optimizer_step: list[float] = []
        self.start = self.begun = time.perf_counter()
        self.callback = Callback()

    @staticmethod
    def progress(what: str, seconds: float) -> None:
        """A line the parent keeps if this run times out: where the time went."""
        print(f"{PROGRESS}{what}: {seconds:.2f} s", flush=True)


def bus_bytes(optimizer) -> dict:
    """What one step of ours moves over the bus each way (nothing for HF's optimizers): the
    streamed state (bench/bus.py, for the in-backward runs), or, with offloaded gradients,
    each gradient out and each updated weight back."""
    import bus  # (bench/bus.py, beside this file)

    optimizer = getattr(optimizer, "optimizer", optimizer)  # (Accelerate's wrapper)
    streamed = bus.streamed_bytes(optimizer)
    if streamed:
        return streamed
    engine = getattr(optimizer, "engine", None)
    if engine is None or not optimizer.options.offload_gradients:
        return {}
    nbytes = sum(slot.param.numel() * slot.param.element_size() for slot in engine.slots)
    return {"bytes_d2h_per_step": nbytes, "bytes_h2d_per_step": nbytes}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_single(args) -> dict:
    # a run about to outlast its time prints every thread's stack (the parent keeps them in
    # the log beside --out): where it waits or works
    faulthandler.dump_traceback_later(max(args.timeout - 2, 1), file=sys.stdout)
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    device = torch.device(args.device)
    optim, ours = RUNS[args.single]
    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[args.model])
    begun = time.perf_counter()
    with device:
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    _Timer.progress("model built", time.perf_counter() - begun)
    if args.cap_gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / total, torch.cuda.current_device())
    batch = args.tokens_per_step // args.seq_len
    steps = args.warmup + args.steps

    class Tokens(Dataset):
        def __len__(self):
            return batch * steps

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, config.vocab_size, (args.seq_len,), generator=g)
            return {"input_ids": ids, "labels": ids}

    kwargs = dict(
        output_dir=str(Path(args.tmp) / args.single), per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        gradient_checkpointing=args.device != "cpu", gradient_checkpointing_kwargs={"use_reentrant": False},
        save_strategy="no", report_to=[], logging_steps=10**6, dataloader_num_workers=0,
        use_cpu=device.type == "cpu", disable_tqdm=True,
    )
    if optim == "deepspeed":
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT="29517").items():
            os.environ.setdefault(key, value)  # one process: DeepSpeed still wants a process group
        kwargs.update(deepspeed=DEEPSPEED, bf16=True)
    elif optim is not None:
        kwargs["optim"] = optim
    timer = _Timer(device)
    training_args = TrainingArguments(**kwargs)
    trainer_kwargs = {}
    if ours is not None:  # in one argument, as docs/frameworks.md has it
        from offload_plugin.integrations.hf import trainer_optimizer

        trainer_kwargs["optimizer_cls_and_kwargs"] = trainer_optimizer(training_args, **ours)
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(),
                      callbacks=[timer.callback], **trainer_kwargs)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    faulthandler.cancel_dump_traceback_later()
    timed = timer.steps[args.warmup:]
    median = statistics.median(timed)
    return {
        "run": args.single, "model": args.model, "tokens_per_step": args.tokens_per_step,
        "seq_len": args.seq_len, "cap_gib": args.cap_gib, "max_grad_norm": args.max_grad_norm,
        "step_s": timed, "median_step_s": median,
        "forward_backward_clip_s": timer.backward[args.warmup:],
        "optimizer_step_s": timer.optimizer_step[args.warmup:], "tokens_per_s": args.tokens_per_step / median,
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
        "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **bus_bytes(trainer.optimizer),
    }


def run_child(args, name: str, cap) -> dict:
    cmd = [sys.executable, __file__, "--single", name, "--model", args.model, "--device", args.device,
           "--tokens-per-step", str(args.tokens_per_step), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--max-grad-norm", str(args.max_grad_norm),
           "--tmp", args.tmp, "--timeout", str(args.timeout)] + (["--cap-gib", str(cap)] if cap else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else (stopped.stdout or "")
        _keep_log(args, name, out)
        done = [line[len(PROGRESS):] for line in out.splitlines() if line.startswith(PROGRESS)]
        return {"run": name, "cap_gib": cap, "progress": done,
                "error": f"did not finish in {args.timeout} s (--timeout); done: {'; '.join(done) or 'nothing'}"}
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    _keep_log(args, name, proc.stdout + proc.stderr)
    done = [line[len(PROGRESS):] for line in proc.stdout.splitlines() if line.startswith(PROGRESS)]
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
    return {"run": name, "cap_gib": cap, "progress": done, "error": "\n".join(tail)}


def _keep_log(args, name: str, text: str) -> None:
    """A failed run's whole output (with the stacks of one that timed out) beside --out."""
    if args.out:
        Path(f"{args.out}.{name}.log").write_text(text)


def table(results: list[dict], base: str) -> str:
    ref = next((r for r in results if r["run"] == base and "error" not in r), None)
    lines = ["| run | GPU cap GiB | step s | tokens/s | vs " + base + " | peak GPU GiB | peak host GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['run']} | {r.get('cap_gib') or ''} | failed: {r['error'].splitlines()[-1][:80]} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else ""
        gpu = f"{r['peak_gpu_gib']:.1f}" if r["peak_gpu_gib"] is not None else ""
        lines.append(f"| {r['run']} | {r['cap_gib'] or ''} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} "
                     f"| {ratio} | {gpu} | {r['peak_host_gib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_1_8b", choices=sorted(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens-per-step", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--runs", default="ours_grads:24,ours_8bit_grads:24,paged_adamw_8bit,adamw_torch_fused",
                        help="comma-separated NAME[:CAP_GIB] (names: " + ", ".join(RUNS) + ")")
    parser.add_argument("--base", default="adamw_torch_fused", help="the run the ratios compare with")
    parser.add_argument("--cap-gib", type=float, default=0.0, help="(child) the GPU memory cap")
    parser.add_argument("--single", help="(child) run one and print its result")
    parser.add_argument("--tmp", default="/tmp/bench_hf")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.single:
        print(MARKER + json.dumps(run_single(args)), flush=True)
        return
    results = []
    for spec in args.runs.split(","):
        name, _, cap = spec.partition(":")
        if name not in RUNS:
            parser.error(f"unknown run {name!r}: one of {', '.join(RUNS)}")
        results.append(run_child(args, name, float(cap) if cap else None))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "step_s"}), flush=True)
    print(table(results, args.base))
    if args.out:
        Path(args.out).write_text(json.dumps({"kind": "hf", "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
