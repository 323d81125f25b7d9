"""OptimizerInBackward: each parameter updated during backward, as soon as its gradient is
complete, by a CPUOffloadOptimizer of its own; one torch optimizer for the loop.

torchtune's full fine-tuning configs step one optimizer per parameter in gradient hooks
(``optimizer_in_bwd``): a gradient is applied and freed as backward goes on, so the GPU
never holds all of them, and the update (streamed through the GPU, or on the host) overlaps
the rest of backward. Hugging Face's ``Trainer``, Accelerate and Lightning have no such
mode; this class gives it to them as one ``torch.optim.Optimizer``: its ``param_groups`` are
what LR schedulers and loggers see (each update reads its group's hyperparameters as they
are when it runs), ``step()`` and ``zero_grad()`` have nothing left to do, and its state dict
is torch's layout over all the parameters.

What it cannot do is clip: a global norm needs every gradient before any update. After an
update ``.grad`` holds an :class:`AppliedGrad`, which gives the gradient's norm (so a
trainer can log it, and a clip whose coefficient comes out at 1 changes nothing) and refuses
every change with the fix, so that a clip, a scale or an unscale after backward fails
loudly instead of being silently dropped. With gradient accumulation the updates run in the
last backward of each window (``accumulation_steps``); the earlier ones leave their
gradients on the device, as without this class.
"""

from __future__ import annotations

import inspect
import logging
import types
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from offload_plugin.host.grad_handle import is_unit_factor, is_whole_2_norm
from offload_plugin.optimizer import CPUOffloadOptimizer

__all__ = ["AppliedGrad", "OptimizerInBackward"]

aten = torch.ops.aten
_log = logging.getLogger("offload_plugin")
# CPUOffloadOptimizer's own options: the same for every parameter, not param-group settings.
OPTIONS = frozenset(name for name, p in inspect.signature(CPUOffloadOptimizer).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY) | {"optimizer_cls"}


class AppliedGrad(torch.Tensor):
    """``.grad`` of a parameter whose update already ran during backward: no memory, its
    2-norm as torch's clip would take it (``linalg_vector_norm``), and a refusal of anything
    else but a multiply by 1 (what a clip that does not clip does) or a ``zero_``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, grad: torch.Tensor, norm: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, grad.shape, dtype=grad.dtype, device=grad.device,
                                                   requires_grad=False)

    def __init__(self, grad: torch.Tensor, norm: torch.Tensor) -> None:
        self.norm = norm

    def __repr__(self) -> str:
        return f"AppliedGrad(shape={tuple(self.shape)}, dtype={self.dtype}: its update ran in backward)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = args[0]
        if func in (aten.detach.default, aten.alias.default, aten.zero_.default):
            return this
        if func is aten.linalg_vector_norm.default and is_whole_2_norm(args, kwargs):
            return this.norm
        if func in (aten.mul_.Tensor, aten.mul_.Scalar) and is_unit_factor(args[1]):
            return this
        raise RuntimeError(
            f"{func.__name__} on the .grad of a parameter that OptimizerInBackward already "
            "updated during backward: the gradient was applied and freed there, so a clip, "
            "a scale or an unscale after backward can no longer change the update. Don't "
            "clip (Hugging Face's Trainer: max_grad_norm=0; it still logs the norm) or scale "
            "after backward (scale the loss instead), or use CPUOffloadOptimizer, which "
            "steps after backward.")


class _Hook:
    """A parameter's gradient hook, weakly bound to its OptimizerInBackward and parameter
    (see host_engine._GradHook for why weakly): ``method(param)``."""

    __slots__ = ("_owner", "_param", "_method")

    def __init__(self, owner: "OptimizerInBackward", param: torch.Tensor, method: str) -> None:
        self._owner, self._param, self._method = weakref.ref(owner), weakref.ref(param), method

    def __call__(self, _tensor: torch.Tensor) -> None:
        owner, param = self._owner(), self._param()
        if owner is not None and param is not None:
            getattr(owner, self._method)(param)


class OptimizerInBackward(Optimizer):
    """Each parameter's update runs in backward, by its own ``CPUOffloadOptimizer``.

    Args:
        params (Iterable): parameters or param-group dicts; frozen ones are dropped.
        accumulation_steps (int): backward passes per optimizer step; the updates run in the
            last of each. Default: ``1``.
        **kwargs: CPUOffloadOptimizer's options (``optimizer_cls``, ``offload_gradients``,
            ...) and the optimizer's hyperparameters (``lr``, ``betas``, ...), the defaults
            of the param groups.

    Raises:
        ValueError: ``accumulation_steps`` is not a positive integer, no trainable
            parameters, or what CPUOffloadOptimizer refuses.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = OptimizerInBackward(model.parameters(), lr=1e-3)
        >>> model(torch.randn(3, 4)).sum().backward()  # updates the weights
        >>> opt.step(); opt.zero_grad()  # (nothing left to do)
    """

    def __init__(self, params: Iterable, accumulation_steps: int = 1, **kwargs: Any) -> None:
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
        self.accumulation_steps = accumulation_steps
        self._options = {k: v for k, v in kwargs.items() if k in OPTIONS}
        self._inner: dict[torch.Tensor, CPUOffloadOptimizer] = {}
        self._group: dict[torch.Tensor, dict] = {}  # (each update reads its group: no search per parameter)
        self._hooks: list = []
        self._task, self._backwards = None, 0
        quiet = _log.level
        _log.setLevel(logging.WARNING)  # (one CPUOffloadOptimizer per parameter: one line for all)
        try:
            super().__init__(params, {k: v for k, v in kwargs.items() if k not in OPTIONS})
        finally:
            _log.setLevel(quiet)
        if not self._inner:
            raise ValueError("OptimizerInBackward got no trainable parameters (requires_grad=True).")
        _log.info("OptimizerInBackward: %d tensors (%s elements), each updated during backward by a "
                  "CPUOffloadOptimizer(%s).", len(self._inner), f"{sum(p.numel() for p in self._inner):,}",
                  ", ".join(f"{k}={v!r}" for k, v in self._options.items()))

    @property
    def optimizers(self) -> types.MappingProxyType:
        """Each parameter's ``CPUOffloadOptimizer`` (a read-only view, as torchtune's
        in-backward wrapper's ``optim_map``): what it holds and moves can be read there."""
        return types.MappingProxyType(self._inner)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, without frozen parameters; each new parameter gets its optimizer and hooks."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        super().add_param_group({**param_group, "params": [p for p in params if p.requires_grad]})
        group = self.param_groups[-1]
        for p in group["params"]:
            self._inner[p], self._group[p] = CPUOffloadOptimizer([p], **self._options, **_hyperparameters(group)), group
            self._hooks.append(p.register_hook(_Hook(self, p, "_before_grad")))  # (before autograd adds it)
            self._hooks.append(p.register_post_accumulate_grad_hook(_Hook(self, p, "_update")))

    # ------------------------------------------------------------------ backward
    @staticmethod
    def _before_grad(p: torch.Tensor) -> None:
        if type(p.grad) is AppliedGrad:  # (spent: autograd must not add the new gradient to it)
            p.grad = None

    def _last_backward(self) -> bool:
        """Whether the backward running now is the last of its accumulation window."""
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task, self._backwards = task, self._backwards + 1
        return self._backwards % self.accumulation_steps == 0

    @torch.no_grad()
    def _update(self, p: torch.Tensor) -> None:
        if not self._last_backward():
            return
        inner = self._inner[p]
        inner.param_groups[0].update(_hyperparameters(self._group[p]))
        grad = p.grad
        norm = (torch._foreach_norm([grad], 2.0)[0] if grad.device.type != "cpu"
                else torch.linalg.vector_norm(grad, 2))  # (what torch's clip takes on each device)
        inner.step()
        inner.zero_grad(set_to_none=True)
        p.grad = AppliedGrad(grad, norm)

    # ------------------------------------------------------------------ the loop's calls
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """The updates ran in backward: runs ``closure`` (whose backward updates), waits for
        updates still writing weights, and returns its loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inner.values():
            inner.finish_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the applied gradients (and any others of these parameters, as torch's)."""
        for p in self._inner:
            if p.grad is not None:
                if set_to_none or type(p.grad) is AppliedGrad:
                    p.grad = None
                else:
                    p.grad.zero_()

    # ------------------------------------------------------------------ state dict
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch's layout over all the parameters, each entry its optimizer's."""
        groups, index = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(index, index + len(g["params"])))})
            index += len(g["params"])
        state = {}
        for i, p in enumerate(self._params()):
            entry = self._inner[p].state_dict()["state"]
            if entry:
                state[i] = entry[0]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (or torch's optimizer over the same
        parameters): every parameter's part is checked before any is loaded.

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: its groups do not match, or a parameter's part is refused (its
                optimizer's message says why); nothing was loaded.
        """
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise TypeError("OptimizerInBackward.load_state_dict takes what state_dict() returned.")
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"the state dict's param groups hold {[len(g['params']) for g in saved]} parameters, "
                f"this optimizer's {[len(g['params']) for g in self.param_groups]}: load it into an "
                "optimizer built over the same parameters. Nothing was loaded.")
        state = state_dict.get("state", {})
        loads = []
        for group, saved_group in zip(self.param_groups, saved):
            hyper = {k: v for k, v in saved_group.items() if k != "params"}
            for p, index in zip(group["params"], saved_group["params"]):
                inner = self._inner[p]
                part = {"state": {0: state[index]} if index in state else {},
                        "param_groups": [{**inner.state_dict()["param_groups"][0], **_hyperparameters(hyper),
                                          "params": [0]}]}
                try:
                    loads.append(inner.checked_load(part))
                except ValueError as err:
                    raise ValueError(f"parameter {index} of the state dict: {err}") from None
        for load in loads:
            load()
        for group, saved_group in zip(self.param_groups, saved):
            group.update({k: v for k, v in saved_group.items() if k != "params"})


def _hyperparameters(group: dict) -> dict:
    """A param group's hyperparameters as a CPUOffloadOptimizer's group takes them."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names", "initial_lr") and k not in OPTIONS}
