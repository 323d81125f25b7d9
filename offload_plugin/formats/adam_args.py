"""A param group's AdamW settings as every kernel takes them (:class:`Settings`), and torch's
fused Adam(W) kernel called over them (:func:`fused`): what each state format's update shares.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

__all__ = ["Settings", "fused"]


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
