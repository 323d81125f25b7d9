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
import weakref
from typing import Optional

import torch
from torch.optim import Optimizer

from offload_plugin.formats.adamw import kernels as adamw, native as native_adam
from offload_plugin.formats.adamw.streamed import adam_state
from offload_plugin.formats.inner import contract
from offload_plugin.host.buffers import HostSlot, back_to_back

__all__ = ["uses_fused_adam", "update_slots", "forget_batches"]

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
