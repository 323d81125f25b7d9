"""CPUOffloadOptimizer: a torch.optim.Optimizer whose state and update live in host memory."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import logging
import math
import threading
import time
import weakref
from collections.abc import MutableMapping
from functools import partial
from itertools import chain
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch.optim import Optimizer
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from offload_plugin.checkpoint_compat import TORCHAO_MINIMAL_SIZE
from offload_plugin.grad_checks import NONFINITE_POLICIES, FiniteRecord, all_finite
from offload_plugin import checkpoint, distributed, host_memory, native_adam
from offload_plugin.checkpoint import MASTER_KEY
from offload_plugin.device_share import DeviceShare, choose_kept
from offload_plugin.distributed import DTensor, local_part
from offload_plugin.host_buffers import (
    HostArena, HostSlot, allocate_landing, allocate_moments, build_slots, weight_mark,
)
from offload_plugin.host_update import update_slots, uses_fused_adam
from offload_plugin import host_worker
from offload_plugin.host_worker import HostWorker, JobBatch
from offload_plugin.transfer import Transfers, min_max_into
from offload_plugin.weight_sync import adopt_weight, changed_slots

__all__ = ["CPUOffloadOptimizer"]

log = logging.getLogger(__name__)

# Optimizers whose step is not a per-parameter update that can run on host copies.
_UNSUPPORTED = {
    torch.optim.LBFGS: "it re-evaluates the model through a closure inside step()",
    torch.optim.SparseAdam: "it needs sparse gradients, which are not offloaded",
}
# CPUOffloadOptimizer's own keyword options (the rest go to optimizer_cls).
_OWN_OPTIONS = [
    "optimizer_cls", "offload_gradients", "master_weights", "pin_memory", "nonfinite_grads",
    "check_host_memory", "delayed_update", "host_threads", "accumulate_on_device",
    "device_fraction",
]


def _resolve_optimizer_cls(optimizer_cls: Union[str, type]) -> type:
    if isinstance(optimizer_cls, str):
        module_name, _, attr = optimizer_cls.rpartition(".")
        try:
            resolved = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(
                f"optimizer_cls={optimizer_cls!r} does not resolve to a class ({err}). "
                "Give a dotted path such as 'torch.optim.AdamW' or the class itself."
            ) from None
        optimizer_cls = resolved
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
        raise TypeError(
            f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}"
        )
    if issubclass(optimizer_cls, CPUOffloadOptimizer):
        raise TypeError("optimizer_cls cannot be CPUOffloadOptimizer itself")
    for unsupported, why in _UNSUPPORTED.items():
        if issubclass(optimizer_cls, unsupported):
            raise ValueError(
                f"optimizer_cls={optimizer_cls.__name__} is not supported: {why}. Use "
                "torch.optim.AdamW (the default) or another per-parameter optimizer."
            )
    return optimizer_cls


def _check_option_names(optimizer_cls: type, optimizer_kwargs: dict) -> None:
    """Refuse a keyword neither we nor ``optimizer_cls`` take, naming the closest valid one
    (``offload_gradient`` would otherwise reach AdamW and be reported as its own)."""
    signature = inspect.signature(optimizer_cls.__init__)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return  # the class takes any keyword: let it judge
    theirs = [n for n, p in signature.parameters.items()
              if n not in ("self", "params") and p.kind is not p.VAR_POSITIONAL]
    for name in optimizer_kwargs:
        if name not in theirs:
            close = difflib.get_close_matches(name, _OWN_OPTIONS + theirs, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"CPUOffloadOptimizer got an unknown option {name!r}: it is neither one of its "
                f"own ({', '.join(_OWN_OPTIONS)}) nor an argument of "
                f"{optimizer_cls.__name__} ({', '.join(theirs)}).{hint}"
            )


def _check_trainable(params: list[torch.Tensor]) -> None:
    """Refuse, before anything is allocated, tensors the host update cannot train."""
    for p in params:
        if p.is_complex():
            raise ValueError(
                f"CPUOffloadOptimizer does not support complex parameters (got {p.dtype}, "
                f"shape {tuple(p.shape)}): the host update works on real tensors. Keep the "
                "parameter real (e.g. store torch.view_as_real(z) and view it as complex in "
                "the forward)."
            )
        if p.is_meta:
            raise ValueError(
                f"CPUOffloadOptimizer got a parameter on the meta device (shape "
                f"{tuple(p.shape)}), which has no values to copy to the host. Materialize the "
                "model first (model.to_empty(device=...) and load or initialize its weights), "
                "then build the optimizer."
            )


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


def _check_dense(grad: torch.Tensor) -> None:
    if grad.is_sparse:
        raise RuntimeError(
            "CPUOffloadOptimizer does not support sparse gradients; build embeddings "
            "with sparse=False."
        )


class _StateByParam(MutableMapping):
    """``optimizer.state`` keyed by the user's parameters, backed by the host optimizer's state."""

    def __init__(self, owner: "CPUOffloadOptimizer") -> None:
        self._owner = owner

    def _where(self, param: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The state mapping that holds ``param``'s state, and its key there."""
        owner = self._owner
        slot = owner._slot_of.get(param)
        if slot is not None:
            return owner._host_optimizer.state, slot.master
        if owner._device_share is not None and param in owner._device_share:
            return owner._device_share.optimizer.state, owner._device_share.target[param]
        raise KeyError(param)

    def __getitem__(self, param):
        # Both optimizers' state is a defaultdict, as torch's optimizers' state is.
        state, key = self._where(param)
        return state[key]

    def __setitem__(self, param, value):
        state, key = self._where(param)
        state[key] = value

    def __delitem__(self, param):
        state, key = self._where(param)
        del state[key]

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
    """Runs ``optimizer_cls`` on host copies of the parameters; the device keeps only weights.

    Frozen parameters (``requires_grad=False``, e.g. QLoRA's NF4 base weights) are dropped
    before anything is allocated or hooked, so ``model.parameters()`` can be passed as
    torchtune's recipes do. ``param_groups``, ``state``, ``defaults``, hooks and the state
    dict behave as on torch's optimizers, so every LR scheduler and checkpoint helper works.

    Each step copies the gradients to pinned host memory (or, with ``offload_gradients``,
    takes the copies made during backward), runs ``optimizer_cls.step`` there and copies
    the updated weights back on a side CUDA stream. On a machine without a GPU the same
    code runs with synchronous copies.

    Args:
        params (Iterable): parameters or param-group dicts, as for any torch optimizer.
        optimizer_cls (type or str): the optimizer run on the host, as a class or a dotted
            path. Default: ``"torch.optim.AdamW"``.
        offload_gradients (bool): move each gradient to host memory as soon as backward
            produces it and free it on the device. Saves the gradients' device memory;
            scale and clip through :meth:`scale_grads` and :meth:`clip_grad_norm_`, since
            the model's ``.grad`` is ``None`` afterwards. Default: ``False``.
        master_weights (bool): keep fp32 copies of bf16/fp16 parameters on the host and
            update those, so that small updates are not rounded away. Default: ``True``.
        pin_memory (bool): page-lock host buffers for fast asynchronous copies (CUDA only).
            Default: ``True``.
        nonfinite_grads (str): what a step with an inf or NaN gradient does: ``"skip"``
            (update nothing, warn) or ``"raise"`` (FloatingPointError). Master weights and
            optimizer state never take a non-finite gradient. Default: ``"skip"``.
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
            one with a GPU (that core launches the GPU work), all without one.
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
            :meth:`overlap_next_step` announces (else ``step()``, ``scale_grads`` or
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

    def __init__(
        self,
        params: Iterable,
        optimizer_cls: Union[str, type] = "torch.optim.AdamW",
        *,
        offload_gradients: bool = False,
        master_weights: bool = True,
        pin_memory: bool = True,
        nonfinite_grads: str = "skip",
        check_host_memory: bool = True,
        delayed_update: bool = False,
        host_threads: Optional[int] = None,
        accumulate_on_device: bool = False,
        device_fraction: float = 0.0,
        **optimizer_kwargs: Any,
    ) -> None:
        if nonfinite_grads not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite_grads must be one of {NONFINITE_POLICIES}, got {nonfinite_grads!r}"
            )
        self.nonfinite_grads = nonfinite_grads
        self.check_host_memory = check_host_memory
        self._finite = FiniteRecord()
        self.optimizer_cls = _resolve_optimizer_cls(optimizer_cls)
        _check_option_names(self.optimizer_cls, optimizer_kwargs)
        if isinstance(params, (set, frozenset)):
            raise TypeError(
                "CPUOffloadOptimizer got its parameters as a set, whose order is not stable "
                "(state-dict indices follow the order): pass a list, e.g. model.parameters()."
            )
        self.offload_gradients = offload_gradients
        self.master_weights = master_weights
        self.pin_memory = pin_memory
        self.delayed_update = bool(delayed_update)
        if accumulate_on_device and not offload_gradients:
            raise ValueError(
                "accumulate_on_device=True only applies with offload_gradients=True (without "
                "it, gradients stay on the device anyway)."
            )
        self.accumulate_on_device = bool(accumulate_on_device)
        if not (isinstance(device_fraction, (int, float)) and 0 <= device_fraction < 1):
            raise ValueError(
                f"device_fraction must be in [0, 1), got {device_fraction!r}; to keep the "
                "whole optimizer on the device, use optimizer_cls directly."
            )
        self.device_fraction = float(device_fraction)
        self._keep_ids: set[int] = set()
        if self.device_fraction and not isinstance(params, torch.Tensor):
            params = list(params)  # read twice: to choose the kept share, then by torch
            self._keep_ids = choose_kept(params, self.device_fraction)
        if host_threads is not None and (not isinstance(host_threads, int) or host_threads < 1):
            raise ValueError(f"host_threads must be a positive int or None, got {host_threads!r}")
        self.host_threads = host_threads
        self._optimizer_kwargs = optimizer_kwargs
        # Validates every hyperparameter with optimizer_cls's own checks and messages
        # ("Invalid learning rate: -1.0") before anything is allocated or hooked.
        defaults = dict(self.optimizer_cls([torch.zeros(1)], **optimizer_kwargs).defaults)

        self._host_optimizer: Optional[Optimizer] = None
        self._device_share: Optional[DeviceShare] = (
            DeviceShare(self.optimizer_cls, optimizer_kwargs, master_weights) if self._keep_ids else None
        )
        self._slot_list: list[HostSlot] = []
        self._slot_of: dict[torch.Tensor, HostSlot] = {}
        # Device meshes of DTensor (FSDP2) parameters: the ranks whose gradients count in
        # the clipping norm and in the decision to skip a non-finite step. Empty otherwise.
        self._meshes: list = []
        self._hooks: list = []
        self._transfers: Optional[Transfers] = None
        self._arena: Optional[HostArena] = None
        self._last_push = None
        self._worker: Optional[HostWorker] = None
        # While a step's updates are being submitted: hyperparameters, grad scale and the
        # parameters already handed to the worker (see overlap_next_step).
        self._overlap: Optional[dict] = None
        # delayed_update: the update running in the background, the flag that the current
        # backward is the last before step(), and a grad_scale to apply before step().
        self._pending: Optional[dict] = None
        self._final_backward = False
        # ids of the parameters whose gradient the announced backward has delivered.
        self._announced_seen: set[int] = set()
        # overlap_next_step(early_forward=True): asked for the coming step(); then the
        # step that returned before its updates finished (see _finish_early_step).
        self._early_forward = False
        self._early: Optional[dict] = None
        # ids of the parameters whose forward gate the last early step never saw pass
        # (unused in the forward, or used without their module's forward: see _gate).
        self._ungated: dict[int, torch.Tensor] = {}
        self._deferred_scale: Optional[float] = None
        # overlap_next_step(clipping=True): each gradient is scaled and its norm taken during
        # backward (on the device on its way out, or by the host worker for a host sum);
        # clip_grad_norm_ sums the norms and leaves the multiply to each update.
        self._prenorm: Optional[dict] = None
        self._clip_coef: Optional[torch.Tensor] = None
        self._push_lock = threading.Lock()
        self._counts = {"kept": 0, "kept_numel": 0, "frozen": 0, "frozen_numel": 0,
                        "on_device": 0, "on_device_numel": 0}
        self._scaled_since_zero_grad = False
        self._warned_unscaled = False

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
        log.info(
            "CPUOffloadOptimizer(%s): optimizing %d tensors (%s elements) on the host%s; "
            "skipped %d frozen tensors (%s elements).",
            self.optimizer_cls.__name__, c["kept"] - c["on_device"],
            f"{c['kept_numel'] - c['on_device_numel']:,}",
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
        if getattr(self, "_early", None) is not None:  # (torch's __init__ calls this early)
            self._finish_early_step()
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

    def _attach(self, group: dict[str, Any]) -> None:
        """Create host copies (and hooks) for a group torch has accepted."""
        params = group["params"]
        devices = {p.device for p in chain(params, (s.param for s in self._slot_list))}
        if len(devices) > 1:
            raise ValueError(
                "CPUOffloadOptimizer needs all trainable parameters on one device, got "
                f"{sorted(map(str, devices))}. Move the model with model.to(device) first."
            )
        _check_trainable(params)
        if params and self._transfers is None:
            self._setup_device(params[0].device)
        on_device = [p for p in params if id(p) in self._keep_ids]
        if any(isinstance(p, DTensor) for p in on_device):
            raise ValueError(
                "device_fraction is not supported with DTensor (FSDP2) parameters yet; "
                "use device_fraction=0."
            )
        all_params, params = params, [p for p in params if id(p) not in self._keep_ids]
        # A DTensor (FSDP2) parameter costs this rank only its local shard.
        shards = [local_part(p) for p in params]
        if params and self.check_host_memory:
            state = host_memory.state_tensors_per_param(self.optimizer_cls, group)
            spares = 2 if self.delayed_update and self.offload_gradients else 0
            host_memory.check(
                host_memory.bytes_needed(shards, self.master_weights, state, spares),
                sum(p.numel() for p in shards), self.master_weights,
            )
        slots = build_slots(
            params, self.master_weights, self._arena,
            spare_grads=self.delayed_update and self.offload_gradients,
        ) if params else []
        host_group = {k: v for k, v in group.items() if k != "params"}
        host_group["params"] = [s.master for s in slots]
        if self._host_optimizer is None:
            self._host_optimizer = self.optimizer_cls([host_group], **self._optimizer_kwargs)
        else:
            self._host_optimizer.add_param_group(host_group)
        if uses_fused_adam(self._host_optimizer, self._host_optimizer.param_groups[-1]):
            allocate_moments(slots)  # (the fused path creates Adam's state itself)
        if self._device_share is not None:  # one group per outer group, even if empty
            self._device_share.add_group({k: v for k, v in group.items() if k != "params"}, on_device)
        for slot in slots:
            slot.order = len(self._slot_list)  # the parameter order: forward order for torchtune
            self._slot_list.append(slot)
            self._slot_of[slot.param] = slot
            if self.offload_gradients:
                self._hooks.append(
                    slot.param.register_post_accumulate_grad_hook(_GradHook(self))
                )
        self._meshes = distributed.meshes_of(s.param for s in self._slot_list)
        self._counts["kept"] += len(all_params)
        self._counts["kept_numel"] += sum(p.numel() for p in shards) + sum(p.numel() for p in on_device)
        self._counts["on_device"] += len(on_device)
        self._counts["on_device_numel"] += sum(p.numel() for p in on_device)

    def _setup_device(self, device: torch.device) -> None:
        self._transfers = Transfers(device)
        pin = self.pin_memory and self._transfers.is_async
        self._arena = HostArena(pin=pin)
        # With a GPU, leave a core to the training thread for launching kernels.
        threads = torch.get_num_threads()
        if self.host_threads is None:
            self.host_threads = max(1, threads - 1) if self._transfers.is_async else threads
        self._worker = HostWorker(self.host_threads)
        if self.host_threads != threads:  # it will set its own count: do it now (see start)
            self._worker.start()
        if device.type != "cuda":
            log.info(
                "CPUOffloadOptimizer: parameters are on %s, not a CUDA device; the update "
                "runs in host memory with synchronous copies.", device,
            )

    def _params(self) -> Iterator[torch.Tensor]:
        """Trainable parameters in order, group by group (the order of state-dict indices)."""
        return (p for g in self.param_groups for p in g["params"])

    def _slots(self) -> Iterator[HostSlot]:
        """Slots of the offloaded parameters, in parameter order."""
        return (self._slot_of[p] for p in self._params() if p in self._slot_of)

    # ------------------------------------------------------------------ gradients
    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        """Backward hook (offload_gradients=True)."""
        if self._early is not None:  # the forward is over: so is the step that returned early
            # Its parameters whose gate did not open must not get a gradient in this
            # backward (checked below until it ends).
            self._ungated = {id(s.param): s.param for s in self._early["gates"].values()}
            torch.autograd.Variable._execution_engine.queue_callback(self._ungated.clear)
            self._finish_early_step()
        if self._ungated and self._ungated.get(id(param)) is param:
            # The forward used it, yet its module's forward pre-hook never ran: something
            # read the weight directly (nn.MultiheadAttention reads out_proj.weight), maybe
            # before its update had arrived. Refuse the gradient rather than guess.
            raise RuntimeError(
                f"CPUOffloadOptimizer(early_forward): a parameter of shape {tuple(param.shape)} "
                "was used by the forward without its own module's forward running (e.g. "
                "nn.MultiheadAttention reads out_proj.weight itself), so it may have been "
                "read before its update arrived. The previous step is complete; this "
                "backward's gradients are not used. Turn early_forward off "
                "(overlap_next_step(early_forward=False); `early_forward: False` in our recipes)."
            )
        if self.overlapping:
            if id(param) in self._announced_seen:
                # Its update (or its norm, or its weight's return) may already be under way.
                raise RuntimeError(
                    "CPUOffloadOptimizer: a second backward after overlap_next_step() reached "
                    "a parameter that already has its gradient for this step. Call "
                    "overlap_next_step() right before the LAST backward of the accumulation "
                    "window, then step()."
                )
            self._announced_seen.add(id(param))
        elif self.accumulate_on_device:
            return  # not the announced last backward: autograd adds the next one on the device
        self._offload_grad(param)

    def _offload_grad(self, param: torch.Tensor) -> None:
        """Backward hook (offload_gradients=True): move ``param.grad`` to the host, free it."""
        slot = self._slot_of[param]
        _check_dense(param.grad)
        grad = local_part(param.grad)
        prenorm_done = False
        if not slot.has_grad:
            # Work the host would do with a pass over each gradient in host memory, where
            # the update is bound by memory bandwidth, is done by the device on the way out
            # (microseconds there): an update that starts now needs an inf/NaN verdict (the
            # gradient's extremes come along); a clipped step needs each gradient scaled
            # and its norm (kept on the device, where torch's clip_grad_norm_ takes them).
            before, check = None, self._overlap is not None and self._overlap["check_each"]
            if check and grad.numel() > 0:
                before = partial(min_max_into, *self._extremes_of(slot, grad))
            elif self._prenorm is not None:
                before, prenorm_done = partial(self._scale_and_norm_on_device, self._prenorm, slot), True
            slot.grad_event = self._transfers.to_host([(grad, slot.grad)], before=before)
            slot.has_grad, slot.extremes_current = True, check and grad.numel() > 0
        else:
            # Gradient accumulation: land the new gradient beside the running sum; the host
            # worker adds it (in the gradient's dtype, as autograd would on the device)
            # while this thread goes on launching the backward. The previous micro-batch's
            # addition is normally done by now; if not, this thread does it first.
            self._settle(slot)
            slot.extremes_current = False  # they describe one micro-batch, not the sum
            if slot.incoming is None:
                self._give_landing_buffers()
            slot.incoming_event = self._transfers.to_host([(grad, slot.incoming)])
            slot.incoming_pending = True
            if self._overlap is None:  # else the update itself adds it, first thing
                self._worker.submit(partial(self._settle, slot), urgent=True)
        param.grad = None
        if self._overlap is not None:
            self._submit_update(slot)
        elif self._prenorm is not None and not prenorm_done:  # an accumulated sum: on the host
            self._prenorm["batch"].add(slot, slot.grad.numel())
        elif self._final_backward:
            self._release_for_push(slot)

    def _extremes_of(self, slot: HostSlot, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two-element buffers (device, host) for ``slot``'s gradient extremes, made once."""
        if slot.extremes is None or slot.extremes[0].dtype != grad.dtype:
            pin = self.pin_memory and self._transfers.is_async
            slot.extremes = (torch.empty(2, dtype=grad.dtype, device=grad.device),
                             torch.empty(2, dtype=grad.dtype, pin_memory=pin))
        return slot.extremes

    def _landed_grad_finite(self, slot: HostSlot) -> bool:
        """Whether ``slot``'s settled host gradient is free of inf/NaN."""
        if slot.extremes_current:  # inf and NaN propagate to the minimum or maximum
            # Two numbers: read in Python, where a torch or native call would give up the GIL.
            return all(math.isfinite(x) for x in slot.extremes[1].tolist())
        return all_finite([slot.grad])

    def _give_landing_buffers(self) -> None:
        """Landing buffers for accumulated gradients, allocated at the first accumulation.

        The weight stage is idle until this step's update (its last copy to the device is
        ordered before this backward), so it serves where there is one; not with
        delayed_update, whose update writes the stage during this backward.
        """
        need = []
        for slot in self._slot_list:
            if slot.incoming is None:
                if slot.weight_stage is not None and not self.delayed_update:
                    slot.incoming = slot.weight_stage
                else:
                    need.append(slot)
        allocate_landing(need, self._arena)

    def _settle(self, slot: HostSlot) -> None:
        """Wait for a slot's gradient copies and add an accumulated one to the running sum.

        Runs on the host worker or the training thread, whichever needs it first.
        """
        with slot.settle_lock:
            Transfers.wait(slot.grad_event)
            slot.grad_event = None
            if slot.incoming_pending:
                Transfers.wait(slot.incoming_event)
                native_adam.add_(slot.grad, slot.incoming)  # torch's add_, one faster pass
                slot.incoming_pending, slot.incoming_event = False, None

    def _settled_host_grads(self) -> list[HostSlot]:
        """offload_gradients: every gradient complete on the host (a ``.grad`` set on the
        device by hand is offloaded too); returns the slots that have one."""
        for slot in self._slot_list:
            if slot.param.grad is not None:
                self._offload_grad(slot.param)
        ready = [s for s in self._slots() if s.has_grad]
        for slot in ready:
            self._settle(slot)
        return ready

    def _grads_in_place(self, action: str) -> list[torch.Tensor]:
        """The gradients scaling and clipping act on: device ``.grad`` or offloaded copies."""
        self._finish_early_step()
        if self._overlap is not None:
            raise RuntimeError(
                f"{action} after overlap_next_step(): the updates already use the "
                "gradients. Pass grad_scale to overlap_next_step() instead, and don't "
                "overlap steps that clip."
            )
        grads = self._ready_grads()
        if self._prenorm is not None:  # scaled (and normed) by the worker: let it finish
            self._prenorm["batch"].flush()
            self._worker.drain()
        if self._clip_coef is not None and action != "step()":
            # Something other than step() reads or changes the gradients after a clip
            # whose multiply was left to the update jobs: do the multiply now, as
            # clip_grad_norm_ would have, and forget the norms it made stale.
            for g in grads:
                g.mul_(self._clip_coef.to(g.device))
            self._clip_coef, self._prenorm = None, None
        if self._deferred_scale is not None:
            # delayed_update: overlap_next_step's grad_scale, applied before anything reads
            # the gradients, as if scale_grads() had been called right after backward.
            factor, self._deferred_scale = self._deferred_scale, None
            self._scale(grads, factor)
        return grads

    @torch.no_grad()
    def scale_grads(self, factor: Union[float, torch.Tensor]) -> None:
        """Multiply every trainable gradient by ``factor``, wherever it currently lives.

        Equivalent to torchtune's ``training.scale_grads(model, factor)``, which cannot
        reach offloaded gradients (they are ``None`` on the model).
        """
        if self._final_backward and (self._deferred_scale is not None or (
                self._prenorm is not None and self._prenorm["grad_scale"] is not None)):
            raise RuntimeError(
                "scale_grads() after overlap_next_step(grad_scale=...): the scale is "
                "already applied once; call one or the other."
            )
        self._scale(self._grads_in_place("scale_grads()"), factor)

    def _scale(self, grads: list[torch.Tensor], factor: Union[float, torch.Tensor]) -> None:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        found, known = torch.zeros(1), True
        for device, group in by_device.items():
            scale = torch.as_tensor(factor, dtype=torch.float32).reshape(1).to(device)
            if device.type == "cpu":
                # Multiplies like `g *= factor` (bit for bit) and flags inf/NaN in one pass.
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, scale)
            else:
                # CUDA's AMP kernel has no bf16 variant; step() scans on the GPU instead.
                for g in group:
                    g.mul_(scale)
                known = False
        if known:
            self._finite.record(found, grads)
        else:
            self._finite.clear()
        self._scaled_since_zero_grad = True

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        """Clip all trainable gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``.

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
        if self._prenorm is not None and float(norm_type) == 2.0 and foreach is None:
            total = self._total_of_prenorms(grads, error_if_nonfinite)
            # Each update job multiplies its gradient by this, as the loop below would
            # here: the same values, without a pass over all gradients in between.
            self._clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).cpu()
            total = total.cpu()
            self._finite.record((~torch.isfinite(total)).float(), grads)
            self._scaled_since_zero_grad = True
            return total
        if self._meshes:
            params = [p for p, _ in self._ready_pairs()]
            total = distributed.global_total_norm(params, grads, norm_type, error_if_nonfinite, foreach)
        else:
            total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula
        for g in grads:
            g.mul_(coef.to(g.device))
        self._finite.record((~torch.isfinite(total)).float(), grads)
        self._scaled_since_zero_grad = True
        return total

    def _total_of_prenorms(self, grads: list[torch.Tensor], error_if_nonfinite: bool) -> torch.Tensor:
        """torch.nn.utils.get_total_norm(grads) from the norms the worker took during
        backward: torch stacks the per-tensor norms grouped by device and dtype, in that
        order, so the same grouping gives the same bits."""
        norms = self._prenorm["norms"]
        grouped = _group_tensors_by_device_and_dtype([grads])
        ordered = []
        for (device, _), ([device_grads], _) in grouped.items():
            for g in device_grads:
                if g not in norms:  # not seen by a worker job: scale and norm it now
                    self._scale_and_norm_grad(self._prenorm, g)
                ordered.append(norms[g])
        # Where torch would add them up: the parameters' device, if the norms were taken there.
        where = next((n.device for n in ordered if n.device.type != "cpu"), grads[0].device)
        total = torch.linalg.vector_norm(torch.stack([n.to(where) for n in ordered]), 2.0)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
                "it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        return total

    def _scale_and_norm(self, pre: dict, slots: list[HostSlot]) -> None:
        """Worker job during a clipped step's last backward: scale each gradient as
        scale_grads would and take its norm as get_total_norm would."""
        for slot in slots:
            self._settle(slot)
            self._scale_and_norm_grad(pre, slot.grad)

    @staticmethod
    def _scale_and_norm_on_device(pre: dict, slot: HostSlot, grad: torch.Tensor) -> None:
        """Scale a gradient on its way to the host as _scale() would on its device, and
        take its norm there (kept under the host copy's key, read by _total_of_prenorms)."""
        if pre["grad_scale"] is not None:
            if grad.device not in pre["device_scale"]:
                pre["device_scale"][grad.device] = pre["scale"].to(grad.device)
            grad.mul_(pre["device_scale"][grad.device])  # fp32 multiply, one rounding
        pre["norms"][slot.grad] = torch._foreach_norm([grad], 2.0)[0]

    @staticmethod
    def _scale_and_norm_grad(pre: dict, grad: torch.Tensor) -> None:
        if pre["grad_scale"] is not None:  # as _scale() multiplies, bit for bit
            torch._amp_foreach_non_finite_check_and_unscale_([grad], pre["found"], pre["scale"])
        pre["norms"][grad] = torch._foreach_norm([grad], 2.0)[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients on the device and in host memory (see torch.optim.Optimizer)."""
        if not self.delayed_update and self._early is None:
            self._flush_updates()
            if self._prenorm is not None:
                self._prenorm["batch"].flush()
            self._worker.drain()
        self._prenorm, self._clip_coef = None, None
        super().zero_grad(set_to_none)
        self._finite.clear()
        if self._early is not None:
            # A step that returned early still reads its host gradients (and adds the last
            # micro-batch's first): they are reset when it finishes, which is before the
            # next gradient lands (the next forward waits for every update first).
            self._early["zero_grad"] = set_to_none
        else:
            self._reset_host_grads(set_to_none)
        self._scaled_since_zero_grad = False

    def _reset_host_grads(self, set_to_none: bool = True) -> None:
        """Offloaded gradients as torch's zero_grad leaves ``.grad``: gone, or zeros that
        the next backward adds to and the next step applies (step count, weight decay)."""
        for slot in self._slot_list:
            # Let in-flight copies land before their buffers count as free again. The lock:
            # with delayed_update the worker may be adding an accumulated gradient.
            with slot.settle_lock:
                Transfers.wait(slot.grad_event)
                Transfers.wait(slot.incoming_event)
                if slot.incoming_pending or not set_to_none:
                    slot.extremes_current = False
                if slot.has_grad and not set_to_none:
                    slot.grad.zero_()
                else:
                    slot.has_grad = False
                slot.incoming_pending = False
                slot.grad_event = slot.incoming_event = None

    # ------------------------------------------------------------------ step
    def overlap_next_step(
        self, grad_scale: Optional[float] = None, clipping: bool = False, early_forward: bool = False
    ) -> None:
        """Start each parameter's update as soon as the next backward delivers its gradient.

        Call it right before the last backward of an accumulation window, then call
        ``step()`` as usual: it only waits for the updates that are still running. The
        host update then overlaps the backward pass instead of following it. Results are
        the same as scaling with ``scale_grads(grad_scale)`` and stepping afterwards; the
        updates read the lr and other hyperparameters in ``param_groups`` now.

        Args:
            grad_scale (float, optional): multiply each gradient by this in the update
                (torchtune's ``1 / num_tokens``), since ``scale_grads`` comes too late.
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
                hook would break their graphs). Ignored with ``delayed_update`` and
                sharded parameters.

        Raises:
            ValueError: without ``offload_gradients=True``, whose backward hooks are what
                bring the gradients to the host early.
        """
        if not self.offload_gradients:
            raise ValueError(
                "overlap_next_step() needs CPUOffloadOptimizer(offload_gradients=True)."
            )
        # A step that returned early may still be updating (this is normally called
        # before the next forward, which it is to overlap); what follows leaves it alone.
        self._early_forward = bool(early_forward) and not self.delayed_update and not self._meshes
        self._scaled_since_zero_grad = True
        self._announced_seen = set()
        if self.delayed_update:
            # The update itself already runs in the background; this backward only tells
            # when each parameter is free to receive its updated weight. Clipping is fine.
            self._final_backward = True
            self._deferred_scale = grad_scale
            return
        if self._meshes or (clipping and self._device_share is not None):
            # Sharded: an update that starts during backward must judge its gradient
            # alone, and a NaN on another rank would then be skipped there but applied
            # here. Only the gradient transfers overlap; step() scales by grad_scale, agrees
            # on the verdict with the other ranks, then updates. (Likewise when clipping
            # with device_fraction, whose device share is scaled and normed at clip time.)
            self._final_backward = True
            self._deferred_scale = grad_scale
            return
        if clipping:
            self._final_backward = True
            pre = {"grad_scale": grad_scale, "found": torch.zeros(1), "norms": {}, "device_scale": {},
                   "scale": torch.tensor([grad_scale if grad_scale is not None else 1.0])}
            pre["batch"] = JobBatch(self._worker, partial(self._scale_and_norm, pre))
            self._prenorm = pre
            return
        self._overlap = self._prepare_updates(grad_scale, check_each=True)
        self._overlap["newest_first"] = self._early_forward

    @property
    def overlapping(self) -> bool:
        """True between ``overlap_next_step()`` and the ``step()`` that completes it."""
        return self._overlap is not None or self._final_backward

    def _prepare_updates(
        self, grad_scale: Optional[float], check_each: bool, wait_pushes: bool = True
    ) -> dict:
        """Sync hyperparameters and make the host buffers safe to overwrite."""
        # Schedulers write lr/betas/momentum into our groups; the host update reads them
        # from its own. (A tensor lr is changed in place: copy its value.)
        hyper = [{k: v.clone() if isinstance(v, torch.Tensor) else v
                  for k, v in outer.items() if k != "params"} for outer in self.param_groups]
        if self._early is None:
            self._set_host_hyperparameters(hyper)
            if wait_pushes:
                # The previous step's weight copies read master/weight_stage: let them
                # finish. (delayed_update waits per parameter, in its jobs.)
                Transfers.wait(self._last_push)
        else:
            # A step that returned early is still updating with the current values: the
            # worker runs its jobs in order, so set the new ones after them. Its weight
            # copies need no wait here: each parameter's next gradient comes from a
            # forward that waited for its copy.
            self._worker.submit(partial(self._set_host_hyperparameters, hyper))
        groups = {m: g for g in self._host_optimizer.param_groups for m in g["params"]}
        plan = {
            "groups": groups, "grad_scale": grad_scale, "submitted": set(),
            "check_each": check_each, "nonfinite": [],
            # Partial offload: parameters updated on the device, and those spared there.
            "device_updated": 0, "device_nonfinite": 0,
        }
        plan["clip_coef"] = self._clip_coef
        # Slots waiting for their update, and how many elements were queued since the last
        # job was submitted. Each job takes the next batch from the front when it runs, so
        # step() can put what is left in forward order (see _return_early).
        plan.update(todo=[], todo_lock=threading.Lock(), queued_numel=0,
                    batch_numel=host_worker.BATCH_NUMEL, ready={}, pushed={},
                    landed_first=False, newest_first=False, pushes_after=None)
        return plan

    def _set_host_hyperparameters(self, hyper: list[dict]) -> None:
        for values, inner in zip(hyper, self._host_optimizer.param_groups):
            inner.update(values)

    def _submit_update(self, slot: HostSlot) -> None:
        """Queue ``slot``'s update (small parameters go to the worker several at a time)."""
        plan = self._overlap
        if not plan["submitted"]:  # the step's first update: nothing has read a master yet
            self._adopt_changed_weights()
        plan["submitted"].add(slot.master)
        with plan["todo_lock"]:
            plan["todo"].append(slot)
            plan["queued_numel"] += slot.master.numel()
            full = plan["queued_numel"] >= plan["batch_numel"]
            if full:
                plan["queued_numel"] = 0
        if full:
            self._worker.submit(partial(self._update_next, plan))

    def _flush_updates(self) -> None:
        """Have the worker update every queued slot, including batches not yet full."""
        plan = self._overlap
        if plan is None:
            return
        with plan["todo_lock"]:
            queued, plan["queued_numel"] = bool(plan["todo"]), 0
        if queued:
            self._worker.submit(partial(self._update_rest, plan))

    def _update_next(self, plan: dict) -> bool:
        """Worker job: update the next batch of queued slots; False if none was left."""
        with plan["todo_lock"]:
            todo = plan["todo"]
            first, end = self._next_batch(plan, todo) if todo else (0, 0)
            slots, plan["todo"] = todo[first:end], todo[:first] + todo[end:]
        if slots:
            self._update_batch(plan, slots)
        return bool(slots)

    def _next_batch(self, plan: dict, todo: list[HostSlot]) -> tuple[int, int]:
        """The range of ``todo`` to update next: about ``batch_numel`` elements, at least
        one slot."""
        batch_numel = plan["batch_numel"]
        if plan["newest_first"] and not plan["landed_first"]:
            # early_forward, during backward (todo in arrival order): the gradient that
            # landed last, and those before it. What backward leaves is then spread over
            # the whole model, so the host keeps updating until the next forward reaches
            # its last layers; oldest first would leave it the early layers only, and
            # the forward of the later ones would run with the host idle.
            last = next((i for i in range(len(todo) - 1, -1, -1) if self._landed(todo[i])), 0)
            first, numel = last, todo[last].master.numel()
            while first > 0 and numel < batch_numel:
                first -= 1
                numel += todo[first].master.numel()
            return first, last + 1
        first = 0
        if plan["landed_first"]:
            # Forward order, but skipping gradients still on their way: the first
            # parameters of the forward are the last of the backward (the embedding
            # lands last), and waiting for them would leave the host idle. If none
            # has landed, wait for the one that lands first: copies land in backward
            # order, so that is the last one in forward order.
            first = next((i for i, slot in enumerate(todo) if self._landed(slot)), len(todo) - 1)
        end, numel = first + 1, todo[first].master.numel()
        while end < len(todo) and numel < batch_numel:
            numel += todo[end].master.numel()
            end += 1
        return first, end

    @staticmethod
    def _landed(slot: HostSlot) -> bool:
        """Whether ``slot``'s gradient copies have completed (the update would not wait)."""
        incoming = slot.incoming_event if slot.incoming_pending else None
        return Transfers.landed(slot.grad_event) and Transfers.landed(incoming)

    def _update_rest(self, plan: dict) -> None:
        """Worker job: update batches until no slot is queued."""
        while self._update_next(plan):
            pass

    def _update_batch(self, plan: dict, slots: list[HostSlot]) -> None:
        """Worker job: update ``slots`` and send their weights to the device."""
        try:
            self._update_and_push(plan, slots)
        finally:  # even on failure: a forward waiting for these must not hang (it raises)
            for slot in slots:
                plan["ready"].setdefault(id(slot.param), threading.Event()).set()

    def _update_and_push(self, plan: dict, slots: list[HostSlot]) -> None:
        trace = self._worker.trace
        start_job = time.perf_counter() if trace is not None else 0.0
        finite = []
        for slot in slots:
            start = time.perf_counter()
            self._settle(slot)
            self._worker.waited_s += time.perf_counter() - start
            # Updates that overlap backward cannot wait for a verdict on all gradients:
            # each checks its own before touching the master weight or the state.
            if plan["check_each"] and not self._landed_grad_finite(slot):
                plan["nonfinite"].append(slot)
            else:
                finite.append(slot)
        if finite:
            grad_scale = plan["grad_scale"]
            if plan["clip_coef"] is not None:  # clip_grad_norm_ left the multiply to us
                if grad_scale is None:  # the update multiplies as mul_ would: no extra pass
                    grad_scale = float(plan["clip_coef"])
                else:
                    for slot in finite:
                        slot.grad.mul_(plan["clip_coef"])
            settled = time.perf_counter() if trace is not None else 0.0
            update_slots(self._host_optimizer, plan["groups"], finite, grad_scale)
            updated = time.perf_counter() if trace is not None else 0.0
            self._last_push = self._transfers.to_device(
                # The parameters themselves: detaching each would cost the GIL a round trip.
                [(slot.weight_source(), local_part(slot.param)) for slot in finite],
                after=plan["pushes_after"],
            )
            for slot in finite:
                plan["pushed"][id(slot.param)] = self._last_push
            if trace is not None:  # (benchmarks) where the host's time goes, per job
                trace.append((start_job, settled, updated, time.perf_counter(),
                              sum(slot.master.numel() for slot in finite), finite[0].order))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Update the host copies with ``optimizer_cls`` and copy the weights to the device.

        Parameters are processed one by one on a background thread: the host update of
        one overlaps the copies of the others in both directions. A step whose gradients
        hold an inf or NaN updates nothing (``nonfinite_grads="skip"``, with a warning)
        or raises (``"raise"``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.delayed_update:
            self._step_delayed()
            return loss
        self._finish_early_step()
        self._ungated = {}
        early, self._early_forward = self._early_forward, False
        try:
            if self._overlap is None:
                self._warn_if_unscaled()
                # A grad_scale that overlap_next_step deferred (sharded parameters) is
                # applied by _grads_in_place.
                grads = self._grads_in_place("step()") if self._final_backward else self._ready_grads()
                if not self._grads_finite(grads):
                    self._skipped_step(grads)
                    return loss
                if not self.offload_gradients:
                    self._copy_device_grads_to_host()
                self._overlap = self._prepare_updates(grad_scale=None, check_each=False)
            plan = self._overlap
            for slot in self._slots():
                if self.offload_gradients and slot.param.grad is not None:
                    self._offload_grad(slot.param)  # set by hand; the hook submits it
                elif slot.has_grad and slot.master not in plan["submitted"]:
                    self._submit_update(slot)
            if early:
                self._return_early(plan)
            self._flush_updates()
            self._step_on_device(plan)  # its kernels run while the host finishes
            if not early:
                self._worker.drain()
                self._refuse_changes_during_step(plan)
                self._report_spared(plan)
        finally:
            self._overlap = None
            self._final_backward, self._deferred_scale = False, None
            self._prenorm, self._clip_coef = None, None
            if not self.offload_gradients:
                for slot in self._slot_list:
                    slot.has_grad = False
            if self._early is None:
                self._transfers.order_compute_after(self._last_push)
        return loss

    # ------------------------------------------------------------------ early forward
    def _return_early(self, plan: dict) -> None:
        """overlap_next_step(early_forward=True): let step() return with updates still
        queued. What is left is updated in forward order, and each module's next forward
        first waits for its own parameters' weights (a forward pre-hook on all modules,
        removed once every weight has been waited for), so the forward starts on the
        first layers while the host updates the later ones."""
        # The next forward's work queued from now on does not read the weights: their
        # copies need only wait for the backward.
        plan["pushes_after"] = self._transfers.mark_compute()
        with plan["todo_lock"]:
            plan["todo"].sort(key=lambda slot: slot.order)
            plan["landed_first"] = True
        plan["gates"] = {id(slot.param): slot for slot in self._slot_list
                         if slot.master in plan["submitted"]}
        plan["hook"] = torch.nn.modules.module.register_module_forward_pre_hook(self._gate)
        self._early = plan

    def _gate(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook while a step that returned early runs: wait for the weights of
        ``module``'s own parameters (on the host until sent, then on the device by event)."""
        plan = self._early
        if plan is None:
            return
        for param in module._parameters.values():
            slot = plan["gates"].get(id(param)) if param is not None else None
            if slot is None or slot.param is not param:  # (ids of dead tensors are reused)
                continue
            del plan["gates"][id(param)]
            ready = plan["ready"].setdefault(id(param), threading.Event())
            while not ready.wait(0.05):
                if self._worker.failed:
                    break
            if self._worker.failed:
                self._finish_early_step()  # raises the worker's error here
            self._transfers.order_compute_after(plan["pushed"].get(id(param)))
        if not plan["gates"]:
            self._finish_early_step()

    def _finish_early_step(self) -> None:
        """Complete a step that returned early: every update done, every weight ordered
        before later device work, inf/NaN reported (see overlap_next_step)."""
        plan, self._early = self._early, None
        if plan is None:
            return
        plan["hook"].remove()
        try:
            self._worker.drain()
        finally:
            self._transfers.order_compute_after(self._last_push)
            if plan.get("zero_grad") is not None:
                self._reset_host_grads(set_to_none=plan["zero_grad"])
        edited = changed_slots(self._slot_list)
        if edited:
            # Changed while this step was still writing weights: whether each change came
            # before or after the new weight landed is unknown. The parameter stays the
            # truth (the host copies follow it), and the user hears of it.
            for slot in edited:
                adopt_weight(slot)
            raise RuntimeError(
                f"CPUOffloadOptimizer: {len(edited)} parameters were changed (in place, or by "
                "load_state_dict) after a step that returned early (early_forward) and before "
                "it had finished writing the new weights, so the change may have been applied "
                "to the old weights or overwritten. Call optimizer.finish_step() before "
                "changing weights outside the optimizer. The optimizer now follows the "
                "weights as they are."
            )
        self._report_spared(plan)

    def _adopt_changed_weights(self) -> None:
        """Take over weights changed outside the optimizer since its host copies last
        matched them (see weight_sync): before a step's first update reads a master."""
        for slot in changed_slots(self._slot_list):
            adopt_weight(slot)
        if self._device_share is not None:
            self._device_share.adopt_changed_weights()

    def _refuse_changes_during_step(self, plan: dict) -> None:
        """After an overlapped step: updates that started during backward read the host
        copies before a change made between overlap_next_step() and step() could count."""
        edited = [s for s in changed_slots(self._slot_list) if s.master in plan["submitted"]]
        if edited:
            for slot in edited:
                adopt_weight(slot)
            raise RuntimeError(
                f"CPUOffloadOptimizer: {len(edited)} parameters were changed outside the "
                "optimizer after overlap_next_step(), while their updates were already "
                "running. Change weights before overlap_next_step() (or after step()). The "
                "optimizer now follows the weights as they are."
            )

    @torch.no_grad()
    def reload_weights(self) -> None:
        """Re-read every parameter into the host copies (the fp32 masters restart from the
        weights unless a weight is exactly its master rounded).

        Changes made in place or by ``load_state_dict`` are picked up by the next step
        without this; call it after writing through ``param.data``, which torch hides from
        the version counters that detection reads.
        """
        self._finish_pending()
        for slot in self._slot_list:
            adopt_weight(slot)
        if self._device_share is not None:
            self._device_share.adopt_changed_weights(all_params=True)

    def finish_step(self) -> None:
        """Wait until the last step has put every weight on the device: a step that returned
        early (``overlap_next_step(early_forward=True)``) or a delayed update, with its
        errors raised. Every method that needs it calls it; call it before reading the
        model's weights other than through its forward (e.g. saving the model) or changing
        them. A no-op otherwise."""
        self._finish_pending()

    def _step_on_device(self, plan: dict) -> None:
        """Partial offload: update the parameters kept on the device (device_fraction)."""
        share = self._device_share
        grads = share.grads(self._params()) if share is not None else []
        if not grads:
            return
        if plan["check_each"] and not all_finite(grads):  # no whole-step verdict to reuse
            plan["device_nonfinite"] = len(grads)
            return
        share.step(self.param_groups, plan["grad_scale"])
        plan["device_updated"] = len(grads)

    def _report_spared(self, plan: dict) -> None:
        """Warn (or raise) about parameters whose non-finite gradients their updates found."""
        skipped = len(plan["nonfinite"]) + plan["device_nonfinite"]
        if skipped:
            updated = len(plan["submitted"]) - len(plan["nonfinite"]) + plan["device_updated"]
            self._nonfinite_step(updated=updated, skipped=skipped)

    def _copy_device_grads_to_host(self) -> None:
        """offload_gradients=False: the recipe has finished with .grad (scaling, clipping)."""
        for slot in self._slots():
            if slot.param.grad is not None:
                slot.grad_event = self._transfers.to_host([(local_part(slot.param.grad), slot.grad)])
                slot.has_grad = True

    # ------------------------------------------------------------------ delayed update
    def _step_delayed(self) -> None:
        """Finish the previous step's update, then start this one's and return."""
        try:
            self._finish_pending()
            if self._judge_in_jobs():
                # Nothing has read all gradients this step (no scale_grads, no clipping):
                # each job scales its gradient inside the update (overlap_next_step's
                # grad_scale) and checks it first, so the training thread makes no pass
                # over the gradients while the GPU waits for the next forward.
                grad_scale, self._deferred_scale = self._deferred_scale, None
                self._settled_host_grads()
                plan = self._prepare_updates(grad_scale, check_each=True, wait_pushes=False)
                self._submit_delayed(plan)
                self._step_on_device(plan)
                return
            grads = self._grads_in_place("step()")
            self._warn_if_unscaled()
            if not self._grads_finite(grads):
                self._skipped_step(grads)
                return
            if not self.offload_gradients:
                self._copy_device_grads_to_host()
            plan = self._prepare_updates(grad_scale=None, check_each=False, wait_pushes=False)
            self._submit_delayed(plan)
            self._step_on_device(plan)
        finally:
            self._final_backward, self._deferred_scale = False, None
            if not self.offload_gradients:
                for slot in self._slot_list:
                    slot.has_grad = False

    def _judge_in_jobs(self) -> bool:
        """delayed_update: whether this step's scaling and inf/NaN check can move into the
        per-parameter jobs: gradients offloaded and announced by overlap_next_step, and
        untouched since (a scale or clip already read them all; then its verdict is
        reused). Not for sharded parameters, whose ranks must agree on one verdict."""
        return (
            self.offload_gradients and self._final_backward and not self._meshes
            and not self._finite.known()
        )

    def _submit_delayed(self, plan: dict) -> None:
        """Hand every parameter with a gradient to the worker; the next backward lands in
        the other gradient buffer."""
        self._adopt_changed_weights()
        batch = JobBatch(self._worker, partial(self._delayed_update, plan))
        for slot in self._slots():
            if not slot.has_grad:
                continue
            job_slot = dataclasses.replace(slot)  # this step's gradient buffer and events
            if slot.grad_spare is not None:  # the next backward lands in the other one
                slot.grad, slot.grad_spare = slot.grad_spare, slot.grad
            slot.has_grad, slot.grad_event = False, None
            plan["submitted"].add(slot.master)
            batch.add((slot, job_slot), slot.master.numel())
        batch.flush()
        self._pending = plan

    def _delayed_update(self, plan: dict, pairs: list[tuple[HostSlot, HostSlot]]) -> None:
        """Worker job: update a batch of parameters (each ``(slot, job_slot)``: the slot and
        its copy holding this step's gradient buffer), then send each updated weight the
        device is done with."""
        finite = []
        for slot, job_slot in pairs:
            Transfers.wait(slot.push_event)  # the previous weight has left the stage
            self._settle(job_slot)
            if plan["check_each"] and not all_finite([job_slot.grad]):
                plan["nonfinite"].append(slot)  # unchanged; nothing to send
            else:
                finite.append((slot, job_slot))
        if not finite:
            return
        update_slots(self._host_optimizer, plan["groups"], [j for _, j in finite], plan["grad_scale"])
        with self._push_lock:
            for slot, _ in finite:
                slot.push_ready = True
                if slot.free_to_push:
                    self._push(slot)

    def _release_for_push(self, slot: HostSlot) -> None:
        """The last backward before step() is done with ``slot``'s weight."""
        with self._push_lock:
            if self._pending is not None and slot.master in self._pending["submitted"]:
                self._allow_push(slot)

    def _allow_push(self, slot: HostSlot) -> None:
        """The device no longer reads ``slot``'s weight: send it now if it is updated, else
        let its job send it (caller holds ``_push_lock``)."""
        slot.free_to_push = True
        if slot.push_ready:
            self._push(slot)

    def _push(self, slot: HostSlot) -> None:
        """Copy an updated weight to the device (caller holds ``_push_lock``), unless the
        weight was changed outside the optimizer meanwhile: the change wins, and the next
        step or state_dict() takes it over (see weight_sync)."""
        if weight_mark(slot.param) == slot.mark:
            slot.push_event = self._transfers.to_device([(slot.weight_source(), slot.device_weight())])
            self._last_push = slot.push_event  # copies complete in issue order
        slot.push_ready = slot.free_to_push = False

    def _finish_pending(self) -> None:
        """Wait for the background update and put all of its weights on the device."""
        self._finish_early_step()  # the same for a step that returned early
        plan = self._pending
        if plan is None:
            return
        try:
            with self._push_lock:
                for slot in self._slot_list:
                    if slot.master in plan["submitted"]:
                        self._allow_push(slot)
            self._worker.drain()  # jobs that finish now push their own weights
        finally:
            self._pending = None
            for slot in self._slot_list:
                slot.push_ready = slot.free_to_push = False
            self._transfers.order_compute_after(self._last_push)
        self._report_spared(plan)  # judged in the jobs: reported one step late

    def _ready_grads(self) -> list[torch.Tensor]:
        """The gradients the next update would use (device .grad, or settled host copies)."""
        return [g for _, g in self._ready_pairs()]

    def _ready_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, gradient)`` for :meth:`_ready_grads`, in parameter order; a DTensor's
        gradient as its local shard; parameters updated on the device with their ``.grad``."""
        host = {s.param: s.grad for s in self._settled_host_grads()} if self.offload_gradients else {}
        pairs = []
        for p in self._params():
            if p in host:
                pairs.append((p, host[p]))
            elif p.grad is not None and (not self.offload_gradients or p not in self._slot_of):
                _check_dense(p.grad)
                pairs.append((p, local_part(p.grad)))
        return pairs

    def _grads_finite(self, grads: list[torch.Tensor]) -> bool:
        known = self._finite.finite(grads)  # from scale_grads/clip_grad_norm_, if current
        finite = all_finite(grads) if known is None else known
        # Sharded: a rank skipping a step the others take would desynchronize the replicas
        # for good, so one rank's inf/NaN skips the step everywhere.
        return not distributed.any_rank(not finite, self._meshes)

    def _skipped_step(self, grads: list[torch.Tensor]) -> None:
        """Report a step skipped as a whole, counting the gradients that were non-finite
        (a pass over each, on this rare path only)."""
        bad = sum(1 for g in grads if not all_finite([g]))
        if bad == 0:  # (sharded: the verdict is every rank's)
            what = (f"another rank had an inf or NaN gradient, so the step was skipped for all "
                    f"{len(grads)} parameters here too (their master weights and optimizer "
                    "state are unchanged)")
        else:
            what = (f"{bad} of {len(grads)} parameters had an inf or NaN gradient, so the step "
                    "was skipped: no master weight or optimizer state changed")
        self._report_nonfinite(what)

    def _nonfinite_step(self, updated: int, skipped: int) -> None:
        """Report updates spared one by one (each judged its own gradient)."""
        what = (
            f"{skipped} parameters had an inf or NaN gradient; their master weights and "
            "optimizer state are unchanged"
            + (f", while the other {updated} parameters were updated (with "
               "overlap_next_step or delayed_update each update checks its own gradient)"
               if updated else ": the step was skipped")
        )
        self._report_nonfinite(what)

    def _report_nonfinite(self, what: str) -> None:
        if self.nonfinite_grads == "raise":
            raise FloatingPointError(
                f"CPUOffloadOptimizer: {what}. Lower the lr, clip gradients, or check the "
                "data; nonfinite_grads='skip' skips such steps instead."
            )
        log.warning("CPUOffloadOptimizer: %s.", what)

    def _warn_if_unscaled(self) -> None:
        if self.offload_gradients and not self._scaled_since_zero_grad and not self._warned_unscaled:
            # torch.distributed.checkpoint's get/set_optimizer_state_dict create the state
            # with a step on zero gradients at lr=0, which must not use up the warning.
            if all(float(g["lr"]) == 0 for g in self.param_groups):
                return
            self._warned_unscaled = True
            log.warning(
                "CPUOffloadOptimizer(offload_gradients=True): step() ran without "
                "optimizer.scale_grads() or optimizer.clip_grad_norm_() since zero_grad(). "
                "torchtune's training.scale_grads(model, ...) and "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) cannot see "
                "offloaded gradients. Use offload_plugin's recipes, call the optimizer's "
                "methods, or set offload_gradients=False. (Shown once.)"
            )

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
        self._adopt_changed_weights()  # a saved master must match the model's weight
        sd = super().state_dict()
        # torch's packing hands out the host optimizer's live per-parameter dicts: copy
        # them before adding keys, so the live state never holds the master or DTensors.
        sd["state"] = {index: dict(entry) for index, entry in sd["state"].items()}
        for index, param in enumerate(self._params()):
            slot = self._slot_of.get(param)
            if slot is None:  # updated on the device (device_fraction)
                master = self._device_share.master(param)
                if master is not None:
                    sd["state"].setdefault(index, {})[MASTER_KEY] = master
                continue
            # delayed_update saves every host weight: a model checkpoint written before
            # this call holds the weights from before the update it just completed.
            if slot.weight_stage is not None or self.delayed_update:
                sd["state"].setdefault(index, {})[MASTER_KEY] = slot.master
            if self._meshes and index in sd["state"]:
                sd["state"][index] = self._shard_state(index, slot, sd["state"][index])
        return sd

    @staticmethod
    def _shard_state(index: int, slot: HostSlot, entry: dict[str, Any]) -> dict[str, Any]:
        shard = slot.master.shape
        out = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape != shard:
                    raise ValueError(
                        f"state {index}[{key!r}] has shape {tuple(value.shape)}, but its "
                        f"parameter's local shard is {tuple(shard)}: a sharded checkpoint "
                        f"cannot hold it. {type(slot.param).__name__} parameters need an "
                        "optimizer_cls whose state is shaped like the parameter (AdamW, SGD, ...)."
                    )
                value = distributed.shard_like(value, slot.param)
            out[key] = value
        return out

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
        # Checked and converted into new tensors; nothing of this optimizer changed yet.
        plan = checkpoint.prepare_load(self, state_dict, torchao_minimal_size, allow_nonfinite)
        checkpoint.apply_state(self, plan)
        # The one place where loading writes master weights and device weights.
        checkpoint.write_weights(self, plan)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _validate_state_dict(self, state_dict: dict[str, Any], allow_nonfinite: bool = False):
        """Check ``state_dict`` against this optimizer without changing anything; returns
        the converted state (``checkpoint.LoadPlan``). Raises ValueError saying what differs."""
        return checkpoint.validate(self, state_dict, allow_nonfinite)

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
