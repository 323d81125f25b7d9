"""The host update queue: one step's plan, and the worker jobs that update slots and send
their weights back to the device.

Every schedule but the delayed one hands its slots to :class:`Updates` one by one (from a
backward hook as each gradient lands, or from ``step()``); small slots go to the host
worker several at a time. Each job takes the next batch from the front of the queue when
it runs, so a schedule can reorder what is left (early_forward puts it in forward order).
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import time
from functools import partial
from typing import Callable, Optional

import torch
from torch.optim import Optimizer

from offload_plugin.distributed import local_part
from offload_plugin.formats import group_checks
from offload_plugin.formats.inner import contract
from offload_plugin.host import inner_step as host_update
from offload_plugin.host import worker as host_worker
from offload_plugin.host.buffers import HostSlot
from offload_plugin.host.gradients import GradientPath
from offload_plugin.host.transfer import Transfers
from offload_plugin.host.worker import HostWorker

__all__ = ["StepPlan", "Updates"]

_by_order = operator.attrgetter("order")


@dataclasses.dataclass
class StepPlan:
    """One step's updates, from their first submission until the step is complete."""

    groups: dict  # id of a host master -> its param group in the inner optimizer
    grad_scale: Optional[float]  # multiply each gradient by this in its update
    check_each: bool  # no whole-step inf/NaN verdict: each update checks its own gradient
    clip_coef: Optional[torch.Tensor]  # left by clip_grad_norm_ for the updates to apply
    submitted: set = dataclasses.field(default_factory=set)  # ids of masters handed to the worker
    # The whole step's inf/NaN verdict when it comes with the copies (after_backward): a
    # callable that the updates wait for.
    verdict: Optional[Callable[[], bool]] = None
    nonfinite: list = dataclasses.field(default_factory=list)  # slots spared (inf/NaN)
    device_updated: int = 0  # partial offload: parameters updated on the device,
    device_nonfinite: int = 0  # and those spared there
    # Slots waiting for their update, and the elements queued since the last job.
    todo: list = dataclasses.field(default_factory=list)
    todo_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    queued_numel: int = 0
    batch_numel: int = dataclasses.field(default_factory=lambda: host_worker.BATCH_NUMEL)
    # early_forward: ids of the parameters whose weight is sent (waited on with `sent`,
    # one condition for the whole plan), and each one's copy event.
    sent_ids: set = dataclasses.field(default_factory=set)
    sent: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    pushed: dict = dataclasses.field(default_factory=dict)
    newest_first: bool = False  # during backward, update the gradient that landed last first
    landed_first: bool = False  # after step() returned: forward order, landed gradients first
    pushes_after: object = None  # weight copies need wait only for this compute event
    gates: dict = dataclasses.field(default_factory=dict)  # early_forward: id -> slot not yet waited for
    hook: object = None  # early_forward's module forward pre-hook
    zero_grad: Optional[bool] = None  # zero_grad(set_to_none) asked while it ran


class Updates:
    """Submits one optimizer's slot updates to the host worker and sends weights back."""

    def __init__(self, inner: Callable[[], Optimizer], grads: GradientPath,
                 transfers: Transfers, worker: HostWorker) -> None:
        self._inner = inner  # the inner optimizer (created with the first param group)
        self.grads, self.transfers, self.worker = grads, transfers, worker
        self.last_push = None  # event of the latest weight copy (copies complete in order)
        self._runs_cache: dict = {}  # for transfer.packed_runs: our host buffers' runs

    # ------------------------------------------------------------------ planning
    def plan(self, param_groups: list[dict], grad_scale: Optional[float], check_each: bool,
             clip_coef: Optional[torch.Tensor], in_flight: bool = False,
             wait_pushes: bool = True) -> StepPlan:
        """A plan for one step's updates, with the current hyperparameters.

        ``in_flight``: a step that returned early is still updating with the previous
        values; the worker runs jobs in order, so the new ones are set after its jobs.
        """
        # Schedulers write lr/betas/momentum into our groups; the host update reads them
        # from its own. (A tensor lr is changed in place: copy its value.)
        hyper = [{k: v.clone() if isinstance(v, torch.Tensor) else v
                  for k, v in outer.items() if k != "params"} for outer in param_groups]
        # Values the fused update cannot use are refused here, before any update of the
        # step (its worker jobs would fail after updating others). Other classes check
        # their own in their step().
        host = self._inner()
        own_check = contract(type(host)).hook(host, "check_group")
        for index, values in enumerate(hyper):
            if host_update.uses_fused_adam(host, values):
                group_checks.check_fused_flags(index, values)
                group_checks.check_hyperparameters(index, values)
            elif own_check is not None:
                own_check(index, values)
        if in_flight:
            # Its weight copies need no wait here: each parameter's next gradient comes
            # from a forward that waited for its copy.
            self.worker.submit(partial(self._set_hyperparameters, hyper))
        else:
            self._set_hyperparameters(hyper)
            if wait_pushes:
                # The previous step's weight copies read master/weight_stage: let them
                # finish. (delayed_update waits per parameter, in its jobs.)
                Transfers.wait(self.last_push)
        # By id: a tensor's __hash__ is Python code, asked per slot at every step.
        groups = {id(m): g for g in host.param_groups for m in g["params"]}
        return StepPlan(groups=groups, grad_scale=grad_scale, check_each=check_each,
                        clip_coef=clip_coef)

    def _set_hyperparameters(self, hyper: list[dict]) -> None:
        for values, inner in zip(hyper, self._inner().param_groups):
            inner.update(values)

    # ------------------------------------------------------------------ submitting
    def submit(self, plan: StepPlan, slots: list[HostSlot]) -> None:
        """Queue the updates of ``slots`` (small slots go to the worker several at a time)."""
        plan.submitted.update(id(slot.master) for slot in slots)
        jobs = 0
        with plan.todo_lock:
            plan.todo.extend(slots)
            for slot in slots:
                plan.queued_numel += slot.master.numel()
                if plan.queued_numel >= plan.batch_numel:
                    plan.queued_numel, jobs = 0, jobs + 1
        for _ in range(jobs):
            self.worker.submit(partial(self._update_next, plan))

    def flush(self, plan: Optional[StepPlan]) -> None:
        """Have the worker update every queued slot, including batches not yet full."""
        if plan is None:
            return
        with plan.todo_lock:
            queued, plan.queued_numel = bool(plan.todo), 0
        if queued:
            self.worker.submit(partial(self._update_rest, plan))

    def _update_rest(self, plan: StepPlan) -> None:
        """Worker job: update batches until no slot is queued."""
        while self._update_next(plan):
            pass

    def _update_next(self, plan: StepPlan) -> bool:
        """Worker job: update the next batch of queued slots; False if none was left."""
        with plan.todo_lock:
            todo = plan.todo
            first, end = self._next_batch(plan, todo) if todo else (0, 0)
            slots, plan.todo = todo[first:end], todo[:first] + todo[end:]
        if slots:
            self._update_batch(plan, slots)
        return bool(slots)

    def _next_batch(self, plan: StepPlan, todo: list[HostSlot]) -> tuple[int, int]:
        """The range of ``todo`` to update next: about ``batch_numel`` elements, at least
        one slot."""
        landed = self.grads.landed
        if plan.newest_first and not plan.landed_first:
            # early_forward, during backward (todo in arrival order): the gradient that
            # landed last, and those before it. What backward leaves is then spread over
            # the whole model, so the host keeps updating until the next forward reaches
            # its last layers; oldest first would leave it the early layers only, and
            # the forward of the later ones would run with the host idle.
            last = next((i for i in range(len(todo) - 1, -1, -1) if landed(todo[i])), 0)
            first, numel = last, todo[last].master.numel()
            while first > 0 and numel < plan.batch_numel:
                first -= 1
                numel += todo[first].master.numel()
            return first, last + 1
        first = 0
        if plan.landed_first:
            # Forward order, but skipping gradients still on their way: the first
            # parameters of the forward are the last of the backward (the embedding
            # lands last), and waiting for them would leave the host idle. If none
            # has landed, wait for the one that lands first: copies land in backward
            # order, so that is the last one in forward order.
            first = next((i for i, slot in enumerate(todo) if landed(slot)), len(todo) - 1)
        end, numel = first + 1, todo[first].master.numel()
        while end < len(todo) and numel < plan.batch_numel:
            numel += todo[end].master.numel()
            end += 1
        return first, end

    # ------------------------------------------------------------------ updating
    def _update_batch(self, plan: StepPlan, slots: list[HostSlot]) -> None:
        """Worker job: update ``slots`` and send their weights to the device."""
        try:
            self._update_and_push(plan, slots)
        finally:  # even on failure: a forward waiting for these must not hang (it raises)
            with plan.sent:
                plan.sent_ids.update(id(slot.param) for slot in slots)
                plan.sent.notify_all()

    def _update_and_push(self, plan: StepPlan, slots: list[HostSlot]) -> None:
        trace = self.worker.trace
        start_job = time.perf_counter() if trace is not None else 0.0
        # In the order of their host buffers: neighbours update and travel packed.
        ordered = sorted(slots, key=_by_order)
        start = time.perf_counter()
        self.grads.complete_all(ordered)
        skipped = plan.verdict is not None and not plan.verdict()
        self.worker.waited_s += time.perf_counter() - start
        if skipped:
            return  # (skipped as a whole: nothing updated, nothing sent)
        finite = ordered
        if plan.check_each:
            # Updates that overlap backward cannot wait for a verdict on all gradients:
            # each checks its own before touching the master weight or the state.
            finite = []
            for slot in ordered:
                (finite if self.grads.landed_finite(slot) else plan.nonfinite).append(slot)
        if not finite:
            return
        grad_scale = plan.grad_scale
        if plan.clip_coef is not None:  # clip_grad_norm_ left the multiply to us
            if grad_scale is None:  # the update multiplies as mul_ would: no extra pass
                grad_scale = float(plan.clip_coef)
            else:
                for slot in finite:
                    slot.grad.mul_(plan.clip_coef)
        settled = time.perf_counter() if trace is not None else 0.0
        host_update.update_slots(self._inner(), plan.groups, finite, grad_scale)
        updated = time.perf_counter() if trace is not None else 0.0
        self.last_push = self.transfers.to_device(
            # The parameters themselves: detaching each would cost the GIL a round trip.
            [slot.push_pair or (slot.weight_source(), local_part(slot.param)) for slot in finite],
            after=plan.pushes_after, runs_cache=self._runs_cache,
        )
        for slot in finite:
            plan.pushed[id(slot.param)] = self.last_push
        if trace is not None:  # (benchmarks) where the host's time goes, per job
            trace.append((start_job, settled, updated, time.perf_counter(),
                          sum(slot.master.numel() for slot in finite), finite[0].order))
