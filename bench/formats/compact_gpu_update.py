"""CompactAdamW's update on the GPU (offload_plugin.formats.compact.gpu, the streamed compact
update's kernel): its bits against the CPU update in every setting, and its rate.

The check covers the settings the streamed update does not use too (Adam's L2 decay, a
gradient scale, clipping, maximize, no masters), so that the kernel stays the CPU update's
twin in all of them.

    python bench/formats/compact_gpu_update.py                           # on a GPU: check, then time
    TRITON_INTERPRET=1 python bench/formats/compact_gpu_update.py --cpu  # the check alone, on the CPU
"""

import argparse
import time

import torch

from offload_plugin.formats.compact import native as compact_adam
from offload_plugin.formats.compact.gpu import GpuMaps, step_, update_
from offload_plugin.formats.compact.native import BLOCK, CompactAdamState


def _on(state: CompactAdamState, device) -> CompactAdamState:
    """A copy of ``state`` on ``device`` (a copy also when that is where it is)."""
    return CompactAdamState(**{f: (getattr(state, f).to(device, copy=True) if isinstance(getattr(state, f), torch.Tensor)
                                   else getattr(state, f)) for f in state.__dataclass_fields__})


def check(device, n: int) -> list[str]:
    """The kernel against compact_adam's CPU update (native where built): several settings,
    three steps each; returns the differences (none: the same bits)."""
    maps, problems = GpuMaps(device), []
    gen = torch.Generator().manual_seed(0)
    settings = [dict(adamw=True, weight_decay=0.01, maximize=False, grad_scale=None, clip_coef=None, mw=True),
                dict(adamw=False, weight_decay=0.1, maximize=True, grad_scale=0.37, clip_coef=0.5, mw=True),
                dict(adamw=True, weight_decay=0.0, maximize=False, grad_scale=1 / 3, clip_coef=None, mw=False)]
    for s in settings:
        cpu = compact_adam._random_state(n, gen, s["mw"])
        gpu = _on(cpu, device)
        for t in range(1, 4):
            grad = (torch.randn(n, generator=gen) * torch.logspace(-6, 1, n)).to(torch.bfloat16)
            kw = dict(lr=1e-3 * t, weight_decay=s["weight_decay"], adamw=s["adamw"], maximize=s["maximize"],
                      grad_scale=s["grad_scale"], clip_coef=s["clip_coef"])
            compact_adam.step_(cpu, grad, **kw)
            step_(gpu, grad.to(device), maps, **kw)
            for f in ("weight", "remainder", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"):
                a, b = getattr(cpu, f), getattr(gpu, f)
                if a is None:
                    continue
                b = b.cpu()
                same = a.view(torch.uint8) == b.view(torch.uint8)
                if not bool(same.all()):
                    problems.append(f"{f}: {int((~same).sum())} bytes differ at step {t} with {s}")
    # A skipped step (the streamed update's verdict: an inf or NaN gradient) writes nothing.
    state = _on(compact_adam._random_state(n, gen, True), device)
    before = _on(state, "cpu")
    coeffs = compact_adam._coefficients(1e-3, 0.9, 0.999, 0.01, 1e-8, 1, True, False, None, None)
    update_(state.weight, state.remainder, torch.full((n,), float("nan")).to(torch.bfloat16).to(device),
            state.exp_avg, state.exp_avg_absmax, state.exp_avg_sq, state.exp_avg_sq_absmax,
            coeffs.to(device), torch.ones(1, device=device), maps)
    for f in ("weight", "remainder", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"):
        if not torch.equal(getattr(state, f).cpu().view(torch.uint8), getattr(before, f).view(torch.uint8)):
            problems.append(f"{f} changed in a skipped step")
    return problems


def time_update(n: int, steps: int) -> None:
    """GPU time of the compact update against torch's fused AdamW on the same bf16 weight."""
    maps = GpuMaps("cuda")
    state = _on(CompactAdamState.zeros((torch.randn(n) * 0.02).to(torch.bfloat16)), "cuda")
    grad = (torch.randn(n, device="cuda") * 1e-3).to(torch.bfloat16)
    p = torch.nn.Parameter(state.weight.clone())
    p.grad = grad.clone()
    adamw = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    compact = timed(lambda: step_(state, grad, maps, lr=1e-4, weight_decay=0.01))
    torch_s = timed(adamw.step)
    # Device memory bytes per element, both 14: compact reads the gradient (2) and reads and
    # writes weight, remainder and two codes (2 x 6); torch's AdamW on bf16 reads the
    # gradient and reads and writes weight and two bf16 moments (2 + 2 x 6).
    for name, s in (("compact (Triton)", compact), ("torch fused AdamW, bf16", torch_s)):
        print(f"{name:26s} {s * 1e3:8.3f} ms  {n / s / 1e9:7.1f} G params/s  {14 * n / s / 1e9:7.0f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="check on the CPU (with TRITON_INTERPRET=1)")
    p.add_argument("--check-numel", type=int, default=BLOCK * 37 + 11)
    p.add_argument("--numel", type=int, default=1 << 28, help="elements to time (GPU)")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    device = "cpu" if args.cpu else "cuda"
    problems = check(device, args.check_numel)
    print("bits: the same as compact_adam's CPU update" if not problems else "bits DIFFER:\n" + "\n".join(problems))
    if device == "cuda":
        time_update(args.numel, args.steps)
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
