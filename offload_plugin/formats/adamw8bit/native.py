"""``AdamW8bit``'s host update in one native pass (``csrc/adamw8bit_host.cpp``).

:func:`offload_plugin.formats.adamw8bit.optimizer.update_8bit_` written as torch CPU operations makes about
twenty passes over each chunk's temporaries: about 0.02 G parameters/s on 2 threads, an
8B model's step taking over a minute on the host. The kernel does the same arithmetic
block by block while the block is in cache. It is built on first use as
``native_adam`` builds its own (same compiler flags, cache and OpenMP runtime) and used
only after it has reproduced the torch reference bit for bit on this machine (weights,
codes and scales; odd sizes, several steps, with and without weight decay and gradient
scaling); otherwise, or with ``OFFLOAD_PLUGIN_NATIVE=0``, the update stays on the torch
path with the same results.

It rounds to nearest only (``stochastic_rounding`` stays on the torch path), and leaves
each chunk where a non-finite value appears to the reference (:meth:`Native8bit.step`).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

import torch

from offload_plugin.formats import native_build
from offload_plugin.formats.adamw8bit import update

__all__ = ["Native8bit", "kernel", "update_8bit_"]

_SOURCE = Path(__file__).parent / "csrc" / "adamw8bit_host.cpp"
_lock = threading.Lock()
_state: dict = {}


class Native8bit:
    """The loaded kernel; :func:`kernel` returns it once verified."""

    def __init__(self, lib) -> None:
        p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._step = lib.adamw8bit_step
        self._step.argtypes = [p, p, p, p, p, p, i64, p, p, p, p, p, p, i64, p, i]
        self._step.restype = i64
        self._sqrt = _torch_sqrt()
        # (kept alive here: the kernel reads them by address)
        self._tables = tuple(t.contiguous() for s in (True, False)
                             for t in (update.dynamic_map(s), update.lut(s)))

    def step(self, weight: torch.Tensor, grad: torch.Tensor, state1: torch.Tensor, absmax1: torch.Tensor,
             state2: torch.Tensor, absmax2: torch.Tensor, coeffs: tuple, num_threads: int) -> list:
        """``update_8bit_``'s round-to-nearest step on its flat host tensors, chunk by chunk
        (``update.CHUNK`` elements). Returns the first elements of the chunks it left
        untouched because a non-finite value appeared there: the caller runs the reference
        on exactly those chunks."""
        n = weight.numel()
        chunks = -(-n // update.CHUNK)
        if not _fits(n, weight, grad, state1, absmax1, state2, absmax2):  # (the reference says what is wrong)
            return list(range(0, n, update.CHUNK))
        if not n:
            return []
        skipped = torch.empty(chunks, dtype=torch.uint8)
        row = torch.tensor(coeffs, dtype=torch.float32)  # (already fp32 values)
        count = self._step(weight.data_ptr(), grad.data_ptr(), state1.data_ptr(), absmax1.data_ptr(),
                           state2.data_ptr(), absmax2.data_ptr(), n, row.data_ptr(),
                           *(t.data_ptr() for t in self._tables), self._sqrt, update.CHUNK,
                           skipped.data_ptr(), int(num_threads))
        if not count:
            return []
        return [k * update.CHUNK for k in skipped.nonzero().view(-1).tolist()]


_DTYPES = (torch.bfloat16, torch.bfloat16, torch.uint8, torch.float32, torch.uint8, torch.float32)


def _fits(n: int, *tensors: torch.Tensor) -> bool:
    """Whether the kernel may read and write these tensors: contiguous CPU tensors of
    update_8bit_'s dtypes, of ``n`` elements (one scale per block)."""
    sizes = (n, n, n, -(-n // update.BLOCK), n, -(-n // update.BLOCK))
    return all(t.device.type == "cpu" and t.dtype == d and t.numel() == size and t.is_contiguous()
               for t, d, size in zip(tensors, _DTYPES, sizes))


_VML_MODE = 0x2 | 0x140000 | 0x100  # VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, as torch's vml.h


def _torch_sqrt() -> Optional[int]:
    """The address of MKL's ``vmsSqrt`` where torch's fp32 ``sqrt`` is it (torch built with
    MKL calls it with _VML_MODE; its results are not always the correctly rounded root),
    else None: then the kernel takes IEEE sqrt, and its check against the reference says
    whether that is torch's."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        vsqrt = lib.vmsSqrt
    except (OSError, AttributeError):
        return None
    vsqrt.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    vsqrt.restype = None
    # (every exponent, subnormals included, and an odd count)
    x = torch.randint(0, 0x7F800000, (4099,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    x = x.view(torch.float32)
    out = torch.empty_like(x)
    vsqrt(x.numel(), x.data_ptr(), out.data_ptr(), _VML_MODE)
    if not torch.equal(out.view(torch.int32), x.sqrt().view(torch.int32)):
        return None
    return ctypes.cast(vsqrt, ctypes.c_void_p).value


def _matches_reference(k: Native8bit) -> Optional[str]:
    """The kernel against update_8bit_'s torch path from fresh state: odd sizes over several
    chunks, five steps, with and without decay and gradient scaling, gradients over eight
    decades (a block of zeros, a block of tiny values and zeros). None if bit-identical."""
    gen = torch.Generator().manual_seed(0)
    block, chunk = update.BLOCK, update.CHUNK
    settings = [(2 * chunk + 1077, 0.01, None), (5 * block + 3, 0.0, 0.37), (4096, 0.1, 3.0)]
    for n, decay, scale in settings:
        blocks = -(-n // block)
        ours = [(torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)).to(torch.bfloat16),
                torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks), torch.zeros(n, dtype=torch.uint8),
                torch.zeros(blocks)]
        ref = [t.clone() for t in ours]
        group = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=decay)
        for step in range(1, 6):
            decades = torch.randint(-7, 1, (n,), generator=gen).float()
            grad = (torch.randn(n, generator=gen) * 10.0 ** decades).to(torch.bfloat16)
            grad[block:2 * block] = 0
            grad[2 * block:3 * block:2] *= 1e-19  # (a second moment whose largest value is subnormal)
            grad[2 * block + 1:3 * block:2] = 0
            coeffs = update.coefficients(group, step, scale)
            if k.step(ours[0], grad, *ours[1:], coeffs, torch.get_num_threads()):
                return f"chunks of finite values were left to the reference at step {step} (n={n})"
            update_8bit_(ref[0], grad, *ref[1:], coeffs, native=False)
            for name, a, b in zip(("weight", "state1", "absmax1", "state2", "absmax2"), ours, ref):
                if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    return f"{name} differs from the reference at step {step} (n={n}, decay {decay}, scale {scale})"
    return None


def kernel() -> Optional[Native8bit]:
    """The verified native kernel, or None (no compiler, build failure, mismatch, or
    ``OFFLOAD_PLUGIN_NATIVE=0``): then update_8bit_ runs its torch path, with the same bits."""
    return native_build.load_verified(_state, _lock, _SOURCE, Native8bit, _matches_reference,
                                     "native AdamW8bit update")


@torch.no_grad()
def update_8bit_(weight: torch.Tensor, grad: torch.Tensor, state1: torch.Tensor, absmax1: torch.Tensor,
                 state2: torch.Tensor, absmax2: torch.Tensor, coeffs: tuple, start: int = 0,
                 numel: Optional[int] = None, *, native: bool = True) -> None:
    """One step of bitsandbytes' 8-bit AdamW in place, on flat host tensors (bf16 weight and
    gradient, uint8 codes, fp32 absmax), with torch's CPU kernels in bitsandbytes' order (the
    moments' multiply-adds are fused there: ``add_(alpha=)`` and ``addcmul_``). ``start``
    and ``numel``: where the tensors lie in their parameter (stochastic rounding's place).
    Rounding to nearest, the native kernel computes the same bits in one
    pass where it was verified on this machine (and ``native``); chunks it leaves (a
    non-finite value) and everything else take torch's kernels."""
    n, seed = weight.numel(), coeffs[11]
    k = kernel() if native and seed < 0 else None
    chunks = (range(0, n, update.CHUNK) if k is None else
              k.step(weight, grad, state1, absmax1, state2, absmax2, coeffs, torch.get_num_threads()))
    for a in chunks:
        update.update_chunk_8bit_(weight, grad, state1, absmax1, state2, absmax2, coeffs, start, numel or n, a)
