"""How AdamW runs: one place turns a param group into kernel arguments and picks the kernel.

As ``torch.optim.adam.adam()`` picks its single-tensor, foreach or fused function for a
list of tensors and calls it with the same arguments, every AdamW update of this package
comes here with its tensors and a :class:`Settings`, and :func:`pick` chooses:

- ``NATIVE``: ``native_adam``'s one pass over host tensors (a bf16 gradient into an fp32
  master with a bf16 weight out, or a bf16 weight), where it was verified bit-identical to
  torch's fused kernel on this machine; a tensor's last elements past whole vectors go to
  ``FUSED`` (torch's scalar tail rounds them its own way).
- ``FUSED``: torch's fused kernel (``_fused_adamw_`` / ``_fused_adam_``), on any device; on
  the host over chunks that stay in cache, the gradient scaled and widened there.
- ``COMPACT``: the 8-bit compact state's kernel (``compact_gpu``'s Triton kernel on CUDA,
  ``compact_adam``'s native one on the host: the same bits).

The results are torch's ``AdamW(fused=True)`` for exact state on the same tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from offload_plugin import compact_adam, native_adam

__all__ = ["Settings", "NATIVE", "FUSED", "COMPACT", "pick", "fused", "host_step", "host_step_many",
           "compact", "compact_step"]

NATIVE, FUSED, COMPACT = "native", "fused", "compact"


@dataclasses.dataclass(frozen=True)
class Settings:
    """A param group's AdamW settings as the kernels take them, read at step time
    (schedulers and users edit groups between steps). Values are kept as the group holds
    them (``lr`` may be a tensor); ``betas`` become floats, as every kernel takes them."""

    lr: Union[float, torch.Tensor]
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    maximize: bool
    decoupled: bool  # AdamW's decay (else Adam's L2 term)
    amsgrad: bool

    @classmethod
    def of(cls, group: dict, decoupled: bool = True) -> "Settings":
        """``group``'s settings; ``decoupled``: the optimizer's kind where the group does not
        say (torch's AdamW and Adam differ only there)."""
        beta1, beta2 = group["betas"]
        return cls(group["lr"], float(beta1), float(beta2), group["weight_decay"], group["eps"],
                   group.get("maximize", False), group.get("decoupled_weight_decay", decoupled),
                   group.get("amsgrad", False))

    @classmethod
    def adamw(cls, group: dict) -> "Settings":
        """``group``'s settings for an optimizer that does AdamW alone (CompactAdamW): no
        maximize, no amsgrad, decoupled decay, whatever the group says of them; its numbers
        as floats (a 0-dim tensor taken as its value)."""
        beta1, beta2 = group["betas"]
        return cls(float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"]),
                   float(group["eps"]), False, True, False)

    def compact_key(self, step: int) -> tuple:
        """The compact kernel's inputs at ``step`` (AdamW's decay, never maximize), as floats:
        a key for a table of its coefficients."""
        return (float(self.lr), self.beta1, self.beta2, float(self.weight_decay), float(self.eps), step)


def pick(weight: torch.Tensor, grad: torch.Tensor, *, compact: bool = False, amsgrad: bool = False,
         weight_out: Optional[torch.Tensor] = None, allow_native: bool = True) -> str:
    """The kernel for ``weight`` (the tensor updated: a master or the weight) with ``grad``:
    COMPACT for the compact 8-bit state; NATIVE where the one-pass kernel applies and was
    verified here (host tensors, a bf16 gradient, an fp32 master with a bf16 ``weight_out``
    or none, or a bf16 weight without one; no amsgrad); else FUSED."""
    if compact:
        return COMPACT
    if not allow_native or amsgrad or grad.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return FUSED
    if weight.dtype == torch.float32:
        if weight_out is not None and weight_out.dtype != torch.bfloat16:
            return FUSED
    elif weight.dtype != torch.bfloat16 or weight_out is not None:
        return FUSED
    native = native_adam.kernel()
    return NATIVE if native is not None and weight.dtype in native.dtypes else FUSED


def fused(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, settings: Settings, *,
          max_exp_avg_sqs: tuple = (), lr=None, grad_scale: Optional[torch.Tensor] = None,
          found_inf: Optional[torch.Tensor] = None) -> None:
    """torch's fused kernel over lists of one device and dtype, the counts ``steps``
    already advanced (torch's fused AdamW counts before its kernel). ``lr``: in place of
    ``settings.lr`` (a tensor moved to the device, a float). ``found_inf`` nonzero: nothing
    is written; ``grad_scale``: the kernel divides each gradient by it."""
    kernel = torch._fused_adamw_ if settings.decoupled else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, list(max_exp_avg_sqs), steps, amsgrad=settings.amsgrad,
           lr=settings.lr if lr is None else lr, beta1=settings.beta1, beta2=settings.beta2,
           weight_decay=settings.weight_decay, eps=settings.eps, maximize=settings.maximize,
           grad_scale=grad_scale, found_inf=found_inf)


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


_gpu_maps: dict = {}


def compact(weight: torch.Tensor, remainder: Optional[torch.Tensor], grad: torch.Tensor,
            exp_avg: torch.Tensor, exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor,
            exp_avg_sq_absmax: torch.Tensor, coeffs: torch.Tensor, found: torch.Tensor) -> None:
    """COMPACT on flat tensors of one device (bf16 weight and gradient, int16 remainder or
    None, uint8 codes, fp32 block absmax), with ``coeffs`` (compact_adam._coefficients) and
    the step's verdict ``found``: nonzero writes nothing. On CUDA queued on the current
    stream (never waits); on the host by the native kernel."""
    if weight.device.type == "cuda":
        from offload_plugin import compact_gpu  # (needs Triton: imported on a GPU only)
        maps = _gpu_maps.get(weight.device)
        if maps is None:
            maps = _gpu_maps[weight.device] = compact_gpu.GpuMaps(weight.device)
        compact_gpu.update_(weight, remainder, grad, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                            coeffs, found, maps)
        return
    if not float(found):
        state = compact_adam.CompactAdamState(weight, remainder, exp_avg, exp_avg_absmax, exp_avg_sq,
                                              exp_avg_sq_absmax)
        compact_adam.update_(state, grad, coeffs, adamw=True)


def compact_step(state: compact_adam.CompactAdamState, grad: torch.Tensor, settings: Settings,
                 grad_scale: Optional[float] = None) -> None:
    """COMPACT for one host tensor's state, advancing ``state.step`` (CompactAdamW.step)."""
    compact_adam.step_(state, grad, lr=float(settings.lr), beta1=settings.beta1, beta2=settings.beta2,
                       eps=float(settings.eps), weight_decay=float(settings.weight_decay),
                       grad_scale=grad_scale)
