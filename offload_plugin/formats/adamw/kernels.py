"""How AdamW runs: one place turns a param group into kernel arguments and picks the kernel.

As ``torch.optim.adam.adam()`` picks its single-tensor, foreach or fused function for a
list of tensors and calls it with the same arguments, every update of torch's Adam(W) state
comes here with its tensors and a :class:`~offload_plugin.formats.adam_args.Settings`, and :func:`pick` chooses:

- ``NATIVE``: ``native_adam``'s one pass over host tensors (a bf16 gradient into an fp32
  master with a bf16 weight out, or a bf16 weight), where it was verified bit-identical to
  torch's fused kernel on this machine; a tensor's last elements past whole vectors go to
  ``FUSED`` (torch's scalar tail rounds them its own way).
- ``FUSED``: torch's fused kernel (``_fused_adamw_`` / ``_fused_adam_``), on any device; on
  the host over chunks that stay in cache, the gradient scaled and widened there.

The results are torch's ``AdamW(fused=True)`` for exact state on the same tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from offload_plugin.formats.adam_args import Settings, fused
from offload_plugin.formats.adamw import native as native_adam

__all__ = ["NATIVE", "FUSED", "Settings", "pick", "fused", "host_step", "host_step_many"]

NATIVE, FUSED = "native", "fused"


def pick(weight: torch.Tensor, grad: torch.Tensor, *, amsgrad: bool = False,
         weight_out: Optional[torch.Tensor] = None, allow_native: bool = True) -> str:
    """The kernel for ``weight`` (the tensor updated: a master or the weight) with ``grad``:
    NATIVE where the one-pass kernel applies and was
    verified here (host tensors, a bf16 gradient, an fp32 master with a bf16 ``weight_out``
    or none, or a bf16 weight without one; no amsgrad); else FUSED."""
    if not allow_native or amsgrad or grad.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return FUSED
    if weight.dtype == torch.float32:
        if weight_out is not None and weight_out.dtype != torch.bfloat16:
            return FUSED
    elif weight.dtype != torch.bfloat16 or weight_out is not None:
        return FUSED
    native = native_adam.kernel()
    return NATIVE if native is not None and weight.dtype in native.dtypes else FUSED


def _native_kwargs(settings: Settings, grad_scale: Optional[float]) -> dict:
    return dict(lr=float(settings.lr), beta1=settings.beta1, beta2=settings.beta2,
                weight_decay=settings.weight_decay, eps=settings.eps, adamw=settings.decoupled,
                maximize=settings.maximize, grad_scale=grad_scale, num_threads=torch.get_num_threads())


def host_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              step: torch.Tensor, settings: Settings, *, max_exp_avg_sq: Optional[torch.Tensor] = None,
              weight_out: Optional[torch.Tensor] = None, grad_scale: Optional[float] = None,
              chunk: int, allow_native: bool = True) -> None:
    """One host tensor's update (flat tensors; ``step`` advanced already): NATIVE over its
    whole vectors where it applies, FUSED over the rest in chunks of ``chunk`` elements,
    each chunk's gradient scaled (in its dtype, as scale_grads rounds) and widened to the
    master's dtype and its weight written to ``weight_out`` while still in cache."""
    start = 0
    if pick(master, grad, amsgrad=settings.amsgrad, weight_out=weight_out, allow_native=allow_native) == NATIVE:
        native = native_adam.kernel()
        start = master.numel() - master.numel() % native.align(master.dtype)
        native.step(master[:start], grad[:start], exp_avg[:start], exp_avg_sq[:start],
                    weight_out[:start] if weight_out is not None else None,
                    step=step.item(), **_native_kwargs(settings, grad_scale))
    for a in range(start, master.numel(), chunk):
        b = a + chunk
        g = grad[a:b]
        if grad_scale is not None:
            g = g * grad_scale  # in the gradient's dtype, rounded as scale_grads would
        if g.dtype != master.dtype:
            g = g.to(master.dtype)
        fused([master[a:b]], [g], [exp_avg[a:b]], [exp_avg_sq[a:b]], [step], settings,
              max_exp_avg_sqs=(max_exp_avg_sq[a:b],) if settings.amsgrad else (), lr=float(settings.lr))
        if weight_out is not None:
            weight_out[a:b].copy_(master[a:b])


def host_step_many(masters: list, grads: list, exp_avgs: list, exp_avg_sqs: list, weight_outs: Optional[list],
                   steps: list, settings: Settings, *, spans: Optional[list] = None,
                   grad_scale: Optional[float] = None) -> None:
    """NATIVE over several whole host tensors of one group, each at its count in ``steps``
    (advanced already). ``spans``: the five lists' tensors each back to back in memory (one
    tensor per list), which one call then updates where the counts agree: the kernel
    updates each element on its own, and each tensor is whole vectors, so every element
    takes the instructions of a call per tensor."""
    native = native_adam.kernel()
    kwargs = _native_kwargs(settings, grad_scale)
    if spans is not None and steps.count(steps[0]) == len(steps):
        native.step(*spans[:4], spans[4] if len(spans) > 4 else None, step=steps[0], **kwargs)
    else:
        native.step_many(masters, grads, exp_avgs, exp_avg_sqs, weight_outs, steps, **kwargs)


