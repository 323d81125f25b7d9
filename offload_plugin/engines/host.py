"""The host engine: gradients go to host memory, ``optimizer_cls.step`` runs there on the
host copies of the weights, and the new weights go back to the device.

It owns what a host step needs beyond the common parts (``engine.Engine``): the gradient
path (``grads``: offloaded during backward, or copied at step), the update queue
(``updates``), the parameters updated on the device (``device_share``, device_fraction),
the backward hooks of offloaded gradients, and the step in progress, one field per
schedule that owns it (``offload_plugin.engines.schedules``: one table says which runs):

- ``overlap``: what ``overlap_next_step`` chose for the coming backward and step();
- ``running``: the plan whose updates are being submitted;
- ``returned_early``: a step that returned before its updates ended (early_forward);
- ``pending``: the update running in the background (delayed_update);
- ``in_backward``: plans queued by step()s inside this backward (optimizer_in_bwd);
- ``ungated``: parameters whose gate that early step never saw pass.
"""

from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Callable, Optional, Union

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from offload_plugin.distributed import local_part
from offload_plugin.engines import schedules
from offload_plugin.engines.base import Engine
from offload_plugin.engines.device_share import DeviceShare
from offload_plugin.engines.schedules import delayed, early_forward, in_backward
from offload_plugin.host.buffers import HostSlot, give_host_copies
from offload_plugin.host.grad_handle import OffloadedGrad, is_handle_of
from offload_plugin.host.gradients import GradientPath, check_dense
from offload_plugin.host.inner_step import forget_batches
from offload_plugin.host.scaling import multiplier
from offload_plugin.host.updates import StepPlan, Updates
from offload_plugin.host.weights import WeightTracker, adopt_weight
from offload_plugin.options import Options

__all__ = ["HostEngine"]

log = logging.getLogger("offload_plugin.optimizer")


class _GradHook:
    """A parameter's post-accumulate-grad hook that reaches the engine through a weak
    reference. The parameter holds its hooks and the optimizer holds the parameter; with
    a bound method in between, a dropped model and optimizer were never collected (torch
    2.13: the cycle runs through the tensor's hook table), and with them the host memory
    and the host worker's thread."""

    __slots__ = ("_engine",)

    def __init__(self, engine: "HostEngine") -> None:
        self._engine = weakref.ref(engine)

    def __call__(self, param: torch.Tensor) -> None:
        engine = self._engine()
        if engine is not None:
            engine.on_grad_accumulated(param)


class _BeforeGrad:
    """A parameter's tensor hook (it runs before autograd adds the new gradient to
    ``.grad``), weakly bound as _GradHook is."""

    __slots__ = ("_engine", "_param")

    def __init__(self, engine: "HostEngine", param: torch.Tensor) -> None:
        self._engine, self._param = weakref.ref(engine), weakref.ref(param)

    def __call__(self, grad: torch.Tensor) -> None:
        engine, param = self._engine(), self._param()
        if engine is not None and param is not None:
            engine.before_grad(param)


class HostEngine(Engine):
    """``optimizer_cls.step`` in host memory (see the module docstring)."""

    def __init__(self, optimizer: Optimizer, options: Options, keeps_some: bool = False) -> None:
        super().__init__(optimizer, options)
        self.grads: Optional[GradientPath] = None
        self.updates: Optional[Updates] = None
        self.device_share: Optional[DeviceShare] = (
            DeviceShare(options.optimizer_cls, options.optimizer_kwargs, options.master_weights)
            if keeps_some else None
        )
        self._hooks: list = []
        self.overlap: Optional[schedules.Overlap] = None
        self.running: Optional[StepPlan] = None
        self.returned_early: Optional[StepPlan] = None
        self.pending = delayed.Pending()
        self.in_backward: list[StepPlan] = []
        self.ungated: dict[int, torch.Tensor] = {}
        # Each slot's weight when its host copy last matched it (by slot.order): a weight
        # written outside the optimizer since is adopted before the next update reads it.
        self.weights = WeightTracker()
        # A step() since the last zero_grad(), and whether the warning about hidden gradients
        # carried past it was given (see before_grad).
        self._stepped, self._warned_carried = False, False

    @classmethod
    def take_over(cls, streamed: Engine) -> "HostEngine":
        """The host update from now on, from the streamed engine's state as it is. The
        slots get host copies of their weights (the streamed update keeps none), adopted
        from the parameters at the next step (weight_sync)."""
        given = streamed.handover()
        engine = cls(given["optimizer"], given["options"])
        engine.slots, engine.inner, engine.scaling = given["slots"], given["inner"], given["scaling"]
        engine.taken_over, engine._membership = given["taken_over"], given["membership"]
        if given["resources"] is not None:
            engine.resources, engine.transfers = given["resources"], given["transfers"]
            engine.worker, engine.arena = given["worker"], given["arena"]
            engine._build_paths()
        slots = list(engine.slots)
        if slots:
            placeholders = {id(slot.master): slot for slot in slots}
            give_host_copies(slots, engine.options.master_weights, engine.arena)
            for slot in slots:
                engine.weights.unknown(slot.order)
            # The inner optimizer knows each slot by its master: key it by the new one.
            inner = engine.inner
            for group in inner.param_groups:
                group["params"] = [placeholders[id(m)].master for m in group["params"]]
            for old in [m for m in inner.state if id(m) in placeholders]:
                inner.state[placeholders[id(old)].master] = inner.state.pop(old)
            forget_batches(inner)
        return engine

    def setup_device(self, device: torch.device) -> None:
        super().setup_device(device)
        self._build_paths()

    def _build_paths(self) -> None:
        options = self.options
        self.grads = GradientPath(self.slots, self.transfers, self.worker, self.arena,
                                  options.pin_memory, options.delayed_update)
        self.updates = Updates(lambda: self.inner, self.grads, self.transfers, self.worker)

    def attach(self, group: dict, params: list[torch.Tensor], on_device: list[torch.Tensor]) -> list[HostSlot]:
        slots = super().attach(group, params, on_device)
        for slot in slots:  # (the host copies were just read from the weights)
            self.weights.matched(slot.order, slot.param)
        if self.device_share is not None:  # one group per outer group, even if empty
            self.device_share.add_group({k: v for k, v in group.items() if k != "params"}, on_device)
        if self.options.offload_gradients:
            self.grads.left_behind = self._left_behind
            for slot in slots:
                self._hooks.append(slot.param.register_hook(_BeforeGrad(self, slot.param)))
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(_GradHook(self)))
                if not self._holds_handle(slot.param):
                    self.scaling.hidden_grads = True
        return slots

    def holds(self, param: torch.Tensor) -> bool:
        return super().holds(param) or (self.device_share is not None and param in self.device_share)

    def state_of(self, param: torch.Tensor) -> Optional[tuple[dict, torch.Tensor]]:
        where = super().state_of(param)
        if where is None and self.device_share is not None and param in self.device_share:
            return self.device_share.optimizer.state, self.device_share.target[param]
        return where

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        schedules.run_step(self)
        self._stepped = True

    def finish(self) -> None:
        in_backward.finish(self)
        early_forward.finish(self)
        delayed.finish(self)

    def overlap_next_step(self, grad_scale: Optional[Union[float, torch.Tensor]], clipping: bool,
                          early: bool) -> None:
        if grad_scale is not None:
            grad_scale = self._overlap_multiplier(grad_scale)
        self.scaling.scaled_since_zero_grad = True
        self.overlap = schedules.choose_overlap(self, grad_scale, clipping, early)

    def _overlap_multiplier(self, grad_scale: Union[float, torch.Tensor]) -> float:
        """The one number each overlapped update multiplies its gradient by: what
        torchtune's scale_grads would (see scaling.multiplier)."""
        # (Once per dtype, not per parameter: this runs before every overlapped backward.)
        dtypes = {p.dtype for p in self.params()}
        values = {multiplier(grad_scale, dtype, self.scaling.on_accelerator) for dtype in dtypes}
        if len(values) > 1:
            raise ValueError(
                "overlap_next_step(grad_scale=...) with trainable parameters of several dtypes "
                f"({sorted(map(str, dtypes))}) on a GPU: scale_grads "
                "rounds the factor to each gradient's dtype there, which one overlapped update "
                "cannot. Give the trainable parameters one dtype, or call scale_grads() after "
                "backward instead of passing grad_scale."
            )
        return values.pop() if values else float(grad_scale)

    # ------------------------------------------------------------------ gradients
    def _holds_handle(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s offloaded gradient leaves a handle on ``.grad`` (grad_handle):
        not a DTensor's, whose ``.grad`` must be a DTensor (it leaves None)."""
        return self.options.offload_gradients and not isinstance(param, DTensor)

    def _left_behind(self, slot: HostSlot) -> Optional[torch.Tensor]:
        """What an offloaded gradient leaves as ``.grad``."""
        return OffloadedGrad(slot.param, slot, self) if self._holds_handle(slot.param) else None

    def host_grad(self, slot: HostSlot, writes: bool) -> torch.Tensor:
        """An OffloadedGrad's host gradient, complete; before a write, nothing may still
        read it (a step that returned early) or be about to (an overlapped step)."""
        early_forward.finish(self)
        if writes and self.running is not None:
            raise RuntimeError(
                "a gradient offloaded after overlap_next_step() was changed (e.g. by "
                "clip_grad_norm_ or zero_grad) before step(): its update may already be "
                "running. Clip with the optimizer (overlap_next_step(clipping=True), then "
                "optimizer.clip_grad_norm_()), or don't call overlap_next_step().")
        if self.scaling.clip_norms is not None:  # the worker may still be scaling host sums
            self.scaling.clip_norms.batch.flush()
            self.worker.drain()
        if self.scaling.clip_coef is not None:  # a clip left to the updates: do it now
            self.scaling.apply_clip_now(self.ready_grads())
        if not slot.has_grad:
            raise RuntimeError(
                "this .grad is an offloaded gradient that the optimizer has since "
                "consumed or cleared (optimizer.zero_grad(), or a delayed_update step): "
                "read param.grad again.")
        self.grads.complete(slot)
        if writes:
            # (An op inside the handle's dispatch does not move the host tensor's version
            # counter, which the finite verdict's record would otherwise see.)
            slot.device_norm = None
            self.scaling.finite.clear()
        return slot.grad

    def device_norm(self, slot: HostSlot) -> Optional[torch.Tensor]:
        """The 2-norm of ``slot``'s host gradient as torch's clip_grad_norm_ takes it of a
        gradient on the device (``_foreach_norm``); None for a parameter on the CPU (the
        host's norm is that one). Taken as the gradient left, while the host gradient is
        unchanged since; else (a sum accumulated on the host, a scaled gradient) of a copy
        sent back for it: exact, at the cost of one copy to the device."""
        grad = self.host_grad(slot, writes=False)
        if slot.device_norm is None and slot.param.device.type != "cpu":
            slot.device_norm = torch._foreach_norm([grad.to(slot.param.device)], 2.0)[0]
        return slot.device_norm

    @staticmethod
    def _take_device_norm(slot: HostSlot, grad: torch.Tensor) -> None:
        slot.device_norm = torch._foreach_norm([grad], 2.0)[0]

    def follow_grad(self, slot: HostSlot) -> bool:
        """Make the host gradient follow ``.grad``, as torch's optimizers read only
        ``.grad``, and return whether ``.grad`` holds a device gradient still to offload.

        With offloaded gradients ``.grad`` is the slot's handle while the host gradient
        stands; ``None`` means it was cleared (``model.zero_grad()``, ``p.grad = None``)
        and another tensor replaced it (``p.grad = g``), except the sum autograd builds on
        the device with accumulate_on_device, which adds to the host gradient.
        """
        grad = slot.param.grad
        if not self._holds_handle(slot.param):
            return grad is not None  # (None there is an offloaded gradient, or none)
        if is_handle_of(grad, slot):
            return False
        part = slot.device_part() if slot.device_part is not None else None
        if grad is not None and grad is part:
            return True
        slot.device_part = None
        if slot.has_grad or slot.incoming_pending:
            self.grads.reset_slot(slot, set_to_none=True)
        return grad is not None

    def before_grad(self, param: torch.Tensor) -> None:
        """Tensor hook (offload_gradients=True), before autograd adds a new gradient to
        ``.grad``: the host gradient follows ``.grad`` (:meth:`follow_grad`); a handle
        steps aside so that autograd starts the device part afresh (the offload adds it
        to the host sum)."""
        if self.taken_over and id(param) in self.taken_over:
            return
        early_forward.on_backward(self, param)  # (a step that returned early reads the host gradients)
        slot = self.slots[param]
        if not self._holds_handle(param) and slot.has_grad and self._stepped and not self._warned_carried:
            self._warned_carried = True
            log.warning(
                "\nCPUOffloadOptimizer(offload_gradients=True): a backward after step() adds to "
                "gradients from before it, which optimizer.zero_grad() was not called to clear. "
                "Offloaded gradients of sharded (FSDP2) parameters leave .grad as None, so "
                "model.zero_grad() cannot clear them (Hugging Face's Trainer clears only that "
                "way): call optimizer.zero_grad() after each step, or set "
                "offload_gradients=False. (Shown once; right if you meant to add them.)")
        if is_handle_of(param.grad, slot) and self.options.accumulate_on_device:
            # Gradients never cleared between steps, summed on the device: autograd adds
            # to the sum so far in torch's order only if that sum is on the device.
            param.grad = param.grad.clone()
            self.grads.reset_slot(slot, set_to_none=True)
        elif is_handle_of(param.grad, slot):
            param.grad = None
        else:
            self.follow_grad(slot)

    def release_handle(self, slot: HostSlot) -> None:
        """The step took ``slot``'s gradient buffer away (delayed_update): ``.grad`` no
        longer stands for it."""
        if is_handle_of(slot.param.grad, slot):
            slot.param.grad = None

    def on_grad_accumulated(self, param: torch.Tensor) -> None:
        """Backward hook (offload_gradients=True)."""
        if self.taken_over and id(param) in self.taken_over:
            return  # (a newer optimizer takes this gradient; this one's step() refuses)
        early_forward.on_backward(self, param)
        overlap = self.overlap
        if overlap is not None:
            if id(param) in overlap.seen:
                # Its update (or its norm, or its weight's return) may already be under way.
                raise RuntimeError(
                    "CPUOffloadOptimizer: a second backward after overlap_next_step() reached "
                    "a parameter that already has its gradient for this step. Call "
                    "overlap_next_step() right before the LAST backward of the accumulation "
                    "window, then step()."
                )
            overlap.seen.add(id(param))
        elif self.options.accumulate_on_device:
            # Not the last backward (overlap_next_step): autograd adds the next one on the device.
            self.slots[param].device_part = weakref.ref(param.grad)
            return
        self.offload_grad(param)

    def offload_grad(self, param: torch.Tensor) -> None:
        """Move ``param.grad`` to its slot, then let the schedule react: queue the update
        (during_backward), take the norm of a host sum (overlapped clipping), or release the
        weight (delayed)."""
        slot, plan = self.slots[param], self.running
        # Work the host would do with a pass over each gradient in host memory, where the
        # update is bound by memory bandwidth, is done by the device on the way out: an
        # update that starts now needs an inf/NaN verdict (the gradient's extremes come
        # along); a clipped step needs each gradient scaled and its norm.
        norms = self.scaling.clip_norms if plan is None else None
        before = partial(norms.on_device, slot) if norms is not None else None
        slot.device_norm = None
        if before is None and not slot.has_grad and param.device.type != "cpu" and self._holds_handle(param):
            # For a clip over model.parameters() through the handle: the norm torch's
            # would take of the device gradient (on the host it would round otherwise).
            before = partial(self._take_device_norm, slot)
        first = self.grads.offload(
            slot, before=before,
            extremes=plan is not None and plan.check_each, add_in_worker=plan is None,
        )
        if plan is not None:
            self.submit(plan, [slot])
        elif norms is not None and not first:  # an accumulated sum: scaled and normed on the host
            norms.batch.add(slot, slot.grad.numel())
        elif self.overlap is not None and self.overlap.schedule == "delayed":
            delayed.release_for_push(self, slot)

    def submit(self, plan: StepPlan, slots: list[HostSlot]) -> None:
        if not plan.submitted:  # the step's first update: nothing has read a master yet
            self.adopt_changed_weights()
        self.updates.submit(plan, slots)

    def complete_host_grads(self) -> list[HostSlot]:
        """offload_gradients: every gradient complete on the host (a ``.grad`` set on the
        device by hand is offloaded too); returns the slots that have one."""
        for slot in self.slots:
            if self.follow_grad(slot):
                self.offload_grad(slot.param)
        ready = [s for s in self.slots.in_order(self.params()) if s.has_grad]
        for slot in ready:
            self.grads.complete(slot)
        return ready

    def ready_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As Engine's, with offloaded gradients' complete host copies; parameters updated on
        the device with their ``.grad``."""
        if not self.options.offload_gradients:
            return super().ready_pairs()
        host = {id(s.param): s.grad for s in self.complete_host_grads()}
        pairs = []
        for p in self.params():
            if id(p) in host:
                pairs.append((p, host[id(p)]))
            elif p.grad is not None and p not in self.slots:
                check_dense(p.grad)
                pairs.append((p, local_part(p.grad)))
        return pairs

    def scale_grads(self, factor: Union[float, torch.Tensor]) -> None:
        overlap, norms = self.overlap, self.scaling.clip_norms
        if overlap is not None and (overlap.pending_scale is not None or (
                norms is not None and norms.grad_scale is not None)):
            raise RuntimeError(
                "scale_grads() after overlap_next_step(grad_scale=...): the scale is "
                "already applied once; call one or the other."
            )
        super().scale_grads(factor)

    def grads_in_place(self, action: str) -> list[torch.Tensor]:
        """The gradients scaling and clipping act on: device ``.grad`` or offloaded copies."""
        early_forward.finish(self)
        for slot in self.slots:
            slot.device_norm = None  # (they are about to change)
        if self.running is not None:
            raise RuntimeError(
                f"{action} after overlap_next_step(): the updates already use the "
                "gradients. Pass grad_scale to overlap_next_step() instead, and don't "
                "overlap steps that clip."
            )
        grads = self.ready_grads()
        if self.scaling.clip_norms is not None:  # scaled (and normed) by the worker: let it finish
            self.scaling.clip_norms.batch.flush()
            self.worker.drain()
        if action != "step()":
            self.scaling.apply_clip_now(grads)
        overlap = self.overlap
        if overlap is not None and overlap.pending_scale is not None:
            # overlap_next_step's grad_scale, applied before anything reads the gradients,
            # as if scale_grads() had been called right after backward.
            factor, overlap.pending_scale = overlap.pending_scale, None
            self.scaling.scale(grads, factor)
        return grads

    def zero_grad(self, set_to_none: bool, clear: Callable[[], None]) -> None:
        self._stepped = False
        # overlap_next_step() announced a step() that never came (its backward raised, and
        # the batch is being dropped): it ends here, or every later backward would be
        # refused as a second one.
        abandoned = self.overlap if not self.in_backward else None
        if not self.options.delayed_update and self.returned_early is None and not self.in_backward:
            self.updates.flush(self.running)
            if self.scaling.clip_norms is not None:
                self.scaling.clip_norms.batch.flush()
            self.worker.drain()
        super().zero_grad(set_to_none, clear)
        if self.returned_early is not None:
            # A step that returned early still reads its host gradients (and adds the last
            # micro-batch's first): they are reset when it finishes, which is before the
            # next gradient lands (the next forward waits for every update first).
            self.returned_early.zero_grad = set_to_none
        else:
            # (Slots whose update this backward queued keep their copy's event: the update
            # waits for it. Waiting here would stall the backward on the GPU.)
            self.grads.reset(set_to_none, keep=in_backward.in_flight(self))
        if abandoned is not None and self.overlap is abandoned:
            self.running, self.overlap = None, None
            self.scaling.reset()
            if abandoned.schedule == "during_backward" and abandoned.seen:
                log.warning(
                    "CPUOffloadOptimizer: zero_grad() after overlap_next_step() without step() (did "
                    "the backward raise?): that step is dropped, but the %d parameter(s) whose "
                    "gradients had arrived were already updated during the backward, as a torch "
                    "step stopped part way leaves them. Load a checkpoint to undo them.",
                    len(abandoned.seen))

    # ------------------------------------------------------------------ state and weights
    def forget_state(self) -> None:
        """The inner optimizer's state was replaced: the update's batches held it."""
        forget_batches(self.inner)

    def changed_slots(self) -> list[HostSlot]:
        """The slots whose parameter was written since its host copy last matched it."""
        return [slot for slot in self.slots if self.weights.changed(slot.order, slot.param)]

    def adopt_weight(self, slot: HostSlot) -> None:
        """Make ``slot``'s host copy follow its parameter again (weight_sync.adopt_weight)."""
        adopt_weight(slot)
        self.weights.matched(slot.order, slot.param)

    def adopt_changed_weights(self) -> None:
        """Take over weights changed outside the optimizer since the host copies last
        matched them (see weight_sync): before a step's first update reads a master."""
        for slot in self.changed_slots():
            self.adopt_weight(slot)
        if self.device_share is not None:
            self.device_share.adopt_changed_weights()

    def reload_weights(self) -> None:
        for slot in self.slots:
            self.adopt_weight(slot)
        if self.device_share is not None:
            self.device_share.adopt_changed_weights(all_params=True)
