"""CPUOffloadOptimizer: a torch.optim.Optimizer whose state and update live in host memory.

This module is the facade: param groups, ``state``, ``step``, ``zero_grad``, the state dict,
scaling and clipping, as torch's optimizers have them. The work is done by parts with one
job each:

- ``options``: the constructor's options, checked once;
- ``slots`` and ``host_buffers``: the table of trainable slots and their host memory;
- ``gradients``: the gradient path (offloaded during backward, or copied at step);
- ``scaling``: scale, clip and the inf/NaN verdict;
- ``schedules``: what a step does (one table; a module per schedule), over ``updates``,
  the host update queue, or ``streamed``, the update on the GPU with the state streamed
  from host memory;
- ``weight_sync``: weights changed outside the optimizer;
- ``checkpoint``: the state dict;
- ``process``: what all instances in a process share (host worker, transfer streams).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import MutableMapping
from functools import partial
from itertools import chain
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch.optim import Optimizer

from offload_plugin import checkpoint, host_memory, process, schedules, streamed
from offload_plugin.checkpoint_compat import TORCHAO_MINIMAL_SIZE
from offload_plugin.device_share import DeviceShare, choose_kept
from offload_plugin.distributed import DTensor, check_rows_sharded, local_part
from offload_plugin.gradients import GradientPath, check_dense
from offload_plugin.host_buffers import HostSlot, allocate_moments, build_slots, give_host_copies
from offload_plugin.host_update import forget_batches, uses_fused_adam
from offload_plugin.options import Options, check_trainable
from offload_plugin.scaling import Scaling, multiplier
from offload_plugin.schedules import delayed, early_forward, in_backward
from offload_plugin.slots import SlotTable
from offload_plugin.updates import StepPlan, Updates
from offload_plugin.weight_sync import adopt_weight, changed_slots

__all__ = ["CPUOffloadOptimizer"]

log = logging.getLogger(__name__)
_ONE_TENSOR_NOTED = False  # (see CPUOffloadOptimizer._log_summary)
# id(parameter) -> (weak parameter, weak optimizer): the optimizer that updates it (see _claim).
_OWNERS: dict[int, tuple] = {}


def _forget_owner(key: int, ref: weakref.ref) -> None:
    """A claimed parameter was freed: its id may be reused by another tensor."""
    if _OWNERS.get(key, (None,))[0] is ref:
        del _OWNERS[key]


class _GradHook:
    """A parameter's post-accumulate-grad hook that reaches the optimizer through a weak
    reference. The parameter holds its hooks and the optimizer holds the parameter; with
    a bound method in between, a dropped model and optimizer were never collected (torch
    2.13: the cycle runs through the tensor's hook table), and with them the host memory
    and the host worker's thread."""

    __slots__ = ("_optimizer",)

    def __init__(self, optimizer: "CPUOffloadOptimizer") -> None:
        self._optimizer = weakref.ref(optimizer)

    def __call__(self, param: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._on_grad_accumulated(param)


class _StateByParam(MutableMapping):
    """``optimizer.state`` keyed by the user's parameters, backed by the host optimizer's state."""

    def __init__(self, owner: "CPUOffloadOptimizer") -> None:
        self._owner = owner

    def _where(self, param: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The state mapping that holds ``param``'s state, and its key there."""
        owner = self._owner
        slot = owner._slots.get(param)
        if slot is not None:
            if owner._streamed is not None:  # the state as the last step left it
                owner._streamed.settle(for_user=True)
            return owner._host_optimizer.state, slot.master
        if owner._device_share is not None and param in owner._device_share:
            return owner._device_share.optimizer.state, owner._device_share.target[param]
        # (torch's state is a defaultdict that would make an empty entry here; one made for a
        # tensor this optimizer never updates would be dropped silently, so say why instead)
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else type(param).__name__
        raise KeyError(
            f"optimizer.state has no entry for this tensor ({shape}): it is not among the "
            "parameters this CPUOffloadOptimizer updates (frozen parameters, requires_grad=False "
            "when it was built, are left out). Use `p in optimizer.state` to test first.")

    def __getitem__(self, param):
        # Both optimizers' state is a defaultdict, as torch's optimizers' state is.
        state, key = self._where(param)
        return state[key]

    def __setitem__(self, param, value):
        state, key = self._where(param)
        state[key] = value
        self._replaced(state)

    def __delitem__(self, param):
        state, key = self._where(param)
        del state[key]
        self._replaced(state)

    def _replaced(self, state: dict) -> None:
        """A parameter's state dict was replaced: the host update's batches held it."""
        if self._owner._host_optimizer is not None and state is self._owner._host_optimizer.state:
            forget_batches(self._owner._host_optimizer)
            if self._owner._streamed is not None:
                self._owner._streamed.forget_state()

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p in self._owner._params() if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, param) -> bool:
        try:
            state, key = self._where(param)
        except (KeyError, TypeError):
            return False
        return key in state

    def __repr__(self) -> str:
        return repr(dict(self.items()))


class CPUOffloadOptimizer(Optimizer):
    """``optimizer_cls`` with its state in host memory; the device keeps only weights.

    Frozen parameters (``requires_grad=False``, e.g. QLoRA's NF4 base weights) are dropped
    before anything is allocated or hooked, so ``model.parameters()`` can be passed as
    torchtune's recipes do. ``param_groups``, ``state``, ``defaults``, hooks and the state
    dict behave as on torch's optimizers, so every LR scheduler and checkpoint helper works.

    On a GPU, AdamW and Adam (fused, the default) without master weights, offloaded
    gradients, ``delayed_update``, ``device_fraction`` or DTensor parameters take the
    streamed update (``offload_plugin.streamed``): each step copies the moments to the GPU,
    torch's fused CUDA kernel updates weights and moments there, and the moments go back,
    all on side streams: bit for bit ``torch.optim.AdamW(fused=True)`` on the GPU.
    Otherwise each step copies the gradients to pinned host memory (or, with
    ``offload_gradients``, takes the copies made during backward), runs
    ``optimizer_cls.step`` there and copies the updated weights back on a side CUDA stream.
    On a machine without a GPU the host update runs with synchronous copies.

    Args:
        params (Iterable): parameters or param-group dicts, as for any torch optimizer.
        optimizer_cls (type or str): the optimizer run on the host, as a class or a dotted
            path. Default: ``"torch.optim.AdamW"``.
        offload_gradients (bool): move each gradient to host memory as soon as backward
            produces it and free it on the device. Saves the gradients' device memory;
            scale and clip through :meth:`scale_grads` and :meth:`clip_grad_norm_`, since
            the model's ``.grad`` is ``None`` afterwards. Default: ``False``.
        master_weights (bool): keep fp32 copies of bf16/fp16 parameters on the host and
            update those, so that small updates are not rounded away. Opt-in: it changes
            the result (no longer torch's ``optimizer_cls`` on the parameters as they are),
            doubles the host memory (16 bytes per bf16 parameter instead of 8) and slows
            the host update, which moves about twice the bytes. Default: ``False``: the
            update runs in the parameter's dtype, bit for bit ``optimizer_cls`` on it.
        pin_memory (bool): page-lock host buffers for fast asynchronous copies (CUDA only).
            Default: ``True``.
        nonfinite_grads (str): what a step with an inf or NaN gradient does: ``"skip"``
            (update nothing, warn) or ``"raise"`` (FloatingPointError). Where updates start
            as gradients arrive (``overlap_next_step`` without clipping, ``optimizer_in_bwd``,
            ``delayed_update`` without scaling or clipping) each parameter is judged alone:
            one with a non-finite gradient is left unchanged, the others update. Master
            weights and optimizer state never take a non-finite gradient. Default: ``"skip"``.
        check_host_memory (bool): before allocating, compare the host memory needed with
            what this process may use (MemAvailable, cgroup limit) and raise
            ``HostMemoryError`` naming both if it cannot fit. Default: ``True``.
        delayed_update (bool): opt-in, NOT exact. ``step()`` returns at once and the host
            update runs during the next forward and backward, which therefore still use
            the weights from before it; each gradient is applied one step late (computed
            on weights that lack the latest update), as in DeepSpeed's delayed parameter
            update. Hides the host update behind GPU work; costs two more gradient-sized
            host buffers with ``offload_gradients``. Updated weights are copied back as
            each parameter's gradient is final in the next step's last backward (see
            :meth:`overlap_next_step`), else at the next ``step()``. ``state_dict()``
            completes the pending update first. Without ``scale_grads`` or clipping
            (``overlap_next_step(grad_scale)`` scales), each update scales and checks its
            own gradient, so step() itself reads no gradient; a parameter with an inf/NaN
            gradient is then left unchanged while the others update, and the warning or
            error comes from the next ``step()``. Default: ``False``.
        host_threads (int, optional): CPU threads for the host update. Default: all but
            one with a GPU (that core launches the GPU work). Parameters on the CPU update
            in the training thread with its own count (``torch.set_num_threads``): a
            second thread's OpenMP team would slow the training thread's every op.
        device_fraction (float): partial offload. Keep the update of the first trainable
            parameters (in the order given; for torchtune models the embeddings and first
            layers, whose gradients arrive last in backward), up to this fraction of all
            trainable elements, on the device with an ordinary ``optimizer_cls`` there. Costs
            their optimizer state (and fp32 masters) in device memory; saves that share of
            the host update, and the tail the next forward waits for. Their gradients stay
            on the device. Chosen at construction; groups added later are offloaded. With
            ``delayed_update`` they update without delay. Default: ``0.0`` (all on the host).
        accumulate_on_device (bool): with ``offload_gradients`` and gradient accumulation,
            leave the gradients on the device until the last backward of the window, which
            :meth:`overlap_next_step` precedes (else ``step()``, ``scale_grads`` or
            ``clip_grad_norm_`` moves them). Saves the host one gradient-sized addition per
            micro-batch, at the cost of a full set of gradients in device memory during
            accumulation (as with ``offload_gradients=False``); the last micro-batch's
            gradients still leave during its backward, and updates can start there.
            Results are unchanged. Default: ``False``.
        **optimizer_kwargs: hyperparameters for ``optimizer_cls`` (``lr``, ``betas``,
            ``weight_decay``, ``fused``, ...).

    Raises:
        ValueError: no trainable parameters, a parameter given twice, parameters on
            different devices, an unresolvable or unsupported ``optimizer_cls``, or an
            invalid hyperparameter (reported by ``optimizer_cls`` itself).
        HostMemoryError: the host buffers and state would not fit (see check_host_memory).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step(); opt.zero_grad()
    """

    _is_offload_optimizer = True  # (options.resolve_optimizer_cls refuses to nest it)

    def __init__(
        self,
        params: Iterable,
        optimizer_cls: Union[str, type] = "torch.optim.AdamW",
        *,
        offload_gradients: bool = False,
        master_weights: bool = False,
        pin_memory: bool = True,
        nonfinite_grads: str = "skip",
        check_host_memory: bool = True,
        delayed_update: bool = False,
        host_threads: Optional[int] = None,
        accumulate_on_device: bool = False,
        device_fraction: float = 0.0,
        **optimizer_kwargs: Any,
    ) -> None:
        options = Options(
            optimizer_cls, optimizer_kwargs, offload_gradients=offload_gradients,
            master_weights=master_weights, pin_memory=pin_memory, nonfinite_grads=nonfinite_grads,
            check_host_memory=check_host_memory, delayed_update=delayed_update,
            host_threads=host_threads, accumulate_on_device=accumulate_on_device,
            device_fraction=device_fraction,
        )
        if isinstance(params, (set, frozenset)):
            raise TypeError(
                "CPUOffloadOptimizer got its parameters as a set, whose order is not stable "
                "(state-dict indices follow the order): pass a list, e.g. model.parameters()."
            )
        defaults = options.defaults()
        self.options = options
        # The options as attributes, as torch's optimizers expose theirs (recipes read them).
        self.optimizer_cls, self._optimizer_kwargs = options.optimizer_cls, options.optimizer_kwargs
        self.offload_gradients, self.master_weights = options.offload_gradients, options.master_weights
        self.pin_memory, self.nonfinite_grads = options.pin_memory, options.nonfinite_grads
        self.check_host_memory, self.delayed_update = options.check_host_memory, options.delayed_update
        self.host_threads, self.accumulate_on_device = options.host_threads, options.accumulate_on_device
        self.device_fraction = options.device_fraction
        self._keep_ids: set[int] = set()
        if self.device_fraction and not isinstance(params, torch.Tensor):
            params = list(params)  # read twice: to choose the kept share, then by torch
            self._keep_ids = choose_kept(params, self.device_fraction)

        # The parts (see the module docstring); the device-bound ones come with the first
        # parameter (_setup_device).
        self._slots = SlotTable()
        self._scaling = Scaling(self.nonfinite_grads, self.offload_gradients)
        self._host_optimizer: Optional[Optimizer] = None
        self._device_share: Optional[DeviceShare] = (
            DeviceShare(self.optimizer_cls, self._optimizer_kwargs, self.master_weights)
            if self._keep_ids else None
        )
        self._hooks: list = []
        # The update on the device with the state streamed from host memory, where it gives
        # torch's result (streamed.eligible), else None: the host update.
        self._streamed: Optional[streamed.StreamedUpdate] = None
        self._eligible_for_streaming = True
        self._shared = self._transfers = self._arena = self._worker = None
        self._grads: Optional[GradientPath] = None
        self._updates: Optional[Updates] = None
        # Per-step state, each a typed record of the schedule that owns it: what
        # overlap_next_step chose, the plan whose updates are being submitted, a step
        # that returned early (early_forward), the update running in the background
        # (delayed_update), and the parameters whose gate that early step never saw pass.
        self._overlap: Optional[schedules.Overlap] = None
        self._running: Optional[StepPlan] = None
        self._returned_early: Optional[StepPlan] = None
        self._pending = delayed.Pending()
        self._in_backward: list[StepPlan] = []  # queued by step()s inside this backward
        self._ungated: dict[int, torch.Tensor] = {}
        self._membership: list = []  # ids of each group's parameters, as the host groups have them
        self._counts = {"kept": 0, "kept_numel": 0, "frozen": 0, "frozen_numel": 0,
                        "on_device": 0, "on_device_numel": 0}
        # Parameters dropped as frozen, until one of them is found with a gradient (warned
        # once, see _warn_unfrozen), and ids of ours a newer optimizer took over (_claim).
        self._frozen: list[weakref.ref] = []
        self._taken_over: set[int] = set()

        super().__init__(params, defaults)  # calls add_param_group for each group
        self.state = _StateByParam(self)
        c = self._counts
        if c["kept"] == 0:
            raise ValueError(
                f"CPUOffloadOptimizer got no trainable parameters: all {c['frozen']} "
                "tensors have requires_grad=False. For LoRA/QLoRA, mark the adapters "
                "trainable first (torchtune.modules.peft.set_trainable_params(model, "
                "get_adapter_params(model))); otherwise check what was passed as params."
            )
        self._log_summary()

    def _log_summary(self) -> None:
        """What was kept and where the update runs, at INFO; at DEBUG for an optimizer of one
        tensor, as torchtune's ``optimizer_in_bwd`` builds one per parameter (a line each
        would flood the recipe's log), after one INFO line per process saying so."""
        global _ONE_TENSOR_NOTED
        c, level = self._counts, logging.INFO
        if c["kept"] == 1:
            level = logging.DEBUG
            if not _ONE_TENSOR_NOTED:
                _ONE_TENSOR_NOTED = True
                log.info("CPUOffloadOptimizer: optimizers over one tensor each (as torchtune's "
                         "optimizer_in_bwd builds them, one per parameter) log what they keep "
                         "at DEBUG level.")
        if self._transfers is not None and not self._transfers.is_async:
            log.log(level, "CPUOffloadOptimizer: parameters are on %s, not a CUDA device; the "
                    "update runs in host memory with synchronous copies.", self._transfers.device)
        log.log(
            level,
            "CPUOffloadOptimizer(%s): optimizing %d tensors (%s elements) %s%s; "
            "skipped %d frozen tensors (%s elements).",
            self.optimizer_cls.__name__, c["kept"] - c["on_device"],
            f"{c['kept_numel'] - c['on_device_numel']:,}",
            ("with the state in host memory, updated on the device "
             + ("by the compact kernel" if self._streamed._compact else "as torch's fused AdamW")
             + " (the state streamed through it)") if self._streamed is not None else "on the host",
            f" and {c['on_device']} ({c['on_device_numel']:,} elements) on the device"
            if c["on_device"] else "",
            c["frozen"], f"{c['frozen_numel']:,}",
        )

    def __reduce_ex__(self, protocol):
        # copy.copy, copy.deepcopy, pickle and torch.save all come here. A copy would share
        # the host buffers, worker thread and gradient hooks of this one, or have none.
        raise TypeError(
            "CPUOffloadOptimizer cannot be copied or pickled: it owns host buffers, a worker "
            "thread and hooks on the model's parameters. Save optimizer.state_dict() (e.g. "
            "torch.save(optimizer.state_dict(), path)) and load it into a CPUOffloadOptimizer "
            "built over the model's parameters with load_state_dict()."
        )

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group as torch's optimizers do, dropping its frozen parameters first."""
        if getattr(self, "_returned_early", None) is not None:  # (torch's __init__ calls this)
            early_forward.finish(self)
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        group = dict(param_group)
        entries = group["params"]
        if isinstance(entries, set):
            raise TypeError(
                "optimizer parameters need to be an ordered collection (a list), not a set: "
                "state-dict indices follow their order."
            )
        entries = [entries] if isinstance(entries, torch.Tensor) else list(entries)
        named = [e for e in entries if isinstance(e, tuple)]
        tensors = [e[1] if isinstance(e, tuple) else e for e in entries]
        keep = [isinstance(t, torch.Tensor) and t.requires_grad for t in tensors]
        for t, k in zip(tensors, keep):
            if isinstance(t, torch.Tensor) and not k:
                self._counts["frozen"] += 1
                self._counts["frozen_numel"] += local_part(t).numel()  # this rank's, as kept
                self._frozen.append(weakref.ref(t))
        kept_entries = [e for e, k in zip(entries, keep) if k]
        kept = [t for t, k in zip(tensors, keep) if k]
        # Non-tensors are kept so that torch reports them with its own message.
        kept_entries += [e for e, t in zip(entries, tensors) if not isinstance(t, torch.Tensor)]
        if len(set(map(id, kept))) != len(kept):
            raise ValueError("a parameter appears more than once in a parameter group")
        if named and len(named) != len(entries):
            raise ValueError("all optimizer params should be with/without names")
        group["params"] = kept_entries
        super().add_param_group(group)
        try:
            self._attach(self.param_groups[-1])
        except BaseException:
            # Leave the optimizer as it was: no group without host copies behind it.
            self.param_groups.pop()
            raise
        self._membership = [list(map(id, g["params"])) for g in self.param_groups]  # (_check_params_known)

    def _attach(self, group: dict[str, Any]) -> None:
        """Create host copies (and hooks) for a group torch has accepted."""
        params = group["params"]
        devices = {p.device for p in chain(params, (s.param for s in self._slots))}
        if len(devices) > 1:
            raise ValueError(
                "CPUOffloadOptimizer needs all trainable parameters on one device, got "
                f"{sorted(map(str, devices))}. Move the model with model.to(device) first."
            )
        check_trainable(params)
        if params and self._transfers is None:
            self._setup_device(params[0].device)
        on_device = [p for p in params if id(p) in self._keep_ids]
        if any(isinstance(p, DTensor) for p in on_device):
            raise ValueError(
                "device_fraction is not supported with DTensor (FSDP2) parameters yet; "
                "use device_fraction=0."
            )
        if getattr(self.optimizer_cls, "bf16_host_only", False):
            self._check_host_only(params)
        all_params, params = params, [p for p in params if id(p) not in self._keep_ids]
        # A DTensor (FSDP2) parameter costs this rank only its local shard.
        shards = [local_part(p) for p in params]
        streaming = self._eligible_for_streaming and streamed.eligible(self, group, params)
        if params and self.check_host_memory:
            state = host_memory.state_tensors_per_param(self.optimizer_cls, group)
            spares = 2 if self.delayed_update and self.offload_gradients else 0
            host_memory.check(
                host_memory.bytes_needed(shards, self.master_weights, state, spares,
                                         host_copies=not streaming),
                sum(p.numel() for p in shards), self.master_weights,
            )
        if not streaming:
            self._stop_streaming()
        slots = build_slots(
            params, self.master_weights, self._arena,
            spare_grads=self.delayed_update and self.offload_gradients, host_copies=not streaming,
        ) if params else []
        host_group = {k: v for k, v in group.items() if k != "params"}
        host_group["params"] = [s.master for s in slots]
        if self._host_optimizer is None:
            self._host_optimizer = self.optimizer_cls([host_group], **self._optimizer_kwargs)
        else:
            self._host_optimizer.add_param_group(host_group)
        if streaming and self._streamed is None and params:
            self._streamed = streamed.StreamedUpdate(self)
        pin_moments = self._streamed is not None and self._arena.pin
        if uses_fused_adam(self._host_optimizer, self._host_optimizer.param_groups[-1]):
            # (the fused path creates Adam's state itself)
            allocate_moments(slots, pin=pin_moments)
        if params and self.check_host_memory and not pin_moments:
            # (moments to be page-locked were zero-filled, even where that failed: resident
            # now; any other state is made at the first step)
            host_memory.promise(self, host_memory.bytes_needed(shards, self.master_weights, state, host_copies=False))
        shard_of = getattr(self._host_optimizer, "shard_of", None)  # (CompactAdamW lays out shards' state)
        for slot in slots:
            slot.on_replaced = getattr(self._host_optimizer, "weight_replaced", None)
            if shard_of is not None and isinstance(slot.param, DTensor):
                shard_of(slot.master, slot.param.shape)
        if self._device_share is not None:  # one group per outer group, even if empty
            self._device_share.add_group({k: v for k, v in group.items() if k != "params"}, on_device)
        self._slots.add(slots)  # in parameter order: forward order for torchtune's models
        if self.offload_gradients:
            for slot in slots:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(_GradHook(self)))
        self._claim(all_params)
        self._counts["kept"] += len(all_params)
        self._counts["kept_numel"] += sum(p.numel() for p in shards) + sum(p.numel() for p in on_device)
        self._counts["on_device"] += len(on_device)
        self._counts["on_device_numel"] += sum(p.numel() for p in on_device)

    def _claim(self, params: list) -> None:
        """This optimizer updates ``params`` from now on. An older CPUOffloadOptimizer over
        one of them (still alive: rebuilt over the same model before the old one was dropped,
        or two built on purpose) leaves it alone and refuses its next step: each keeps its
        own copy of the weight and writes it back whole, so two would undo each other's
        updates where torch's optimizers apply both."""
        for p in params:
            held = _OWNERS.get(id(p))
            older = held[1]() if held is not None and held[0]() is p else None
            if older is not None and older is not self and older._holds(p):
                older._taken_over.add(id(p))
            ref = weakref.ref(p, partial(_forget_owner, id(p)))
            _OWNERS[id(p)] = (ref, weakref.ref(self))

    def _holds(self, p: torch.Tensor) -> bool:
        return self._slots.get(p) is not None or (self._device_share is not None and p in self._device_share)

    def _check_not_taken_over(self) -> None:
        if self._taken_over:
            raise ValueError(
                f"CPUOffloadOptimizer: a newer CPUOffloadOptimizer was built over "
                f"{len(self._taken_over)} of this optimizer's parameters and updates them now; "
                "this one no longer does (each keeps its own host copy of a weight and writes "
                "it back whole, so two optimizers over one parameter would undo each other's "
                "updates). Step the newer optimizer, or build one optimizer over all the "
                "parameter groups (add_param_group). Nothing was updated."
            )

    def _warn_unfrozen(self) -> None:
        """A parameter dropped as frozen (requires_grad=False when this optimizer was built)
        that has a gradient now, and was not added since (add_param_group), is not updated,
        where torch's optimizers would update it: say so once."""
        unfrozen = sum(1 for ref in self._frozen
                       if (t := ref()) is not None and t.grad is not None and not self._holds(t))
        if unfrozen:
            self._frozen = []  # (once)
            warnings.warn(
                f"CPUOffloadOptimizer: {unfrozen} parameter(s) that had requires_grad=False when "
                "it was built (left out as frozen, as QLoRA's base weights) have gradients now; "
                "it does not update them. Add them with optimizer.add_param_group({'params': "
                "[...]}), or set requires_grad before building the optimizer.", stacklevel=3)

    def _stop_streaming(self) -> None:
        """A group the streamed update cannot take: the host update takes over for all, from
        the state as it is. The slots get host copies of their weights (the streamed update
        keeps none), adopted from the parameters at the next step (weight_sync)."""
        self._eligible_for_streaming = False
        if self._streamed is None:
            return
        self._streamed.settle()
        self._streamed = None
        host = self._host_optimizer
        placeholders = {id(slot.master): slot for slot in self._slots}
        give_host_copies(list(self._slots), self.master_weights, self._arena)
        # The host optimizer knows each slot by its master: key it by the new one.
        for group in host.param_groups:
            group["params"] = [placeholders[id(m)].master for m in group["params"]]
        for old in [m for m in host.state if id(m) in placeholders]:
            host.state[placeholders[id(old)].master] = host.state.pop(old)
        forget_batches(host)

    def _setup_device(self, device: torch.device) -> None:
        self._shared = process.resources(device, self.host_threads)
        self._transfers, self._worker = self._shared.transfers, self._shared.worker
        self.host_threads = self._worker.num_threads
        self._arena = self._shared.arena(self.pin_memory).account()  # this optimizer's share
        self._grads = GradientPath(self._slots, self._transfers, self._worker, self._arena,
                                   self.pin_memory, self.delayed_update)
        self._scaling.on_accelerator = device.type != "cpu"
        self._updates = Updates(lambda: self._host_optimizer, self._grads, self._transfers,
                                self._worker)

    def _params(self) -> Iterator[torch.Tensor]:
        """Trainable parameters in order, group by group (the order of state-dict indices)."""
        return (p for g in self.param_groups for p in g["params"])

    def _check_params_known(self) -> None:
        """Refuse a tensor put into ``param_groups[i]["params"]`` by hand: torch's optimizers
        update it from then on, but it has no host copy here and would be left alone. A
        parameter moved between groups (or the lists reordered) by hand: see _regroup."""
        # (One C-level pass per group: the step asks it of every parameter.)
        membership = [list(map(id, group["params"])) for group in self.param_groups]
        if membership == self._membership:
            return
        share = self._device_share
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if self._slots.get(p) is None and (share is None or p not in share):
                    raise ValueError(
                        f"param_groups[{i}]['params'] holds a tensor of shape "
                        f"{tuple(getattr(p, 'shape', ()))} that CPUOffloadOptimizer was not "
                        "given: it has no host copy to update. Add parameters with "
                        "optimizer.add_param_group({'params': [...]}) instead."
                    )
        self._regroup(membership)

    def _regroup(self, membership: list) -> None:
        """The groups' ``params`` lists were edited by hand, with parameters of this
        optimizer: torch's optimizers update each with the hyperparameters of the group it
        is in now. The host optimizer's groups (the host update's) and the streamed
        update's plans were cut from the old membership: they follow."""
        ids = [i for group in membership for i in group]
        if len(set(ids)) != len(ids):
            raise ValueError(
                "a parameter is in more than one of param_groups' 'params' lists (torch's "
                "optimizers would update it once for each): keep each parameter in one group.")
        if self._device_share is not None:
            raise ValueError(
                "param_groups' 'params' lists were edited by hand; with device_fraction the "
                "groups are split between the device and the host when built, so move "
                "parameters between groups by building the optimizer with the groups you need.")
        if len(ids) != len(self._slots):
            raise ValueError(
                "a parameter was taken out of param_groups' 'params' lists by hand; "
                "CPUOffloadOptimizer would go on updating it. Put it back, and to leave it "
                "alone set its .grad to None (or p.requires_grad_(False) before backward).")
        self._finish_pending()  # (an update still running reads the host groups)
        host = self._host_optimizer
        for group, inner in zip(self.param_groups, host.param_groups):
            inner["params"] = [slot.master for slot in self._slots.in_order(group["params"])]
        forget_batches(host)
        if self._streamed is not None:
            self._streamed.forget_plans()
        self._membership = membership

    def _check_host_only(self, params: list) -> None:
        """optimizer_cls=CompactAdamW (or another ``host_only`` class) updates bf16 host
        copies, of DTensors sharded by rows: refuse what it cannot take before anything is
        allocated."""
        name = self.optimizer_cls.__name__
        for p in params:
            if isinstance(p, DTensor):
                check_rows_sharded(p)
        if self.master_weights or any(p.dtype != torch.bfloat16 for p in params):
            dtypes = sorted({str(p.dtype) for p in params})
            raise ValueError(
                f"optimizer_cls={name} updates bf16 host copies and keeps the master itself: it "
                f"needs bf16 parameters (got {', '.join(dtypes)}) and master_weights=False (the "
                f"default; got {self.master_weights}). Convert the model with "
                "model.to(torch.bfloat16) (torchtune: dtype=bf16)."
            )

    # ------------------------------------------------------------------ gradients
    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        """Backward hook (offload_gradients=True)."""
        if self._taken_over and id(param) in self._taken_over:
            return  # (a newer optimizer takes this gradient; this one's step() refuses)
        early_forward.on_backward(self, param)
        overlap = self._overlap
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
        elif self.accumulate_on_device:
            return  # not the last backward (overlap_next_step): autograd adds the next one on the device
        self._offload_grad(param)

    def _offload_grad(self, param: torch.Tensor) -> None:
        """Move ``param.grad`` to its slot, then let the schedule react: queue the update
        (during_backward), take the norm of a host sum (overlapped clipping), or release the
        weight (delayed)."""
        slot, plan = self._slots[param], self._running
        # Work the host would do with a pass over each gradient in host memory, where the
        # update is bound by memory bandwidth, is done by the device on the way out: an
        # update that starts now needs an inf/NaN verdict (the gradient's extremes come
        # along); a clipped step needs each gradient scaled and its norm.
        norms = self._scaling.clip_norms if plan is None else None
        first = self._grads.offload(
            slot, before=partial(norms.on_device, slot) if norms is not None else None,
            extremes=plan is not None and plan.check_each, add_in_worker=plan is None,
        )
        if plan is not None:
            self._submit(plan, [slot])
        elif norms is not None and not first:  # an accumulated sum: scaled and normed on the host
            norms.batch.add(slot, slot.grad.numel())
        elif self._overlap is not None and self._overlap.schedule == "delayed":
            delayed.release_for_push(self, slot)

    def _submit(self, plan: StepPlan, slots: list[HostSlot]) -> None:
        if not plan.submitted:  # the step's first update: nothing has read a master yet
            self._adopt_changed_weights()
        self._updates.submit(plan, slots)

    def _settled_host_grads(self) -> list[HostSlot]:
        """offload_gradients: every gradient complete on the host (a ``.grad`` set on the
        device by hand is offloaded too); returns the slots that have one."""
        for slot in self._slots:
            if slot.param.grad is not None:
                self._offload_grad(slot.param)
        ready = [s for s in self._slots.in_order(self._params()) if s.has_grad]
        for slot in ready:
            self._grads.settle(slot)
        return ready

    def _ready_grads(self) -> list[torch.Tensor]:
        """The gradients the next update would use (device .grad, or settled host copies)."""
        return [g for _, g in self._ready_pairs()]

    def _ready_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, gradient)`` for :meth:`_ready_grads`, in parameter order; a DTensor's
        gradient as its local shard; parameters updated on the device with their ``.grad``."""
        if not self.offload_gradients:
            pairs = []
            sharded = self._slots.sharded
            for p in self._params():
                grad = p.grad
                if grad is not None:
                    if grad.is_sparse:
                        check_dense(grad)
                    pairs.append((p, local_part(grad) if sharded else grad))
            return pairs
        host = {id(s.param): s.grad for s in self._settled_host_grads()}
        pairs = []
        for p in self._params():
            if id(p) in host:
                pairs.append((p, host[id(p)]))
            elif p.grad is not None and p not in self._slots:
                check_dense(p.grad)
                pairs.append((p, local_part(p.grad)))
        return pairs

    def _grads_in_place(self, action: str) -> list[torch.Tensor]:
        """The gradients scaling and clipping act on: device ``.grad`` or offloaded copies."""
        early_forward.finish(self)
        if self._running is not None:
            raise RuntimeError(
                f"{action} after overlap_next_step(): the updates already use the "
                "gradients. Pass grad_scale to overlap_next_step() instead, and don't "
                "overlap steps that clip."
            )
        grads = self._ready_grads()
        if self._scaling.clip_norms is not None:  # scaled (and normed) by the worker: let it finish
            self._scaling.clip_norms.batch.flush()
            self._worker.drain()
        if action != "step()":
            self._scaling.apply_clip_now(grads)
        overlap = self._overlap
        if overlap is not None and overlap.pending_scale is not None:
            # overlap_next_step's grad_scale, applied before anything reads the gradients,
            # as if scale_grads() had been called right after backward.
            factor, overlap.pending_scale = overlap.pending_scale, None
            self._scaling.scale(grads, factor)
        return grads

    @torch.no_grad()
    def scale_grads(self, factor: Union[float, torch.Tensor]) -> None:
        """Multiply every trainable gradient by ``factor``, wherever it currently lives.

        Equivalent to torchtune's ``training.scale_grads(model, factor)``, which cannot
        reach offloaded gradients (they are ``None`` on the model).
        """
        overlap, norms = self._overlap, self._scaling.clip_norms
        if overlap is not None and (overlap.pending_scale is not None or (
                norms is not None and norms.grad_scale is not None)):
            raise RuntimeError(
                "scale_grads() after overlap_next_step(grad_scale=...): the scale is "
                "already applied once; call one or the other."
            )
        self._scaling.scale(self._grads_in_place("scale_grads()"), factor)

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        """Clip all trainable gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``.

        The norm is taken over the parameters in ``param_groups`` order, as torch's over the
        same list: the norm of the per-tensor norms depends on their order in its last bit,
        so it equals ``clip_grad_norm_(model.parameters())`` bit for bit where the groups
        list the parameters in the model's order (torchtune's recipes build one group from
        ``model.parameters()``), and may differ in that bit otherwise.

        With DTensor (FSDP2) parameters the norm covers every rank's shards, and all
        ranks clip by the same coefficient, as torch's ``clip_grad_norm_`` over the model
        would; every rank must call it.

        After ``overlap_next_step(clipping=True)`` (2-norm, ``foreach=None``) it adds up the
        norms taken during backward, and each update job multiplies its gradient by the
        coefficient before updating (anything else that reads the gradients first gets
        them multiplied): the same values as clipping here.

        Returns:
            torch.Tensor: the total norm over ALL trainable parameters before clipping (on
            the host when gradients are offloaded); a plain tensor, the global norm, also
            for sharded parameters.

        Raises:
            ValueError: sharded parameters with a ``norm_type`` other than inf or a
                positive number.
        """
        grads = self._grads_in_place("clip_grad_norm_()")
        params = [p for p, _ in self._ready_pairs()] if self._slots.sharded else []
        return self._scaling.clip(params, grads, self._slots.meshes, max_norm, norm_type,
                                  error_if_nonfinite, foreach)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients on the device and in host memory (see torch.optim.Optimizer)."""
        host = self._streamed is None  # (the streamed update keeps no host gradients, no worker)
        if host and not self.delayed_update and self._returned_early is None and not self._in_backward:
            self._updates.flush(self._running)
            if self._scaling.clip_norms is not None:
                self._scaling.clip_norms.batch.flush()
            self._worker.drain()
        self._scaling.reset()
        super().zero_grad(set_to_none)
        self._scaling.finite.clear()
        if self._returned_early is not None:
            # A step that returned early still reads its host gradients (and adds the last
            # micro-batch's first): they are reset when it finishes, which is before the
            # next gradient lands (the next forward waits for every update first).
            self._returned_early.zero_grad = set_to_none
        elif host:
            # (Slots whose update this backward queued keep their copy's event: the update
            # waits for it. Waiting here would stall the backward on the GPU.)
            self._grads.reset(set_to_none, keep=in_backward.in_flight(self))
        self._scaling.scaled_since_zero_grad = False

    # ------------------------------------------------------------------ step
    def overlap_next_step(
        self, grad_scale: Optional[Union[float, torch.Tensor]] = None, clipping: bool = False,
        early_forward: bool = False,
    ) -> None:
        """Start each parameter's update as soon as the next backward delivers its gradient.

        Call it right before the last backward of an accumulation window, then call
        ``step()`` as usual: it only waits for the updates that are still running. The
        host update then overlaps the backward pass instead of following it. Results are
        the same as scaling with ``scale_grads(grad_scale)`` and stepping afterwards; the
        updates read the lr and other hyperparameters in ``param_groups`` now.

        Args:
            grad_scale (float or Tensor, optional): multiply each gradient by this in the
                update (torchtune's ``1 / num_tokens``), since ``scale_grads`` comes too late;
                rounded as ``scale_grads`` rounds it (to the gradients' dtype on a GPU).
            clipping (bool): ``clip_grad_norm_`` will be called before ``step()``. No update
                may start before it, but each gradient is scaled and its norm taken on
                its device on the way out (on the host for a sum accumulated there), so
                ``clip_grad_norm_`` only sums the norms (where torch would), and each
                update folds the clip coefficient into its pass. Same results as
                scaling, clipping and stepping afterwards.
            early_forward (bool): ``step()`` returns once the updates are queued; what is
                left is updated in forward order, and each module's next forward waits
                only for its own parameters' new weights (a forward pre-hook on every
                module until all have arrived), so the next forward overlaps the end of
                the host update (call this before that forward: it leaves a step still
                running alone). Same results, if (1) every parameter is first used in the
                forward of the module it is registered on (true for torchtune's models), and
                (2) nothing reads the weights before that forward except after
                :meth:`finish_step` (our recipes call it before saving). A weight that the
                forward reads without its module's forward (``nn.MultiheadAttention`` reads
                ``out_proj.weight`` itself) makes the next backward raise RuntimeError, with
                the previous step complete and no new gradient used. Errors and the
                inf/NaN report of that step come from the next forward or the next call
                that needs the step finished. Not with ``torch.compile``d modules (the
                hook would break their graphs). Refused with ``delayed_update`` and
                with sharded parameters.

        Which schedule the step then runs is in ``offload_plugin.schedules`` (one table).

        Raises:
            ValueError: without ``offload_gradients=True``, whose backward hooks are what
                bring the gradients to the host early; ``early_forward`` with
                ``delayed_update`` or sharded parameters.
        """
        self._check_not_taken_over()
        if not self.offload_gradients:
            raise ValueError(
                "overlap_next_step() needs CPUOffloadOptimizer(offload_gradients=True)."
            )
        # A step that returned early may still be updating (this is normally called before
        # the next forward, which it is to overlap); what follows leaves it alone.
        if grad_scale is not None:
            grad_scale = self._overlap_multiplier(grad_scale)
        self._scaling.scaled_since_zero_grad = True
        self._overlap = schedules.choose_overlap(self, grad_scale, clipping, bool(early_forward))

    def _overlap_multiplier(self, grad_scale: Union[float, torch.Tensor]) -> float:
        """The one number each overlapped update multiplies its gradient by: what
        torchtune's scale_grads would (see scaling.multiplier)."""
        # (Once per dtype, not per parameter: this runs before every overlapped backward.)
        dtypes = {p.dtype for p in self._params()}
        values = {multiplier(grad_scale, dtype, self._scaling.on_accelerator) for dtype in dtypes}
        if len(values) > 1:
            raise ValueError(
                "overlap_next_step(grad_scale=...) with trainable parameters of several dtypes "
                f"({sorted(map(str, dtypes))}) on a GPU: scale_grads "
                "rounds the factor to each gradient's dtype there, which one overlapped update "
                "cannot. Give the trainable parameters one dtype, or call scale_grads() after "
                "backward instead of passing grad_scale."
            )
        return values.pop() if values else float(grad_scale)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch.amp.GradScaler hands the scale to step() (``self.grad_scale``) instead of
        unscaling the gradients first where this is True, as it is for torch's fused AdamW,
        whose kernel divides by it: a different rounding from unscaling, and fp16 gradients,
        which GradScaler refuses to unscale, work. The streamed update runs that kernel.
        Offloaded gradients are not on the model, where GradScaler looks for them: True
        there too, so that it hands its scale to step(), which refuses it with advice
        (unscaling would find no gradient and fail with torch's "No inf checks")."""
        return self._streamed is not None or self.offload_gradients

    @property
    def overlapping(self) -> bool:
        """True between ``overlap_next_step()`` and the ``step()`` that completes it."""
        return self._overlap is not None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Update every parameter that has a gradient.

        The streamed update queues its copies and kernels on side streams and returns;
        later work on the compute stream sees the new weights. The host update processes
        parameters in batches on a background thread: the update of one overlaps the copies
        of the others in both directions. A step whose gradients hold an inf or NaN updates
        nothing (``nonfinite_grads="skip"``, with a warning; the streamed update warns at
        the next step or state read) or raises (``"raise"``).
        """
        if self.offload_gradients and getattr(self, "grad_scale", None) is not None:
            raise ValueError(
                "torch.amp.GradScaler with offload_gradients=True: the gradients are moved to "
                "host memory during backward, where GradScaler cannot check or unscale them. "
                "Use offload_gradients=False with GradScaler, or train in bf16 without a "
                "scaler (as torchtune does). Nothing was updated."
            )
        self._check_not_taken_over()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params_known()
        if self._frozen:
            self._warn_unfrozen()
        schedules.run_step(self)
        # Its state exists now, or will in a moment (an update that returned early); a
        # parameter without a gradient makes none, which a later preflight then misses.
        host_memory.settle(self)
        return loss

    def finish_step(self) -> None:
        """Wait until the last step has put every weight on the device: a step that returned
        early (``overlap_next_step(early_forward=True)``) or a delayed update, with its
        errors raised. Every method that needs it calls it; call it before reading the
        model's weights other than through its forward (e.g. saving the model) or changing
        them. A no-op otherwise."""
        self._finish_pending()

    def _finish_pending(self) -> None:
        if self._streamed is not None:
            self._streamed.settle()
        in_backward.finish(self)
        early_forward.finish(self)
        delayed.finish(self)

    # ------------------------------------------------------------------ changed weights
    def _adopt_changed_weights(self) -> None:
        """Take over weights changed outside the optimizer since its host copies last
        matched them (see weight_sync): before a step's first update reads a master. (The
        streamed update reads no master: the device weights are what it updates; only
        CompactAdamW's remainders there follow the writes.)"""
        if self._streamed is not None:
            self._streamed.weights_written()
            return
        for slot in changed_slots(self._slots):
            adopt_weight(slot)
        if self._device_share is not None:
            self._device_share.adopt_changed_weights()

    @torch.no_grad()
    def reload_weights(self) -> None:
        """Re-read every parameter into the host copies (the fp32 masters restart from the
        weights unless a weight is exactly its master rounded). The streamed update keeps no
        copies; with CompactAdamW every master restarts from its weight.

        Changes made in place or by ``load_state_dict`` are picked up by the next step
        without this; call it after writing through ``param.data``, which torch hides from
        the version counters that detection reads.
        """
        self._finish_pending()
        if self._streamed is not None:  # (no host copies: it reads the parameters themselves)
            self._streamed.weights_reloaded()
            return
        for slot in self._slots:
            adopt_weight(slot)
        if self._device_share is not None:
            self._device_share.adopt_changed_weights(all_params=True)

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``{"state": {index: {...}}, "param_groups": [...]}``.

        State tensors are the host copies. With master weights, each bf16/fp16 parameter's
        fp32 master is saved under ``"master_weight"`` so that a resume continues exactly;
        torch's optimizers ignore that key when loading.

        For a DTensor (FSDP2) parameter, state shaped like its local shard is returned as
        a DTensor laid out like the parameter (still backed by host memory), which is what
        ``get_optimizer_state_dict`` and ``torch.distributed.checkpoint`` gather or save
        by shard; scalar state such as ``step`` stays a plain tensor.

        Raises:
            ValueError: a DTensor parameter has state with dimensions that is not shaped
                like its shard (e.g. factored state), which cannot be saved per shard.
        """
        self._finish_pending()
        self._check_params_known()
        self._adopt_changed_weights()  # a saved master must match the model's weight
        return checkpoint.with_masters(self, super().state_dict())

    def load_state_dict(
        self,
        state_dict: dict[str, Any],
        torchao_minimal_size: int = TORCHAO_MINIMAL_SIZE,
        *,
        allow_nonfinite: bool = False,
    ) -> None:
        """Load a state dict from this class or any torch optimizer over the same parameters.

        A checkpoint of torchao's CPUOffloadOptimizer (``{"offloaded": ..., "on-device":
        ...}``) is converted first; give ``torchao_minimal_size`` if it was not built with
        torchao's default. Every group and entry is checked (keys the optimizer class
        needs, types, dtypes, exact shapes, finite values) and copied before anything
        changes, so a refused load leaves parameters, state and groups as they were.
        Hyperparameters are taken as ``optimizer_cls`` takes them: an Adam checkpoint
        loaded with AdamW continues as AdamW, as with torch's AdamW. State lands in host
        memory.

        Args:
            state_dict (dict): what ``state_dict()`` of this class or of a torch optimizer
                returned, or a torchao CPUOffloadOptimizer checkpoint.
            torchao_minimal_size (int): the ``minimal_size`` of that torchao optimizer.
            allow_nonfinite (bool): load state and master weights that hold inf or NaN
                (refused by default: the next step would carry them into the weights).

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: the state dict does not match this optimizer's groups, parameter
                counts, parameter shapes or optimizer class, or holds a malformed or
                non-finite entry; the message says what differs.
        """
        self._finish_pending()
        self._check_params_known()
        # Checked and converted into new tensors; nothing of this optimizer changed yet.
        plan = checkpoint.prepare_load(self, state_dict, torchao_minimal_size, allow_nonfinite)
        checkpoint.apply_state(self, plan)
        host_memory.settle(self)  # (the loaded state is allocated)
        if self._host_optimizer is not None:
            forget_batches(self._host_optimizer)
        if self._streamed is not None:
            self._streamed.forget_state()
        # The one place where loading writes master weights and device weights.
        checkpoint.write_weights(self, plan)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ------------------------------------------------------------------ reporting
    def host_memory_bytes(self) -> int:
        """Host bytes held for the optimizer: master weights, gradients, staging and state."""
        state_bytes = sum(
            v.numel() * v.element_size()
            for st in self._host_optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        return self._arena.nbytes() + state_bytes

    def __repr__(self) -> str:
        body = super().__repr__().split(" (", 1)[1]
        return (
            f"{type(self).__name__}(optimizer_cls={self.optimizer_cls.__name__}, "
            f"offload_gradients={self.offload_gradients}, "
            f"master_weights={self.master_weights}, "
            f"delayed_update={self.delayed_update}"
            + (", accumulate_on_device=True" if self.accumulate_on_device else "")
            + (f", device_fraction={self.device_fraction}" if self.device_fraction else "")
            + f") ({body}"
        )
