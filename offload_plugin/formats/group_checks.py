"""Checks every family's update shares: a param group's settings (finite numbers, flags that
are flags, torch's fused-kernel flags) and the start of a host optimizer's ``step()``, which
checks every tensor and state entry before anything changes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Optional

import torch

from offload_plugin.formats.inner import contract

__all__ = ["checked_step", "check_fused_flags", "check_hyperparameters", "settings_problem", "check_settings"]


def checked_step(optimizer, closure, check_tensor, check_entry):
    """The start of a host optimizer's ``step()`` (CompactAdamW's, AdamW8bit's): the closure's
    loss, then every group (:func:`check_hyperparameters`), stepping tensor
    (``check_tensor(t, "parameter" or "gradient")``) and state entry (``check_entry(p,
    entry, group)``) checked before any parameter is updated. They are the user's to edit
    between steps: a refused step changes nothing."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    own_check = contract(type(optimizer)).hook(optimizer, "check_group")
    for index, group in enumerate(optimizer.param_groups):
        check_hyperparameters(index, group)
        if own_check is not None:
            own_check(index, group)
        for p in group["params"]:
            if p.grad is not None:
                check_tensor(p, "parameter")
                check_tensor(p.grad, "gradient")
                if p.grad.shape != p.shape:
                    raise ValueError(
                        f"a gradient of shape {tuple(p.grad.shape)} for a parameter of shape "
                        f"{tuple(p.shape)}: set .grad to a tensor shaped like its parameter. "
                        "Nothing was updated.")
                if optimizer.state.get(p):
                    check_entry(p, optimizer.state[p], group)
    return loss


def check_fused_flags(index: int, group: dict) -> None:
    """torch's Adam(W) refuses ``fused`` and ``foreach`` both True (at its step, and in a
    checkpoint our loader reads): a group edited so between steps is refused before any
    update, as its own checkpoint would be."""
    if group.get("fused") and group.get("foreach"):
        raise ValueError(
            f"param_groups[{index}] has fused=True and foreach=True, which torch's AdamW "
            "refuses together: set foreach back to False (or None) before the next step(). "
            "Nothing was updated.")


def check_hyperparameters(index: int, group: dict) -> None:
    """Refuse, before any update of the step, a hyperparameter the fused update cannot use.

    Groups are the user's to edit between steps. torch's fused AdamW raises on such a value
    (some only after advancing its step counts); here the update would raise from the
    worker after updating other slots, or take ``lr="0.01"`` as 0.01, which torch refuses.
    """
    def number(value, zero_dim: bool = False) -> bool:
        if isinstance(value, torch.Tensor):
            return value.numel() == 1 and not value.is_complex() and (value.dim() == 0 or not zero_dim)
        return isinstance(value, numbers.Real)

    betas = group.get("betas")
    bad = [key for key in ("lr", "eps", "weight_decay")
           # (the kernels take eps and weight_decay as numbers: a tensor([0.1]) is refused there)
           if not number(group.get(key), zero_dim=key != "lr")]
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(map(number, betas))):
        bad.append("betas")
    # (the kernels take True or False alone, not 1; CompactAdamW's groups have no maximize)
    if not isinstance(group.get("maximize", False), bool):
        bad.append("maximize")
    if bad:
        key = bad[0]
        needs = {"betas": "a pair of numbers", "maximize": "True or False"}.get(
            key, "a number (or a one-element tensor)" if key == "lr" else "a number (or a 0-dim tensor)")
        raise TypeError(
            f"param_groups[{index}][{key!r}] is {group.get(key)!r:.60}; the update needs {needs}. "
            "Set it to a valid value before the next step(); nothing was updated."
        )


def settings_problem(group: Mapping, flags: tuple = ()) -> Optional[tuple[str, str]]:
    """What is wrong with an Adam group's settings for the 8-bit updates (CompactAdamW's,
    AdamW8bit's), as (key, what it needs), or None: lr, eps and weight_decay finite numbers
    >= 0 (or one-element tensors), betas two numbers in [0, 1) (beta1 = 1 divides by zero),
    min_8bit_size a whole number >= 0, and each key of ``flags`` True or False (or 1 or 0;
    a string "False" is not False)."""
    def number(value) -> Optional[float]:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            value = value.item()
        return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None

    for key in ("lr", "eps", "weight_decay"):
        value = number(group.get(key))
        if value is None or not math.isfinite(value) or value < 0.0:
            return key, "a finite number >= 0"
    betas = group.get("betas")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2
            and all(b is not None and 0.0 <= b < 1.0 for b in map(number, betas))):
        return "betas", "two numbers in [0, 1)"
    size = group.get("min_8bit_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return "min_8bit_size", "a whole number >= 0"
    for key in flags:  # (0 and 1 too, as the offload optimizer's own flags take them)
        value = group.get(key, False)
        if not (isinstance(value, numbers.Integral) and value in (0, 1)):
            return key, "True or False"
    return None


def check_settings(index: int, group: Mapping, flags: tuple = ()) -> None:
    """Refuse, before a step changes anything, settings edited into param_groups[index]
    that the constructor would have refused (:func:`settings_problem`)."""
    problem = settings_problem(group, flags)
    if problem is not None:
        key, needs = problem
        raise ValueError(f"param_groups[{index}][{key!r}] is {group.get(key)!r:.60}; the update needs "
                         f"{needs}. Set a valid value before the next step(); nothing was updated.")
