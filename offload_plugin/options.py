"""CPUOffloadOptimizer's options: checked once, at construction, with the fix in each message.

Every option that does not combine with another is refused here, when it is asked for;
nothing is silently ignored later. What the step does with the options is decided in one
place, ``schedules.choose``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from typing import Optional, Union

import torch
from torch.optim import Optimizer

from offload_plugin.grad_checks import NONFINITE_POLICIES

__all__ = ["Options", "OWN_OPTIONS", "resolve_optimizer_cls", "check_trainable"]

# Optimizers whose step is not a per-parameter update that can run on host copies.
_UNSUPPORTED = {
    torch.optim.LBFGS: "it re-evaluates the model through a closure inside step()",
    torch.optim.SparseAdam: "it needs sparse gradients, which are not offloaded",
}


# The on/off options (each must be a bool).
_FLAGS = ("offload_gradients", "master_weights", "pin_memory", "check_host_memory",
          "delayed_update", "accumulate_on_device")


@dataclasses.dataclass
class Options:
    """The constructor's options (see CPUOffloadOptimizer for what each does)."""

    optimizer_cls: type
    optimizer_kwargs: dict
    offload_gradients: bool = False
    master_weights: bool = False
    pin_memory: bool = True
    nonfinite_grads: str = "skip"
    check_host_memory: bool = True
    delayed_update: bool = False
    host_threads: Optional[int] = None
    accumulate_on_device: bool = False
    device_fraction: float = 0.0

    def __post_init__(self) -> None:
        self.optimizer_cls = resolve_optimizer_cls(self.optimizer_cls)
        _check_option_names(self.optimizer_cls, self.optimizer_kwargs)
        for name in _FLAGS:
            value = getattr(self, name)
            # bool("false") is True: a quoted YAML value or a CLI string would silently
            # turn the option on. (0 and 1 are taken, as bool() reads them.)
            if not isinstance(value, bool) and not (isinstance(value, int) and value in (0, 1)):
                raise TypeError(
                    f"{name} must be True or False, got {value!r} ({type(value).__name__}). "
                    f"In a YAML config, write {name}: true or {name}: false, unquoted."
                )
        if self.optimizer_kwargs.get("capturable"):
            # torch's step asserts on host tensors ("If capturable=True, params and
            # state_steps must be on supported devices"), at every step.
            raise ValueError(
                "capturable=True does not apply: the update runs on host (CPU) copies, which "
                "CUDA graphs cannot capture. Leave capturable unset (False)."
            )
        if self.nonfinite_grads not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite_grads must be one of {NONFINITE_POLICIES}, got {self.nonfinite_grads!r}"
            )
        if self.accumulate_on_device and not self.offload_gradients:
            raise ValueError(
                "accumulate_on_device=True only applies with offload_gradients=True (without "
                "it, gradients stay on the device anyway)."
            )
        if not (isinstance(self.device_fraction, (int, float)) and 0 <= self.device_fraction < 1):
            raise ValueError(
                f"device_fraction must be in [0, 1), got {self.device_fraction!r}; to keep the "
                "whole optimizer on the device, use optimizer_cls directly."
            )
        if self.device_fraction and getattr(self.optimizer_cls, "bf16_host_only", False):
            raise ValueError(
                f"optimizer_cls={self.optimizer_cls.__name__} updates host tensors only; it "
                "does not combine with device_fraction. Use device_fraction=0."
            )
        host_threads = self.host_threads
        if host_threads is not None and (
                not isinstance(host_threads, int) or isinstance(host_threads, bool) or host_threads < 1):
            raise ValueError(f"host_threads must be a positive int or None, got {host_threads!r}")
        self.offload_gradients, self.master_weights = bool(self.offload_gradients), bool(self.master_weights)
        self.delayed_update = bool(self.delayed_update)
        self.accumulate_on_device = bool(self.accumulate_on_device)
        self.device_fraction = float(self.device_fraction)
        if (issubclass(self.optimizer_cls, torch.optim.Adam)
                and not {"fused", "foreach", "capturable", "differentiable"} & self.optimizer_kwargs.keys()):
            # No speed flag needed: Adam(W) without a choice of implementation runs torch's
            # fused kernel on the host (and the one-pass native update where it applies),
            # bit-identical to torch.optim.AdamW(fused=True) on the same tensors; torch's
            # own default there is a per-tensor loop several times slower (FACTS: 0.81 vs 4.64
            # G params/s on the H200 host). fused=False or foreach keeps torch's loop.
            self.optimizer_kwargs = dict(self.optimizer_kwargs, fused=True)

    def defaults(self) -> dict:
        """``optimizer_cls``'s defaults with these hyperparameters, checked by the class itself
        ("Invalid learning rate: -1.0") before anything is allocated or hooked."""
        # A 1x1 matrix: classes for matrices (torch.optim.Muon) refuse a 1-D probe.
        return dict(self.optimizer_cls([torch.zeros(1, 1)], **self.optimizer_kwargs).defaults)


OWN_OPTIONS = ["optimizer_cls"] + [f.name for f in dataclasses.fields(Options)
                                   if f.name not in ("optimizer_cls", "optimizer_kwargs")]


def resolve_optimizer_cls(optimizer_cls: Union[str, type]) -> type:
    """The class for a dotted path or a class; refused if it cannot run on host copies."""
    if isinstance(optimizer_cls, str):
        module_name, _, attr = optimizer_cls.rpartition(".")
        try:
            resolved = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(
                f"optimizer_cls={optimizer_cls!r} does not resolve to a class ({err}). "
                "Give a dotted path such as 'torch.optim.AdamW' or the class itself."
            ) from None
        optimizer_cls = resolved
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
        raise TypeError(
            f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}"
        )
    if getattr(optimizer_cls, "_is_offload_optimizer", False):
        raise TypeError("optimizer_cls cannot be CPUOffloadOptimizer itself")
    for unsupported, why in _UNSUPPORTED.items():
        if issubclass(optimizer_cls, unsupported):
            raise ValueError(
                f"optimizer_cls={optimizer_cls.__name__} is not supported: {why}. Use "
                "torch.optim.AdamW (the default) or another per-parameter optimizer."
            )
    return optimizer_cls


def _check_option_names(optimizer_cls: type, optimizer_kwargs: dict) -> None:
    """Refuse a keyword neither we nor ``optimizer_cls`` take, naming the closest valid one
    (``offload_gradient`` would otherwise reach AdamW and be reported as its own)."""
    signature = inspect.signature(optimizer_cls.__init__)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return  # the class takes any keyword: let it judge
    theirs = [n for n, p in signature.parameters.items()
              if n not in ("self", "params") and p.kind is not p.VAR_POSITIONAL]
    for name in optimizer_kwargs:
        if name not in theirs:
            close = difflib.get_close_matches(name, OWN_OPTIONS + theirs, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"CPUOffloadOptimizer got an unknown option {name!r}: it is neither one of its "
                f"own ({', '.join(OWN_OPTIONS)}) nor an argument of "
                f"{optimizer_cls.__name__} ({', '.join(theirs)}).{hint}"
            )


def check_trainable(params: list[torch.Tensor]) -> None:
    """Refuse, before anything is allocated, tensors the host update cannot train."""
    for p in params:
        if p.is_complex():
            raise ValueError(
                f"CPUOffloadOptimizer does not support complex parameters (got {p.dtype}, "
                f"shape {tuple(p.shape)}): the host update works on real tensors. Keep the "
                "parameter real (e.g. store torch.view_as_real(z) and view it as complex in "
                "the forward)."
            )
        if p.is_meta:
            raise ValueError(
                f"CPUOffloadOptimizer got a parameter on the meta device (shape "
                f"{tuple(p.shape)}), which has no values to copy to the host. Materialize the "
                "model first (model.to_empty(device=...) and load or initialize its weights), "
                "then build the optimizer."
            )
