"""AdamW8bit's update written as torch operations: bitsandbytes' maps and quantizer, a step's
coefficients, stochastic rounding, and the 8-bit and 32-bit steps on one chunk.

This is the reference: the native host kernel (:mod:`offload_plugin.formats.adamw8bit.native`)
and the GPU kernel (:mod:`offload_plugin.formats.adamw8bit.gpu`) are checked against it bit for bit.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping
from typing import Optional

import torch

__all__ = ["BLOCK", "MIN_8BIT_SIZE", "CHUNK", "dynamic_map", "lut", "quantize_", "dequantize", "coefficients",
           "round_weight", "update_chunk_8bit_", "update_32bit_"]

BLOCK = 256  # elements per absmax (bitsandbytes' block-wise optimizers since 0.43)
MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller parameters keep fp32 moments
_LUT_SIZE = 65536
CHUNK = 1 << 16  # elements per pass of the host update (whole blocks; its temporaries stay in cache)


# --- the maps and the quantizer ----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic map (``create_dynamic_map``, 8 bits, 7 exponent bits), in its fp32
    arithmetic: for each decade 10**-6 .. 10**0, the centres of equal bins of [0.1, 1] (2**e
    bins, twice as many unsigned, which spends the sign bit on the fraction), scaled by the
    decade in fp32; with 0 and 1.0, sorted. Signed maps hold each value negated too."""
    values = [0.0, 1.0]
    for e in range(7):
        bins = 2 ** e if signed else 2 ** (e + 1)
        edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float32)
        centres = (edges[:-1] + edges[1:]) / 2.0
        scaled = centres * float(10 ** (e - 6))  # (the decade rounded to fp32, as a scalar)
        values += scaled.tolist()
        if signed:
            values += (centres * -float(10 ** (e - 6))).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def lut(signed: bool) -> torch.Tensor:
    """bitsandbytes' CPU quantizer's table: [-1, 1] cut into 65,536 points, each holding the
    code of the first map value past the midpoints below it (uint8 [65536])."""
    values = dynamic_map(signed)
    mids = (values[:-1] + values[1:]) * 0.5
    points = torch.arange(_LUT_SIZE, dtype=torch.float32) * 2.0 / float(_LUT_SIZE - 1) - 1.0
    return torch.searchsorted(mids, points, side="left").to(torch.uint8)


def quantize_(values: torch.Tensor, signed: bool, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """Quantize flat fp32 ``values`` (a whole number of blocks, or a parameter's last
    elements) into ``codes`` (uint8) and ``absmax`` (fp32, one per block), as bitsandbytes'
    CPU backend does: each block's largest magnitude, then each value times its reciprocal,
    clamped to [-1, 1], to the nearest of the table's 65,536 points, and that point's code.
    A block of zeros has absmax 0 and codes 0. Non-finite values as there too: a NaN takes
    no part in its block's absmax and gets code 0, so that it costs its own element alone;
    an inf makes its block's absmax inf, so that the block's finite values quantize as 0
    and the inf itself (inf times 0) as a NaN."""
    n = values.numel()
    blocks = -(-n // BLOCK)
    padded = values if n == blocks * BLOCK else torch.nn.functional.pad(values, (0, blocks * BLOCK - n))
    padded = padded.view(blocks, BLOCK)
    magnitude = padded.abs()
    top = magnitude.masked_fill_(magnitude.isnan(), 0.0).amax(dim=1)
    inverse = torch.where(top == 0, 0.0, 1.0 / top)  # (a zero block: codes 0 below, no NaN here)
    scaled = (padded * inverse.unsqueeze(1)).clamp_(-1.0, 1.0)
    scaled.masked_fill_(scaled.isnan(), -1.0)  # (NaN, or inf times 0: the first point, code 0)
    index = scaled.add_(1.0).mul_(0.5).mul_(float(_LUT_SIZE - 1)).add_(0.5).to(torch.int64)
    out = lut(signed)[index.clamp_(0, _LUT_SIZE - 1)]
    out[top == 0] = 0
    codes.copy_(out.view(-1)[:n])
    absmax.copy_(top)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of flat ``codes``: their map value times their block's absmax."""
    n = codes.numel()
    return dynamic_map(signed)[codes.long()] * absmax.reshape(-1).repeat_interleave(BLOCK)[:n]


# --- the update --------------------------------------------------------------------------------

def _f32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest, as torch rounds a Python scalar for an fp32 kernel)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # (beyond fp32's range: torch rounds it to inf)
        return math.copysign(math.inf, x)


def coefficients(group: Mapping, step: int, grad_scale: Optional[float] = None) -> tuple:
    """The update's scalars for step number ``step`` (counted from 1), each rounded to fp32
    where bitsandbytes' kernel takes it (derived in double first, as it derives them):
    (beta1, 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2**step), eps, 1 - lr * weight_decay,
    -lr / (1 - beta1**step), the 32-bit update's step size -lr * sqrt(..) / (1 - beta1**step),
    eps * sqrt(..), the gradient scale (1.0: none), the step's rounding seed (-1.0: round to
    nearest, else stochastic_rounding's, from the count: exact in fp32 below 2**24 steps)).
    The host update and the GPU kernel take the same row."""
    lr, (beta1, beta2), eps, decay = (float(group["lr"]), tuple(map(float, group["betas"])),
                                      float(group["eps"]), float(group["weight_decay"]))
    correction1 = 1.0 - beta1 ** step
    correction2 = math.sqrt(1.0 - beta2 ** step)
    return tuple(map(_f32, (beta1, 1.0 - beta1, beta2, 1.0 - beta2, correction2, eps,
                            1.0 - lr * decay if decay > 0.0 else 1.0, -lr / correction1,
                            -lr * correction2 / correction1, eps * correction2,
                            1.0 if grad_scale is None else float(grad_scale),
                            float(step % 2**24) if group.get("stochastic_rounding") else -1.0)))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 tensors holding values < 2**32): Wellons' lowbias32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def round_weight(p: torch.Tensor, seed: float, start: int, numel: int) -> torch.Tensor:
    """fp32 ``p`` (elements ``start`` on of a parameter of ``numel``) as bf16: to nearest
    (seed < 0, bitsandbytes' rounding), or stochastically (``stochastic_rounding=True``):
    up with probability the distance to the lower bf16 value over the gap, from 16 random
    bits that hash the element's place and the step, so that the host and the GPU kernel
    round alike. inf and NaN round to nearest."""
    if seed < 0:
        return p.to(torch.bfloat16)
    index = torch.arange(start, start + p.numel(), dtype=torch.int64) & 0xFFFFFFFF
    key = _mix32(torch.tensor((int(seed) * 0x9E3779B1 ^ numel) & 0xFFFFFFFF, dtype=torch.int64))
    bits = p.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    up = (bits + (_mix32(index ^ key) & 0xFFFF)) >> 16
    up = torch.where(up >= 2**15, up - 2**16, up).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isfinite(p), up, p.to(torch.bfloat16))


def _grad(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient in fp32, scaled as ``grad.mul_(scale)`` would have (rounded to bf16)."""
    if scale == 1.0:
        return grad.float()
    return grad.float().mul_(scale).to(grad.dtype).float()


def update_chunk_8bit_(weight: torch.Tensor, grad: torch.Tensor, state1: torch.Tensor, absmax1: torch.Tensor,
                       state2: torch.Tensor, absmax2: torch.Tensor, coeffs: tuple, start: int, numel: int,
                       a: int) -> None:
    """One step of bitsandbytes' 8-bit AdamW in place on the chunk of ``CHUNK`` elements from
    ``a`` on (flat host tensors: bf16 weight and gradient, uint8 codes, fp32 absmax), with
    torch's CPU kernels in bitsandbytes' order (the moments' multiply-adds fused there:
    ``add_(alpha=)`` and ``addcmul_``); ``start`` and ``numel``: where the tensors lie in their
    parameter (stochastic rounding's place). The reference the native and GPU kernels match."""
    b1, omb1, b2, omb2, c2, eps, decay, step_size, _, _, scale, seed = coeffs
    b = min(weight.numel(), a + CHUNK)
    ka, kb = a // BLOCK, -(-b // BLOCK)
    m = dequantize(state1[a:b], absmax1[ka:kb], True)
    v = dequantize(state2[a:b], absmax2[ka:kb], False)
    g = _grad(grad[a:b], scale)
    m.mul_(b1).add_(g, alpha=omb1)
    v.mul_(b2).addcmul_(g, g, value=omb2)
    denom = v.sqrt().div_(c2).add_(eps)
    p = weight[a:b].float()
    if decay != 1.0:
        p.mul_(decay)
    p.addcdiv_(m, denom, value=step_size)
    weight[a:b].copy_(round_weight(p, seed, start + a, numel))
    quantize_(m, True, state1[a:b], absmax1[ka:kb])
    quantize_(v, False, state2[a:b], absmax2[ka:kb])


@torch.no_grad()
def update_32bit_(weight: torch.Tensor, grad: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
                  coeffs: tuple, start: int = 0, numel: Optional[int] = None) -> None:
    """bitsandbytes' 32-bit AdamW step in place (parameters under min_8bit_size): fp32 moments."""
    b1, omb1, b2, omb2, _, _, decay, _, step_size, eps_c2, scale, seed = coeffs
    g = _grad(grad, scale)
    state1.mul_(b1).add_(g, alpha=omb1)
    state2.mul_(b2).addcmul_(g, g, value=omb2)
    p = weight.float()
    if decay != 1.0:
        p.mul_(decay)
    p.add_(state1 / state2.sqrt().add_(eps_c2), alpha=step_size)
    weight.copy_(round_weight(p, seed, start, numel or weight.numel()))
