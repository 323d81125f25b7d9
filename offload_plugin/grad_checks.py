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

from offload_plugin import native_adam

__all__ = ["NONFINITE_POLICIES", "all_finite", "FiniteRecord"]

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
            on_gpu.setdefault((t.device, t.dtype), []).append(t)
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


def _gpu_all_finite(groups: dict) -> bool:
    """Each group (same device and dtype) in one read-only multi-tensor pass, torch's
    ``_foreach_norm`` with ord 1 (as ``clip_grad_norm_`` runs it): a sum of absolute
    values is NaN or inf if any element is. It can also overflow for finite values near
    the dtype's largest; only then are the groups checked again exactly, per tensor."""
    # One verdict per device, each norm already there (a .to() per norm cost ~2 us each).
    verdicts: dict = {}
    for (device, _), group in groups.items():
        found = torch.stack(torch._foreach_norm(group, 1)).isfinite().all()
        verdicts[device] = found if device not in verdicts else verdicts[device] & found
    if all(bool(v) for v in verdicts.values()):
        return True
    return all(_extremes_finite(t) for group in groups.values() for t in group)


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
