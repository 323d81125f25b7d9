"""``early_forward``: step() returns before the host update ends; the next forward waits,
module by module, for its own parameters' new weights.

What is left when step() returns is updated in forward order, and a forward pre-hook on
every module (removed once every weight has been waited for) makes each module's forward
wait for its parameters' weights: on the host until sent, then on the device by event.
The step is finished (errors raised, inf/NaN reported) when the last gate opens, at the
first gradient of the next backward, or by any method that needs it (``finish_step``).

Same results, if every parameter is first used in the forward of the module it is
registered on (true for torchtune's models) and nothing reads or changes the weights before
that forward except after ``finish_step()``. A weight the forward reads without its module's
forward makes the next backward raise; a weight changed while the step still writes
weights makes the finish raise.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from offload_plugin.engines.schedules import after_backward
from offload_plugin.host.updates import StepPlan

__all__ = ["return_early", "finish", "on_backward"]


def return_early(engine, plan: StepPlan) -> None:
    """Let step() return with ``plan``'s updates still queued."""
    # The next forward's work queued from now on does not read the weights: their copies
    # need only wait for the backward.
    plan.pushes_after = engine.transfers.mark_compute()
    with plan.todo_lock:
        plan.todo.sort(key=lambda slot: slot.order)
        plan.landed_first = True
    plan.gates = {id(slot.param): slot for slot in engine.slots if id(slot.master) in plan.submitted}
    plan.hook = torch.nn.modules.module.register_module_forward_pre_hook(partial(_gate, engine))
    engine.returned_early = plan


def _gate(engine, module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook: wait for the weights of ``module``'s own parameters."""
    plan = engine.returned_early
    if plan is None:
        return
    for param in module._parameters.values():
        slot = plan.gates.get(id(param)) if param is not None else None
        if slot is None or slot.param is not param:  # (ids of dead tensors are reused)
            continue
        del plan.gates[id(param)]
        with plan.sent:
            while id(param) not in plan.sent_ids and not engine.worker.failed:
                plan.sent.wait(0.05)
        if engine.worker.failed:
            finish(engine)  # raises the worker's error here
        engine.transfers.order_compute_after(plan.pushed.get(id(param)))
    if not plan.gates:
        finish(engine)


def finish(engine) -> None:
    """Complete a step that returned early: every update done, every weight ordered before
    later device work, inf/NaN reported. A no-op otherwise."""
    plan, engine.returned_early = engine.returned_early, None
    if plan is None:
        return
    plan.hook.remove()
    try:
        engine.worker.drain()
    finally:
        engine.transfers.order_compute_after(engine.updates.last_push)
        if plan.zero_grad is not None:
            engine.grads.reset(set_to_none=plan.zero_grad)
    # (changed while this step was still writing weights: whether each change came before
    # or after the new weight landed is unknown)
    after_backward.refuse_edits_during_update(engine, engine.changed_slots(), "early_forward")
    after_backward.report_spared(engine, plan)


def on_backward(engine, param: torch.Tensor) -> None:
    """A gradient hook fired: the forward is over, so is a step that returned early. Its
    parameters whose gate never opened must not get a gradient in this backward: the
    forward used them, yet their module's forward pre-hook never ran (something read the
    weight directly, as nn.MultiheadAttention reads out_proj.weight), maybe before the
    update had arrived. Refuse the gradient rather than guess."""
    plan = engine.returned_early
    if plan is not None:
        engine.ungated = {id(s.param): s.param for s in plan.gates.values()}
        torch.autograd.Variable._execution_engine.queue_callback(engine.ungated.clear)
        finish(engine)
    if engine.ungated and engine.ungated.get(id(param)) is param:
        raise RuntimeError(
            f"CPUOffloadOptimizer(early_forward): a parameter of shape {tuple(param.shape)} "
            "was used by the forward without its own module's forward running (e.g. "
            "nn.MultiheadAttention reads out_proj.weight itself), so it may have been "
            "read before its update arrived. The previous step is complete; this "
            "backward's gradients are not used. Turn early_forward off "
            "(overlap_next_step(early_forward=False); `early_forward: False` in our recipes)."
        )
