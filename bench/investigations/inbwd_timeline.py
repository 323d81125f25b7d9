"""Where an in-backward step's time goes, on the GPU's streams and on the thread that runs
the gradient hooks: Llama-3.1-8B's shapes (``--layers`` decoder layers, random init, bf16,
activation checkpointing, torchtune's chunked cross-entropy), each parameter stepped from
its gradient's hook as ``torchtune.training.register_optim_in_bwd_hooks`` does, the GPU
capped at ``--cap-gib``.

Per run: the median step after two warm-up steps; the host seconds per step inside the
hooks' ``step()`` calls, split into the streamed engine's queueing of GPU work
(``streamed._run_jobs``) and its waits for the update stream (``StagingRing.hold``, the
bound on gradients in flight); flushes and units per step. With ``--profile``, one more
step under torch.profiler (CUDA activity): per stream the busy seconds and the count of
kernels and copies, and the tail from the last compute kernel to the last copy.

    python bench/investigations/inbwd_timeline.py --layers 32 --cap-gib 24 --profile adamw8bit \\
        --json /tmp/inbwd_timeline.json          # on the GPU machine
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: offload_plugin, installed or not

from offload_plugin import CPUOffloadOptimizer  # noqa: E402
from offload_plugin.engines import streamed  # noqa: E402
from offload_plugin.formats.adamw8bit import streamed as adamw8bit_streamed  # noqa: E402

GIB = 1 << 30
# name -> (optimizer kwargs, or None for no update, or "gpu" for torch's fused AdamW on the GPU;
#          streamed module settings to run it with, "uncapped": no GPU cap, "stage_scale": AdamW8bit's)
RUNS = {
    "none": (None, {}),
    "gpu_adamw": ("gpu", {}),
    "default": ({}, {}),
    "adamw8bit": (dict(optimizer_cls="offload_plugin.AdamW8bit"), {}),
    "adamw8bit_flush128m": (dict(optimizer_cls="offload_plugin.AdamW8bit"), {"flush_numel": 1 << 27}),
    "adamw8bit_inflight2g": (dict(optimizer_cls="offload_plugin.AdamW8bit"), {"in_flight_bytes": 2 * GIB}),
    "adamw8bit_inflight4g": (dict(optimizer_cls="offload_plugin.AdamW8bit"), {"in_flight_bytes": 4 * GIB}),
    "default_inflight4g": ({}, {"in_flight_bytes": 4 * GIB}),
    "adamw8bit_uncapped": (dict(optimizer_cls="offload_plugin.AdamW8bit"), {"uncapped": True}),
    "adamw8bit_flush64m": (dict(optimizer_cls="offload_plugin.AdamW8bit"), {"flush_numel": 1 << 26}),
    "adamw8bit_scale8": (dict(optimizer_cls="offload_plugin.AdamW8bit"), {"stage_scale": 8}),
    "adamw8bit_scale8_flush64m": (dict(optimizer_cls="offload_plugin.AdamW8bit"),
                                  {"stage_scale": 8, "flush_numel": 1 << 26}),
    "adamw8bit_scale8_inflight2g": (dict(optimizer_cls="offload_plugin.AdamW8bit"),
                                    {"stage_scale": 8, "in_flight_bytes": 2 * GIB}),
    "compact": (dict(optimizer_cls="offload_plugin.CompactAdamW"), {}),
}


def build(layers: int) -> torch.nn.Module:
    from torchtune.models.llama3_1 import llama3_1
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import set_activation_checkpointing

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = llama3_1(vocab_size=128_256, num_layers=layers, num_heads=32, num_kv_heads=8, embed_dim=4096,
                         max_seq_len=8192, intermediate_dim=14336).to(torch.bfloat16)
    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    model.set_num_output_chunks(8)
    return model


class Timers:
    """Host seconds inside the hooks, inside _run_jobs and inside hold (bench-side wrappers);
    with ``profiler`` set (a cProfile.Profile), the hooks' step() calls run under it."""

    def __init__(self) -> None:
        self.s = dict(step=0.0, run_jobs=0.0, hold=0.0)
        self.n = dict(step=0, run_jobs=0, units=0)
        self.profiler = None
        run_jobs, hold = streamed._run_jobs, streamed.StagingRing.hold

        def timed_run_jobs(ring, jobs):
            t = time.perf_counter()
            try:
                return run_jobs(ring, jobs)
            finally:
                self.s["run_jobs"] += time.perf_counter() - t
                self.n["run_jobs"] += 1
                self.n["units"] += sum(len(job.plan.units) for job in jobs)

        def timed_hold(ring, nbytes):
            t = time.perf_counter()
            try:
                return hold(ring, nbytes)
            finally:
                self.s["hold"] += time.perf_counter() - t

        streamed._run_jobs, streamed.StagingRing.hold = timed_run_jobs, timed_hold

    def reset(self) -> None:
        for d in (self.s, self.n):
            for k in d:
                d[k] = 0


def profile_step(step) -> dict:
    """One step under torch.profiler (CUDA activity only): per stream busy seconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
    events = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type().name != "CUDA":
            continue
        name = e.name()
        kind = ("h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "memcpy" if "Memcpy" in name
                else "memset" if "Memset" in name else "kernel")
        events.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id(), kind, name))
    if not events:
        return {"profile": "no CUDA events"}
    t0 = min(e[0] for e in events)
    streams: dict = {}
    for start, end, stream, kind, name in events:
        s = streams.setdefault(stream, {"busy_s": 0.0, "count": 0, "kinds": {}})
        s["busy_s"] += (end - start) / 1e9
        s["count"] += 1
        s["kinds"][kind] = s["kinds"].get(kind, 0) + 1
    # The compute stream: the one with the most kernels that are not ours (triton update kernels).
    ours = lambda n: "update" in n or "adam" in n.lower()  # noqa: E731
    per_stream_kernels: dict = {}
    for start, end, stream, kind, name in events:
        if kind == "kernel" and not ours(name):
            per_stream_kernels[stream] = per_stream_kernels.get(stream, 0) + 1
    compute = max(per_stream_kernels, key=per_stream_kernels.get)
    compute_k = [(a, b) for a, b, s, k, n in events if s == compute and k == "kernel"]
    last_compute = max(b for a, b in compute_k)
    last_any = max(e[1] for e in events)
    first_copy = min((a for a, b, s, k, n in events if k in ("h2d", "d2h")), default=None)
    out = {
        "profiled_span_s": (last_any - t0) / 1e9,
        "compute_stream": compute,
        "compute_busy_s": sum(b - a for a, b in compute_k) / 1e9,
        "compute_last_end_s": (last_compute - t0) / 1e9,
        "first_copy_s": None if first_copy is None else (first_copy - t0) / 1e9,
        "tail_after_compute_s": (last_any - last_compute) / 1e9,
        "update_kernels_busy_s": sum(b - a for a, b, s, k, n in events if k == "kernel" and ours(n)) / 1e9,
        "streams": {str(k): v for k, v in streams.items()},
    }
    return out


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += "inf or NaN" in record.getMessage()


def measure(name: str, model, tokens: int, steps: int, cap_gib, timers: Timers, profile: bool,
            jobs_profile: bool = False, initial: Optional[list] = None) -> dict:
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    # Every run starts from the same weights and sees the same batches (the runs of a call share
    # one model, which each run's steps change).
    if initial is not None:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), initial):
                p.copy_(saved)
    torch.manual_seed(1)

    base, _, warps = name.partition("@")  # "adamw8bit@W": the 8-bit kernel launched with W warps a program
    kwargs, settings = RUNS[base][0], dict(RUNS[base][1])
    if warps:
        from offload_plugin.formats.adamw8bit import gpu as adamw8bit_gpu

        shipped_warps, adamw8bit_gpu.WARPS = adamw8bit_gpu.WARPS, int(warps)
    uncapped = settings.pop("uncapped", False)
    scale = settings.pop("stage_scale", None)  # (AdamW8bit's units: StateFormat.stage_scale)
    if scale is not None:
        adamw8bit_streamed.FORMAT.stage_scale = scale
    saved = {k: getattr(streamed.config, k) for k in settings}
    for k, v in settings.items():
        setattr(streamed.config, k, v)
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = 1.0 if (cap_gib is None or kwargs == "gpu" or uncapped) else min(1.0, cap_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    torch.cuda.reset_peak_memory_stats()
    host = {"s": 0.0}
    handles = []
    params = [p for p in model.parameters() if p.requires_grad]
    optims = {}
    if kwargs is not None:
        for p in params:
            optims[p] = (torch.optim.AdamW([p], lr=1e-5, fused=True) if kwargs == "gpu"
                         else CPUOffloadOptimizer([p], lr=1e-5, **kwargs))

        def hook(p, optimizer):
            t = time.perf_counter()
            if timers.profiler is not None:
                timers.profiler.runcall(optimizer.step)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            host["s"] += time.perf_counter() - t
            timers.n["step"] += 1

        for p, opt in optims.items():
            handles.append(p.register_post_accumulate_grad_hook(functools.partial(hook, optimizer=opt)))
    else:
        for p in params:
            handles.append(p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)))
    loss_fn = CEWithChunkedOutputLoss()
    batch = tokens // 2048
    times, rows = [], []

    marks = {}

    def one_step():
        marks["start"] = time.perf_counter()
        ids = torch.randint(0, 128_256, (batch, 2048), device="cuda")
        logits = model(ids)
        loss = loss_fn(logits, ids)
        del logits
        marks["forward"] = time.perf_counter()
        loss.backward()
        marks["backward"] = time.perf_counter()
        torch.cuda.synchronize()

    out = {"run": name, "tokens": tokens, "gpu_cap_gib": None if fraction == 1.0 else cap_gib}
    collecting = {"s": 0.0, "at": None}

    def on_gc(phase, info):  # (Python's collections: they hold the thread that launches kernels)
        if phase == "start":
            collecting["at"] = time.perf_counter()
        elif collecting["at"] is not None:
            collecting["s"] += time.perf_counter() - collecting["at"]

    gc.callbacks.append(on_gc)
    skipped = _Count()  # the optimizers' reports of steps skipped for an inf or NaN gradient
    logging.getLogger("offload_plugin").addHandler(skipped)
    try:
        for i in range(steps + 2):
            torch.cuda.synchronize()
            host["s"] = 0.0
            collecting["s"] = 0.0
            timers.reset()
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            start = time.perf_counter()
            one_step()
            if i >= 2:
                times.append(time.perf_counter() - start)
                rows.append(dict(host_in_step_s=host["s"], run_jobs_s=timers.s["run_jobs"], hold_s=timers.s["hold"],
                                 flushes=timers.n["run_jobs"], units=timers.n["units"], step_calls=timers.n["step"],
                                 forward_host_s=marks["forward"] - marks["start"],
                                 backward_host_s=marks["backward"] - marks["forward"], gc_s=collecting["s"],
                                 alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries))
        out["step_s"] = statistics.median(times)
        out["step_times"] = times
        out["tokens_per_s"] = tokens / out["step_s"]
        for k in rows[0]:
            out[k] = statistics.median(r[k] for r in rows)
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / GIB
        with torch.no_grad():
            out["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if profile:
            out.update(profile_step(one_step))
        if jobs_profile:  # one more step, the hooks' step() calls under cProfile: where their host time goes
            import cProfile
            import io
            import pstats

            timers.profiler = cProfile.Profile()
            try:
                one_step()
            finally:
                profiler, timers.profiler = timers.profiler, None
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(40)
            out["jobs_profile"] = text.getvalue()
    except torch.OutOfMemoryError as err:
        out["failed"] = f"OutOfMemoryError: {str(err)[:160]}"
    finally:
        gc.callbacks.remove(on_gc)
        logging.getLogger("offload_plugin").removeHandler(skipped)
        out["nonfinite_reports"] = skipped.n
        for h in handles:
            h.remove()
        for k, v in saved.items():
            setattr(streamed.config, k, v)
        if scale is not None:
            del adamw8bit_streamed.FORMAT.stage_scale
        if warps:
            adamw8bit_gpu.WARPS = shipped_warps
        for opt in optims.values():
            if hasattr(opt, "finish_step"):
                opt.finish_step()
        del optims
        for p in params:
            p.grad = None
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--runs", default="none,gpu_adamw,adamw8bit,default",
                   help="comma-separated names of RUNS; adamw8bit@W launches the 8-bit kernel with W warps a "
                        "program (adamw8bit_gpu.WARPS)")
    p.add_argument("--profile", default="", help="comma-separated runs to profile one more step of")
    p.add_argument("--jobs-profile", default="",
                   help="comma-separated runs to run one more step of with the hooks' step() calls (which queue "
                        "and run the jobs: streamed._run_jobs) under cProfile")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    model = build(args.layers)
    initial = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    timers = Timers()
    profiled = set(filter(None, args.profile.split(",")))
    jobs_profiled = set(filter(None, args.jobs_profile.split(",")))
    rows = []
    for name in args.runs.split(","):
        rows.append(measure(name, model, args.tokens, args.steps, args.cap_gib, timers, name in profiled,
                            name in jobs_profiled, initial))
        r = rows[-1]
        print(json.dumps({k: v for k, v in r.items() if k not in ("streams", "jobs_profile")}), flush=True)
        if "jobs_profile" in r:
            print(r["jobs_profile"], flush=True)
        if args.json:
            args.json.write_text(json.dumps({"kind": "inbwd_timeline", "layers": args.layers, "rows": rows},
                                            indent=1) + "\n")
    base = next((r for r in rows if r["run"] == "gpu_adamw" and "step_s" in r), None)
    print("| run | GPU cap | step s | vs GPU AdamW | host s in hooks | of which queueing | waiting | flushes | units "
          "| forward host s | gc s | allocator retries | inf/NaN skip reports | weights finite |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_s" not in r:
            print(f"| {r['run']} | {r['failed']} |")
            continue
        ratio = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        print(f"| {r['run']} | {r['gpu_cap_gib'] or 'none'} | {r['step_s']:.3f} | {ratio} | {r['host_in_step_s']:.3f} "
              f"| {r['run_jobs_s']:.3f} | {r['hold_s']:.3f} | {r['flushes']:.0f} | {r['units']:.0f} "
              f"| {r['forward_host_s']:.3f} | {r['gc_s']:.3f} | {r['alloc_retries']:.0f} | {r['nonfinite_reports']} "
              f"| {r['weights_finite']} |")


if __name__ == "__main__":
    main()
