"""A one-pass Adam(W) update for fp32 master weights with bf16 gradients (optional).

torch has no fused CPU kernel that reads a bf16 gradient into an fp32 update and writes
the bf16 weight back, so without this the host runs three passes (upcast, fused AdamW,
downcast). ``csrc/adam_master_bf16.cpp`` does the same arithmetic in one pass. It also
updates bf16 weights without master weights in one pass over whole tensors, gradient
scaling included (torch's path: a scaled copy of the gradient, then its kernel). It is
compiled on first use with the system's C++ compiler (about a second; cached under
``$OFFLOAD_PLUGIN_CACHE`` or ``~/.cache/offload_plugin``) and linked to the OpenMP
runtime torch already uses, so both share one thread pool.

It is used only after it has reproduced ``torch._fused_adamw_`` / ``torch._fused_adam_``
bit for bit on this machine (several settings, several steps); otherwise, or without a
compiler, the update stays on torch's kernels with the same results, only slower. Set
``OFFLOAD_PLUGIN_NATIVE=0`` to never build or use it.

The same library adds one bf16 tensor into another in one pass (:func:`add_`, gradient
accumulation on the host), checked against ``torch.Tensor.add_`` the same way: torch's bf16
``add_`` moves well under half the memory bandwidth the host reaches in other kernels.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Optional

import torch

from offload_plugin.formats import native_build

__all__ = ["kernel", "add_", "NativeAdam", "ALIGN", "ALIGN_BF16"]

log = logging.getLogger(__name__)

# The kernel covers whole blocks of ALIGN elements; torch's own kernel handles a tensor's
# last elements past its vector width differently (scalar code), so those go to torch.
# 16 fp32 or 64 bf16 elements are whole vectors for every x86 vector width torch uses.
ALIGN = 16
ALIGN_BF16 = 64

_SOURCE = Path(__file__).parent / "csrc" / "adam_master_bf16.cpp"
_lock = threading.Lock()
_state: dict = {}


def _load(path: Path):
    lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
    p, i64, d, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int, ctypes.c_float
    fp32 = lib.adam_master_bf16_step
    fp32.argtypes = [p, p, p, p, p, i64, d, d, d, d, d, d, i, i, i, f, i]
    fp32.restype = i
    bf16 = lib.adam_bf16_step
    bf16.argtypes = [p, p, p, p, i64, d, d, d, d, d, d, i, i, i, f, i]
    bf16.restype = i
    add = lib.add_bf16_inplace
    add.argtypes = [p, p, i64, i]
    add.restype = i
    nonfinite = lib.any_nonfinite
    nonfinite.argtypes = [p, i64, i, i]
    nonfinite.restype = i
    # Arrays of pointers, sizes and step counts, then the shared scalars.
    pp, pi64, pd = ctypes.POINTER(p), ctypes.POINTER(i64), ctypes.POINTER(d)
    fp32_many = lib.adam_master_bf16_many
    fp32_many.argtypes = [i64, pp, pp, pp, pp, pp, pi64, pd, d, d, d, d, d, i, i, i, f, i]
    fp32_many.restype = i
    bf16_many = lib.adam_bf16_many
    bf16_many.argtypes = [i64, pp, pp, pp, pp, pi64, pd, d, d, d, d, d, i, i, i, f, i]
    bf16_many.restype = i
    return fp32, bf16, add, nonfinite, fp32_many, bf16_many


class NativeAdam:
    """The loaded kernel. Call :meth:`step` on flat, contiguous host tensors.

    ``dtypes`` holds the weight dtypes it was verified for on this machine (fp32 masters,
    bf16 weights without masters); only those may be stepped. ``can_add`` says whether
    :meth:`add_` was verified (it is checked separately and does not affect ``dtypes``).
    """

    def __init__(self, fns) -> None:
        self._fp32, self._bf16, self._add, self._nonfinite, self._fp32_many, self._bf16_many = fns
        self.dtypes: set = {torch.float32, torch.bfloat16}
        self.can_add = True
        self.can_check = True
        self.can_step_many = True

    @staticmethod
    def align(dtype: torch.dtype) -> int:
        """The kernel takes a multiple of this many elements (see ALIGN)."""
        return ALIGN_BF16 if dtype == torch.bfloat16 else ALIGN

    def step(
        self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor, weight_out: Optional[torch.Tensor], *, lr: float,
        beta1: float, beta2: float, weight_decay: float, eps: float, step: float,
        adamw: bool, maximize: bool, grad_scale: Optional[float], num_threads: int,
    ) -> None:
        """Update ``master``, ``exp_avg``, ``exp_avg_sq`` in place from ``grad`` (bf16).

        ``master`` and the moments are fp32 (then ``weight_out``, bf16 or None, receives
        the new weight) or bf16 (no master weights; ``weight_out`` must be None).
        ``step`` is the count after this update. All tensors: 1-D, contiguous, same
        numel, a multiple of :meth:`align`.
        """
        n = master.numel()
        tensors = (master, grad, exp_avg, exp_avg_sq) + ((weight_out,) if weight_out is not None else ())
        if n % self.align(master.dtype) or any(
            t.numel() != n or not t.is_contiguous() or t.device.type != "cpu" for t in tensors
        ):
            raise ValueError("NativeAdam.step needs contiguous CPU tensors of one numel, "
                             "a multiple of NativeAdam.align(dtype)")
        bf16 = torch.bfloat16
        state_ok = exp_avg.dtype == exp_avg_sq.dtype == master.dtype
        if grad.dtype != bf16 or not state_ok or master.dtype not in self.dtypes or (
            weight_out is not None and (weight_out.dtype != bf16 or master.dtype == bf16)
        ):
            raise ValueError("NativeAdam.step needs a bf16 gradient and an fp32 master with "
                             "fp32 moments (bf16 weight_out optional), or bf16 weight and moments")
        scalars = (
            float(lr), float(beta1), float(beta2), float(weight_decay), float(eps), float(step),
            int(adamw), int(maximize), int(grad_scale is not None),
            float(grad_scale if grad_scale is not None else 1.0), int(num_threads),
        )
        ptrs = (master.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr())
        if master.dtype == bf16:
            self._bf16(*ptrs, n, *scalars)
        else:
            out = weight_out.data_ptr() if weight_out is not None else None
            self._fp32(*ptrs, out, n, *scalars)

    def step_many(
        self, masters: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
        weight_outs: Optional[list], steps: list, *, lr: float, beta1: float, beta2: float,
        weight_decay: float, eps: float, adamw: bool, maximize: bool,
        grad_scale: Optional[float], num_threads: int,
    ) -> None:
        """:meth:`step` for several tensors of one parameter group in one call, each with
        its own step count (``steps``); the same values as calling :meth:`step` on each.
        ``weight_outs`` is None or a list like ``masters`` (fp32 masters only)."""
        if not self.can_step_many:
            raise RuntimeError("NativeAdam.step_many did not match step() on this machine")
        count = len(masters)
        lists = [masters, grads, exp_avgs, exp_avg_sqs] + ([weight_outs] if weight_outs is not None else [])
        if any(len(x) != count for x in lists) or len(steps) != count:
            raise ValueError("NativeAdam.step_many needs lists of one length")
        if count == 0:
            return
        dtype = masters[0].dtype
        if dtype not in self.dtypes or (weight_outs is not None and dtype != torch.float32):
            raise ValueError("NativeAdam.step_many needs fp32 masters (with optional bf16 "
                             "weight_outs) or bf16 weights, of a dtype that was verified")
        state_dtypes = (dtype, torch.bfloat16, dtype, dtype) + ((torch.bfloat16,) if weight_outs is not None else ())
        numels = []
        for k in range(count):
            tensors = [x[k] for x in lists]
            n = tensors[0].numel()
            if n % self.align(dtype) or any(
                t.numel() != n or t.dtype != want or not t.is_contiguous() or t.device.type != "cpu"
                for t, want in zip(tensors, state_dtypes)
            ):
                raise ValueError("NativeAdam.step_many needs, per tensor, contiguous CPU "
                                 "tensors of one numel, a multiple of NativeAdam.align(dtype), "
                                 "with the dtypes step() takes")
            numels.append(n)
        ptrs = [(ctypes.c_void_p * count)(*(t.data_ptr() for t in x)) for x in lists]
        scalars = (
            float(lr), float(beta1), float(beta2), float(weight_decay), float(eps),
            int(adamw), int(maximize), int(grad_scale is not None),
            float(grad_scale if grad_scale is not None else 1.0), int(num_threads),
        )
        sizes = (ctypes.c_int64 * count)(*numels)
        step_counts = (ctypes.c_double * count)(*map(float, steps))
        if dtype == torch.bfloat16:
            self._bf16_many(count, *ptrs, sizes, step_counts, *scalars)
        else:
            outs = ptrs[4] if weight_outs is not None else None
            self._fp32_many(count, *ptrs[:4], outs, sizes, step_counts, *scalars)

    def add_(self, dst: torch.Tensor, src: torch.Tensor, num_threads: int) -> None:
        """``dst += src`` for contiguous, non-overlapping bf16 CPU tensors of one numel
        (any numel), with the values of ``dst.add_(src)``; a NaN is stored as 0xffff."""
        if not _addable(dst, src):
            raise ValueError("NativeAdam.add_ needs contiguous, non-overlapping bf16 CPU "
                             "tensors of one numel")
        if not self.can_add:
            raise RuntimeError("NativeAdam.add_ did not match torch on this machine")
        if dst.numel():
            self._add(dst.data_ptr(), src.data_ptr(), dst.numel(), int(num_threads))

    def finite(self, t: torch.Tensor, num_threads: int) -> bool:
        """Whether a contiguous bf16 or fp32 CPU tensor holds no inf and no NaN."""
        if not (t.device.type == "cpu" and t.is_contiguous() and t.dtype in _CHECKED):
            raise ValueError("NativeAdam.finite needs a contiguous bf16 or fp32 CPU tensor")
        if not self.can_check:
            raise RuntimeError("NativeAdam.finite did not match torch on this machine")
        return t.numel() == 0 or not self._nonfinite(
            t.data_ptr(), t.numel(), t.element_size(), int(num_threads))


_CHECKED = (torch.bfloat16, torch.float32)


def finite(t: torch.Tensor) -> Optional[bool]:
    """Whether ``t`` holds no inf and no NaN, in one native read pass (with
    ``torch.get_num_threads()`` threads); None where that does not apply (not a
    contiguous bf16/fp32 CPU tensor, or no verified kernel): ask torch then."""
    native = _state["kernel"] if "kernel" in _state else kernel()
    if (native is None or not native.can_check or t.device.type != "cpu"
            or t.dtype not in _CHECKED or not t.is_contiguous()):
        return None
    return native.finite(t, torch.get_num_threads())


def _many_matches_step(native: NativeAdam) -> Optional[str]:
    """native.step_many against native.step tensor by tensor (steps and sizes differing,
    fp32 masters with and without weight_out, bf16): None if bit-identical."""
    gen = torch.Generator().manual_seed(1)
    for dtype in sorted(native.dtypes, key=str):
        for with_out in ([True, False] if dtype == torch.float32 else [False]):
            sizes = [ALIGN_BF16 * k for k in (1, 3, 1100, 2)]  # 1100 * 64 > one 64 Ki piece
            steps = [1.0, 2.0, 7.0, 1000.0]
            made = [[(torch.randn(n, generator=gen) * 0.1).to(dtype) for _ in range(3)] for n in sizes]
            grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes]
            twins = [[t.clone() for t in ts] for ts in made]
            outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes] if with_out else None
            twin_outs = [o.clone() for o in outs] if with_out else None
            kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, adamw=True,
                      maximize=False, grad_scale=0.5, num_threads=torch.get_num_threads())
            native.step_many([m[0] for m in made], grads, [m[1] for m in made], [m[2] for m in made],
                             outs, steps, **kw)
            for k, (w, m, v) in enumerate(twins):
                native.step(w, grads[k], m, v, twin_outs[k] if with_out else None, step=steps[k], **kw)
                got = made[k] + ([outs[k]] if with_out else [])
                want = [w, m, v] + ([twin_outs[k]] if with_out else [])
                if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want)):
                    return f"step_many differs from step for {dtype}"
    return None


def _check_matches_torch(native: NativeAdam) -> Optional[str]:
    """native.finite against torch.isfinite(t).all(): None if they agree everywhere."""
    gen = torch.Generator().manual_seed(0)
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        info = torch.iinfo(bits)
        # Every exponent and sign, with one special value placed at each end and in the middle.
        n = 7 * 4096 + 5
        t = torch.randint(info.min, info.max, (n,), generator=gen, dtype=bits).view(dtype)
        t[~torch.isfinite(t)] = 1.0
        cases = [t]
        for bad in (float("inf"), -float("inf"), float("nan")):
            for where in (0, n // 2, n - 1):
                c = t.clone()
                c[where] = bad
                cases.append(c)
        for c in cases + [t[:0], t[:1], t[:33]]:
            if native.finite(c, torch.get_num_threads()) != bool(torch.isfinite(c).all()):
                return f"finite() differs from torch.isfinite on {dtype}"
    return None


def _addable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    if not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()
               for t in (dst, src)) or dst.numel() != src.numel():
        return False
    # The kernel reads src while writing dst (restrict pointers): no shared bytes at all.
    nbytes = dst.numel() * 2
    return dst.data_ptr() + nbytes <= src.data_ptr() or src.data_ptr() + nbytes <= dst.data_ptr()


def add_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.add_(src)``: in one native pass (with ``torch.get_num_threads()`` threads)
    for contiguous bf16 CPU tensors of one shape when the kernel was verified here,
    else through torch. Same values either way (a NaN's bit pattern may differ, as it
    does between torch's own vector and scalar code)."""
    native = _state["kernel"] if "kernel" in _state else kernel()
    if (native is not None and native.can_add and dst.shape == src.shape
            and not (dst.requires_grad or src.requires_grad) and _addable(dst, src)):
        if dst.numel():  # checked above: skip NativeAdam.add_'s second check (a few µs)
            native._add(dst.data_ptr(), src.data_ptr(), dst.numel(), torch.get_num_threads())
    else:
        dst.add_(src)


_SETTINGS = [
    dict(adamw=True, weight_decay=0.01, beta1=0.9, maximize=False, grad_scale=None),
    dict(adamw=True, weight_decay=0.0, beta1=0.3, maximize=True, grad_scale=1 / 3),
    dict(adamw=False, weight_decay=0.1, beta1=0.9, maximize=False, grad_scale=0.37),
    dict(adamw=False, weight_decay=0.0, beta1=0.0, maximize=False, grad_scale=None),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _matches_torch(native: NativeAdam, dtype: torch.dtype) -> Optional[str]:
    """Run native and torch side by side for weights of ``dtype``; None if bit-identical,
    else what differed. torch's reference is what the host update does without the kernel:
    the gradient scaled in bf16 (as scale_grads would), upcast for fp32 masters, then
    torch's fused kernel."""
    gen = torch.Generator().manual_seed(0)
    n = ALIGN_BF16 * 1031
    for s in _SETTINGS:
        master = (torch.randn(n, generator=gen) * torch.logspace(-6, 2, n)).to(dtype)
        m, v = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
        ref_master, ref_m, ref_v = master.clone(), m.clone(), v.clone()
        step_t = torch.zeros(())
        out = torch.empty(n, dtype=torch.bfloat16) if dtype == torch.float32 else None
        for k in range(1, 4):
            grad = (torch.randn(n, generator=gen) * torch.logspace(-8, 1, n)).to(torch.bfloat16)
            g = grad * s["grad_scale"] if s["grad_scale"] is not None else grad  # rounds in bf16
            g = g.to(dtype)
            step_t += 1
            kernel = torch._fused_adamw_ if s["adamw"] else torch._fused_adam_
            kernel([ref_master], [g], [ref_m], [ref_v], [], [step_t], amsgrad=False,
                   lr=1e-3 * k, beta1=s["beta1"], beta2=0.999, weight_decay=s["weight_decay"],
                   eps=1e-8, maximize=s["maximize"], grad_scale=None, found_inf=None)
            native.step(master, grad, m, v, out, lr=1e-3 * k, beta1=s["beta1"], beta2=0.999,
                        weight_decay=s["weight_decay"], eps=1e-8, step=float(k),
                        adamw=s["adamw"], maximize=s["maximize"],
                        grad_scale=s["grad_scale"], num_threads=torch.get_num_threads())
            pairs = [("weight", master, ref_master), ("exp_avg", m, ref_m), ("exp_avg_sq", v, ref_v)]
            if out is not None:
                pairs.append(("bf16 weight", out, ref_master.to(torch.bfloat16)))
            for name, a, b in pairs:
                if not torch.equal(_bits(a), _bits(b)):
                    return f"{name} differs from torch's kernel at step {k} with {s}"
    return None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN equals any NaN: torch's bf16 add_ itself writes
    0xffff from its x86 vector code and 0x7fc0 from its scalar tails, which fall at places
    set by its thread count."""
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(_bits(a)[~nan_a], _bits(b)[~nan_b])


def _add_matches_torch(native: NativeAdam) -> Optional[str]:
    """native.add_ against torch's add_ on bf16: None if the same values, else what differed.
    Operands: every bit pattern (so every exponent, subnormals, infs, NaNs), values of
    close magnitude (rounding, cancellation), every pair of some special values; an odd
    size that several threads split."""
    gen = torch.Generator().manual_seed(0)
    n = 3 * 32768 + 77
    # inf - inf, overflow to inf, subnormal sums, signed zeros, ties to even at 1.0.
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan"), 0.0, -0.0,
                            3e38, -3e38, 1e-40, -1e-40, 1.0, 1.0078125, 2.0 ** -8],
                           dtype=torch.bfloat16)
    pairs = len(special) ** 2
    for k, what in enumerate(["bit patterns", "close magnitudes"]):
        if k == 0:
            dst, src = (torch.randint(-(1 << 15), 1 << 15, (n,), generator=gen, dtype=torch.int16)
                        .view(torch.bfloat16) for _ in range(2))
        else:  # from 1e-38 to 3e38
            scale = torch.logspace(-38, 38.5, n)
            dst, src = ((torch.randn(n, generator=gen) * scale).to(torch.bfloat16) for _ in range(2))
        dst[:pairs] = special.repeat_interleave(len(special))
        src[:pairs] = special.repeat(len(special))
        ref = dst.clone().add_(src)
        native.add_(dst, src, torch.get_num_threads())
        if not _same_values(dst, ref):
            return f"add_ differs from torch's on {what}"
    return None


def kernel() -> Optional[NativeAdam]:
    """The verified native kernel, or None (no compiler, build failure, mismatch, or disabled).

    Its ``dtypes`` lists the weight dtypes that matched torch bit for bit here, ``can_add``
    whether its add did; None when neither the update nor the add can be used.
    """
    with _lock:
        if "kernel" in _state:
            return _state["kernel"]
        result, reasons, add_reason = None, [], None
        if os.environ.get("OFFLOAD_PLUGIN_NATIVE", "1") == "0":
            reasons.append("OFFLOAD_PLUGIN_NATIVE=0")
            add_reason = reasons[0]
        else:
            try:
                candidate = NativeAdam(_load(native_build.build(_SOURCE)))
                for dtype in sorted(candidate.dtypes, key=str):
                    why = _matches_torch(candidate, dtype)
                    if why is not None:
                        candidate.dtypes.discard(dtype)
                        reasons.append(f"{dtype}: {why}")
                add_reason = _add_matches_torch(candidate)
                candidate.can_add = add_reason is None
                candidate.can_check = _check_matches_torch(candidate) is None
                candidate.can_step_many = bool(candidate.dtypes) and _many_matches_step(candidate) is None
                result = candidate if candidate.dtypes or candidate.can_add or candidate.can_check else None
            except (RuntimeError, OSError) as err:
                reasons.append(str(err))
                add_reason = str(err)
        reason = "; ".join(reasons) or None
        if reason:
            log.info("offload_plugin: one-pass host update unavailable (%s); using torch's "
                     "fused kernel in several passes there (same results, slower).", reason)
        if add_reason:
            log.info("offload_plugin: one-pass bf16 gradient add unavailable (%s); using "
                     "torch's add_ (same results, slower).", add_reason)
        _state["kernel"] = result
        _state["reason"] = reason
        _state["add_reason"] = add_reason
        return result
