"""CPUOffloadOptimizer: a torch.optim.Optimizer whose state and update live in host memory.

This module is the facade: param groups, ``state``, ``step``, ``zero_grad``, scaling and
clipping, the state dict, as torch's optimizers have them. Where and how the update runs
is an engine's job (``engine``: the streamed engine, ``streamed``, or the host engine,
``host_engine``, chosen as groups are added); the options are checked in ``options``, the
state dict in ``checkpoint``, ``optimizer.state`` is ``state_view``, and which optimizer
updates a parameter is ``ownership``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.optim import Optimizer

from offload_plugin.checkpoint import state_dict as checkpoint
from offload_plugin.checkpoint.torchao import TORCHAO_MINIMAL_SIZE
from offload_plugin.engines import streamed
from offload_plugin.engines.base import Engine
from offload_plugin.engines.device_share import choose_kept
from offload_plugin.engines.host import HostEngine
from offload_plugin.host import memory as host_memory
from offload_plugin.options import (
    Options, check_amp_scaler, check_device_share, check_host_only, check_overlap, check_trainable,
)
from offload_plugin.engines.schedules import early_forward
from offload_plugin.ownership import check_not_taken_over, claim
from offload_plugin.state_view import StateView
from offload_plugin.trainable import Kept

__all__ = ["CPUOffloadOptimizer"]



class CPUOffloadOptimizer(Optimizer):
    """``optimizer_cls`` with its state in host memory; the device keeps only weights.

    Frozen parameters (``requires_grad=False``, e.g. QLoRA's NF4 base weights) are dropped
    before anything is allocated or hooked, so ``model.parameters()`` can be passed as
    torchtune's recipes do. ``param_groups``, ``state``, ``defaults``, hooks and the state
    dict behave as on torch's optimizers, so every LR scheduler and checkpoint helper works.

    On a GPU, AdamW and Adam (fused, the default) without master weights, offloaded
    gradients, ``delayed_update``, ``device_fraction`` or DTensor parameters stream their
    state through the GPU (``streamed``): bit for bit ``torch.optim.AdamW(fused=True)`` on
    the GPU. Otherwise each step copies the gradients to pinned host memory (or, with
    ``offload_gradients``, takes the copies made during backward), runs
    ``optimizer_cls.step`` there and copies the updated weights back on a side CUDA stream
    (``host_engine``). ``docs/options.md`` says what each option does and costs, and which
    combinations run where (one table, ``options.COMBINATIONS``).

    Args:
        params (Iterable): parameters or param-group dicts, as for any torch optimizer.
        optimizer_cls (type or str): the optimizer run on the host, as a class or a dotted
            path. Default: ``"torch.optim.AdamW"``.
        offload_gradients (bool): move each gradient to host memory as soon as backward
            produces it; scale and clip through :meth:`scale_grads` and
            :meth:`clip_grad_norm_` then. Default: ``False``.
        master_weights (bool): opt-in, changes the result: fp32 host copies of bf16/fp16
            parameters, updated instead of the parameters. Default: ``False`` (bit for bit
            ``optimizer_cls`` on the parameters).
        pin_memory (bool): page-lock host buffers (CUDA only). Default: ``True``.
        nonfinite_grads (str): a step with an inf or NaN gradient: ``"skip"`` (update
            nothing, warn) or ``"raise"`` (FloatingPointError). Default: ``"skip"``.
        check_host_memory (bool): raise ``HostMemoryError`` before allocating if the host
            buffers and state would not fit. Default: ``True``.
        delayed_update (bool): opt-in, NOT exact: ``step()`` returns at once and the update
            runs during the next forward and backward (DeepSpeed's delayed parameter
            update). Default: ``False``.
        host_threads (int, optional): CPU threads for the host update. Default: all but one
            with a GPU.
        device_fraction (float): keep the update of the first trainable parameters, up to
            this fraction of all trainable elements, on the device. Default: ``0.0``.
        accumulate_on_device (bool): with ``offload_gradients`` and gradient accumulation,
            leave gradients on the device until the last backward of the window (see
            :meth:`overlap_next_step`). Default: ``False``.
        **optimizer_kwargs: hyperparameters for ``optimizer_cls`` (``lr``, ``betas``,
            ``weight_decay``, ``fused``, ...).

    Raises:
        ValueError: no trainable parameters, a parameter given twice, parameters on
            different devices, an unresolvable or unsupported ``optimizer_cls``, a refused
            combination of options, or an invalid hyperparameter.
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
        self.options = options
        # The options as attributes, as torch's optimizers expose theirs (recipes read them).
        for name in ("optimizer_cls", "offload_gradients", "master_weights", "pin_memory",
                     "nonfinite_grads", "check_host_memory", "delayed_update", "host_threads",
                     "accumulate_on_device", "device_fraction"):
            setattr(self, name, getattr(options, name))
        self._keep_ids: set[int] = set()
        if self.device_fraction and not isinstance(params, torch.Tensor):
            params = list(params)  # read twice: to choose the kept share, then by torch
            self._keep_ids = choose_kept(params, self.device_fraction)
        # The streamed engine where the options may allow it; the host engine takes over at
        # the first group it cannot take (see _attach). The device share is the host's.
        self._engine: Engine = (HostEngine(self, options, keeps_some=True) if self._keep_ids
                                else streamed.StreamedEngine(self, options))
        self._kept = Kept()  # what was kept of the tensors given, and the frozen ones

        super().__init__(params, options.defaults())  # calls add_param_group for each group
        self.state = StateView(lambda: self._engine)
        self._kept.check_any()
        self._kept.log(self.optimizer_cls, self._engine)

    @property
    def engine(self) -> Engine:
        """The update engine in use (``streamed.StreamedEngine`` or ``host_engine.HostEngine``),
        for inspection: its slots, inner optimizer and parts."""
        return self._engine

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
        if getattr(self._engine, "returned_early", None) is not None:
            early_forward.finish(self._engine)
        group, frozen_at = self._kept.filter(param_group)
        super().add_param_group(group)
        try:
            self._attach(self.param_groups[-1])
        except BaseException:
            # Leave the optimizer as it was: no group without host copies behind it.
            self.param_groups.pop()
            raise
        self._kept.frozen_at.append(frozen_at)
        self._engine.note_groups()

    def _attach(self, group: dict[str, Any]) -> None:
        """Hand a group torch has accepted to the engine (host copies, state, hooks)."""
        params = group["params"]
        engine = self._engine
        check_trainable(params, held=(s.param for s in engine.slots))
        if params and engine.transfers is None:
            engine.setup_device(params[0].device)
            self.host_threads = engine.worker.num_threads
        on_device = [p for p in params if id(p) in self._keep_ids]
        check_device_share(on_device)
        check_host_only(self.optimizer_cls, self.master_weights, params)
        offloaded = [p for p in params if id(p) not in self._keep_ids]
        if not engine.accepts(group, offloaded):
            engine = self._engine = HostEngine.take_over(engine)
        engine.attach(group, offloaded, on_device)
        claim(self, params)
        self._kept.add(offloaded, on_device)

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def scale_grads(self, factor: Union[float, torch.Tensor]) -> None:
        """Multiply every trainable gradient by ``factor``, wherever it currently lives.

        Equivalent to torchtune's ``training.scale_grads(model, factor)``, which cannot
        reach offloaded gradients (they are ``None`` on the model).
        """
        self._engine.scale_grads(factor)

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
        same list: bit for bit ``clip_grad_norm_(model.parameters())`` where the groups list
        the parameters in the model's order (torchtune's recipes), else maybe not in the last
        bit. With DTensor (FSDP2) parameters the norm covers every rank's shards and every
        rank must call it. After ``overlap_next_step(clipping=True)`` it adds up the norms
        taken during backward and the updates fold in the coefficient: the same values.

        Returns:
            torch.Tensor: the total norm over all trainable parameters before clipping (on
            the host when gradients are offloaded), also the global one when sharded.

        Raises:
            ValueError: sharded parameters with a ``norm_type`` other than inf or a
                positive number.
        """
        return self._engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients on the device and in host memory (see torch.optim.Optimizer)."""
        self._engine.zero_grad(set_to_none, partial(super().zero_grad, set_to_none))

    # ------------------------------------------------------------------ step
    def overlap_next_step(
        self, grad_scale: Optional[Union[float, torch.Tensor]] = None, clipping: bool = False,
        early_forward: bool = False,
    ) -> None:
        """Start each parameter's update as soon as the next backward delivers its gradient.

        Call it right before the last backward of an accumulation window, then ``step()`` as
        usual: it only waits for the updates still running, so the host update overlaps
        the backward pass. Same results as ``scale_grads(grad_scale)`` and stepping after
        backward; the updates read the hyperparameters in ``param_groups`` now.
        ``docs/options.md`` ("Methods") has the details and conditions of each argument.

        Args:
            grad_scale (float or Tensor, optional): multiply each gradient by this in the
                update (torchtune's ``1 / num_tokens``), rounded as ``scale_grads`` rounds it.
            clipping (bool): ``clip_grad_norm_`` will be called before ``step()``: each
                gradient is scaled and normed on its way out, and each update folds the clip
                coefficient in. Same results as clipping after backward.
            early_forward (bool): ``step()`` returns once the updates are queued, and each
                module's next forward waits only for its own parameters' new weights. Same
                results if every parameter is first used in its own module's forward and
                nothing reads the weights before then except after :meth:`finish_step`
                (else the next backward raises). Not with ``torch.compile``d modules.

        Raises:
            ValueError: without ``offload_gradients=True``; ``early_forward`` with
                ``delayed_update`` or sharded parameters.
        """
        check_not_taken_over(self._engine.taken_over)
        check_overlap(self.options, early_forward=bool(early_forward), sharded=self._engine.slots.sharded)
        # A step that returned early may still be updating (this is normally called before
        # the next forward, which it is to overlap); what follows leaves it alone.
        self._engine.overlap_next_step(grad_scale, clipping, bool(early_forward))

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch.amp.GradScaler hands the scale to step() (``self.grad_scale``) instead of
        unscaling the gradients first where this is True, as it is for torch's fused AdamW,
        whose kernel divides by it: a different rounding from unscaling, and fp16 gradients,
        which GradScaler refuses to unscale, work. The streamed update runs that kernel.
        Offloaded gradients leave a handle on ``.grad`` that GradScaler unscales (the host
        copy: grad_handle), except those of DTensor parameters, which leave nothing: True
        there, so that it hands its scale to step(), which refuses it with advice
        (unscaling would find no gradient and fail with torch's "No inf checks")."""
        return self._engine.takes_amp_scale

    @property
    def overlapping(self) -> bool:
        """True between ``overlap_next_step()`` and the ``step()`` that completes it."""
        return self._engine.overlap is not None

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
        check_amp_scaler(self.options, getattr(self, "grad_scale", None),
                         hidden_grads=self._engine.scaling.hidden_grads)
        check_not_taken_over(self._engine.taken_over)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.check_groups()
        self._kept.warn_unfrozen(self._engine.holds)
        engine = self._engine
        if not engine.still_applies():
            engine = self._engine = HostEngine.take_over(engine)  # (a group's fused was switched off)
        engine.step()
        # Its state exists now, or will in a moment (an update that returned early); a
        # parameter without a gradient makes none, which a later preflight then misses.
        host_memory.allocated(self)
        return loss

    def finish_step(self) -> None:
        """Wait until the last step has put every weight on the device: a step that returned
        early (``overlap_next_step(early_forward=True)``) or a delayed update, with its
        errors raised. Every method that needs it calls it; call it before reading the
        model's weights other than through its forward (e.g. saving the model) or changing
        them. A no-op otherwise."""
        self._engine.finish()

    @torch.no_grad()
    def reload_weights(self) -> None:
        """Re-read every parameter into the host copies (the fp32 masters restart from the
        weights unless a weight is exactly its master rounded). The streamed update keeps no
        copies; with CompactAdamW every master restarts from its weight.

        Changes made in place or by ``load_state_dict`` are picked up by the next step
        without this; call it after writing through ``param.data``, which torch hides from
        the version counters that detection reads.
        """
        self._engine.finish()
        self._engine.reload_weights()

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``{"state": {index: {...}}, "param_groups": [...]}``, with the host
        copies as state tensors. With master weights, each fp32 master is saved under
        ``"master_weight"`` so that a resume continues exactly (torch's optimizers ignore
        it). For a DTensor (FSDP2) parameter, state shaped like its shard is a DTensor laid
        out like the parameter, as ``torch.distributed.checkpoint`` saves by shard.

        Raises:
            ValueError: a DTensor parameter's state is not shaped like its shard.
        """
        self._engine.finish()
        self._engine.check_groups()
        self._engine.adopt_changed_weights()  # a saved master must match the model's weight
        return checkpoint.with_masters(self._engine, super().state_dict())

    def load_state_dict(
        self,
        state_dict: dict[str, Any],
        torchao_minimal_size: int = TORCHAO_MINIMAL_SIZE,
        *,
        allow_nonfinite: bool = False,
    ) -> None:
        """Load a state dict from this class or any torch optimizer over the same parameters.

        A torchao CPUOffloadOptimizer checkpoint (``{"offloaded": ..., "on-device": ...}``)
        is converted first. Every group and entry is checked (keys, types, dtypes, exact
        shapes, finite values) and copied before anything changes, so a refused load leaves
        parameters, state and groups as they were. Hyperparameters are taken as
        ``optimizer_cls`` takes them. State lands in host memory.

        Args:
            state_dict (dict): what ``state_dict()`` of this class or of a torch optimizer
                returned, or a torchao CPUOffloadOptimizer checkpoint.
            torchao_minimal_size (int): that torchao optimizer's ``minimal_size``.
            allow_nonfinite (bool): load state and master weights that hold inf or NaN
                (refused by default: the next step would carry them into the weights).

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: it does not match this optimizer, or holds a malformed or
                non-finite entry; the message says what differs.
        """
        self.checked_load(state_dict, torchao_minimal_size, allow_nonfinite=allow_nonfinite)()

    def checked_load(self, state_dict: dict[str, Any], torchao_minimal_size: int = TORCHAO_MINIMAL_SIZE,
                     *, allow_nonfinite: bool = False) -> Callable[[], None]:
        """:meth:`load_state_dict` in two parts: check ``state_dict`` now (raising as it
        raises, with nothing changed) and return the call that loads it. Several optimizers
        loading one checkpoint (OptimizerInBackward's) check every part before any loads."""
        engine = self._engine
        engine.finish()
        self._engine.check_groups()
        # Checked and converted into new tensors; nothing of this optimizer changed yet.
        hooks = [partial(hook, self) for hook in self._optimizer_load_state_dict_pre_hooks.values()]
        hooks.append(partial(self._kept.drop_frozen, self.param_groups))  # (torch's, over model.parameters())
        plan = checkpoint.prepare_load(engine, state_dict, torchao_minimal_size, allow_nonfinite, hooks)

        def load() -> None:
            checkpoint.apply_state(engine, plan)
            host_memory.allocated(self)  # (the loaded state is allocated)
            engine.forget_state()
            # The one place where loading writes master weights and device weights.
            checkpoint.write_weights(engine, plan)
            for hook in self._optimizer_load_state_dict_post_hooks.values():
                hook(self)
        return load

    # ------------------------------------------------------------------ reporting
    def host_memory_bytes(self) -> int:
        """Host bytes held for the optimizer: master weights, gradients, staging and state."""
        return self._engine.host_memory_bytes()

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
