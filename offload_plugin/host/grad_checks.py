"""Non-finite gradient detection that reuses the passes a step makes anyway.

Scaling (``scale_grads``) reads every gradient; it uses torch's AMP kernel, which
multiplies and flags non-finite values in the same pass. Clipping computes the global
norm, which is finite only if every gradient is. Either result stays valid while the
gradients it read are unchanged (same tensors, same version counters); only otherwise
does ``step()`` scan the gradients itself.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from offload_plugin.formats.adamw import native as native_adam

__all__ = ["NONFINITE_POLICIES", "all_finite", "finite_on_device", "FiniteRecord"]

NONFINITE_POLICIES = ("skip", "raise")


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True if no tensor holds an inf or a NaN.

    GPU tensors are checked together (:func:`_gpu_all_finite`): a few multi-tensor
    kernels and one wait. A check per tensor would wait for the GPU once per tensor:
    35 ms for 192 LoRA adapters on the H200, against 1.1 ms for the whole AdamW step there.

    Contiguous bf16/fp32 host tensors take native_adam's check (a test of the exponent
    bits, one call per tensor: the host worker does this for every parameter, and each
    torch op it calls costs a GIL round trip with the training thread). Otherwise
    :func:`_extremes_finite`.
    """
    on_gpu: dict = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        if t.is_cuda:
            on_gpu.setdefault(t.device, []).append(t)
            continue
        native = native_adam.finite(t)  # host tensors: one native pass, one call
        if native is not None:
            if not native:
                return False
            continue
        if not _extremes_finite(t):
            return False
    return not on_gpu or _gpu_all_finite(on_gpu)


def _extremes_finite(t: torch.Tensor) -> bool:
    """One vectorized read pass, no temporaries: the minimum and maximum are both finite
    exactly when every element is (they propagate NaN, and an inf is an extreme).
    ``torch.isfinite(t).all()`` gives the same answer but writes a bool per element, and
    on the CPU runs ~80x slower for bf16 (measured on 100M elements)."""
    lo, hi = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _gpu_all_finite(by_device: dict) -> bool:
    """The tensors of each device in read-only multi-tensor passes (:func:`finite_on_device`),
    one wait; only if a sum is not finite are they checked again exactly, per tensor."""
    # One verdict per device, each norm already there (a .to() per norm cost ~2 us each).
    verdicts = [finite_on_device(group) for group in by_device.values()]
    if all(bool(v) for v in verdicts):
        return True
    return all(_extremes_finite(t) for group in by_device.values() for t in group)


def finite_on_device(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A bool tensor on the tensors' device (one device), computed without waiting for it:
    True means that every element is finite; False that one may not be, which
    :func:`all_finite` must confirm.

    Per dtype, torch's ``_foreach_norm`` with ord 1 (as ``clip_grad_norm_`` runs it): a sum
    of absolute values is NaN or inf if any element is, and it can also overflow for
    finite values near the dtype's largest (hence "may"). Host tensors get
    :func:`all_finite`'s exact answer (a native pass is faster there than a norm)."""
    if tensors and not tensors[0].is_cuda:
        return torch.tensor(all_finite(tensors))
    by_dtype: dict = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    found = None
    for group in by_dtype.values():
        if len(group) == 1:  # (a packed run: one norm, no stack, no reduction of verdicts)
            ok = torch.linalg.vector_norm(group[0], 1).isfinite()
        else:
            ok = torch.stack(torch._foreach_norm(group, 1)).isfinite().all()
        found = ok if found is None else found & ok
    if found is None:
        device = tensors[0].device if tensors else "cpu"
        return torch.ones((), dtype=torch.bool, device=device)
    return found


class FiniteRecord:
    """Remembers whether a set of gradients was finite when last read in full."""

    def __init__(self) -> None:
        self._found: Optional[torch.Tensor] = None
        self._seen: list[tuple[torch.Tensor, int]] = []

    def record(self, found_nonfinite: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
        """``found_nonfinite`` (a tensor, nonzero if any value was inf/NaN) covers ``grads``."""
        self._found = found_nonfinite
        self._seen = [(g, g._version) for g in grads]

    def clear(self) -> None:
        self._found, self._seen = None, []

    def known(self) -> bool:
        """Whether a scale or clip has recorded a verdict since the last clear()."""
        return self._found is not None

    def finite(self, grads: Sequence[torch.Tensor]) -> Optional[bool]:
        """The recorded answer if ``grads`` are exactly what was read, else None (unknown)."""
        if self._found is None or len(grads) != len(self._seen):
            return None
        for g, (seen, version) in zip(grads, self._seen):
            if g is not seen or g._version != version:
                return None
        return not bool(self._found.item())
