"""Weights changed outside the optimizer: noticed at the next step and taken over, as torch does.

torch's optimizers read the parameter itself at every step, so whatever changed it since
the last step (``model.load_state_dict``, ``torch.nn.init``, an in-place edit under
``no_grad``, a resume that loads the model after the optimizer) is what the next step
updates. Ours updates a host copy and writes the result over the parameter; left alone,
that would undo such a change.

Every in-place change of a tensor bumps its version counter (the counter autograd uses to
refuse a backward through a modified tensor), and the optimizer's own writes into the
parameters do not (they go through the CUDA runtime or a ``.data`` alias: see
``HostSlot.device_weight``). So a parameter whose counter or storage differs from what was
recorded when the host copy last matched it has been changed by someone else. Checking
costs a few attribute reads per parameter and step, no pass over any data. Only then is the
weight copied back to the host: without master weights it replaces the host copy; with
them, the fp32 master restarts from it, unless the weight is still exactly the rounding of
the master (nothing changed, e.g. a resume that reloads the model weights saved with the
optimizer state), so that such a resume stays bit-exact.

A DTensor (FSDP2) parameter's own counter moves with in-place ops on the DTensor, its local
shard's with ops on the shard: both are checked.

Not seen, by torch's design: writes through ``param.data``, a tensor with a version counter
of its own (autograd does not see them either). After such a write, call
``CPUOffloadOptimizer.reload_weights()``.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from offload_plugin.host.buffers import HostSlot, weight_mark

__all__ = ["weight_mark", "version", "WeightTracker", "adopt_weight", "bits_equal"]


def version(param: torch.Tensor) -> tuple[int, int]:
    """A mark that in-place writes move: the tensor's version counter, and its storage,
    which a ``param.data = ...`` replacement moves. For a weight the optimizer updates in
    place through a raw pointer (CompactAdamW on its host tensors), which moves neither."""
    return param._version, param.data_ptr()


class WeightTracker:
    """Which watched weights were written outside the optimizer since it last matched them.

    One record per key (a parameter, a slot's order, ...): the weight's mark (``mark``:
    :func:`weight_mark` by default, or :func:`version`) when the optimizer's copy, or what it
    derived from the weight, last matched it. A key never recorded counts as unchanged; one
    recorded as unknown (:meth:`unknown`) as changed, whatever the weight holds."""

    def __init__(self, mark: Callable[[torch.Tensor], Hashable] = weight_mark) -> None:
        self._mark = mark
        self._marks: dict = {}

    def matched(self, key, param: torch.Tensor) -> None:
        """The optimizer's copy of ``param`` (recorded under ``key``) matches it now."""
        self._marks[key] = self._mark(param)

    def unknown(self, key) -> None:
        """Whether the optimizer's copy matches is not known: the next check says changed."""
        self._marks[key] = None

    def watches(self, key) -> bool:
        return key in self._marks

    def changed(self, key, param: torch.Tensor) -> bool:
        """Whether ``param`` was written since it was last matched under ``key``."""
        mark = self._marks.get(key, ...)
        return mark is not ... and mark != self._mark(param)

    def keys(self) -> list:
        return list(self._marks)

    def clear(self) -> None:
        self._marks.clear()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaN and -0 included)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


@torch.no_grad()
def adopt_weight(slot: HostSlot) -> bool:
    """Make ``slot``'s host copy follow its parameter again; returns whether it changed (the
    caller records the weight as matched in its WeightTracker).

    Runs on the training thread: the copy to the host is ordered after the work queued on
    the current stream, which is where the change was made.
    """
    weight = slot.device_weight()
    if weight.shape != slot.master.shape:
        raise ValueError(
            f"a parameter's shape changed from {tuple(slot.master.shape)} to "
            f"{tuple(weight.shape)} after CPUOffloadOptimizer was built (param.data was "
            "replaced?). Give the model its final shapes, then build the optimizer."
        )
    if weight.dtype != slot.grad.dtype:
        raise ValueError(
            f"a parameter's dtype changed from {slot.grad.dtype} to {weight.dtype} after "
            "CPUOffloadOptimizer was built. Convert the model (model.to(dtype)) first, then "
            "build the optimizer."
        )
    if weight.device != slot.param_device:
        raise ValueError(
            f"a parameter moved from {slot.param_device} to {weight.device} after "
            "CPUOffloadOptimizer was built. Move the model (model.to(device)) first, then "
            "build the optimizer."
        )
    host = weight.to("cpu", copy=True)
    if host.dtype != slot.master.dtype and bits_equal(slot.master.to(host.dtype), host):
        return False  # the weight is still the rounded master: keep the master's extra bits
    same = host.dtype == slot.master.dtype and bits_equal(slot.master, host)
    if not same:
        slot.master.copy_(host)
    if slot.on_replaced is not None:
        # Written, the same bits or not: CompactAdamW's master restarts from the weight, as
        # where it cannot compare (its weight is the master's upper half: CompactAdamW._setup_tracking).
        slot.on_replaced(slot.master)
    return not same  # (the same bits: the inner optimizer keeps what it derived)
