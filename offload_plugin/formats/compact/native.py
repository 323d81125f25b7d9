"""Compact AdamW host state: 8 bytes per parameter, updated in one native pass.

The exact host update keeps an fp32 master and two fp32 moments (12 bytes per parameter
beside the bf16 weight and gradient) and moves about 30 bytes per parameter per step. This
module keeps instead, per parameter:

* the bf16 weight (the one the GPU sees) and a 16-bit remainder that together hold the
  fp32 master exactly (:func:`split_master` / :func:`master_of`): 2 + 2 bytes;
* ``exp_avg`` as signed and ``exp_avg_sq`` as unsigned 8-bit codes of the dynamic
  (tree) map of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2022),
  with one fp32 absmax per block of 256 values (:func:`dynamic_map`): 1 + 1 + 8/256 bytes;
* the bf16 gradient (2 bytes), which the host holds anyway.

An update dequantizes the moments, does AdamW in fp32 exactly as with an fp32 master,
and stores the new moments as their nearest codes (deterministic: ties to the lower
code), but for one floor: a positive second moment under half the smallest positive code
(times its block's absmax) takes that code, not code 0 (0.0), as 0 would leave the next
update dividing a nonzero first moment by eps alone and moving the weight by thousands of
lr; zero keeps code 0. bitsandbytes' CUDA kernel has no such floor (it rounds to nearest;
its CPU backend's lookup table happens never to give a positive value code 0).
``csrc/adam_compact.cpp`` does this in one pass over 14 bytes per parameter; the
pure-torch :func:`reference_step` does the same IEEE operations in the same order and is
used where no compiler is available, and by the tests, which require the two to agree bit
for bit. The kernel is also checked against it on first use, as native_adam checks its own.

State layout (:class:`CompactAdamState`, flat 1-D tensors of a parameter's numel ``n``)::

    weight            bf16  [n]                the host weight, updated in place
    remainder         int16 [n] or None        None: no master (bf16 weight alone)
    exp_avg           uint8 [n]                codes of dynamic_map(signed=True)
    exp_avg_absmax    fp32  [ceil(n / 256)]
    exp_avg_sq        uint8 [n]                codes of dynamic_map(signed=False)
    exp_avg_sq_absmax fp32  [ceil(n / 256)]
    step              int

Conversions: :func:`from_adamw` / :func:`to_adamw` (torch AdamW state), :func:`from_bnb`
(a bitsandbytes AdamW8bit state entry, translated through its own maps).

Why the master is a remainder, not stochastic rounding: on bench/formats/compact_quality.py's
bigram runs (tiny Llama, 300 steps, two seeds) the loss curve's mean distance from exact
AdamW's was 0.0008 with the remainder (as bitsandbytes' AdamW8bit on fp32 masters),
0.0008-0.0009 with stochastically rounded bf16 weights and 0.08 with plain bf16 weights; at
lr 3e-4, 0.0021-0.0024 against 0.0024-0.0026 and 0.25; the exact master also makes a resume
and the conversions to and from torch's AdamW exact (docs/formats.md#compact). The
remainder costs 2 bytes per parameter.

Where the update's time goes (one thread, data in cache): on a 16-core Xeon of the H200
machine, about 1.85 ns per element against 1.1 for the fp32-master update, which the
divider bounds, when the codes were decoded by arithmetic; with 15 threads the compact
update ran at about the fp32-master update's rate, compute-bound, rather than at the 2x
its 14 bytes per element allow. On a 2-core Sapphire Rapids VM (262,144 elements), by
leaving one part out at a time: 1.24 ns per element in all (the exact
update 0.65), of which quantizing the two moments 0.39 (their two gathers 0.10),
decoding them by arithmetic 0.22, sqrt and divide 0.15, packing the 16-bit outputs 0.06.
Decoding by gather instead took it to 1.10 ns, byte-permute decoding (VBMI) to 1.19.
Quantizing by arithmetic on the map's decades would replace a gather of 5 micro-ops by
about as many operations; what remains is the update's own arithmetic.
"""

from __future__ import annotations

import ctypes
import functools
import math
import numbers
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

from offload_plugin.formats import bnb_layout as bnb_state
from offload_plugin.formats import native_build

__all__ = [
    "BLOCK", "CompactAdamState", "dynamic_map", "master_of", "split_master", "quantize",
    "dequantize", "step_", "reference_step", "from_adamw", "to_adamw", "from_bnb", "kernel",
]


BLOCK = 256  # elements per absmax, as bitsandbytes' block-wise optimizers
_SOURCE = Path(__file__).parent / "csrc" / "adam_compact.cpp"
_F32_MIN_NORMAL = torch.finfo(torch.float32).tiny


# --- the quantization maps -------------------------------------------------------------------

def _decode_form(signed: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The map as arithmetic, per group j (16 entries, 9 used): fp32 d[j], beta[j] and
    int32 base[j], such that the code whose magnitude rank a (signed: |code - 127|,
    unsigned: code + 1) falls in group j has value d[j] + beta[j] * (a - base[j]).

    From the paper's definition: after the sign bit (signed maps only), the number of
    zero bits before the first one bit is a decimal exponent e in 0..6, and the bits after
    it split [0.1, 1] into `bins` equal bins; a code stands for the centre of its bin
    times 10**-e, 10**-e * (0.1 + 0.9 * (k + 0.5) / bins) for bin k, which is d + beta * k.
    The unsigned map spends the sign bit on one more fraction bit (twice the bins). Both
    add 0 (group 0) and 1.0 (group 8). Sorted, the bins of decade e are ranks
    bins .. 2 * bins - 1 (a's bit length, less one when unsigned, is j = 7 - e + 1)."""
    d, beta = torch.zeros(16, dtype=torch.float64), torch.zeros(16, dtype=torch.float64)
    base = torch.zeros(16, dtype=torch.int32)
    for j in range(1, 8):
        e = 7 - j
        bins = 2 ** (j - 1) if signed else 2 ** j
        beta[j] = 10.0 ** -e * 0.9 / bins
        d[j] = 10.0 ** -e * (0.1 + 0.45 / bins)
        base[j] = bins
    d[8] = 1.0
    return d.to(torch.float32), beta.to(torch.float32), base


@functools.lru_cache(maxsize=None)
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 values of the dynamic tree map of Dettmers et al. (see
    _decode_form), each computed as d + beta * k in fp32 (two roundings: within a few
    ulps of the exact centre; an earlier kernel decoded by that arithmetic, and saved
    states mean these bits, so they stay). bitsandbytes' qmaps are the
    same map computed by other fp32 steps; from_bnb translates through its qmaps and never
    assumes they equal these."""
    d, beta, base = _decode_form(signed)
    codes = torch.arange(256, dtype=torch.int32)
    a = (codes - 127).abs() if signed else codes + 1
    bit_length = torch.where(a > 0, torch.floor(torch.log2(a.double().clamp(min=1))).to(torch.int32) + 1, 0)
    j = (bit_length if signed else bit_length - 1).long()
    k = (a - base[j]).to(torch.float32)
    values = d[j] + beta[j] * k
    if signed:
        values = torch.where(codes < 127, -values, values)
    assert bool((values[1:] > values[:-1]).all()), "the map must be sorted"
    return values


def _midpoints(values: torch.Tensor) -> torch.Tensor:
    """The decision boundaries: y's code is the number of midpoints below y."""
    return (values[:-1] + values[1:]) * 0.5


class _MapArgs(ctypes.Structure):
    """adam_compact.cpp's Map: pointers to the tensors of a _Map."""
    _fields_ = [("values", ctypes.c_void_p), ("table", ctypes.c_void_p), ("k0", ctypes.c_int32),
                ("nb", ctypes.c_int32), ("carry_table", ctypes.c_void_p)]


@dataclass(frozen=True)
class _Map:
    values: torch.Tensor  # fp32 [256], sorted
    mids: torch.Tensor    # fp32 [255]
    table: torch.Tensor   # int32 [nb] or [2 * nb]: the kernel's lookup table (see the .cpp)
    k0: int
    nb: int
    signed: bool

    @functools.cached_property
    def carry_table(self) -> torch.Tensor:
        """table with 0xffff - mid in place of mid in the positive buckets: the AVX-512
        quantizer's form, where the midpoint's test is one add (adam_compact.cpp,
        quantize16)."""
        return self.table ^ torch.cat([torch.full((self.nb,), 0xFFFF, dtype=torch.int32),
                                       torch.zeros(len(self.table) - self.nb, dtype=torch.int32)])

    def args(self) -> _MapArgs:
        return _MapArgs(self.values.data_ptr(), self.table.data_ptr(), self.k0, self.nb,
                        self.carry_table.data_ptr())


def _hi16(x: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) >> 16


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of int64 bit patterns in [0, 2**32)."""
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)


@functools.lru_cache(maxsize=None)
def _map(signed: bool) -> _Map:
    """dynamic_map(signed) with the kernel's lookup table: one entry per bf16 bucket of
    |y| (its top 16 bits) from k0 to 1.0, each holding the code at the bucket's end
    nearest zero and the low 16 bits of the one midpoint inside it, if any; buckets below
    k0 and above 1.0 hold no midpoint and are clamped to the ends."""
    values = dynamic_map(signed)
    mids = _midpoints(values)
    nonzero = mids[mids != 0].abs()
    k0 = int(_hi16(nonzero.min().reshape(1))) - 1  # the bucket below the smallest midpoint
    nb = int(_hi16(torch.ones(1))) - k0 + 1        # up to the bucket of 1.0
    hi16 = torch.arange(k0, k0 + nb, dtype=torch.int64)
    lo = _from_bits(hi16 << 16)
    lo[0] = 0.0                                     # bucket 0 also takes every |y| below it
    hi = _from_bits((hi16 << 16) | 0xFFFF)
    hi[-1] = float("inf")                           # the last takes every |y| above 1.0
    halves = []
    for sign in ([1.0, -1.0] if signed else [1.0]):
        # Codes at the ends of each bucket, positive: [lo, hi]; negative: [-hi, -lo].
        near, far = (lo, hi) if sign > 0 else (-lo, -hi)
        base = torch.searchsorted(mids, near if sign > 0 else far)
        top = torch.searchsorted(mids, far if sign > 0 else near)
        inside = top - base
        if (inside > 1).any():
            raise AssertionError("a bucket holds two midpoints: the table would be wrong")
        mid = mids[base.clamp(max=len(mids) - 1)].abs()
        if ((inside == 1) & (_hi16(mid) != hi16)).any():
            raise AssertionError("a midpoint lies in a clamped bucket")
        low = mid.view(torch.int32).to(torch.int64) & 0xFFFF
        none = 0xFFFF if sign > 0 else 0  # a compare that never passes
        halves.append((base << 16) | torch.where(inside == 1, low, torch.full_like(low, none)))
    table = torch.cat(halves).to(torch.int32)
    return _Map(values, mids, table, k0, nb, signed)


def quantize(x: torch.Tensor, signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-wise codes (uint8) and absmax (fp32, one per 256 values) of a flat fp32 ``x``:
    each block is multiplied by 1 / its absmax (0 when that is 0 or subnormal: such a
    block is stored as zeros) and each value stored as its nearest code, except that in
    the unsigned map a positive value never takes code 0 (0.0) but code 1."""
    m = _map(signed)
    n = x.numel()
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[:n] = x.reshape(-1)
    # NaN is ignored, as the kernel's max (`a > b ? a : b`) ignores it.
    absmax = padded.view(blocks, BLOCK).abs().nan_to_num(nan=0.0).amax(dim=1)
    zero = ~(absmax >= _F32_MIN_NORMAL)
    absmax = torch.where(zero, torch.zeros_like(absmax), absmax)
    inv = torch.where(zero, torch.zeros_like(absmax), torch.ones_like(absmax) / absmax)
    y = (padded.view(blocks, BLOCK) * inv[:, None]).reshape(-1)[:n]
    codes = torch.searchsorted(m.mids, y)
    if not signed:  # a positive second moment takes at least code 1 (see the module docstring)
        codes = torch.where((codes == 0) & (y > 0), torch.ones_like(codes), codes)
    return codes.to(torch.uint8), absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of block-wise codes: map value times the block's absmax."""
    n = codes.numel()
    return _map(signed).values[codes.reshape(-1).long()] * absmax.repeat_interleave(BLOCK)[:n]


# --- the master: bf16 weight + int16 remainder ------------------------------------------------

def split_master(master: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight, int16 remainder) of an fp32 master, with master_of(w, r) == master
    bit for bit. w is the nearest bf16 value, ties away from zero (so that the remainder,
    bits(master) - bits(w) << 16, fits 16 bits: see adam_compact.cpp); a NaN master gives a
    quiet NaN weight and remainder 0."""
    u = master.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = (u + 0x8000) >> 16
    nan = master.reshape(-1).isnan()
    w = torch.where(nan, (u >> 16) | 0x40, hi)
    r = torch.where(nan, torch.zeros_like(u), u - (hi << 16))
    w = torch.where(w >= 2 ** 15, w - 2 ** 16, w).to(torch.int16).view(torch.bfloat16)
    return w, r.to(torch.int16)


def master_of(weight: torch.Tensor, remainder: Optional[torch.Tensor]) -> torch.Tensor:
    """The fp32 master held by a bf16 weight and its remainder (the weight alone if None)."""
    if remainder is None:
        return weight.reshape(-1).float()
    hi = weight.reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
    return _from_bits(((hi << 16) + remainder.reshape(-1).to(torch.int64)) & 0xFFFFFFFF)


def zero_code(signed: bool) -> int:
    """The code of 0.0 in a map (fresh moments are zeros)."""
    return int(torch.searchsorted(_map(signed).mids, torch.zeros(1)))


# --- the state --------------------------------------------------------------------------------

@dataclass
class CompactAdamState:
    """One parameter's compact AdamW state (see the module docstring for the layout).

    ``weight`` is the parameter's host copy, updated in place by :func:`step_`; whoever
    changes it otherwise (new weights loaded) must zero ``remainder`` (:meth:`reset_master`),
    or the master becomes that weight plus a stale remainder.
    """

    weight: torch.Tensor
    remainder: Optional[torch.Tensor]
    exp_avg: torch.Tensor
    exp_avg_absmax: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_sq_absmax: torch.Tensor
    step: int = 0

    @classmethod
    def zeros(cls, weight: torch.Tensor, master_weights: bool = True) -> "CompactAdamState":
        """Fresh state for a flat, contiguous bf16 host weight (kept, not copied)."""
        if weight.dtype != torch.bfloat16 or not weight.is_contiguous() or weight.dim() != 1:
            raise ValueError("CompactAdamState needs a flat, contiguous bf16 weight")
        n, blocks = weight.numel(), -(-weight.numel() // BLOCK)
        zero_m = zero_code(signed=True)
        return cls(
            weight=weight,
            remainder=torch.zeros(n, dtype=torch.int16) if master_weights else None,
            exp_avg=torch.full((n,), zero_m, dtype=torch.uint8),
            exp_avg_absmax=torch.zeros(blocks),
            exp_avg_sq=torch.zeros(n, dtype=torch.uint8),  # code 0 is 0.0 in the unsigned map
            exp_avg_sq_absmax=torch.zeros(blocks),
        )

    def master(self) -> torch.Tensor:
        return master_of(self.weight, self.remainder)

    def moments(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """exp_avg and exp_avg_sq, dequantized (fp32)."""
        return (dequantize(self.exp_avg, self.exp_avg_absmax, True),
                dequantize(self.exp_avg_sq, self.exp_avg_sq_absmax, False))

    def reset_master(self) -> None:
        if self.remainder is not None:
            self.remainder.zero_()

    def nbytes(self) -> int:
        """Host bytes of this state, the weight included (the gradient not)."""
        ts = [self.weight, self.remainder, self.exp_avg, self.exp_avg_absmax, self.exp_avg_sq,
              self.exp_avg_sq_absmax]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def state_dict(self) -> dict:
        """The optimizer-state entry, without the weight (saved with the model): restoring
        it onto the same bf16 weight with :meth:`from_state_dict` resumes bit-exactly."""
        d = {"step": torch.tensor(float(self.step)), "exp_avg": self.exp_avg,
             "exp_avg_absmax": self.exp_avg_absmax, "exp_avg_sq": self.exp_avg_sq,
             "exp_avg_sq_absmax": self.exp_avg_sq_absmax}
        if self.remainder is not None:
            d["remainder"] = self.remainder
        return d

    @classmethod
    def from_state_dict(cls, d: dict, weight: torch.Tensor) -> "CompactAdamState":
        """The state :meth:`state_dict` saved, over ``weight``; ValueError if an entry is
        missing or of another dtype, size or value than this layout holds."""
        n, blocks = weight.numel(), -(-weight.numel() // BLOCK)
        want = {"exp_avg": (torch.uint8, n), "exp_avg_sq": (torch.uint8, n),
                "exp_avg_absmax": (torch.float32, blocks), "exp_avg_sq_absmax": (torch.float32, blocks),
                "remainder": (torch.int16, n)}
        for key, (dtype, numel) in want.items():
            t = d.get(key)
            if t is None and key == "remainder":
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != numel:
                raise ValueError(f"compact state entry {key!r}: expected {dtype} of {numel} elements")
        for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            if not bool(((d[key] >= 0) & torch.isfinite(d[key])).all()):
                raise ValueError(f"compact state entry {key!r}: block scales must be finite and >= 0")
        flat = lambda key: d[key].detach().reshape(-1).to("cpu").clone()
        return cls(weight=weight, remainder=flat("remainder") if "remainder" in d else None,
                   exp_avg=flat("exp_avg"), exp_avg_absmax=flat("exp_avg_absmax"),
                   exp_avg_sq=flat("exp_avg_sq"), exp_avg_sq_absmax=flat("exp_avg_sq_absmax"),
                   step=int(checked_step("compact state entry", d.get("step"), whole=True)))


def checked_step(where: str, value, whole: bool) -> float:
    """A saved step count as a float: a number or a one-element real tensor, finite and
    >= 0, and a whole number where ``whole`` (the compact update counts whole steps; torch's
    AdamW keeps a float). Raises ValueError naming ``where`` otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool \
            and not value.is_complex() and value.layout == torch.strided and not value.is_meta:
        value = value.item()
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok or (whole and value != int(value)):
        raise ValueError(
            f"{where} ('step') is {value!r:.40}; it needs {'a whole' if whole else 'a finite'} "
            "number of steps >= 0 (a number or a one-element tensor)."
        )
    return float(value)


# --- the update -------------------------------------------------------------------------------

def _coefficients(lr, beta1, beta2, weight_decay, eps, step, adamw, maximize, grad_scale,
                  clip_coef) -> torch.Tensor:
    """The update's fp32 scalars, in the kernel's Coefficients order: derived in double
    (as torch's kernels derive theirs) and rounded to fp32 once, here, for both the kernel
    and the reference. The gradient scale comes first, rounded to bf16 as torchtune's
    scale_grads rounds it (as in the exact path); the clip coefficient and maximize fold
    into one factor applied after, in fp32."""
    factor = (1.0 if clip_coef is None else float(clip_coef)) * (-1.0 if maximize else 1.0)
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return torch.tensor([
        factor,
        0.0 if adamw else weight_decay,           # l2
        1.0 - lr * weight_decay if adamw else 1.0,  # decay
        beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 / math.sqrt(bc2), eps, -lr / bc1,
        1.0 if grad_scale is None else float(grad_scale),  # pre_scale
    ], dtype=torch.float64).to(torch.float32)


def reference_step(state: CompactAdamState, grad: torch.Tensor, coeffs: torch.Tensor,
                   adamw: bool) -> None:
    """The kernel's update in torch, operation for operation (state.step not advanced)."""
    factor, l2, decay, b1, omb1, b2, omb2, bc2, eps, nss, pre_scale = coeffs.unbind()
    p = state.master()
    g = grad.reshape(-1)
    if float(pre_scale) != 1.0:
        g = g * float(pre_scale)  # bf16, rounded as scale_grads rounds
    g = g.float() * factor
    if not adamw and float(l2) != 0.0:
        g = g + p * l2
    m, v = state.moments()
    m = m * b1 + g * omb1
    v = v * b2 + (g * g) * omb2
    p = p * decay
    # torch's fp32 sqrt is not correctly rounded on CPU (it is within half an ulp plus a
    # little); in double it is, and rounding that to fp32 is the correctly rounded fp32
    # sqrt (double has more than 2 * 24 + 2 bits), as the kernel's sqrt instruction gives.
    denom = v.double().sqrt().float() * bc2 + eps  # bc2: 1 / sqrt(1 - beta2 ** step)
    p = p + (m * nss) / denom
    if state.remainder is not None:
        w, r = split_master(p)
        state.remainder.copy_(r)
    else:
        w = p.to(torch.bfloat16)  # nearest even (a NaN's bits may differ from the kernel's)
    state.weight.copy_(w)
    for codes, absmax, new, signed in ((state.exp_avg, state.exp_avg_absmax, m, True),
                                       (state.exp_avg_sq, state.exp_avg_sq_absmax, v, False)):
        c, a = quantize(new, signed)
        codes.copy_(c)
        absmax.copy_(a)


def _check(state: CompactAdamState, grad: torch.Tensor) -> None:
    n = state.weight.numel()
    blocks = -(-n // BLOCK)
    want = [(state.weight, torch.bfloat16, n), (grad, torch.bfloat16, n),
            (state.exp_avg, torch.uint8, n), (state.exp_avg_sq, torch.uint8, n),
            (state.exp_avg_absmax, torch.float32, blocks),
            (state.exp_avg_sq_absmax, torch.float32, blocks)]
    if state.remainder is not None:
        want.append((state.remainder, torch.int16, n))
    for t, dtype, numel in want:
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("compact step needs contiguous CPU tensors: bf16 weight and grad, "
                             "int16 remainder, uint8 codes of the weight's numel and fp32 "
                             "absmax of one per 256 elements")


def step_(state: CompactAdamState, grad: torch.Tensor, *, lr: float, beta1: float = 0.9,
          beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
          adamw: bool = True, maximize: bool = False, grad_scale: Optional[float] = None,
          clip_coef: Optional[float] = None, num_threads: Optional[int] = None,
          native: bool = True) -> None:
    """One AdamW (or Adam, ``adamw=False``: L2 weight decay) step of ``state`` in place,
    from a bf16 ``grad`` of the weight's numel, multiplied first by ``grad_scale``
    (rounded to bf16 as ``grad * grad_scale`` is: the same bits as scaling the gradient
    beforehand, as torchtune's scale_grads does) and then by ``clip_coef`` (in fp32). Advances ``state.step``. The gradient must be finite
    (skip steps whose gradients are not, as the exact path does). Uses the native kernel
    when it was built and verified here (and ``native``), else :func:`reference_step`:
    the same bits either way."""
    _check(state, grad)
    state.step += 1
    coeffs = _coefficients(lr, beta1, beta2, weight_decay, eps, state.step, adamw, maximize,
                           grad_scale, clip_coef)
    update_(state, grad, coeffs, adamw, num_threads, native)


def update_(state: CompactAdamState, grad: torch.Tensor, coeffs: torch.Tensor, adamw: bool,
            num_threads: Optional[int] = None, native: bool = True) -> None:
    """The update with ``coeffs`` (_coefficients) already derived, ``state.step`` left as it
    is: by the native kernel where it was built and verified here (and ``native``), else by
    :func:`reference_step`, the same bits either way."""
    k = kernel() if native else None
    if k is None:
        reference_step(state, grad, coeffs, adamw)
    else:
        k.step(state, grad, coeffs, adamw,
               torch.get_num_threads() if num_threads is None else num_threads)


# --- the native kernel ------------------------------------------------------------------------

class CompactKernel:
    """The loaded adam_compact.cpp; :func:`kernel` returns it once verified."""

    def __init__(self, lib) -> None:
        p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._step = lib.adam_compact_step
        self._step.argtypes = [p, p, p, p, p, p, p, i64, p, p, p, i, i]
        self._step.restype = i
        self._quantize = lib.compact_quantize
        self._quantize.argtypes = [p, p, i64, p, i, i]
        self._quantize.restype = i
        self.has_avx512 = bool(lib.compact_has_avx512())
        self._maps = (_map(True), _map(False))
        self._args = tuple(m.args() for m in self._maps)  # kept alive with the tensors above

    def step(self, state: CompactAdamState, grad: torch.Tensor, coeffs: torch.Tensor,
             adamw: bool, num_threads: int) -> None:
        r = state.remainder.data_ptr() if state.remainder is not None else None
        self._step(state.weight.data_ptr(), r, grad.data_ptr(), state.exp_avg.data_ptr(),
                   state.exp_avg_absmax.data_ptr(), state.exp_avg_sq.data_ptr(),
                   state.exp_avg_sq_absmax.data_ptr(), state.weight.numel(),
                   ctypes.byref(self._args[0]), ctypes.byref(self._args[1]),
                   coeffs.data_ptr(), int(adamw), int(num_threads))

    def quantize_normalized(self, y: torch.Tensor, signed: bool, vector: bool = True) -> torch.Tensor:
        """Codes of fp32 values already divided by their absmax: the table lookup alone, by
        the AVX-512 code (``vector``, where built) or the portable one."""
        y = y.reshape(-1).contiguous()
        out = torch.empty(y.numel(), dtype=torch.uint8)
        self._quantize(y.data_ptr(), out.data_ptr(), y.numel(),
                       ctypes.byref(self._args[0 if signed else 1]), int(signed), int(vector))
        return out


_lock = threading.Lock()
_state: dict = {}


def _random_state(n: int, gen: torch.Generator, master_weights: bool) -> CompactAdamState:
    w = (torch.randn(n, generator=gen) * torch.logspace(-4, 1, n)).to(torch.bfloat16)
    s = CompactAdamState.zeros(w, master_weights)
    if master_weights:
        s.remainder.copy_(torch.randint(-(1 << 15), 1 << 15, (n,), generator=gen, dtype=torch.int16))
    return s


def _matches_reference(k: CompactKernel) -> Optional[str]:
    """The kernel against reference_step, several settings and steps: None if bit-identical."""
    gen = torch.Generator().manual_seed(0)
    n = BLOCK * 37 + 11
    settings = [dict(adamw=True, weight_decay=0.01, maximize=False, grad_scale=None, clip_coef=None, mw=True),
                dict(adamw=False, weight_decay=0.1, maximize=True, grad_scale=0.37, clip_coef=0.5, mw=True),
                dict(adamw=True, weight_decay=0.0, maximize=False, grad_scale=1 / 3, clip_coef=None, mw=False)]
    for s in settings:
        a = _random_state(n, gen, s["mw"])
        b = CompactAdamState(**{f: (getattr(a, f).clone() if isinstance(getattr(a, f), torch.Tensor) else getattr(a, f))
                                for f in a.__dataclass_fields__})
        for t in range(1, 4):
            grad = (torch.randn(n, generator=gen) * torch.logspace(-6, 1, n)).to(torch.bfloat16)
            coeffs = _coefficients(1e-3 * t, 0.9, 0.999, s["weight_decay"], 1e-8, t, s["adamw"],
                                   s["maximize"], s["grad_scale"], s["clip_coef"])
            k.step(a, grad, coeffs, s["adamw"], torch.get_num_threads())
            reference_step(b, grad, coeffs, s["adamw"])
            for f in ("weight", "remainder", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"):
                x, y = getattr(a, f), getattr(b, f)
                if x is not None and not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                    return f"{f} differs from the reference at step {t} with {s}"
    return None


def kernel() -> Optional[CompactKernel]:
    """The verified native kernel, or None (no compiler, build failure, mismatch, or
    ``OFFLOAD_PLUGIN_NATIVE=0``): then step_ runs the reference, with the same bits."""
    return native_build.load_verified(_state, _lock, _SOURCE, CompactKernel, _matches_reference,
                                     "native compact update")


# --- conversions ------------------------------------------------------------------------------

def from_adamw(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: int = 0, master: Optional[torch.Tensor] = None,
               master_weights: bool = True) -> CompactAdamState:
    """Compact state from torch AdamW state: ``exp_avg``/``exp_avg_sq`` of ``param``'s
    numel (any float dtype), ``step``, and the fp32 ``master`` if there is one, else
    ``param`` itself is the master (exactly kept when fp32). The new bf16 weight is a new
    flat tensor (``state.weight``): copy it into the host weight, or the GPU's, as it may
    differ from ``param.to(bfloat16)`` by one ulp at exact ties (it rounds ties away from
    zero). Moments are quantized to their nearest codes."""
    source = (master if master is not None else param).detach().reshape(-1).to("cpu", torch.float32)
    if master_weights:
        weight, remainder = split_master(source)
    else:
        weight, remainder = source.to(torch.bfloat16), None
    m_codes, m_absmax = quantize(exp_avg.detach().reshape(-1).to("cpu", torch.float32), True)
    v_codes, v_absmax = quantize(exp_avg_sq.detach().reshape(-1).to("cpu", torch.float32), False)
    return CompactAdamState(weight=weight.contiguous(), remainder=remainder, exp_avg=m_codes,
                            exp_avg_absmax=m_absmax, exp_avg_sq=v_codes,
                            exp_avg_sq_absmax=v_absmax, step=int(float(step)))


def to_adamw(state: CompactAdamState) -> Tuple[torch.Tensor, dict]:
    """(fp32 master, torch AdamW state entry {"step", "exp_avg", "exp_avg_sq"}): the master
    is exact; the moments are the dequantized codes. Loading them into torch.optim.AdamW
    (fp32 parameter = the master) continues the same optimization with fp32 moments."""
    m, v = state.moments()
    return state.master(), {"step": torch.tensor(float(state.step)), "exp_avg": m, "exp_avg_sq": v}


def from_bnb(param: torch.Tensor, entry: dict, master_weights: bool = True) -> CompactAdamState:
    """Compact state from one parameter's entry of a bitsandbytes (0.50) AdamW8bit state
    dict: ``state1``/``state2`` uint8 codes, ``qmap1``/``qmap2`` their maps, ``absmax1``/
    ``absmax2`` one per block, ``step``; the quantization tensors may be wrapped under
    ``"__bnb_optimizer_quant_state__"`` (its state_dict() does that). Parameters it kept
    in 32 bits (fewer than its min_8bit_size elements) hold fp32 ``state1``/``state2``.
    Its moments are dequantized through its own maps and quantized again with ours.
    bitsandbytes has no master weights: ``param`` is the master.

    Raises:
        ValueError: the entry is not what bitsandbytes writes for ``param`` (bnb_state says
            what differs).
    """
    moments = bnb_state.read_entry("bitsandbytes state entry", entry, param.shape)
    return from_adamw(param, moments.exp_avg, moments.exp_avg_sq, step=moments.step,
                      master_weights=master_weights)
