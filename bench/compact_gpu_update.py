"""A prototype for issue #20: CompactAdamW's update made on the GPU, for a compact state
that streams through the GPU the way the default update's moments do.

The host would keep only the 8-bit codes, their block absmax and the int16 remainder
(about 4 bytes per bf16 parameter); each step they cross the bus, this kernel updates them
next to the bf16 weight the GPU already holds, and they go back. Bus traffic matches the
default streamed update's (4 bytes each way per parameter), which ran Llama-3.1-8B under a
24 GiB cap at 2.25x torchao's offload optimizer, and the host's cores do no arithmetic, so
the compact update would no longer be bound by them (docs/notes.md, session 22).

The kernel must give the bits of offload_plugin.compact_adam (its native CPU kernel and
its torch reference agree bit for bit), so that a compact state moves freely between the
two and a resume is exact: every fp32 operation here is one IEEE operation in the
reference's order, division and square root correctly rounded (``tl.div_rn``,
``tl.sqrt_rn``; Triton's ``/`` and ``tl.sqrt`` are approximate on NVIDIA GPUs) and no
multiply-add contracted (``enable_fp_fusion=False``).

Not wired into the optimizer: this file only checks the bits and times the kernel.

    python bench/compact_gpu_update.py                           # on a GPU: check, then time
    TRITON_INTERPRET=1 python bench/compact_gpu_update.py --cpu  # the check alone, on the CPU
"""

import argparse
import os
import time

import torch
import triton
import triton.language as tl

from offload_plugin import compact_adam
from offload_plugin.compact_adam import BLOCK, CompactAdamState


@triton.jit
def _bf16_rne(u):
    """fp32 bits (uint32) rounded to bf16, nearest even, back as fp32 bits (finite u)."""
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) << 16


@triton.jit
def _quantize(y, table, k0, nb, SIGNED: tl.constexpr):
    """compact_adam's table lookup: the nearest code of y (already divided by the absmax)."""
    u = y.to(tl.uint32, bitcast=True)
    mag = u & 0x7FFFFFFF
    key = (mag >> 16).to(tl.int32) - k0
    key = tl.minimum(tl.maximum(key, 0), nb - 1)
    low = mag & 0xFFFF
    if SIGNED:
        neg = (u >> 31) != 0
        e = tl.load(table + key + tl.where(neg, nb, 0)).to(tl.uint32, bitcast=True)
        mid = e & 0xFFFF
        up = tl.where(neg, low < mid, low > mid)
    else:
        e = tl.load(table + key).to(tl.uint32, bitcast=True)
        up = low > (e & 0xFFFF)
    return ((e >> 16) + up.to(tl.uint32)).to(tl.uint8)


@triton.jit
def _compact_adamw_kernel(weight, remainder, grad, m_code, m_absmax, v_code, v_absmax, n,
                          coeffs, m_values, v_values, m_table, v_table, m_k0, m_nb, v_k0, v_nb,
                          MASTER: tl.constexpr, L2: tl.constexpr, PRE_SCALE: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr):
    block = tl.program_id(0)
    offs = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    inside = offs < n
    # The coefficients, fp32, in compact_adam._coefficients' order.
    factor = tl.load(coeffs + 0)
    l2 = tl.load(coeffs + 1)
    decay = tl.load(coeffs + 2)
    b1 = tl.load(coeffs + 3)
    omb1 = tl.load(coeffs + 4)
    b2 = tl.load(coeffs + 5)
    omb2 = tl.load(coeffs + 6)
    bc2 = tl.load(coeffs + 7)
    eps = tl.load(coeffs + 8)
    nss = tl.load(coeffs + 9)
    pre = tl.load(coeffs + 10)

    w = tl.load(weight + offs, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    if MASTER:
        r = tl.load(remainder + offs, mask=inside, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
        p = ((w << 16) + r).to(tl.float32, bitcast=True)
    else:
        p = (w << 16).to(tl.float32, bitcast=True)
    g = (tl.load(grad + offs, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
    g = g.to(tl.float32, bitcast=True)
    if PRE_SCALE:
        g = _bf16_rne((g * pre).to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)
    g = g * factor
    if L2:
        g = g + p * l2
    m = tl.load(m_values + tl.load(m_code + offs, mask=inside, other=0).to(tl.int32)) * tl.load(m_absmax + block)
    v = tl.load(v_values + tl.load(v_code + offs, mask=inside, other=0).to(tl.int32)) * tl.load(v_absmax + block)
    m = m * b1 + g * omb1
    v = v * b2 + (g * g) * omb2
    p = p * decay
    denom = tl.sqrt_rn(v) * bc2 + eps
    p = p + tl.div_rn(m * nss, denom)

    u = p.to(tl.uint32, bitcast=True)
    if MASTER:
        hi = (u + 0x8000) >> 16
        tl.store(remainder + offs, (u - (hi << 16)).to(tl.int32, bitcast=True).to(tl.int16), mask=inside)
    else:
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        hi = tl.where(nan, 0xFFFF, _bf16_rne(u) >> 16)
    tl.store(weight + offs, hi.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)

    # The block's new absmax (0 for a block whose largest moment is 0 or subnormal), then
    # the codes, as the CPU kernel quantizes them.
    m_max = tl.max(tl.where(inside, tl.abs(m), 0.0), axis=0)
    v_max = tl.max(tl.where(inside, v, 0.0), axis=0)
    min_normal = 1.17549435e-38
    m_zero = _below(m_max, min_normal)
    v_zero = _below(v_max, min_normal)
    tl.store(m_absmax + block, tl.where(m_zero, 0.0, m_max))
    tl.store(v_absmax + block, tl.where(v_zero, 0.0, v_max))
    m_inv = tl.where(m_zero, 0.0, tl.div_rn(1.0, tl.where(m_zero, 1.0, m_max)))
    v_inv = tl.where(v_zero, 0.0, tl.div_rn(1.0, tl.where(v_zero, 1.0, v_max)))
    tl.store(m_code + offs, _quantize(m * m_inv, m_table, m_k0, m_nb, True), mask=inside)
    tl.store(v_code + offs, _quantize(v * v_inv, v_table, v_k0, v_nb, False), mask=inside)


@triton.jit
def _below(x, bound):
    """!(x >= bound): true for NaN too, as the CPU kernel's test."""
    return ~(x >= bound)


class GpuMaps:
    """compact_adam's two maps (values and lookup tables) on a device."""

    def __init__(self, device) -> None:
        self.m, self.v = compact_adam._map(True), compact_adam._map(False)
        self.m_values, self.v_values = self.m.values.to(device), self.v.values.to(device)
        self.m_table, self.v_table = self.m.table.to(device), self.v.table.to(device)


def step_(state: CompactAdamState, grad: torch.Tensor, maps: GpuMaps, *, lr: float,
          beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
          adamw: bool = True, maximize: bool = False, grad_scale=None, clip_coef=None) -> None:
    """compact_adam.step_ with every tensor of ``state`` and ``grad`` on the GPU."""
    state.step += 1
    coeffs = compact_adam._coefficients(lr, beta1, beta2, weight_decay, eps, state.step, adamw,
                                        maximize, grad_scale, clip_coef)
    n = state.weight.numel()
    master = state.remainder is not None
    l2 = (not adamw) and float(coeffs[1]) != 0.0
    pre = float(coeffs[10]) != 1.0
    _compact_adamw_kernel[(triton.cdiv(n, BLOCK),)](
        state.weight.view(torch.int16), state.remainder if master else state.weight.view(torch.int16),
        grad.view(torch.int16), state.exp_avg, state.exp_avg_absmax, state.exp_avg_sq,
        state.exp_avg_sq_absmax, n, coeffs.to(state.weight.device), maps.m_values, maps.v_values,
        maps.m_table, maps.v_table, maps.m.k0, maps.m.nb, maps.v.k0, maps.v.nb,
        MASTER=master, L2=l2, PRE_SCALE=pre, BLOCK_SIZE=BLOCK, **_NO_CONTRACTION)


# Triton contracts a * b + c into one fused multiply-add on a GPU unless told not to; the
# CPU kernel rounds each operation (-ffp-contract=off). (The interpreter has no option.)
_NO_CONTRACTION = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


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
