"""The update of one parameter in host memory.

For Adam/AdamW with ``fused=True`` on an fp32 master with a bf16 gradient, the update is
one pass of ``native_adam``'s kernel (bf16 gradient in, master and moments updated, bf16
weight out), verified bit-identical to torch's fused kernel on this machine; likewise for
bf16 weights without master weights (gradient scaling folded into the same pass). Without it
(or for other dtypes), torch's own fused CPU kernel runs over chunks of the parameter:
per chunk, the gradient is upcast, the master, moments and step are updated, and the
weight to send back is written, while the chunk is still in cache. Either way results are
bit-identical to ``torch.optim.AdamW(fused=True)`` on the host copies.

Any other ``optimizer_cls`` (or Adam without ``fused``) goes through its own ``step()``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import weakref
from collections.abc import Mapping
from typing import Optional

import torch
from torch.optim import Optimizer

from offload_plugin import adamw, native_adam
from offload_plugin.adamw_moments import adam_state
from offload_plugin.host_buffers import HostSlot, back_to_back
from offload_plugin.inner import contract

__all__ = ["uses_fused_adam", "check_fused_flags", "check_hyperparameters", "settings_problem", "check_settings", "update_slots",
           "forget_batches"]

# 2 Mi elements: the fp32 gradient temporary (8 MiB) and the chunk of master weight read
# back for the bf16 copy stay in the last-level cache between the three operations.
CHUNK_NUMEL = 1 << 21
# Benchmarks switch this off to time torch's three-pass path on the same machine.
USE_NATIVE = True


def uses_fused_adam(optimizer: Optimizer, group: dict) -> bool:
    """Whether ``group`` of ``optimizer`` can take the chunked fused path."""
    return (
        isinstance(optimizer, torch.optim.Adam)
        and bool(group.get("fused"))
        and not group.get("capturable")
        and not group.get("differentiable")
    )


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


def _fused_adam_update(
    optimizer: Optimizer, group: dict, slot: HostSlot, state: dict, grad_scale: Optional[float]
) -> None:
    """One slot's step from its ``state`` (as adam_state gave it: checked, complete)."""
    state["step"] += 1
    adamw.host_step(
        slot.master.view(-1), slot.grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
        state["step"], _settings(optimizer, group),
        max_exp_avg_sq=state["max_exp_avg_sq"].view(-1) if group["amsgrad"] else None,
        weight_out=slot.weight_stage.view(-1) if slot.weight_stage is not None else None,
        grad_scale=grad_scale, chunk=CHUNK_NUMEL, allow_native=USE_NATIVE)


def _settings(optimizer: Optimizer, group: dict) -> adamw.Settings:
    return adamw.Settings.of(group, decoupled=isinstance(optimizer, torch.optim.AdamW))


def _one_native_call(slot: HostSlot, group: dict) -> bool:
    """Whether ``slot`` can go through step_many (alone or with others): the one-pass
    kernel applies to all of it (no torch tail) and its buffers are contiguous."""
    if group["amsgrad"] or not USE_NATIVE:
        return False
    if slot.native_whole is None:  # a slot's buffers never change: work it out once
        master, stage = slot.master, slot.weight_stage
        native = native_adam.kernel() if adamw.pick(master, slot.grad, weight_out=stage) == adamw.NATIVE else None
        slot.native_whole = (
            native is not None and native.can_step_many and master.numel() > 0
            and master.numel() % native.align(master.dtype) == 0
            and all(t.is_contiguous() for t in (master, slot.grad) + ((stage,) if stage is not None else ()))
        )
    return slot.native_whole


@dataclasses.dataclass
class _Batch:
    """What _fused_adam_many works out for one batch of slots from their buffers and state
    tensors, which stay the same objects step after step (the plans cut the same batches)."""

    slots: list  # (held, so that the ids keying this batch stay theirs)
    state_map: dict  # the optimizer's ``state`` when worked out (a load replaces it)
    held: list  # each slot's (state, step, exp_avg, exp_avg_sq) when worked out
    tensors: list  # master, grad, exp_avg, exp_avg_sq[, weight_stage] lists
    spans: Optional[list]  # back_to_back of each list, or None if any is not
    usable: bool  # moments contiguous and step counts float32 scalars (else slot by slot)
    counts: Optional[torch.Tensor]  # if usable: the step counts side by side (each
    # state["step"] a view of one)

    def current(self, optimizer: Optimizer) -> bool:
        """Whether every slot's state is still the one worked out: the same state mapping,
        per-slot dicts and tensors. A slot's dict is replaced only through the optimizer's
        ``state`` (which forgets the batches: see forget_batches) or by a load (a new
        mapping), so its own entries are all that is asked per slot: no lookup by tensor,
        whose hash is Python code."""
        return optimizer.state is self.state_map and all(
            st.get("step") is step and st.get("exp_avg") is m and st.get("exp_avg_sq") is v
            for st, step, m, v in self.held)


# inner optimizer -> {ids of a batch's slots: _Batch}; weak, so that it goes with its optimizer.
_BATCHES: "weakref.WeakKeyDictionary[Optimizer, dict]" = weakref.WeakKeyDictionary()


def _batch(optimizer: Optimizer, slots: list[HostSlot]) -> _Batch:
    """The batch of ``slots`` as last worked out, or anew if a state tensor was replaced
    since (a loaded state dict, a new entry), creating missing state as torch would."""
    batches = _BATCHES.setdefault(optimizer, {})
    key = tuple(map(id, slots))
    batch = batches.get(key)
    if batch is not None and batch.current(optimizer):
        return batch
    states = [adam_state(optimizer, slot, False) for slot in slots]
    tensors = [[slot.master for slot in slots], [slot.grad for slot in slots],
               [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]]
    if slots[0].weight_stage is not None:
        tensors.append([slot.weight_stage for slot in slots])
    spans = [back_to_back(x) for x in tensors]
    usable = all(st["exp_avg"].is_contiguous() and st["exp_avg_sq"].is_contiguous()
                 and st["step"].dtype == torch.float32 and st["step"].dim() == 0 for st in states)
    counts = None
    if usable:
        # Each state["step"] becomes a 0-d view of one tensor of counts, with its value:
        # one add_ then advances them all (a copy in and out per slot cost 0.4 ms of a step
        # over 192 LoRA adapters on the H200), and an in-place change of one still shows.
        counts = torch.stack([st["step"] for st in states])
        for st, cell in zip(states, counts.unbind()):
            st["step"] = cell
    batch = _Batch(list(slots), optimizer.state,
                   [(st, st["step"], st["exp_avg"], st["exp_avg_sq"]) for st in states],
                   tensors, None if any(span is None for span in spans) else spans, usable, counts)
    if len(batches) > 64:  # (plans cut new batches when arrival order changes)
        batches.clear()
    batches[key] = batch
    return batch


def forget_batches(optimizer: Optimizer) -> None:
    """Drop what _fused_adam_many worked out for ``optimizer``'s batches: after a load that
    replaced its state tensors (so that the old ones are not kept alive until each batch
    steps again), and whenever a slot's state dict may have been replaced (see
    _Batch.current)."""
    _BATCHES.pop(optimizer, None)


def _fused_adam_many(optimizer: Optimizer, group: dict, batch: _Batch, grad_scale: Optional[float]) -> None:
    """_fused_adam_update for one or several slots of one group in one native call
    (hundreds of LoRA adapters: per-slot Python and a thread team per call would dwarf the
    arithmetic; for one slot, two torch calls instead of its views and step arithmetic)."""
    if not batch.usable:
        for slot, (state, *_) in zip(batch.slots, batch.held):  # e.g. state loaded with another layout
            _fused_adam_update(optimizer, group, slot, state, grad_scale)
        return
    batch.counts.add_(1)  # each slot's state["step"] += 1 (float32): they are its views
    tensors = batch.tensors
    adamw.host_step_many(*tensors[:4], tensors[4] if len(tensors) > 4 else None, batch.counts.tolist(),
                         _settings(optimizer, group), spans=batch.spans, grad_scale=grad_scale)


def update_slots(
    optimizer: Optimizer,
    group_of: dict,
    slots: list[HostSlot],
    grad_scale: Optional[float] = None,
) -> None:
    """Run one optimizer step for ``slots`` (each with a gradient in ``slot.grad``).

    Args:
        optimizer: the inner optimizer over the slots' master tensors.
        group_of: maps the id of a master tensor to its param group in ``optimizer``.
        slots: the parameters to update now; others are left untouched.
        grad_scale: multiply gradients by this first (None: leave them as they are).

    After it returns, each slot's ``weight_stage`` (if any) holds the new weight.
    """
    generic, together, fused, singles = [], {}, {}, []  # (fused: per group, asked once per call)
    for slot in slots:
        group = group_of[id(slot.master)]
        gid = id(group)
        is_fused = fused.get(gid)
        if is_fused is None:
            is_fused = fused[gid] = uses_fused_adam(optimizer, group)
        if not is_fused:
            generic.append(slot)
        elif _one_native_call(slot, group):
            # Even alone: _fused_adam_update's views and step arithmetic are torch calls that
            # each give up the GIL, and the training thread launching kernels delays every
            # return; this path makes two.
            key = (gid, slot.master.dtype, slot.weight_stage is None)
            together.setdefault(key, (group, []))[1].append(slot)
        else:
            singles.append((group, slot))
    # Every slot's state is checked (missing state created) before any slot is updated,
    # as torch's step checks all before updating any: a refused entry changes nothing.
    states = [adam_state(optimizer, slot, group["amsgrad"]) for group, slot in singles]
    batches = [(group, _batch(optimizer, batch)) for group, batch in together.values()]
    for (group, slot), state in zip(singles, states):
        _fused_adam_update(optimizer, group, slot, state, grad_scale)
    for group, batch in batches:
        _fused_adam_many(optimizer, group, batch, grad_scale)
    if not generic:
        return
    # CompactAdamW scales inside its one pass; others get the gradients scaled first, in
    # their dtype as scale_grads would and in place (the host copy is this step's alone): a
    # scaled copy of each gradient is fresh memory at every step, whose page faults cost
    # more than an update (Llama-3.1-8B, CompactAdamW, H200 host: 4.96 s a step that way).
    scales_inside = contract(type(optimizer)).scales_gradients_in_step
    for slot in generic:
        g = slot.grad
        if grad_scale is not None and not scales_inside:
            g.mul_(grad_scale)
        if g.dtype != slot.master.dtype:
            g = g.to(slot.master.dtype)
        slot.master.grad = g
    try:
        # Parameters whose .grad is None are skipped by torch's optimizers, so one call
        # updates exactly this subset.
        if scales_inside and grad_scale is not None:
            optimizer.step(grad_scale=grad_scale)
        else:
            optimizer.step()
    finally:
        for slot in generic:
            slot.master.grad = None
    for slot in generic:
        if slot.weight_stage is not None:
            slot.weight_stage.copy_(slot.master)
