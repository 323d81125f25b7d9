"""A deep, bitwise snapshot of an optimizer and its parameters: what a refused
``load_state_dict`` must leave exactly as it was (CPUOffloadOptimizer or a plain optimizer
such as CompactAdamW used directly)."""

import copy

import torch


def snapshot(opt) -> tuple:
    """Parameters, groups (settings and membership), the state dict, the live state (the
    host optimizer's, for CPUOffloadOptimizer) and the host masters."""
    engine = getattr(opt, "engine", None)  # (CPUOffloadOptimizer's: the inner optimizer and host slots)
    inner = engine.inner if engine is not None and engine.inner is not None else opt
    params = [p for g in opt.param_groups for p in g["params"]]
    return (
        [p.detach().clone() for p in params],
        [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
        [[id(p) for p in g["params"]] for g in opt.param_groups],
        copy.deepcopy(opt.state_dict()),
        [copy.deepcopy(dict(inner.state[p])) if p in inner.state else None
         for g in inner.param_groups for p in g["params"]],
        [s.master.clone() for s in engine.slots] if engine is not None else [],
    )


def same(a, b) -> bool:
    """Bitwise equality of nested state (tensors by dtype, shape and bits, NaN included)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b or (a != a and b != b)


def assert_unchanged(before: tuple, after: tuple) -> None:
    names = ("parameters", "param_groups", "group membership", "state_dict()", "live state", "host masters")
    for name, x, y in zip(names, before, after):
        assert same(x, y), f"{name} changed by a refused load"
