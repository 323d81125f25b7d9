"""Step schedules of the host update: what one optimizer step does, from the gradients to
the new weights, when the update runs in host memory (``host_engine``). (The streamed engine,
``offload_plugin.engines.streamed``, steps on the device and none of these apply.) Each takes the
host engine and uses its public parts.

Which schedule a step uses is decided here, in :func:`choose_overlap` (for a step that
``overlap_next_step`` prepared) and :func:`run_step`, by this table and nothing else:

=============================  ===========================  ================================
options / parameters           ``overlap_next_step(...)``   schedule (module)
=============================  ===========================  ================================
``delayed_update``             any, or not called           ``delayed``: step() returns at
                                                            once; the update runs during the
                                                            next forward and backward
sharded (FSDP2) parameters     called                       ``after_backward``, gradients
                                                            already on the host: the ranks
                                                            agree on inf/NaN in step()
``clipping=True`` with         called                       ``after_backward``, as above
``device_fraction``                                         (the device share clips then)
``clipping=True``              called                       ``after_backward``, each gradient
                                                            scaled and normed on its way out
(no other restriction)         called                       ``during_backward``: each update
                                                            starts when its gradient lands
(no other restriction)         not called, step() from a    ``in_backward``: step() queues
                               gradient hook (torchtune's   the update and returns; the
                               ``optimizer_in_bwd``)        backward's end waits for it
(no other restriction)         not called                   ``after_backward``
=============================  ===========================  ================================

``early_forward=True`` (``early_forward`` module) applies to the overlapped
``after_backward`` and ``during_backward`` schedules of single-device parameters: step()
returns with updates still queued, and each module's next forward waits for its own
weights. It is refused with ``delayed_update`` (whose step returns at once anyway) and with
sharded parameters (each rank's forward would wait on the others' weights unseen).

Every schedule updates the parameters kept on the device (``device_fraction``) in step().
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from offload_plugin.engines.schedules import after_backward, delayed, during_backward, early_forward, in_backward

__all__ = ["Overlap", "choose_overlap", "run_step"]


@dataclasses.dataclass
class Overlap:
    """What ``overlap_next_step()`` said about the coming backward and step()."""

    schedule: str  # "during_backward", "after_backward" or "delayed"
    grad_scale: Optional[float]
    early_forward: bool
    # A grad_scale that step() (or the first scale or clip) applies before reading the
    # gradients, as if scale_grads() had been called right after backward.
    pending_scale: Optional[float] = None
    seen: set = dataclasses.field(default_factory=set)  # ids of parameters whose gradient came


def choose_overlap(engine, grad_scale: Optional[float], clipping: bool, early: bool) -> Overlap:
    """The schedule of the step that follows the next backward (the table above); the
    optimizer has refused what does not combine (options.check_overlap)."""
    if engine.options.delayed_update:
        # The update runs in the background anyway; this backward only tells when each
        # parameter is free to receive its updated weight. Clipping needs nothing here.
        return Overlap("delayed", grad_scale, False, pending_scale=grad_scale)
    if engine.slots.sharded or (clipping and engine.device_share is not None):
        # Sharded: an update that starts during backward must check its gradient alone,
        # and a NaN on another rank would then be skipped there but applied here. Only the
        # transfers overlap; step() scales by grad_scale, agrees with the other ranks on
        # the verdict, then updates. (Likewise when clipping with device_fraction, whose
        # device share is scaled and normed at clip time.)
        return Overlap("after_backward", grad_scale, early, pending_scale=grad_scale)
    if clipping:
        engine.scaling.prepare_clipping(engine.worker, engine.grads, grad_scale)
        return Overlap("after_backward", grad_scale, early)
    during_backward.start(engine, grad_scale, newest_first=early)
    return Overlap("during_backward", grad_scale, early)


def run_step(engine) -> None:
    """step(): the schedule overlap_next_step chose, or the one the options give."""
    if in_backward.applies(engine):
        in_backward.step(engine)
        return
    if engine.options.delayed_update:
        delayed.step(engine)
        return
    early_forward.finish(engine)
    engine.ungated = {}
    overlap = engine.overlap
    early = overlap is not None and overlap.early_forward
    try:
        plan = engine.running
        if plan is None:
            plan = after_backward.start(engine)
            if plan is None:  # skipped: a gradient was not finite
                return
        after_backward.submit_the_rest(engine, plan)
        if early:
            early_forward.return_early(engine, plan)
        engine.updates.flush(plan)
        after_backward.step_on_device(engine, plan)  # its kernels run while the host finishes
        if not early:
            engine.worker.drain()
            if overlap is not None and overlap.schedule == "during_backward":
                during_backward.refuse_changes_during_step(engine, plan)
            after_backward.report_spared(engine, plan)
    finally:
        engine.running, engine.overlap = None, None
        engine.scaling.reset()
        if not engine.options.offload_gradients:
            for slot in engine.slots:
                slot.has_grad = False
        if engine.returned_early is None:
            engine.transfers.order_compute_after(engine.updates.last_push)
