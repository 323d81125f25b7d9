"""``load_state_dict`` for optimizers that check a whole checkpoint before changing anything
(CompactAdamW, AdamW8bit): torch's order (pre-hooks, groups, state, post-hooks), with each
group and entry checked and converted by the optimizer's own functions first, so that a
refused load leaves parameters, state and groups as they were. State tensors keep their
dtypes (torch's own loading casts every state tensor of a floating-point parameter to its
dtype: uint8 codes and int16 remainders would become bf16).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Callable, Optional

from torch.optim import Optimizer

__all__ = ["load_checked"]


def load_checked(optimizer: Optimizer, state_dict, group_to_load: Callable, check_entry: Callable,
                 before_post_hooks: Optional[Callable] = None) -> None:
    """Load ``state_dict`` into ``optimizer``: ``group_to_load(i, saved, current)`` gives group
    i's new settings (raising ValueError to refuse), ``check_entry(where, entry, param,
    group)`` a parameter's new state entry; ``before_post_hooks()`` runs once all is in place.

    Raises:
        TypeError: ``state_dict`` is not a dict.
        ValueError: it does not match the optimizer's groups and parameters, or a check refused
            a group or an entry (the message says which and what to do).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError("load_state_dict expects an optimizer state dict (a dict with 'state' "
                        f"and 'param_groups'), got {type(state_dict).__name__}.")
    state_dict = dict(state_dict)  # shallow, as torch does: hooks may replace entries
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    groups, state = _checked(optimizer, state_dict, group_to_load, check_entry)
    # Nothing below can fail: all was checked and copied.
    optimizer.state = collections.defaultdict(dict, state)
    for group, hyper in zip(optimizer.param_groups, groups):
        params, names = group["params"], group.get("param_names")
        group.clear()
        group.update(hyper, params=params)
        if names is not None and "param_names" not in hyper:  # as torch keeps them
            group["param_names"] = names
    if before_post_hooks is not None:
        before_post_hooks()
    for hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        hook(optimizer)


def _checked(optimizer: Optimizer, state_dict: Mapping, group_to_load: Callable,
             check_entry: Callable) -> tuple[list, dict]:
    """(each group's new settings, the new state by parameter); reads the optimizer only."""
    who = type(optimizer).__name__
    saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    if not (isinstance(saved_state, Mapping) and isinstance(saved_groups, (list, tuple)) and all(
            isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in saved_groups)):
        raise ValueError("not an optimizer state dict: it needs a dict 'state' and a list "
                         "'param_groups' of dicts, each with a 'params' list (torch's layout).")
    if len(saved_groups) != len(optimizer.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, optimizer.param_groups)):
        raise ValueError(
            f"the state dict has {[len(s['params']) for s in saved_groups]} parameters per group, "
            f"this {who} {[len(g['params']) for g in optimizer.param_groups]}: build it over "
            "the same parameter groups as the optimizer that saved it."
        )
    where_is = {}  # saved index -> (parameter, group number)
    for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        for index, p in zip(saved["params"], group["params"]):
            try:
                seen = index in where_is
            except TypeError:
                raise ValueError(f"parameter group {i} lists {index!r:.40}, which is not a valid index.") from None
            if seen:
                raise ValueError(f"parameter index {index!r} appears more than once in the state dict's groups.")
            where_is[index] = (p, i)
    groups = [group_to_load(i, saved, group)
              for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups))]
    state = {}
    for index, entry in saved_state.items():
        if index not in where_is:
            raise ValueError(f"the state dict has state for {index!r:.40}, which its groups do not list.")
        p, i = where_is[index]
        if not isinstance(entry, Mapping):
            raise ValueError(f"state entry {index!r} is a {type(entry).__name__}, not a dict of per-parameter state.")
        if entry:  # (an empty one: not stepped yet)
            state[p] = check_entry(f"state entry {index!r}", entry, p, groups[i])
    return groups, state
