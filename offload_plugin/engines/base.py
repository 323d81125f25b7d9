"""The update engines: what ``CPUOffloadOptimizer`` hands its work to.

The optimizer (``optimizer.py``) is torch's facade: param groups, hooks, the state dict.
Where the update runs is an engine's job, one engine per optimizer:

- ``streamed.StreamedEngine``: the state lives in host memory and streams through the GPU,
  whose kernel updates weights and state there (AdamW on a GPU, gradients left on it);
- ``host_engine.HostEngine``: gradients go to host memory and ``optimizer_cls.step`` runs
  there, on the host copies of the weights, which go back (every other case).

The optimizer builds the streamed engine where its options allow streaming, and hands over
to the host engine (``HostEngine.take_over``) at the first parameter group the streamed one
cannot take (``streamed.eligible``) or when a group stops asking for what its kernel does;
never back.

:class:`Engine` is what both have, and the interface the optimizer calls:

- ``attach(group, params, on_device)``: host slots (and state) for a group torch accepted;
- ``step()``: update every parameter with a gradient; ``finish()``: wait for anything
  still in flight and raise its errors;
- ``zero_grad``, ``scale_grads``, ``clip_grad_norm_``: as the optimizer's, on the
  gradients wherever they are;
- ``state_of(param)``: where ``optimizer.state[param]`` lives; ``forget_state()``: it was
  replaced (a load, ``state[p] = ...``); ``host_memory_bytes()``;
- ``note_groups()``, ``check_groups()``: follow the groups' members edited by hand, or
  refuse;
- ``adopt_changed_weights()``: take over weights written outside the optimizer;
  ``reload_weights()``: re-read every weight (``param.data`` writes).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch.optim import Optimizer

from offload_plugin import distributed
from offload_plugin.distributed import DTensor, local_part
from offload_plugin.formats import registry as state_formats
from offload_plugin.formats.inner import contract
from offload_plugin.host import memory as host_memory, process
from offload_plugin.host.buffers import HostSlot, allocate_moments, build_slots
from offload_plugin.host.gradients import check_dense
from offload_plugin.host.inner_step import forget_batches, uses_fused_adam
from offload_plugin.host.scaling import Scaling
from offload_plugin.host.slots import SlotTable
from offload_plugin.options import Options

__all__ = ["Engine"]


class Engine:
    """What both engines own: the trainable slots (``slots``, each parameter's host
    buffers), the inner optimizer (``inner``: ``optimizer_cls`` over the slots' host
    tensors, which holds the state), scaling and clipping (``scaling``), and this process's
    share of the device resources (``resources``, ``transfers``, ``worker``, ``arena``).

    It reads the optimizer only through its public attributes (``param_groups``,
    ``defaults``, GradScaler's ``grad_scale``)."""

    streams = False  # whether the update runs on the device with the state streamed to it
    device_share = None  # the parameters updated on the device (device_fraction): host engine only
    overlap = None  # what overlap_next_step() chose (host engine only)

    # What the update looks like from outside, in the words trainable's log uses.
    where_text = "on the host"

    def accepts(self, group: dict, params: list[torch.Tensor]) -> bool:
        """Whether this engine can update ``params`` of a new ``group``; else the host engine
        takes over (HostEngine.take_over), as building with that group gives."""
        return True

    def still_applies(self) -> bool:
        """Whether every group, as edited or loaded since, still suits this engine; else the
        host engine takes over."""
        return True

    @property
    def takes_amp_scale(self) -> bool:
        """Whether step() takes a GradScaler's scale itself (torch's ``_step_supports_amp_scaling``):
        where the gradients are out of the GradScaler's reach (see CPUOffloadOptimizer's)."""
        return self.scaling.hidden_grads

    @property
    def keeps_host_weights(self) -> bool:
        """Whether the slots hold host copies of their weights (a saved master loads there)."""
        return not self.streams

    def handover(self) -> dict:
        """What another engine taking over this one's parameters continues with: its slots,
        inner optimizer, scaling, groups' membership, ownership record and device resources
        (after finishing any step in flight)."""
        self.finish()
        return dict(optimizer=self._optimizer, options=self.options, slots=self.slots, inner=self.inner,
                    scaling=self.scaling, taken_over=self.taken_over, membership=self._membership,
                    resources=self.resources, transfers=self.transfers, worker=self.worker, arena=self.arena)

    def __init__(self, optimizer: Optimizer, options: Options) -> None:
        self._optimizer = optimizer
        self.options = options
        self.slots = SlotTable()
        self.inner: Optional[Optimizer] = None
        self.scaling = Scaling(options.nonfinite_grads)
        self.resources: Optional[process.Resources] = None
        self.transfers = self.worker = self.arena = None
        self.taken_over: set[int] = set()  # ids of parameters a newer optimizer updates now
        self._membership: list = []  # ids of each group's parameters, as the inner groups have them

    # ------------------------------------------------------------------ the optimizer's view
    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self._optimizer.defaults

    @property
    def amp_scale(self) -> Optional[torch.Tensor]:
        """torch.amp.GradScaler's scale, handed to step() (see the optimizer's
        ``_step_supports_amp_scaling``)."""
        return getattr(self._optimizer, "grad_scale", None)

    def params(self) -> Iterator[torch.Tensor]:
        """Trainable parameters in order, group by group (the order of state-dict indices)."""
        return (p for g in self.param_groups for p in g["params"])

    def holds(self, param: torch.Tensor) -> bool:
        return self.slots.get(param) is not None

    # ------------------------------------------------------------------ attach
    def setup_device(self, device: torch.device) -> None:
        self.resources = process.resources(device, self.options.host_threads)
        self.transfers, self.worker = self.resources.transfers, self.resources.worker
        self.arena = self.resources.arena(self.options.pin_memory).account()  # this optimizer's share
        self.scaling.on_accelerator = device.type != "cpu"

    def attach(self, group: dict[str, Any], params: list[torch.Tensor],
               on_device: list[torch.Tensor]) -> list[HostSlot]:
        """Host slots, the inner optimizer's group and its state's memory for ``group``
        (torch accepted it; ``params`` are those this engine updates, ``on_device`` those
        kept on the device). Checks the host memory first: nothing is allocated if it
        cannot fit."""
        options = self.options
        if params and self.transfers is None:
            self.setup_device(params[0].device)
        shards = [local_part(p) for p in params]  # a DTensor (FSDP2) costs this rank its shard
        host_copies = not self.streams
        if params and options.check_host_memory:
            state = host_memory.state_tensors_per_param(options.optimizer_cls, group)
            own_format = contract(options.optimizer_cls)
            # (a class with its own state format on bf16 host copies says its state's bytes)
            state_bytes = (state_formats.get(own_format.state_format).state_bytes
                           if own_format.bf16_host_only and own_format.state_format else None)
            spares = 2 if options.delayed_update and options.offload_gradients else 0
            host_memory.check(
                host_memory.bytes_needed(shards, options.master_weights, state, spares,
                                         host_copies=host_copies, state_bytes=state_bytes),
                sum(p.numel() for p in shards), options.master_weights,
            )
        slots = build_slots(
            params, options.master_weights, self.arena,
            spare_grads=options.delayed_update and options.offload_gradients,
            host_copies=host_copies,
        ) if params else []
        host_group = {k: v for k, v in group.items() if k != "params"}
        host_group["params"] = [s.master for s in slots]
        if self.inner is None:
            self.inner = options.optimizer_cls([host_group], **options.optimizer_kwargs)
        else:
            self.inner.add_param_group(host_group)
        pin_moments = self.streams and self.arena is not None and self.arena.pin
        if uses_fused_adam(self.inner, self.inner.param_groups[-1]):
            allocate_moments(slots, pin=pin_moments)  # (the fused path creates Adam's state itself)
        if params and options.check_host_memory and not pin_moments:
            # (moments to be page-locked were zero-filled, even where that failed: resident
            # now; any other state is made at the first step)
            host_memory.promise(self._optimizer, host_memory.bytes_needed(
                shards, options.master_weights, state, host_copies=False, state_bytes=state_bytes))
        hooks = contract(type(self.inner))
        shard_of = hooks.hook(self.inner, "shard_of")  # (CompactAdamW lays out shards' state)
        for slot in slots:
            slot.on_replaced = hooks.hook(self.inner, "weight_replaced")
            if shard_of is not None and isinstance(slot.param, DTensor):
                shard_of(slot.master, slot.param.shape, distributed.first_row(slot.param))
        self.slots.add(slots)  # in parameter order: forward order for torchtune's models
        return slots

    # ------------------------------------------------------------------ what each engine does
    def step(self) -> None:
        """Update every parameter that has a gradient (the optimizer's ``step()``)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for anything still in flight (a queued step, copies into host memory, an
        update running in the background) and raise its errors. Cheap when idle."""
        raise NotImplementedError

    def forget_state(self) -> None:
        """The inner optimizer's state was replaced (a load, ``state[p] = ...``): drop what
        was worked out from it (batches, plans, step counts on the device)."""
        raise NotImplementedError

    def adopt_changed_weights(self) -> None:
        """Take over weights written outside the optimizer since it last matched them,
        before a step's first update (or a state dict) reads what derives from them."""
        raise NotImplementedError

    def reload_weights(self) -> None:
        """Re-read every weight (after writes through ``param.data``, which no tracker sees)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ gradients
    def ready_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, gradient)`` of every parameter the next update would step, in parameter
        order; a DTensor's gradient as its local shard."""
        pairs = []
        sharded = self.slots.sharded
        for p in self.params():
            grad = p.grad
            if grad is not None:
                if grad.is_sparse:
                    check_dense(grad)
                pairs.append((p, local_part(grad) if sharded else grad))
        return pairs

    def ready_grads(self) -> list[torch.Tensor]:
        return [g for _, g in self.ready_pairs()]

    def grads_in_place(self, action: str) -> list[torch.Tensor]:
        """The gradients scale_grads and clip_grad_norm_ act on (``action`` names the call)."""
        grads = self.ready_grads()
        self.scaling.apply_clip_now(grads)
        return grads

    def scale_grads(self, factor: Union[float, torch.Tensor]) -> None:
        self.scaling.scale(self.grads_in_place("scale_grads()"), factor)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                        foreach: Optional[bool]) -> torch.Tensor:
        grads = self.grads_in_place("clip_grad_norm_()")
        params = [p for p, _ in self.ready_pairs()] if self.slots.sharded else []
        return self.scaling.clip(params, grads, self.slots.meshes, max_norm, norm_type,
                                 error_if_nonfinite, foreach)

    def zero_grad(self, set_to_none: bool, clear: Callable[[], None]) -> None:
        """Reset the gradients: ``clear`` is torch's zero_grad of the model's ``.grad``."""
        self.scaling.reset()
        clear()
        self.scaling.finite.clear()

    # ------------------------------------------------------------------ state
    def host_memory_bytes(self) -> int:
        """Host bytes held: master weights, gradients, staging and state."""
        state_bytes = sum(v.numel() * v.element_size() for entry in self.inner.state.values()
                          for v in entry.values() if isinstance(v, torch.Tensor))
        return self.arena.nbytes() + state_bytes

    def state_of(self, param: torch.Tensor) -> Optional[tuple[dict, torch.Tensor]]:
        """The state mapping that holds ``param``'s state and its key there, or None."""
        slot = self.slots.get(param)
        return None if slot is None else (self.inner.state, slot.master)

    # ------------------------------------------------------------------ groups edited by hand
    def note_groups(self) -> None:
        """The groups' members as the inner groups have them (after add_param_group)."""
        self._membership = [list(map(id, group["params"])) for group in self.param_groups]

    def check_groups(self) -> None:
        """Refuse a tensor put into ``param_groups[i]["params"]`` by hand: torch's optimizers
        update it from then on, but it has no host copy here and would be left alone. A
        parameter moved between groups (or the lists reordered) by hand: see regroup."""
        # (One C-level pass per group: the step asks it of every parameter.)
        membership = [list(map(id, group["params"])) for group in self.param_groups]
        if membership == self._membership:
            return
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if not self.holds(p):
                    raise ValueError(
                        f"param_groups[{i}]['params'] holds a tensor of shape "
                        f"{tuple(getattr(p, 'shape', ()))} that CPUOffloadOptimizer was not "
                        "given: it has no host copy to update. Add parameters with "
                        "optimizer.add_param_group({'params': [...]}) instead."
                    )
        ids = [i for group in membership for i in group]
        if len(set(ids)) != len(ids):
            raise ValueError(
                "a parameter is in more than one of param_groups' 'params' lists (torch's "
                "optimizers would update it once for each): keep each parameter in one group.")
        if self.device_share is not None:
            raise ValueError(
                "param_groups' 'params' lists were edited by hand; with device_fraction the "
                "groups are split between the device and the host when built, so move "
                "parameters between groups by building the optimizer with the groups you need.")
        if len(ids) != len(self.slots):
            raise ValueError(
                "a parameter was taken out of param_groups' 'params' lists by hand; "
                "CPUOffloadOptimizer would go on updating it. Put it back, and to leave it "
                "alone set its .grad to None (or p.requires_grad_(False) before backward).")
        self.regroup()
        self._membership = membership

    def regroup(self) -> None:
        """The groups' members were edited by hand, with parameters of this optimizer: torch's
        optimizers update each with the hyperparameters of the group it is in now. The inner
        groups (and an engine's plans) were cut from the old membership: they follow."""
        self.finish()  # (an update still running reads the inner groups)
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner["params"] = [slot.master for slot in self.slots.in_order(group["params"])]
        forget_batches(self.inner)
