"""The ``"adamw"`` state format: torch's Adam(W) state, two moments in the dtype of the
tensor the update writes (see offload_plugin.formats.registry).

Without master weights that tensor is the parameter, and the streamed update moves the two
moments through the GPU (4 bytes per bf16 parameter each way), where torch's fused kernel
updates them with the weight the GPU holds: bit for bit torch's ``AdamW(fused=True)`` there.
With fp32 masters (``MASTERS``) the moments are fp32 beside an fp32 master, and the update
stays on the host (offload_plugin.host.inner_step), whose kernels give the same bits.

Units: neighbours in one group and dtype whose moments follow each other in host memory
share one, up to a quarter of a staging buffer (so that even a step over small adapters has
several units, whose copies in and out overlap); a parameter of ``chunk_numel`` or more is
cut into ranges of that size. A unit's moments travel in a pair of staging buffers of the
parameters' dtype (the ring's pool of that dtype).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch.optim import Optimizer

from offload_plugin.formats.adamw import kernels as adamw
from offload_plugin.formats.base import StateFormat
from offload_plugin.host.buffers import HostSlot, back_to_back

__all__ = ["Moments", "FORMAT", "MASTERS", "adam_state"]

_KEYS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(eq=False)
class _Unit:
    """Parameters (or a range of one) whose moments lie back to back in host memory and
    pass through one staging buffer: ``items`` are ``(slot, start, end)`` element ranges."""

    group: int
    items: list
    numel: int
    exp_avg: torch.Tensor  # the host spans the moments come from and go back to
    exp_avg_sq: torch.Tensor
    params: list  # the device tensors the kernel updates (views for a range)
    at: list = dataclasses.field(default_factory=list)  # each item's place among the step's gradients
    stage_views: dict = dataclasses.field(default_factory=dict)  # (buffer index, offset) -> (ms, vs)
    generation: int = -1  # of the ring whose buffers stage_views cut


class Moments(StateFormat):
    """Adam(W)'s moments in the updated tensor's dtype; ``master``: beside an fp32 master."""

    name = "adamw"
    kernel_text = "as torch's fused AdamW"

    def __init__(self, master: bool = False) -> None:
        self.master = master

    def refuses(self, params: Sequence[torch.Tensor], settings: dict, on_cpu: bool) -> Optional[str]:
        if self.master:
            return "fp32 masters are updated on the host"
        if (not settings.get("fused") or settings.get("amsgrad") or settings.get("capturable")
                or settings.get("differentiable")):
            return "only torch's fused AdamW without amsgrad runs on the GPU this way"
        if not all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params):
            return "parameters of another dtype than fp32, bf16 or fp16"
        return None

    def leaves(self, inner, index: int, group: dict) -> Optional[str]:
        # ``fused`` set to False (or None) between steps makes torch's AdamW go on with its
        # for-loop, other bits; amsgrad=True loaded with its state (a state dict of torch's
        # AdamW(amsgrad=True)) makes it go on with amsgrad, which this kernel call has not.
        # (A state dict of torch's AdamW built without fused=True loads fused=None. amsgrad
        # switched on by hand over state without max_exp_avg_sq stays: step() refuses it, as
        # torch does.)
        if not group.get("fused"):
            return f"['fused'] is {group.get('fused')!r}, so torch's AdamW would go on with its for-loop"
        state = inner.state
        if group.get("amsgrad") and all("max_exp_avg_sq" in state[m]
                                        for m in inner.param_groups[index]["params"] if state.get(m)):
            return "['amsgrad'] is True with its state, so torch's AdamW would go on with amsgrad"
        return None

    def state_bytes(self, param: torch.Tensor) -> int:
        if self.master:
            return 3 * 4  # (the master and two moments, fp32)
        return 2 * param.element_size()

    def entries(self, inner, slots: list, group_of: list, pin: bool) -> list[dict]:
        # (the state torch's fused AdamW creates at a parameter's first step, in the moments
        # set aside for the slot, page-locked where the engine asked: allocate_moments)
        return [adam_state(inner, slot, False) for slot in slots]

    def hold(self, entries: list) -> list:
        return [[(k, e[k]) for k in _KEYS] for e in entries]

    def cut(self, slots: list[HostSlot], entries: list, group_of: list, chunk_numel: int) -> list[_Unit]:
        pack_numel = max(1, chunk_numel // 4)
        units: list[_Unit] = []
        run: list[int] = []  # indices into slots

        def close_run() -> None:
            if run:
                units.append(_unit(group_of[run[0]], [(i, slots[i], 0, slots[i].param.numel()) for i in run],
                                   entries))
                run.clear()

        for i, slot in enumerate(slots):
            n = slot.param.numel()
            if n >= chunk_numel:
                close_run()
                for a in range(0, n, chunk_numel):
                    units.append(_unit(group_of[i], [(i, slot, a, min(n, a + chunk_numel))], entries))
                continue
            if run:
                last = run[-1]
                together = (group_of[last] == group_of[i]
                            and slots[last].param.dtype == slot.param.dtype
                            and sum(slots[k].param.numel() for k in run) + n <= pack_numel
                            and all(back_to_back([entries[last][k], entries[i][k]]) is not None for k in _KEYS))
                if not together:
                    close_run()
            run.append(i)
        close_run()
        return units

    def reserve(self, ring, unit: _Unit) -> None:
        ring.reserve(unit.exp_avg.dtype, unit.numel)

    def stage_size(self, unit: _Unit) -> tuple:
        return unit.exp_avg.dtype, unit.numel, 0

    def staged_views(self, unit: _Unit, ring, index: int, at: int, at_byte: int) -> tuple:
        if unit.generation != ring.generation:
            unit.stage_views, unit.generation = {}, ring.generation
        views = unit.stage_views.get((index, at))
        if views is None:
            m_stage, v_stage = ring.buffers(unit.exp_avg.dtype, index)
            views = unit.stage_views[(index, at)] = (m_stage[at:at + unit.numel], v_stage[at:at + unit.numel],
                                                     _item_views(unit, m_stage[at:at + unit.numel]),
                                                     _item_views(unit, v_stage[at:at + unit.numel]))
        return views

    def host_views(self, unit: _Unit) -> tuple:
        return None, None, _item_views(unit, unit.exp_avg), _item_views(unit, unit.exp_avg_sq)

    def stage_in(self, unit: _Unit, views: tuple) -> None:
        views[0].copy_(unit.exp_avg, non_blocking=True)
        views[1].copy_(unit.exp_avg_sq, non_blocking=True)

    def stage_out(self, unit: _Unit, views: tuple) -> None:
        unit.exp_avg.copy_(views[0], non_blocking=True)
        unit.exp_avg_sq.copy_(views[1], non_blocking=True)

    def step_args(self, inner, slots: list, units: list, groups: list, counts: list, amp_scale) -> list:
        # torch.amp.GradScaler's scale, handed over instead of unscaling the gradients: the
        # kernel divides by it, as torch's fused AdamW's does.
        decoupled = isinstance(inner, torch.optim.AdamW)
        settings = [adamw.Settings.of(g, decoupled) for g in groups]
        return [(settings[unit.group], amp_scale) for unit in units]

    def update(self, unit: _Unit, views: tuple, grads: list, steps: list, found: torch.Tensor, args) -> None:
        settings, amp_scale = args
        gs = []
        for i, (_, a, b) in zip(unit.at, unit.items):
            g = grads[i]
            gs.append(g if a == 0 and b == g.numel() else g.view(-1)[a:b])
        lr = settings.lr
        if isinstance(lr, torch.Tensor):
            lr = lr.to(unit.params[0].device)
        adamw.fused(unit.params, gs, views[2], views[3], [steps[i] for i in unit.at], settings,
                    lr=lr, grad_scale=amp_scale, found_inf=found)


def adam_state(optimizer: Optimizer, slot: HostSlot, amsgrad: bool) -> dict:
    """The state torch's fused Adam would create for ``slot.master`` (same keys, dtypes,
    shapes), or the existing state, checked before anything of it changes."""
    master = slot.master
    state = optimizer.state[master]
    if state:
        _check_adam_state(state, master, amsgrad)
    else:
        state["step"] = torch.zeros((), dtype=torch.float32)
        if slot.moments is not None:  # host memory set aside for them (huge pages)
            state["exp_avg"], state["exp_avg_sq"] = (m.zero_() for m in slot.moments)
        else:
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(
                master, memory_format=torch.preserve_format
            )
    return state


def _check_adam_state(state: dict, master: torch.Tensor, amsgrad: bool) -> None:
    """A slot's existing state, as the fused kernels need it. ``optimizer.state[p]`` is the
    user's to replace (torch's optimizers allow it), and the kernels walk raw pointers: a
    moment of another size read and wrote past its end (heap corruption). Checked before
    the step count advances, so a refused entry leaves everything as it was."""
    where = f"optimizer.state[p] of a parameter of shape {tuple(master.shape)}"
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    missing = [key for key in ("step",) + keys if key not in state]
    if missing:
        why = (" amsgrad=True was set after this parameter's first step (torch's AdamW cannot "
               "switch it on then either): set amsgrad when building the optimizer, or "
               "`del optimizer.state[p]` to restart its state." if missing == ["max_exp_avg_sq"]
               else " Put back the full entry, or `del optimizer.state[p]` to restart its state.")
        raise ValueError(f"{where} lacks {missing}.{why}")
    step = state["step"]
    if not (isinstance(step, torch.Tensor) and step.numel() == 1 and step.is_floating_point()):
        raise ValueError(
            f"{where}: 'step' is {step!r:.40}; it must be a one-element floating-point tensor "
            "(e.g. torch.tensor(1.0)), as torch's fused AdamW keeps it."
        )
    for key in keys:
        value = state[key]
        if not (isinstance(value, torch.Tensor) and value.shape == master.shape
                and value.dtype == master.dtype and value.device == master.device):
            what = (f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
                    if isinstance(value, torch.Tensor) else type(value).__name__)
            raise ValueError(
                f"{where}: {key!r} is {what}; it must be a {master.dtype} tensor of the "
                f"parameter's shape in host memory (cpu). Assign one of that shape and dtype, "
                "or `del optimizer.state[p]` to restart its state."
            )
        if not value.is_contiguous():
            # The kernels view state as flat vectors: a contiguous copy of the same values
            # (torch's loop AdamW reads them as such; load_state_dict copies likewise).
            state[key] = value.contiguous()


def _unit(group: int, placed: list, entries: list) -> _Unit:
    """A unit of ``placed`` ``(place in the step, slot, start, end)``."""
    def span(key: str) -> torch.Tensor:
        parts = [entries[i][key].view(-1)[a:b] for i, _, a, b in placed]
        return parts[0] if len(parts) == 1 else back_to_back(parts)

    items = [(s, a, b) for _, s, a, b in placed]
    params = [s.param.detach() if (a, b) == (0, s.param.numel()) else s.param.detach().view(-1)[a:b]
              for s, a, b in items]
    return _Unit(group, items, sum(b - a for _, a, b in items), span("exp_avg"), span("exp_avg_sq"),
                 params, at=[i for i, *_ in placed])


def _item_views(unit: _Unit, flat: torch.Tensor) -> list[torch.Tensor]:
    """``flat`` cut into one tensor per item, shaped like what the kernel pairs it with."""
    views, at = [], 0
    for (_, a, b), param in zip(unit.items, unit.params):
        views.append(flat[at:at + b - a].view(param.shape))
        at += b - a
    return views


FORMAT = Moments()
MASTERS = Moments(master=True)
