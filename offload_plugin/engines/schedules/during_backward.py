"""The ``during_backward`` schedule: each update starts as soon as its gradient lands.

``overlap_next_step()`` (before the last backward of an accumulation window) makes the
plan; each backward hook then sends its gradient to the host with its minimum and maximum
(so the update can check it alone) and queues the slot's update, which the host worker
runs while backward goes on. step() queues what is left and waits (or, with
``early_forward``, returns). Same results as scaling and stepping after backward.
"""

from __future__ import annotations

from typing import Optional

from offload_plugin.host.updates import StepPlan

__all__ = ["start", "refuse_changes_during_step"]


def start(engine, grad_scale: Optional[float], newest_first: bool) -> None:
    """The plan the coming backward's hooks submit to (see Updates.submit)."""
    plan = engine.updates.plan(engine.param_groups, grad_scale, check_each=True,
                             clip_coef=engine.scaling.clip_coef,
                             in_flight=engine.returned_early is not None)
    plan.newest_first = newest_first
    engine.running = plan


def refuse_changes_during_step(engine, plan: StepPlan) -> None:
    """Updates that started during backward read the host copies before a change made
    between overlap_next_step() and step() could count: refuse it, then follow it."""
    edited = [s for s in engine.changed_slots() if id(s.master) in plan.submitted]
    if edited:
        for slot in edited:
            engine.adopt_weight(slot)
        raise RuntimeError(
            f"CPUOffloadOptimizer: {len(edited)} parameters were changed outside the "
            "optimizer after overlap_next_step(), while their updates were already "
            "running. Change weights before overlap_next_step() (or after step()). The "
            "optimizer now follows the weights as they are."
        )
