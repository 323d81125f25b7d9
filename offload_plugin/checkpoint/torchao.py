"""Reading optimizer checkpoints written by torchao's CPUOffloadOptimizer.

torchao saves ``{"offloaded": [one state dict per tensor], "on-device": state dict}``: each
trainable tensor with at least ``minimal_size`` elements has its own optimizer (one group,
one parameter), the smaller ones share an on-device optimizer with one group per user group
that had any. The layout records neither tensor names nor ``minimal_size``, so conversion
replays torchao's construction over our parameter groups, which must be the same groups in
the same order (torchao's default ``minimal_size`` is 4096).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["is_torchao_state_dict", "convert_torchao_state_dict"]

TORCHAO_MINIMAL_SIZE = 4096  # torchao.optim.CPUOffloadOptimizer's default


def is_torchao_state_dict(state_dict: Any) -> bool:
    return isinstance(state_dict, dict) and "offloaded" in state_dict and "state" not in state_dict


def _group_tensors(params: Iterable) -> list[list[torch.Tensor]]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [list(g["params"]) for g in params]
    return [params]


def _same(a: Any, b: Any) -> bool:
    """Whether two hyperparameter values are equal (tensors by value, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b) or (a != a and b != b)


def convert_torchao_state_dict(
    state_dict: dict, params: Iterable, minimal_size: int = TORCHAO_MINIMAL_SIZE
) -> dict:
    """Turn a torchao CPUOffloadOptimizer state dict into torch's standard layout.

    Args:
        state_dict: what torchao's ``CPUOffloadOptimizer.state_dict()`` returned.
        params: the trainable parameters, or param-group dicts, in the order torchao got them.
        minimal_size: the ``minimal_size`` torchao was built with.

    Returns:
        dict: ``{"state": {index: ...}, "param_groups": [...]}`` over ``params``.

    Raises:
        ValueError: the checkpoint holds a different number of tensors or groups, state its
            groups do not list, or different hyperparameters for tensors of one of ours.
    """
    offloaded = list(state_dict["offloaded"])
    on_device = state_dict.get("on-device") or {"state": {}, "param_groups": []}
    device_groups = list(on_device["param_groups"])
    stray = set(on_device["state"]) - {i for g in device_groups for i in g["params"]}
    if stray:
        raise ValueError(f"torchao checkpoint's on-device state has entries {sorted(map(repr, stray))[:4]} "
                         "that none of its groups lists.")
    state, groups, index = {}, [], 0
    for g, tensors in enumerate(_group_tensors(params)):
        small = [p for p in tensors if p.numel() < minimal_size]
        if small and not device_groups:
            raise ValueError(
                "torchao checkpoint has fewer on-device groups than these parameters need: "
                f"was it saved for another model, or with minimal_size != {minimal_size}?"
            )
        device_group = device_groups.pop(0) if small else None
        device_ids = list(device_group["params"]) if device_group else []
        hyper, ids = None, []
        for p in tensors:
            if p.numel() >= minimal_size:
                if not offloaded:
                    raise ValueError(
                        "torchao checkpoint has fewer offloaded tensors than these parameters "
                        f"(minimal_size={minimal_size}): it belongs to another model."
                    )
                entry = offloaded.pop(0)
                (group,) = entry["param_groups"]
                (pid,) = group["params"]  # (one tensor per offloaded optimizer)
                if set(entry["state"]) - {pid}:
                    raise ValueError("torchao checkpoint has an offloaded optimizer with state for "
                                     "tensors its group does not list.")
                saved = entry["state"].get(pid)
            else:
                if not device_ids:
                    raise ValueError("torchao checkpoint's on-device group is smaller than ours.")
                group = device_group
                saved = on_device["state"].get(device_ids.pop(0))
            mine = {k: v for k, v in group.items() if k != "params"}
            differ = [] if hyper is None else sorted(
                k for k in hyper.keys() | mine.keys() if k not in hyper or k not in mine or not _same(hyper[k], mine[k]))
            if differ:
                # (e.g. a scheduler with one lambda per torchao group) Ours keep one set per group.
                raise ValueError(
                    f"torchao checkpoint gives the tensors of parameter group {g} different {differ}; "
                    "these parameter groups hold one value each. Build the optimizer with one group "
                    "per distinct setting, or set them equal in the checkpoint."
                )
            hyper = mine
            if saved is not None:
                state[index] = saved
            ids.append(index)
            index += 1
        if device_ids:
            raise ValueError("torchao checkpoint's on-device group is larger than ours.")
        groups.append({**(hyper or {}), "params": ids})
    if offloaded or device_groups:
        raise ValueError(
            f"torchao checkpoint has {len(offloaded)} offloaded tensors and "
            f"{len(device_groups)} on-device groups more than these parameters: it belongs "
            "to another model."
        )
    return {"state": state, "param_groups": groups}
