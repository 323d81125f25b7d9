"""Which CPUOffloadOptimizer updates a parameter: the newest one built over it.

Each optimizer keeps its own host copy of a weight and writes it back whole, so two over
one parameter would undo each other's updates where torch's optimizers apply both. An
older optimizer still alive (rebuilt over the same model before the old one was dropped,
or two built on purpose) leaves the parameter alone and refuses its next step. Refused
at the older one's step, not when the newer one is built: building a second optimizer
over a live model and loading state into it (a resume in one process, a notebook cell
run again) keeps working while the old object exists.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch

__all__ = ["claim", "check_not_taken_over"]

# id(parameter) -> (weak parameter, weak optimizer): the optimizer that updates it.
_OWNERS: dict[int, tuple] = {}


def _forget_owner(key: int, ref: weakref.ref) -> None:
    """A claimed parameter was freed: its id may be reused by another tensor."""
    if _OWNERS.get(key, (None,))[0] is ref:
        del _OWNERS[key]


def claim(optimizer, params: list[torch.Tensor]) -> None:
    """``optimizer`` updates ``params`` from now on; an older optimizer that held one of
    them marks it taken over (its engine's ``taken_over``)."""
    for p in params:
        held = _OWNERS.get(id(p))
        older = held[1]() if held is not None and held[0]() is p else None
        if older is not None and older is not optimizer and older.engine.holds(p):
            older.engine.taken_over.add(id(p))
        ref = weakref.ref(p, partial(_forget_owner, id(p)))
        _OWNERS[id(p)] = (ref, weakref.ref(optimizer))


def check_not_taken_over(taken_over: set) -> None:
    """Refuse a step of an optimizer whose parameters (some of them) a newer one took over."""
    if taken_over:
        raise ValueError(
            f"CPUOffloadOptimizer: a newer CPUOffloadOptimizer was built over "
            f"{len(taken_over)} of this optimizer's parameters and updates them now; "
            "this one no longer does (each keeps its own host copy of a weight and writes "
            "it back whole, so two optimizers over one parameter would undo each other's "
            "updates). Step the newer optimizer, or build one optimizer over all the "
            "parameter groups (add_param_group). Nothing was updated."
        )
