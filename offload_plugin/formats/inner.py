"""The contract between ``CPUOffloadOptimizer`` and its ``optimizer_cls`` (the inner optimizer).

Any ``torch.optim.Optimizer`` subclass that updates the tensors it is given works as it is:
the offload optimizer builds it over host copies (or, streamed, over placeholders shaped
like the parameters) and calls ``step()``, ``state_dict()`` and ``load_state_dict()``. An
optimizer that wants more (its own state format, checks of its own checkpoint entries, to
hear of weights written outside it) declares it here and nowhere else: the traits below are
class attributes, the hooks methods. :class:`InnerOptimizer` documents each; subclassing it
is optional (it only adds the defaults). :func:`contract` reads and checks a class once,
when it is given as ``optimizer_cls``, and is what the rest of the package asks.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Mapping, Optional

import torch

from offload_plugin.formats import registry

__all__ = ["InnerOptimizer", "Contract", "contract", "HOOKS"]


class InnerOptimizer:
    """What an ``optimizer_cls`` may declare for ``CPUOffloadOptimizer`` (all optional).

    Traits (class attributes):

    - ``bf16_host_only``: its update runs on bf16 host copies only, so the offload
      optimizer refuses other parameter dtypes and ``device_fraction`` (which would run it
      on the device).
    - ``state_format``: the name of its state format (:mod:`offload_plugin.formats.registry`),
      which the streamed update moves through the GPU; None: it is streamed only if it is
      torch's fused Adam(W) (the ``"adamw"`` format), else updated on the host.
    - ``scales_gradients_in_step``: ``step(grad_scale=s)`` multiplies each gradient by
      ``s`` inside its own pass, with the bits of ``grad.mul_(s)`` first.
    - ``optional_group_keys``: group keys that checkpoints of its peers may lack; the loading
      optimizer's own setting then holds.

    Hooks: the methods below; a class without one gets the generic behaviour.
    """

    bf16_host_only: bool = False
    state_format: Optional[str] = None
    scales_gradients_in_step: bool = False
    optional_group_keys: tuple = ()

    def check_state_entry(self, where: str, entry: Mapping, param: torch.Tensor, group: dict) -> dict:
        """A checkpoint's entry for ``param``, checked and converted into new host tensors
        (raise ValueError naming ``where``); called for every entry before a load changes
        anything. Without it the offload optimizer checks torch's layouts itself."""
        raise NotImplementedError

    def saved_entry(self, p: torch.Tensor, entry: dict, weight: torch.Tensor) -> dict:
        """``p``'s entry as a checkpoint holds it, given ``weight``, the parameter's weight
        (a new dict: what the format saves beside its state, such as a weight's digest)."""
        raise NotImplementedError

    def shard_of(self, p: torch.Tensor, full_shape, first_row: int = 0) -> None:
        """``p`` is this rank's dim-0 rows of a (FSDP2) parameter of ``full_shape``, from
        row ``first_row`` on; said before ``p`` has state, so that its layout can agree
        across ranks."""
        raise NotImplementedError

    def weight_replaced(self, p: torch.Tensor, weight: Optional[torch.Tensor] = None) -> None:
        """``p``'s weight was written outside the optimizer (``weight``: where that weight is,
        when ``p`` is a placeholder): state derived from the old weight goes."""
        raise NotImplementedError

    def before_update(self, p: torch.Tensor, weight: torch.Tensor) -> None:
        """An update that bypasses ``step()`` (the streamed update) is about to read
        ``weight`` for ``p``: decide first what ``step()`` would decide first (a loaded remainder)."""
        raise NotImplementedError

    def check_group(self, index: int, group: dict) -> None:
        """Refuse (ValueError) settings edited into ``param_groups[index]`` that its update
        cannot take; called for every group before a step changes anything. Without it the
        offload optimizer checks only what torch's fused AdamW needs."""
        raise NotImplementedError

    def init_state(self, p: torch.Tensor, group: dict, empty: Callable = torch.empty) -> dict:
        """``p``'s state entry, made (zeros, from ``empty(shape, dtype=...)``) if it has none:
        the streamed update makes state in page-locked memory this way."""
        raise NotImplementedError


HOOKS = ("check_state_entry", "saved_entry", "shard_of", "weight_replaced", "before_update", "check_group",
         "init_state")
_TRAITS = {"bf16_host_only": bool, "scales_gradients_in_step": bool}


@dataclasses.dataclass(frozen=True)
class Contract:
    """What one ``optimizer_cls`` declares (see :class:`InnerOptimizer`), checked."""

    cls: type
    bf16_host_only: bool
    state_format: Optional[str]
    scales_gradients_in_step: bool
    optional_group_keys: tuple
    hooks: frozenset  # the names of HOOKS the class defines

    def hook(self, optimizer, name: str) -> Optional[Callable]:
        """``optimizer``'s bound hook ``name``, or None where its class does not offer it."""
        assert name in HOOKS, name
        return getattr(optimizer, name) if name in self.hooks else None


_checked: dict = {}


def contract(cls: type) -> Contract:
    """``cls``'s contract, checked the first time it is asked for.

    Raises:
        TypeError: ``cls`` is the offload optimizer itself, or a trait or hook is not what
            :class:`InnerOptimizer` says it is (the message names it).
    """
    found = _checked.get(cls)
    if found is not None:
        return found
    if getattr(cls, "_is_offload_optimizer", False):  # (CPUOffloadOptimizer's own marker)
        raise TypeError("optimizer_cls cannot be CPUOffloadOptimizer itself")
    name = getattr(cls, "__name__", repr(cls))
    for trait, kind in _TRAITS.items():
        if not isinstance(getattr(cls, trait, False), kind):
            raise TypeError(f"{name}.{trait} must be True or False, got {getattr(cls, trait)!r:.40}")
    keys = getattr(cls, "optional_group_keys", ())
    if not (isinstance(keys, (tuple, list, frozenset, set)) and all(isinstance(k, str) for k in keys)):
        raise TypeError(f"{name}.optional_group_keys must be a tuple of group key names, got {keys!r:.60}")
    state_format = getattr(cls, "state_format", None)
    hooks = frozenset(h for h in HOOKS if callable(getattr(cls, h, None))
                      and getattr(cls, h) is not getattr(InnerOptimizer, h))
    for hook in hooks:
        _check_signature(name, hook, getattr(cls, hook))
    if getattr(cls, "scales_gradients_in_step", False) and "grad_scale" not in _parameters(cls.step):
        raise TypeError(f"{name} says scales_gradients_in_step, but its step() takes no grad_scale")
    if state_format is not None:
        needs = registry.needs(state_format)  # (raises for an unknown name)
        lacking = sorted(set(needs) - hooks)
        if lacking:
            raise TypeError(f"{name}.state_format={state_format!r} needs the hooks {lacking}, "
                            "which it does not define")
    made = _checked[cls] = Contract(cls, bool(getattr(cls, "bf16_host_only", False)), state_format,
                                    bool(getattr(cls, "scales_gradients_in_step", False)),
                                    tuple(keys), hooks)
    return made


def _parameters(fn) -> Mapping:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # (a builtin without a signature: taken on trust)
        return {}


def _check_signature(name: str, hook: str, fn) -> None:
    """``fn`` takes the arguments the package passes to ``hook`` (InnerOptimizer's)."""
    want = list(inspect.signature(getattr(InnerOptimizer, hook)).parameters.values())
    params = _parameters(fn)
    if not params:
        return
    try:
        inspect.signature(fn).bind(*[None] * sum(p.default is p.empty for p in want))
    except TypeError:
        raise TypeError(f"{name}.{hook} must take ({', '.join(p.name for p in want)}) as "
                        f"InnerOptimizer.{hook} documents; it takes {inspect.signature(fn)}") from None
