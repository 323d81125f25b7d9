"""Partial offload: the parameters whose update stays on their own device.

``CPUOffloadOptimizer(device_fraction=f)`` keeps the update of the first trainable
parameters, up to a fraction ``f`` of all trainable elements, on the device, with an
ordinary ``optimizer_cls`` instance there; the rest goes to the host as usual. In a
torchtune model the first parameters are the embeddings and the first layers: their
gradients arrive last in backward, so their host updates would be the tail that the
next forward waits for, and the next forward needs their weights first. The fraction
trades device memory (optimizer state, and fp32 masters with ``master_weights``) for
host time.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
from torch.optim import Optimizer

from offload_plugin.host.buffers import master_dtype_for
from offload_plugin.host.weights import WeightTracker

__all__ = ["DeviceShare", "choose_kept"]


def _tensors(params: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``params`` as an optimizer takes them (tensors, named tuples, groups)."""
    for entry in params:
        if isinstance(entry, dict):
            inner = entry.get("params", [])
            yield from _tensors([inner] if isinstance(inner, torch.Tensor) else inner)
        elif isinstance(entry, tuple) and len(entry) == 2:
            if isinstance(entry[1], torch.Tensor):
                yield entry[1]
        elif isinstance(entry, torch.Tensor):
            yield entry


def choose_kept(params: list, fraction: float) -> set[int]:
    """ids of the leading trainable parameters holding at most ``fraction`` of all
    trainable elements (whole tensors only, in the order given)."""
    trainable = [t for t in _tensors(params) if t.requires_grad]
    budget = fraction * sum(t.numel() for t in trainable)
    kept, used = set(), 0
    for t in trainable:
        if used + t.numel() > budget:
            break
        kept.add(id(t))
        used += t.numel()
    return kept


class DeviceShare:
    """``optimizer_cls`` over the kept parameters, on their device.

    With ``master_weights``, a bf16/fp16 parameter gets an fp32 master on the device and
    the weight is its rounded copy, as on the host. Groups mirror the outer optimizer's
    one for one (possibly empty), so hyperparameters and state-dict groups line up.
    """

    def __init__(self, optimizer_cls: type, optimizer_kwargs: dict, master_weights: bool) -> None:
        self._cls, self._kwargs = optimizer_cls, optimizer_kwargs
        self._master_weights = master_weights
        self.optimizer: Optional[Optimizer] = None
        self.target: dict[torch.Tensor, torch.Tensor] = {}  # param -> what the optimizer updates
        # The parameters with a master, each watched since the master last matched it (see
        # weight_sync); the optimizer's own writes go through .data and leave their marks.
        self._written = WeightTracker()

    def __contains__(self, param: torch.Tensor) -> bool:
        return param in self.target

    def add_group(self, hyperparameters: dict, params: list[torch.Tensor]) -> None:
        for p in params:
            dtype = master_dtype_for(p, self._master_weights)
            self.target[p] = p if dtype == p.dtype else p.detach().to(dtype).requires_grad_()
            if self.target[p] is not p:
                self._written.matched(p, p)
        group = dict(hyperparameters, params=[self.target[p] for p in params])
        if self.optimizer is None:
            self.optimizer = self._cls([group], **self._kwargs)
        else:
            self.optimizer.add_param_group(group)

    def master(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The device master of ``param``, or None if the optimizer updates it directly."""
        target = self.target[param]
        return None if target is param else target

    def grads(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [p.grad for p in params if p in self.target and p.grad is not None]

    @torch.no_grad()
    def adopt_changed_weights(self, all_params: bool = False) -> None:
        """Masters follow weights changed outside the optimizer (as in weight_sync, on the
        device): unless a weight is still exactly its master rounded. Parameters without a
        master are updated in place by the optimizer, as torch's are."""
        for p in self._written.keys():
            if all_params or self._written.changed(p, p):
                target = self.target[p]
                if not torch.equal(target.to(p.dtype).view(torch.int16), p.detach().view(torch.int16)):
                    target.copy_(p)
                self._written.matched(p, p)

    @torch.no_grad()
    def step(self, outer_groups: list[dict], grad_scale: Optional[float] = None) -> None:
        """Update the kept parameters that have a gradient; ``grad_scale`` multiplies each
        gradient first (in the gradient's dtype, rounded as scale_grads would, as the host
        update does)."""
        for outer, inner in zip(outer_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.adopt_changed_weights()
        ready = [p for p in self.target if p.grad is not None]
        for p in ready:
            target = self.target[p]
            if grad_scale is not None:
                p.grad.mul_(grad_scale)
            if target is not p:
                target.grad = p.grad.to(target.dtype)
        try:
            self.optimizer.step()  # parameters without .grad are left alone
        finally:
            for p in ready:
                target = self.target[p]
                if target is not p:
                    p.data.copy_(target)  # (.data: leaves the mark to outside changes)
                    target.grad = None

    def load_master(self, param: torch.Tensor, saved: Optional[torch.Tensor]) -> None:
        """After loading: the master from a checkpoint, else from the weight."""
        target = self.target[param]
        if target is param:
            return
        with torch.no_grad():
            if saved is not None:
                target.copy_(saved)
            else:
                target.copy_(param)
        # As on the host (checkpoint.write_weights): the parameter is left as it is, and a
        # weight that is not the saved master rounded is decided at the next step.
        matches = torch.equal(target.to(param.dtype).view(torch.int16), param.detach().view(torch.int16))
        if matches:
            self._written.matched(param, param)
        else:
            self._written.unknown(param)
