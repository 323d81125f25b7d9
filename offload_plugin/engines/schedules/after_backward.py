"""The ``after_backward`` schedule: step() checks all gradients (or its updates wait for the
verdict that comes with the copies), then updates every slot.

The plain schedule (no ``overlap_next_step``), and the overlapped one for clipped or
sharded steps, whose gradients already left the device during backward: step() scales
by overlap_next_step's scale if not yet applied, agrees on the inf/NaN verdict (with every rank
when sharded), copies device gradients to the host (without ``offload_gradients``), and
hands each slot to the host worker; the parameters kept on the device update meanwhile.
Also the last part of the ``during_backward`` schedule's step (``submit_the_rest``).
"""

from __future__ import annotations

from typing import Optional

from offload_plugin.host import grad_checks
from offload_plugin.host.updates import StepPlan

__all__ = ["start", "submit_the_rest", "step_on_device", "report_spared", "refuse_edits_during_update"]


def start(engine) -> Optional[StepPlan]:
    """The step's plan, with the gradients checked finite or their verdict to come; None if
    the step is skipped."""
    engine.scaling.warn_if_unscaled(engine.param_groups)
    # A grad_scale that overlap_next_step left to step() is applied by _grads_in_place.
    grads = engine.grads_in_place("step()") if engine.overlap is not None else engine.ready_grads()
    batches = [] if engine.options.offload_gradients else engine.grads.copy_batches(engine.slots.in_order(engine.params()))
    if len(batches) == 1 and _checked_on_the_way(engine, grads):
        # One copy batch (LoRA adapters, a small model): the gradients go to the host now,
        # the device checks them as they leave, and the updates are queued meanwhile; the
        # first to run waits for the verdict (a skipped step's updates change nothing, and
        # report_spared reports it). Weights changed outside the optimizer are taken over
        # at the first submission, as in every step: a skipped step would leave them to
        # the next, with the same result.
        verdict = engine.grads.copy_at_step(batches, check=True)
        plan = _plan(engine)
        plan.verdict = verdict
    else:
        if not engine.scaling.step_is_finite(grads, engine.slots.meshes):
            engine.scaling.report_skipped_step(grads)
            return None
        engine.grads.copy_at_step(batches)
        plan = _plan(engine)
    engine.running = plan
    return plan


def _plan(engine) -> StepPlan:
    return engine.updates.plan(engine.param_groups, grad_scale=None, check_each=False,
                             clip_coef=engine.scaling.clip_coef)


def _checked_on_the_way(engine, grads: list) -> bool:
    """Whether copy_at_step may give the inf/NaN verdict: the plain step of device gradients
    that no scale or clip checked already, all of them copied by it (not those kept on the
    device with device_fraction), on one rank (sharded: the ranks agree first)."""
    return (not engine.options.offload_gradients and engine.device_share is None and not engine.slots.sharded
            and engine.scaling.finite.finite(grads) is None)


def submit_the_rest(engine, plan: StepPlan) -> None:
    """Hand every slot with a gradient not yet submitted to the worker."""
    rest = []
    for slot in engine.slots.in_order(engine.params()):
        if engine.options.offload_gradients and engine.follow_grad(slot):
            engine.offload_grad(slot.param)  # set by hand; offloading submits it
        elif slot.has_grad and id(slot.master) not in plan.submitted:
            rest.append(slot)
    if rest:
        engine.submit(plan, rest)


def step_on_device(engine, plan: StepPlan) -> None:
    """Partial offload: update the parameters kept on the device (device_fraction)."""
    share = engine.device_share
    grads = share.grads(engine.params()) if share is not None else []
    if not grads:
        return
    if plan.check_each and not grad_checks.all_finite(grads):  # no whole-step verdict to reuse
        plan.device_nonfinite = len(grads)
        return
    share.step(engine.param_groups, plan.grad_scale)
    plan.device_updated = len(grads)


def report_spared(engine, plan: StepPlan) -> None:
    """Warn (or raise) about parameters whose non-finite gradients their updates found, or
    about the whole step, skipped by the verdict its updates waited for."""
    if plan.verdict is not None and not plan.verdict():
        engine.scaling.report_skipped_step(engine.ready_grads())  # (still on the device)
        return
    skipped = len(plan.nonfinite) + plan.device_nonfinite
    updated = len(plan.submitted) - len(plan.nonfinite) + plan.device_updated
    engine.scaling.report_spared(updated, skipped)


def refuse_edits_during_update(engine, edited: list, schedule: str) -> None:
    """The one rule for weights changed outside the optimizer while a step that returned
    before its updates ended (``early_forward``, ``delayed_update``) could still write them:
    the parameter is the truth, so the change stays and the host copies follow it (an update
    that had not landed is dropped, though its moments advanced), and the user hears of it
    here, the step otherwise complete."""
    if not edited:
        return
    for slot in edited:
        engine.adopt_weight(slot)
    raise RuntimeError(
        f"CPUOffloadOptimizer: {len(edited)} parameters were changed (in place, or by "
        f"load_state_dict) after a step that returned early ({schedule}) and before it had "
        "finished writing the new weights, so the change may have been applied to the old "
        "weights or overwritten, or the update dropped. Call optimizer.finish_step() before "
        "changing weights outside the optimizer. The optimizer now follows the weights as "
        "they are."
    )
