"""CompactAdamW's update on the GPU, in Triton: the streamed compact update's kernel.

The host keeps the compact state (8-bit codes, their block absmax, the int16 remainder:
about 4 bytes per bf16 parameter); each step it crosses the bus, this kernel updates it next
to the bf16 weight and gradient the GPU already holds, and it goes back
(offload_plugin.engines.streamed).

It gives the bits of offload_plugin.formats.compact.native (its native CPU kernel and its torch
reference agree bit for bit), so that a compact state moves freely between the host update
and this one and a resume is exact: every fp32 operation here is one IEEE operation in the
reference's order, division and square root correctly rounded (``tl.div_rn``,
``tl.sqrt_rn``; Triton's ``/`` and ``tl.sqrt`` are approximate on NVIDIA GPUs) and no
multiply-add contracted (``enable_fp_fusion=False``). bench/formats/compact_gpu_update.py checks
the bits of every setting and times it; tests/test_gpu_update_kernels.py runs that check.

Imported only where Triton is (torch's CUDA wheels bring it).
"""

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from offload_plugin.formats.compact import native as compact_adam
from offload_plugin.formats.compact.native import BLOCK, CompactAdamState

__all__ = ["GpuMaps", "update_", "step_"]


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
        code = (e >> 16) + up.to(tl.uint32)
    else:
        e = tl.load(table + key).to(tl.uint32, bitcast=True)
        code = (e >> 16) + (low > (e & 0xFFFF)).to(tl.uint32)
        # A positive y (its bits positive as int32) takes at least code 1, never 0.0, as
        # the CPU kernel's unsigned quantize(); 0 keeps code 0.
        code = tl.maximum(code, (u.to(tl.int32, bitcast=True) > 0).to(tl.uint32))
    return code.to(tl.uint8)


@triton.jit
def _compact_adamw_kernel(weight, remainder, grad, m_code, m_absmax, v_code, v_absmax, n,
                          coeffs, skip, m_values, v_values, m_table, v_table, m_k0, m_nb, v_k0, v_nb,
                          MASTER: tl.constexpr, L2: tl.constexpr, PRE_SCALE: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr):
    block = tl.program_id(0)
    offs = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    # A step whose gradients hold an inf or NaN (skip != 0, decided on the device) writes
    # nothing: the state and the weight stay as they were, as torch's fused AdamW skips.
    limit = tl.where(tl.load(skip) == 0, n, 0)
    inside = offs < n
    stored = offs < limit  # (inside, unless skipped)
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
        tl.store(remainder + offs, (u - (hi << 16)).to(tl.int32, bitcast=True).to(tl.int16), mask=stored)
    else:
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        hi = tl.where(nan, 0xFFFF, _bf16_rne(u) >> 16)
    tl.store(weight + offs, hi.to(tl.uint16).to(tl.int16, bitcast=True), mask=stored)

    # The block's new absmax (0 for a block whose largest moment is 0 or subnormal), then
    # the codes, as the CPU kernel quantizes them.
    m_max = tl.max(tl.where(inside, tl.abs(m), 0.0), axis=0)
    v_max = tl.max(tl.where(inside, v, 0.0), axis=0)
    min_normal = 1.17549435e-38
    m_zero = _below(m_max, min_normal)
    v_zero = _below(v_max, min_normal)
    tl.store(m_absmax + block, tl.where(m_zero, 0.0, m_max), mask=block * BLOCK_SIZE < limit)
    tl.store(v_absmax + block, tl.where(v_zero, 0.0, v_max), mask=block * BLOCK_SIZE < limit)
    m_inv = tl.where(m_zero, 0.0, tl.div_rn(1.0, tl.where(m_zero, 1.0, m_max)))
    v_inv = tl.where(v_zero, 0.0, tl.div_rn(1.0, tl.where(v_zero, 1.0, v_max)))
    tl.store(m_code + offs, _quantize(m * m_inv, m_table, m_k0, m_nb, True), mask=stored)
    tl.store(v_code + offs, _quantize(v * v_inv, v_table, v_k0, v_nb, False), mask=stored)


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


def update_(weight: torch.Tensor, remainder: Optional[torch.Tensor], grad: torch.Tensor,
            exp_avg: torch.Tensor, exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor,
            exp_avg_sq_absmax: torch.Tensor, coeffs: torch.Tensor, skip: torch.Tensor,
            maps: GpuMaps) -> None:
    """One compact AdamW step in place, on the current stream: flat tensors on one device
    (the weight and gradient bf16, ``remainder`` int16 or None, codes uint8, absmax fp32 one
    per 256 elements), ``coeffs`` the 11 fp32 scalars of compact_adam._coefficients, and
    ``skip`` a one-element float tensor: nonzero writes nothing. Queued, never waits."""
    n = weight.numel()
    if n == 0:
        return
    master = remainder is not None
    _compact_adamw_kernel[(triton.cdiv(n, BLOCK),)](
        weight.view(torch.int16), remainder if master else weight.view(torch.int16),
        grad.view(torch.int16), exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, n,
        coeffs, skip, maps.m_values, maps.v_values, maps.m_table, maps.v_table,
        maps.m.k0, maps.m.nb, maps.v.k0, maps.v.nb,
        MASTER=master, L2=False, PRE_SCALE=False, BLOCK_SIZE=BLOCK, **_NO_CONTRACTION)


def step_(state: CompactAdamState, grad: torch.Tensor, maps: GpuMaps, *, lr: float,
          beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
          adamw: bool = True, maximize: bool = False, grad_scale=None, clip_coef=None) -> None:
    """compact_adam.step_ with every tensor of ``state`` and ``grad`` on the GPU (every
    setting of the kernel: bench/formats/compact_gpu_update.py checks them all)."""
    state.step += 1
    coeffs = compact_adam._coefficients(lr, beta1, beta2, weight_decay, eps, state.step, adamw,
                                        maximize, grad_scale, clip_coef)
    n = state.weight.numel()
    master = state.remainder is not None
    l2 = (not adamw) and float(coeffs[1]) != 0.0
    pre = float(coeffs[10]) != 1.0
    device = state.weight.device
    _compact_adamw_kernel[(triton.cdiv(n, BLOCK),)](
        state.weight.view(torch.int16), state.remainder if master else state.weight.view(torch.int16),
        grad.view(torch.int16), state.exp_avg, state.exp_avg_absmax, state.exp_avg_sq,
        state.exp_avg_sq_absmax, n, coeffs.to(device), torch.zeros(1, device=device),
        maps.m_values, maps.v_values, maps.m_table, maps.v_table, maps.m.k0, maps.m.nb,
        maps.v.k0, maps.v.nb, MASTER=master, L2=l2, PRE_SCALE=pre, BLOCK_SIZE=BLOCK,
        **_NO_CONTRACTION)


# Triton contracts a * b + c into one fused multiply-add on a GPU unless told not to; the
# CPU kernel rounds each operation (-ffp-contract=off). (The interpreter has no option.)
_NO_CONTRACTION = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}
