"""Where a streamed step's time goes on the GPU machine: the copy bandwidth the host allows,
and one traced step of Llama-3.2-1B full fine-tuning under torchtune's optimizer_in_bwd and
with a plain step after backward.

1. ``copies``: the moments of a model of ``--numel`` bf16 parameters (4 bytes each way per
   parameter) copied host->device and device->host in staging-sized pieces, each direction
   alone and both at once (bench/bus.py's ``copies``): the floor for the streamed update's time.
2. ``lora``: bench/investigations/step_overhead.py's 192 LoRA adapters, one step traced likewise.
3. ``step``: the 1B model (random init, bf16, 2 x 2048 tokens), traced with torch.profiler
   over one step after warm-up: step time, GPU time in kernels and in copies each way, and
   the achieved bytes/s.

    python bench/investigations/streamed_timeline.py                 # both, on the GPU machine
    python bench/investigations/streamed_timeline.py --chunk 4194304 # a smaller staging buffer
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: bus.py
from bus import copies  # noqa: E402  (pinned copies in staging-sized pieces, as the streamed update's)
from offload_plugin import CPUOffloadOptimizer  # noqa: E402
from offload_plugin.engines import streamed  # noqa: E402


def _trace(one) -> dict:
    """One traced call of ``one()`` (after warm-up): its wall time and the GPU's time in
    kernels and in copies each way."""
    times = [one() for _ in range(6)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        traced = one()
    kinds = {"kernels": 0.0, "h2d": 0.0, "d2h": 0.0, "adam": 0.0}
    spans: dict = {}  # kind -> [first start, last end], microseconds
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = ("h2d" if "HtoD" in e.name else "d2h" if "DtoH" in e.name
                else None if "Memcpy" in e.name or "Memset" in e.name
                else "adam" if "adam" in e.name.lower() else "kernels")
        if kind is None:
            continue
        kinds[kind] += e.device_time_total / 1e6
        span = spans.setdefault(kind, [e.time_range.start, e.time_range.end])
        span[0], span[1] = min(span[0], e.time_range.start), max(span[1], e.time_range.end)
    origin = min((a for a, _ in spans.values()), default=0)
    return {"step_s": [round(t, 5) for t in times[2:]], "traced_step_s": round(traced, 5),
            "gpu_busy_s": {k: round(v, 5) for k, v in kinds.items()},
            "first_start_last_end_ms": {k: [round((a - origin) / 1e3, 2), round((b - origin) / 1e3, 2)]
                                        for k, (a, b) in spans.items()}}


def lora_step() -> dict:
    """step_overhead.py's 192 rank-8 adapters: one step() until the weights are back."""
    from step_overhead import adapters

    params = adapters(torch.device("cuda"), 8)
    opt = CPUOffloadOptimizer(params, lr=1e-4)

    def one() -> float:
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        opt.zero_grad()
        return t

    return {"workload": "192 LoRA adapters, rank 8", **_trace(one)}


def step(in_bwd: bool) -> dict:
    from torchtune import training
    from torchtune.models.llama3_2 import llama3_2_1b

    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16), torch.device("cuda"):
        model = llama3_2_1b()
    tokens = torch.randint(0, 128_000, (2, 2049), device="cuda")
    if in_bwd:
        optims = {p: CPUOffloadOptimizer([p], lr=1e-5) for p in model.parameters()}
        training.register_optim_in_bwd_hooks(model, optims)
        opt = None
    else:
        opt = CPUOffloadOptimizer(model.parameters(), lr=1e-5)

    def one() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    numel = sum(p.numel() for p in model.parameters())
    return {"workload": f"Llama-3.2-1B full, 4096 tokens, {'optimizer_in_bwd' if in_bwd else 'step after backward'}",
            **_trace(one), "moments GB each way": round(numel * 4 / 1e9, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=streamed.config.stage_numel)
    p.add_argument("--numel", type=int, default=1_235_814_400)
    p.add_argument("--only", choices=["copies", "lora", "step"], default=None)
    args = p.parse_args()
    streamed.config.stage_numel = args.chunk
    out = {"chunk": args.chunk}
    if args.only in (None, "copies"):
        out["copies"] = copies(args.numel, args.chunk)
    if args.only in (None, "lora"):
        out["lora"] = lora_step()
    if args.only in (None, "step"):
        out["steps"] = [step(True), step(False)]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
