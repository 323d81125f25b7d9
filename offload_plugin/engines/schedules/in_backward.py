"""The ``in_backward`` schedule: step() called from a gradient hook while backward runs.

torchtune's full fine-tuning recipes with ``optimizer_in_bwd: True`` (the stock configs'
setting) build one optimizer per parameter and call its ``step()`` and ``zero_grad()`` in
that parameter's post-accumulate-grad hook. Waiting there for the host update would stop
the backward once per parameter. Instead step() sends the gradient to the host with its
minimum and maximum (the update checks it alone, as during_backward's updates do), queues
the update and returns, so the host updates this parameter while backward goes on with the
others. When the backward ends (a callback queued on autograd's engine), the optimizer
waits for its updates, reports parameters spared for inf/NaN gradients, and orders later
GPU work after the weights' copies.

Same results as stepping after backward: each update reads only its own gradient, and its
weight goes back to the device only after backward is done with it (its hook has fired).
"""

from __future__ import annotations

import torch

from offload_plugin.engines.schedules import after_backward

__all__ = ["applies", "step", "finish", "in_flight"]


def applies(engine) -> bool:
    """Whether this step() runs inside a backward (and no other schedule was chosen)."""
    return (torch._C._current_graph_task_id() != -1 and engine.overlap is None
            and not engine.options.delayed_update)


def step(engine) -> None:
    plan = engine.updates.plan(engine.param_groups, grad_scale=None, check_each=True, clip_coef=None)
    for slot in engine.slots.in_order(engine.params()):
        if engine.follow_grad(slot):
            engine.grads.offload(slot, extremes=True, add_in_worker=False)
        if slot.has_grad and id(slot.master) not in plan.submitted:
            engine.submit(plan, [slot])
    engine.updates.flush(plan)
    after_backward.step_on_device(engine, plan)
    if not engine.in_backward:  # the first of this backward: finish when it ends
        torch.autograd.Variable._execution_engine.queue_callback(lambda: finish(engine))
    engine.in_backward.append(plan)
    if not engine.options.offload_gradients:  # as after a step: the next backward brings new ones
        for slot in engine.slots:
            slot.has_grad = False


def in_flight(engine) -> set:
    """Ids of the masters whose update this backward queued and has not waited for."""
    return {m for plan in engine.in_backward for m in plan.submitted}


def finish(engine) -> None:
    """Wait for the updates that steps inside the last backward queued. A no-op otherwise."""
    plans, engine.in_backward = engine.in_backward, []
    if not plans:
        return
    try:
        engine.worker.drain()
    finally:
        engine.transfers.order_compute_after(engine.updates.last_push)
    for plan in plans:
        after_backward.report_spared(engine, plan)
