"""AdamW8bit's update on the GPU, in Triton: the streamed 8-bit state's kernels.

The host keeps bitsandbytes' 8-bit state (codes and block scales, about 2 bytes per
parameter); each step it crosses the bus and these kernels update it next to the bf16
weight and gradient the GPU holds (offload_plugin.formats.adamw8bit.streamed).

They give the bits of the host update (offload_plugin.formats.adamw8bit.optimizer: bitsandbytes' CPU
backend, operation for operation), so that the state moves freely between the two and
between this optimizer and bitsandbytes: each fp32 operation is one IEEE operation in that
order, the moments' multiply-adds fused where torch's CPU kernels fuse them (``tl.fma``)
and no other multiply-add contracted (``enable_fp_fusion=False``), division and square root
correctly rounded (``tl.div_rn``, ``tl.sqrt_rn``: Triton's ``/`` and ``tl.sqrt`` are
approximate on NVIDIA GPUs). bench/formats/adamw8bit_gpu_update.py checks the bits and times the
kernel; tests/test_gpu_update_kernels.py runs that check, tests/test_adamw8bit.py the streamed
optimizer's.

Imported only where Triton is (torch's CUDA wheels bring it).
"""

import os

import torch
import triton
import triton.language as tl

from offload_plugin.formats.adamw8bit import update as adamw8bit
from offload_plugin.formats.adamw8bit.update import BLOCK

__all__ = ["GpuMaps", "update_8bit_", "update_32bit_"]

_ELEMENTS_32BIT = 1024  # elements per program of the 32-bit kernel
# Warps per program of the 8-bit kernel (a program per 256-element block): one warp takes the
# block's largest magnitudes in registers, without shared memory or barriers. On the H200 it
# ran a 32 M-element unit in 0.205 ms against 0.215 (2 warps), 0.244 (4) and 0.377 (8), and
# took 0.076-0.083 s of GPU time inside an 8B backward against 0.089-0.094 with 4 warps
# (bench/formats/adamw8bit_gpu_update.py --warps; bench/investigations/inbwd_timeline.py "adamw8bit@W").
WARPS = 1


@triton.jit
def _to_bf16_bits(p):
    """fp32 to bf16 bits (int32), nearest even; NaN as torch writes it (0x7FC0)."""
    u = p.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC0, rounded).to(tl.int32)


@triton.jit
def _mix32(x):
    """adamw8bit._mix32 on uint32 (its products wrap at 32 bits)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _round(p, index, key, STOCHASTIC: tl.constexpr):
    """adamw8bit.round_weight: bf16 bits (int32) of fp32 ``p``, to nearest or stochastically
    from 16 bits hashing ``index`` (the element's place in its parameter) and ``key``."""
    if STOCHASTIC:
        u = p.to(tl.uint32, bitcast=True)
        up = ((u + (_mix32(index.to(tl.uint32) ^ key.to(tl.uint32)) & 0xFFFF)) >> 16).to(tl.int32)
        finite = (u & 0x7FFFFFFF) < 0x7F800000
        return tl.where(finite, up, _to_bf16_bits(p))
    return _to_bf16_bits(p)


@triton.jit
def _bf16(x_bits):
    """bf16 bits (int16) to fp32."""
    return (x_bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _grad(grad, offs, inside, scale, SCALE: tl.constexpr):
    g = _bf16(tl.load(grad + offs, mask=inside, other=0))
    if SCALE:  # (as grad.mul_(scale) in bf16 before the step)
        g = _bf16(_to_bf16_bits(g * scale).to(tl.int16))
    return g


@triton.jit
def _quantize(x, inside, lut):
    """A block's codes and absmax, as adamw8bit.quantize_ (bitsandbytes' CPU table)."""
    top = tl.max(tl.where(inside, tl.abs(x), 0.0), axis=0)
    zero = top == 0.0
    inv = tl.where(zero, 0.0, tl.div_rn(1.0, tl.where(zero, 1.0, top)))
    y = tl.minimum(tl.maximum(x * inv, -1.0), 1.0)
    index = ((((y + 1.0) * 0.5) * 65535.0) + 0.5).to(tl.int32)
    index = tl.minimum(tl.maximum(index, 0), 65535)
    codes = tl.where(zero, 0, tl.load(lut + index).to(tl.int32))
    return codes.to(tl.uint8), top


@triton.jit
def _adamw8bit_kernel(weight, grad, state1, absmax1, state2, absmax2, n, coeffs, skip,
                      map1, map2, lut1, lut2, start, key, SCALE: tl.constexpr,
                      STOCHASTIC: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    block = tl.program_id(0)
    offs = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    # A step whose gradients hold an inf or NaN (skip != 0, decided on the device) writes
    # nothing, as torch's fused AdamW skips.
    limit = tl.where(tl.load(skip) == 0, n, 0)
    inside = offs < n
    stored = offs < limit
    b1 = tl.load(coeffs + 0)
    omb1 = tl.load(coeffs + 1)
    b2 = tl.load(coeffs + 2)
    omb2 = tl.load(coeffs + 3)
    c2 = tl.load(coeffs + 4)
    eps = tl.load(coeffs + 5)
    decay = tl.load(coeffs + 6)
    step_size = tl.load(coeffs + 7)
    g = _grad(grad, offs, inside, tl.load(coeffs + 10), SCALE)
    m = tl.load(map1 + tl.load(state1 + offs, mask=inside, other=0).to(tl.int32)) * tl.load(absmax1 + block)
    v = tl.load(map2 + tl.load(state2 + offs, mask=inside, other=0).to(tl.int32)) * tl.load(absmax2 + block)
    m = tl.fma(g, omb1, m * b1)
    v = tl.fma(omb2 * g, g, v * b2)
    denom = tl.div_rn(tl.sqrt_rn(v), c2) + eps
    p = _bf16(tl.load(weight + offs, mask=inside, other=0)) * decay
    p = p + tl.div_rn(step_size * m, denom)
    tl.store(weight + offs, _round(p, start + offs, key, STOCHASTIC).to(tl.int16), mask=stored)
    codes1, top1 = _quantize(m, inside, lut1)
    codes2, top2 = _quantize(v, inside, lut2)
    tl.store(state1 + offs, codes1, mask=stored)
    tl.store(state2 + offs, codes2, mask=stored)
    tl.store(absmax1 + block, top1, mask=block * BLOCK_SIZE < limit)
    tl.store(absmax2 + block, top2, mask=block * BLOCK_SIZE < limit)


@triton.jit
def _adamw32bit_kernel(weight, grad, state1, state2, n, coeffs, skip, start, key,
                       SCALE: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    limit = tl.where(tl.load(skip) == 0, n, 0)
    inside = offs < n
    stored = offs < limit
    b1 = tl.load(coeffs + 0)
    omb1 = tl.load(coeffs + 1)
    b2 = tl.load(coeffs + 2)
    omb2 = tl.load(coeffs + 3)
    decay = tl.load(coeffs + 6)
    step_size = tl.load(coeffs + 8)
    eps_c2 = tl.load(coeffs + 9)
    g = _grad(grad, offs, inside, tl.load(coeffs + 10), SCALE)
    m = tl.fma(g, omb1, tl.load(state1 + offs, mask=inside, other=0.0) * b1)
    v = tl.fma(omb2 * g, g, tl.load(state2 + offs, mask=inside, other=0.0) * b2)
    p = _bf16(tl.load(weight + offs, mask=inside, other=0)) * decay
    p = tl.fma(tl.div_rn(m, tl.sqrt_rn(v) + eps_c2), step_size, p)
    tl.store(weight + offs, _round(p, start + offs, key, STOCHASTIC).to(tl.int16), mask=stored)
    tl.store(state1 + offs, m, mask=stored)
    tl.store(state2 + offs, v, mask=stored)


class GpuMaps:
    """The two dynamic maps and bitsandbytes' quantizer tables for them, on a device."""

    def __init__(self, device) -> None:
        self.map1, self.map2 = (adamw8bit.dynamic_map(s).to(device) for s in (True, False))
        self.lut1, self.lut2 = (adamw8bit.lut(s).to(device) for s in (True, False))


def update_8bit_(weight: torch.Tensor, grad: torch.Tensor, state1: torch.Tensor, absmax1: torch.Tensor,
                 state2: torch.Tensor, absmax2: torch.Tensor, coeffs: torch.Tensor, skip: torch.Tensor,
                 maps: GpuMaps, scaled: bool = False, start: int = 0, numel: int = 0, seed: int = -1) -> None:
    """adamw8bit.update_8bit_ on flat device tensors, queued on the current stream.
    ``coeffs``: adamw8bit.coefficients' row as an fp32 tensor; ``skip``: a one-element float
    tensor, nonzero: write nothing; ``scaled``: the row's gradient scale is not 1; ``seed``:
    the row's rounding seed (stochastic rounding if >= 0, of elements ``start`` on of a
    parameter of ``numel``)."""
    n = weight.numel()
    if n:
        _adamw8bit_kernel[(triton.cdiv(n, BLOCK),)](
            weight.view(torch.int16), grad.view(torch.int16), state1, absmax1, state2, absmax2, n,
            coeffs, skip, maps.map1, maps.map2, maps.lut1, maps.lut2, start, _key(seed, numel),
            SCALE=scaled, STOCHASTIC=seed >= 0, BLOCK_SIZE=BLOCK, num_warps=WARPS, **_NO_CONTRACTION)


def update_32bit_(weight: torch.Tensor, grad: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
                  coeffs: torch.Tensor, skip: torch.Tensor, scaled: bool = False, start: int = 0,
                  numel: int = 0, seed: int = -1) -> None:
    """adamw8bit.update_32bit_ on flat device tensors, queued on the current stream."""
    n = weight.numel()
    if n:
        _adamw32bit_kernel[(triton.cdiv(n, _ELEMENTS_32BIT),)](
            weight.view(torch.int16), grad.view(torch.int16), state1, state2, n, coeffs, skip, start,
            _key(seed, numel), SCALE=scaled, STOCHASTIC=seed >= 0, BLOCK_SIZE=_ELEMENTS_32BIT,
            **_NO_CONTRACTION)


def _key(seed: int, numel: int) -> int:
    """The rounding key of a step (adamw8bit.round_weight's), as a uint32 value."""
    if seed < 0:
        return 0
    return int(adamw8bit._mix32(torch.tensor((seed * 0x9E3779B1 ^ numel) & 0xFFFFFFFF, dtype=torch.int64)))


# Triton contracts a * b + c into a fused multiply-add on a GPU unless told not to; torch's CPU
# kernels fuse only where tl.fma stands above. (The interpreter has no option.)
_NO_CONTRACTION = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}
