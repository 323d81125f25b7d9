"""The ``delayed`` schedule (``delayed_update=True``, opt-in, NOT exact).

step() finishes the previous step's update, then hands this step's gradients to the host
worker and returns at once: the update runs during the next forward and backward, which
therefore still use the weights from before it (each gradient is applied one step late,
as in DeepSpeed's delayed parameter update). Each updated weight goes back to the device
once the next step's last backward is done with it (which ``overlap_next_step`` marks),
else at the next step(). The next backward's gradients land in a second buffer
(``grad_spare``) while the update reads the first.

Without ``scale_grads`` or clipping (``overlap_next_step(grad_scale)`` scales), each update
scales and checks its own gradient, so step() reads no gradient; a parameter with an
inf/NaN gradient is left unchanged while the others update, reported by the next step().
"""

from __future__ import annotations

import dataclasses
import threading
from functools import partial
from typing import Optional

from offload_plugin.engines.schedules import after_backward
from offload_plugin.host import grad_checks
from offload_plugin.host import inner_step as host_update
from offload_plugin.host.buffers import HostSlot
from offload_plugin.host.transfer import Transfers
from offload_plugin.host.updates import StepPlan
from offload_plugin.host.worker import JobBatch

__all__ = ["Pending", "step", "finish", "release_for_push"]


@dataclasses.dataclass
class Pending:
    """The update running in the background, and the lock its weight copies take (from the
    worker, or from a backward hook)."""

    plan: Optional[StepPlan] = None
    push_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # Slots whose weight was changed outside the optimizer before its update was sent:
    # the change stayed, the update did not land (finish() says so).
    overridden: list = dataclasses.field(default_factory=list)


def step(engine) -> None:
    """Finish the previous step's update, then start this one's and return."""
    overlap = engine.overlap
    try:
        finish(engine)
        if _check_in_jobs(engine):
            # Nothing has read all gradients this step (no scale_grads, no clipping): each
            # job scales its gradient inside the update (overlap_next_step's grad_scale)
            # and checks it first, so the training thread makes no pass over the gradients
            # while the GPU waits for the next forward.
            grad_scale, overlap.pending_scale = overlap.pending_scale, None
            engine.complete_host_grads()
            plan = engine.updates.plan(engine.param_groups, grad_scale, check_each=True,
                                     clip_coef=None, wait_pushes=False)
        else:
            grads = engine.grads_in_place("step()")
            engine.scaling.warn_if_unscaled(engine.param_groups)
            if not engine.scaling.step_is_finite(grads, engine.slots.meshes):
                engine.scaling.report_skipped_step(grads)
                return
            if not engine.options.offload_gradients:
                engine.grads.copy_at_step(engine.grads.copy_batches(engine.slots.in_order(engine.params())))
            plan = engine.updates.plan(engine.param_groups, grad_scale=None, check_each=False,
                                     clip_coef=None, wait_pushes=False)
        _submit(engine, plan)
        after_backward.step_on_device(engine, plan)
    finally:
        engine.overlap = None
        if not engine.options.offload_gradients:
            for slot in engine.slots:
                slot.has_grad = False


def _check_in_jobs(engine) -> bool:
    """Whether this step's scaling and inf/NaN check can move into the per-parameter jobs:
    gradients offloaded and overlapped (overlap_next_step), and untouched since (a scale
    or clip already read them all; then its verdict is reused). Not for sharded
    parameters, whose ranks must agree on one verdict."""
    return (engine.options.offload_gradients and engine.overlap is not None and not engine.slots.sharded
            and not engine.scaling.finite.known())


def _submit(engine, plan: StepPlan) -> None:
    """Hand every parameter with a gradient to the worker; the next backward lands in the
    other gradient buffer."""
    engine.adopt_changed_weights()
    batch = JobBatch(engine.worker, partial(_update, engine, plan))
    for slot in engine.slots.in_order(engine.params()):
        if not slot.has_grad:
            continue
        job_slot = dataclasses.replace(slot)  # this step's gradient buffer and events
        if slot.grad_spare is not None:  # the next backward lands in the other one
            slot.grad, slot.grad_spare = slot.grad_spare, slot.grad
        slot.has_grad, slot.grad_event = False, None
        engine.release_handle(slot)
        plan.submitted.add(id(slot.master))
        batch.add((slot, job_slot), slot.master.numel())
    batch.flush()
    engine.pending.plan = plan


def _update(engine, plan: StepPlan, pairs: list[tuple[HostSlot, HostSlot]]) -> None:
    """Worker job: update a batch of parameters (each ``(slot, job_slot)``: the slot and its
    copy holding this step's gradient buffer), then send each updated weight the device is
    done with."""
    finite = []
    for slot, job_slot in pairs:
        Transfers.wait(slot.push_event)  # the previous weight has left the stage
        engine.grads.complete(job_slot)
        if plan.check_each and not grad_checks.all_finite([job_slot.grad]):
            plan.nonfinite.append(slot)  # unchanged; nothing to send
        else:
            finite.append((slot, job_slot))
    if not finite:
        return
    host_update.update_slots(engine.inner, plan.groups, [j for _, j in finite], plan.grad_scale)
    with engine.pending.push_lock:
        for slot, _ in finite:
            slot.push_ready = True
            if slot.free_to_push:
                _push(engine, slot)


def release_for_push(engine, slot: HostSlot) -> None:
    """The last backward before step() is done with ``slot``'s weight."""
    pending = engine.pending
    with pending.push_lock:
        if pending.plan is not None and id(slot.master) in pending.plan.submitted:
            _allow_push(engine, slot)


def _allow_push(engine, slot: HostSlot) -> None:
    """The device no longer reads ``slot``'s weight: send it now if it is updated, else let
    its job send it (caller holds the push lock)."""
    slot.free_to_push = True
    if slot.push_ready:
        _push(engine, slot)


def _push(engine, slot: HostSlot) -> None:
    """Copy an updated weight to the device (caller holds the push lock), unless the weight
    was changed outside the optimizer meanwhile: the change wins, and finish() refuses it
    (after_backward.refuse_edits_during_update)."""
    if engine.weights.changed(slot.order, slot.param):
        engine.pending.overridden.append(slot)
    else:
        slot.push_event = engine.transfers.to_device([(slot.weight_source(), slot.device_weight())])
        engine.updates.last_push = slot.push_event  # copies complete in issue order
    slot.push_ready = slot.free_to_push = False


def finish(engine) -> None:
    """Wait for the background update and put all of its weights on the device."""
    pending = engine.pending
    plan = pending.plan
    if plan is None:
        return
    try:
        with pending.push_lock:
            for slot in engine.slots:
                if id(slot.master) in plan.submitted:
                    _allow_push(engine, slot)
        engine.worker.drain()  # jobs that finish now push their own weights
    finally:
        pending.plan = None
        for slot in engine.slots:
            slot.push_ready = slot.free_to_push = False
        engine.transfers.order_compute_after(engine.updates.last_push)
    overridden, pending.overridden = pending.overridden, []
    after_backward.refuse_edits_during_update(engine, overridden, "delayed_update")
    after_backward.report_spared(engine, plan)  # checked in the jobs: reported one step late
