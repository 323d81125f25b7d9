"""An offloaded gradient as ``param.grad``: a handle whose operations run on the host copy.

With ``offload_gradients=True`` each gradient leaves the device during backward. Leaving
``.grad`` as ``None`` then would hide it from everything that follows torch's conventions:
``model.zero_grad()`` (Hugging Face's ``Trainer`` clears with it alone) would not clear it,
and ``clip_grad_norm_(model.parameters())`` would find no gradient (norm 0.0, nothing
clipped): silently not torch's result. So ``.grad`` becomes an :class:`OffloadedGrad`: a
tensor with the gradient's shape, dtype and device but no device memory, whose operations
(``zero_``, ``mul_``, norms, GradScaler's unscale, reading it) run on the host copy.

What the model's ``.grad`` says is the truth, as in torch. The engine reads it before each
backward adds a gradient and at each step (``HostEngine.follow_grad``): still this handle,
the host gradient stands and the next backward adds to it; ``None`` (``model.zero_grad()``,
``p.grad = None``), the host gradient is gone; another tensor (``p.grad = g``), that tensor
is the gradient. DTensor (FSDP2) parameters get no handle: a DTensor's ``.grad`` must be
one, so theirs stays ``None`` after offloading, as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload_plugin.host.scaling import multiplier

__all__ = ["OffloadedGrad", "is_handle_of", "is_unit_factor", "is_whole_2_norm"]

aten = torch.ops.aten
_ALIASES = (aten.detach.default, aten.alias.default)  # .data, .detach(): the same gradient


class OffloadedGrad(torch.Tensor):
    """``param.grad`` of an offloaded gradient (see the module docstring).

    ``engine`` (held weakly) gives the host gradient (``host_grad(slot, writes)``: it
    waits for the slot's copies, and for anything still reading the gradient before a
    write) and its 2-norm as torch's clip would take it on the device
    (``device_norm(slot)``).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, param: torch.Tensor, slot: Any, engine: Any):
        return torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False)

    def __init__(self, param: torch.Tensor, slot: Any, engine: Any) -> None:
        # Weak: the parameter holds its .grad, and the engine holds the parameter.
        self._slot, self._engine = weakref.ref(slot), weakref.ref(engine)

    def _owner(self) -> tuple[Any, Any]:
        slot, engine = self._slot(), self._engine()
        if slot is None or engine is None:
            raise RuntimeError(
                "this .grad is a gradient offloaded by a CPUOffloadOptimizer that no longer "
                "exists: clear it (model.zero_grad()) before the next backward.")
        return slot, engine

    def host(self, writes: bool = False) -> torch.Tensor:
        """The host gradient this handle stands for (complete)."""
        slot, engine = self._owner()
        return engine.host_grad(slot, writes)

    def __imul__(self, other: Any) -> "OffloadedGrad":
        # torchtune's scale_grads (`p.grad *= factor`): on a GPU the kernel reads a 0-dim
        # device factor in the gradient's dtype (scaling.multiplier). torch's clip
        # multiplies real gradients with a foreach kernel, which reads it in fp32: that
        # is what mul_ below does.
        if isinstance(other, torch.Tensor) and other.dim() == 0 and other.device.type != "cpu":
            other = torch.tensor(multiplier(other, self.dtype, on_accelerator=True))
        return self.mul_(other)

    def __repr__(self) -> str:
        return (f"OffloadedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}: in host memory)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES:
            slot, engine = args[0]._owner()
            return cls(args[0], slot, engine)
        if func is aten.linalg_vector_norm.default and is_whole_2_norm(args, kwargs):
            slot, engine = args[0]._owner()
            norm = engine.device_norm(slot)
            if norm is not None:  # torch's clip would have taken this one, on the device
                return norm
        if func in (aten.mul_.Tensor, aten.mul_.Scalar) and is_unit_factor(args[1]):
            # clip_grad_norm_ multiplies by its clamped coefficient even when it is 1.0 (HF
            # logs the norm through a clip at inf): x * 1.0 is x, without a pass over host memory.
            return args[0]
        flat, spec = tree_flatten((args, kwargs))
        written = _written(func, args, kwargs)
        handles = [x for x in flat if isinstance(x, OffloadedGrad)]
        device = handles[0].device
        # Every operand on the host: the handles as their host gradients, device tensors
        # as copies (written back below if the operation writes them).
        host_flat, host_of = [], {}
        for x in flat:
            if isinstance(x, OffloadedGrad):
                host = x.host(writes=id(x) in written)
                host_of[id(host)] = x
                host_flat.append(host)
            elif isinstance(x, torch.Tensor) and x.device.type != "cpu":
                host_flat.append(x.cpu())
            else:
                host_flat.append(x)
        host_args, host_kwargs = tree_unflatten(host_flat, spec)
        out = func(*host_args, **host_kwargs)
        for original, host in zip(flat, host_flat):
            if (isinstance(original, torch.Tensor) and not isinstance(original, OffloadedGrad)
                    and id(original) in written and host is not original):
                original.copy_(host)  # (e.g. GradScaler's found_inf, on the device)
        out_flat, out_spec = tree_flatten(out)
        # A result that is a handle's host gradient (an in-place op returns its input) is
        # that handle; anything else computed goes to where the gradient lives.
        out_flat = [host_of.get(id(o), o.to(device) if isinstance(o, torch.Tensor)
                                and id(o) not in host_of else o) for o in out_flat]
        return tree_unflatten(out_flat, out_spec)


def _written(func, args, kwargs) -> set[int]:
    """Ids of the tensors ``func`` writes (its schema's mutable arguments)."""
    written: set[int] = set()
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(t, torch.Tensor):
                written.add(id(t))
    return written


def is_unit_factor(factor: Any) -> bool:
    """Whether a multiplier is exactly 1 (a number or a 0-dim tensor)."""
    if isinstance(factor, torch.Tensor):
        return factor.dim() == 0 and type(factor) is torch.Tensor and bool(factor == 1)
    return isinstance(factor, (int, float)) and factor == 1


def is_whole_2_norm(args, kwargs) -> bool:
    """linalg_vector_norm(handle) as clip_grad_norm_ asks it: the 2-norm of all of it."""
    bound = dict(zip(("x", "ord", "dim", "keepdim"), args), **kwargs)
    return (float(bound.get("ord", 2)) == 2.0 and bound.get("dim") is None
            and not bound.get("keepdim", False) and bound.get("dtype") is None)


def is_handle_of(grad: Any, slot: Any) -> bool:
    """Whether ``grad`` is the handle of ``slot``'s offloaded gradient."""
    return type(grad) is OffloadedGrad and grad._slot() is slot
