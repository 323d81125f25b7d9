"""The state format of ``AdamW8bit`` (offload_plugin.formats.registry): bitsandbytes' 8-bit
state, kept in host memory and updated on the GPU as it passes through.

Per parameter the host keeps two uint8 codes and, per 256 elements, two fp32 block scales:
about 2 bytes per parameter, which cross the bus each way each step by DMA (half of what
the default's bf16 moments need); the weight and the gradient stay on the GPU and the
host's cores do no arithmetic. ``adamw8bit_gpu``'s kernels give the host update's bits
(offload_plugin.formats.adamw8bit.optimizer), so the same state moves between the two. Parameters under
``min_8bit_size`` elements keep fp32 moments (8 bytes) and take bitsandbytes' 32-bit update.

The optimizer names this module as its ``state_format``; nothing else in the package knows
of it. The units, their staging and the host state's page-locked blocks are as the compact
format's (offload_plugin.formats.compact.streamed, whose ``HostState`` this reuses), without a
remainder. The bias corrections come from each parameter's step count on the host
(``counts_on_host``); a step skipped for a non-finite gradient writes nothing, decided on
the GPU.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch

from offload_plugin.formats.adamw8bit import optimizer as adamw8bit
from offload_plugin.formats.adamw8bit.update import BLOCK
from offload_plugin.formats.base import HostState, StateFormat, device_refusal
from offload_plugin.host.buffers import HostSlot

__all__ = ["POOL", "Unit", "stage_layout", "AdamW8bitFormat", "FORMAT"]

POOL = "adamw8bit"  # the staging ring's pool for these units
_BYTE_ALIGN = 64


@dataclasses.dataclass(eq=False)
class Unit:
    """Elements ``[start, end)`` of one parameter and their host state, flat: ``(absmax1,
    absmax2, state1, state2)`` in 8 bits, ``(state1, state2)`` in fp32."""

    group: int
    slot: HostSlot
    start: int
    end: int
    eight_bit: bool
    host: tuple
    param: torch.Tensor  # the device weight's flat view [start, end)
    at: int = 0  # the slot's place among the step's gradients
    stage_views: dict = dataclasses.field(default_factory=dict)  # (pair, byte) -> (views, copies)
    generation: int = -1

    @property
    def numel(self) -> int:
        return self.end - self.start


def stage_layout(chunk_numel: int) -> list:
    """A staging pair of this pool for units of up to ``chunk_numel`` elements: bytes for
    the codes and the block scales (the first buffer is a placeholder: no unit has state of
    the parameter's own width)."""
    return [(1, torch.uint8), (2 * chunk_numel + 8 * (chunk_numel // BLOCK), torch.uint8)]


def _stage_need(unit: Unit) -> tuple[int, int]:
    """(elements, bytes) the unit takes in a staging pair, rounded so that the next unit's
    views stay aligned."""
    n = -(-unit.numel // BLOCK) * BLOCK
    nbytes = 2 * n + 8 * (n // BLOCK) if unit.eight_bit else 8 * unit.numel
    return n, -(-nbytes // _BYTE_ALIGN) * _BYTE_ALIGN


def _copies(staged: tuple, host: tuple) -> tuple:
    """(staged, host) pairs to copy, a pair whose views follow the last one's in both memories
    joined to it: a unit of a whole parameter has its two scales and its two codes side by
    side on the host (HostState carves them in turn), so it takes two copies each way, not
    four (each costs the autograd thread some microseconds inside a backward)."""
    out: list = []
    for s, h in zip(staged, host):
        if out and _follows(out[-1][0], s) and _follows(out[-1][1], h):
            out[-1] = (_joined(out[-1][0], s), _joined(out[-1][1], h))
        else:
            out.append((s, h))
    return tuple(out)


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())


def _joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(0).set_(a.untyped_storage(), a.storage_offset(), (a.numel() + b.numel(),))


def _stage_views(unit: Unit, raw: torch.Tensor, at_byte: int) -> tuple:
    n, raw = unit.numel, raw[at_byte:]
    if not unit.eight_bit:
        return raw[:4 * n].view(torch.float32), raw[4 * n:8 * n].view(torch.float32)
    nb = -(-n // BLOCK)
    return (raw[:4 * nb].view(torch.float32), raw[4 * nb:8 * nb].view(torch.float32),
            raw[8 * nb:8 * nb + n], raw[8 * nb + n:8 * nb + 2 * n])


class AdamW8bitFormat(StateFormat):
    """AdamW8bit's state as a state format."""

    name = "adamw8bit"
    needs = ("init_state", "check_state_entry", "saved_entry")
    counts_on_host = True  # (the coefficients come from each parameter's count)
    takes_grad_scale = False  # (bf16 parameters need no loss scaling)
    kernel_text = "by bitsandbytes' 8-bit AdamW update"
    stage_scale = 4  # (about 2 bytes an element against the default's 4: units of 32 M elements, 65 MiB)

    def __init__(self) -> None:
        self._host_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # inner -> HostState
        self._maps: dict = {}  # device -> adamw8bit_gpu.GpuMaps

    def refuses(self, params, settings: dict, on_cpu: bool) -> Optional[str]:
        if not all(p.dtype == torch.bfloat16 for p in params):
            return "AdamW8bit updates bf16 parameters"
        return device_refusal(params[0].device, on_cpu)

    def state_bytes(self, param: torch.Tensor) -> int:
        return 2 if param.numel() >= adamw8bit.MIN_8BIT_SIZE else 8  # (and 8 bytes per 256 elements)

    def entries(self, inner, slots: list, group_of: list, pin: bool) -> list[dict]:
        """As the format's, with every entry the user may have edited (a plan is made anew
        when one was) checked as AdamW8bit.step checks it, all before any changes."""
        groups = [inner.param_groups[g] for g in group_of]
        held = [(s.master, inner.state[s.master], g) for s, g in zip(slots, groups) if inner.state.get(s.master)]
        for p, entry, group in held:
            adamw8bit.check_live_entry(p, entry, group)
        for p, _, group in held:
            inner.init_state(p, group)  # (a Python-int count made the fp32 tensor the update counts in)
        host = self._host_states.get(inner)
        if host is None:
            host = self._host_states[inner] = HostState(pin=pin)
        return host.ensure(inner, slots, groups)

    def cut(self, slots: list, entries: list, group_of: list, chunk_numel: int) -> list[Unit]:
        """One unit per parameter, or per range of a larger one: ``chunk_numel`` elements
        (whole blocks) in 8 bits, a quarter of that in fp32 (8 bytes an element: a staging
        pair holds 2 bytes per element of ``chunk_numel``). Empty parameters have none (their
        counts go on)."""
        units = []
        for at, (slot, entry, group) in enumerate(zip(slots, entries, group_of)):
            n = slot.param.numel()
            eight = entry["state1"].dtype == torch.uint8
            flat = [entry[k].view(-1) for k in (("absmax1", "absmax2", "state1", "state2") if eight
                                                else ("state1", "state2"))]
            param = slot.param.detach().view(-1)
            step = -(-chunk_numel // BLOCK) * BLOCK if eight else max(chunk_numel // 4, 1)  # (whole blocks)
            for a in range(0, n, step):
                b = min(n, a + step)
                if eight:
                    ka, kb = a // BLOCK, -(-b // BLOCK)
                    host = (flat[0][ka:kb], flat[1][ka:kb], flat[2][a:b], flat[3][a:b])
                else:
                    host = (flat[0][a:b], flat[1][a:b])
                units.append(Unit(group, slot, a, b, eight, host, param[a:b], at))
        return units

    def reserve(self, ring, unit: Unit) -> None:
        need, _ = _stage_need(unit)
        ring.reserve(POOL, need if unit.eight_bit else 4 * unit.numel, layout=stage_layout)

    def stage_size(self, unit: Unit) -> tuple:
        return (POOL, *_stage_need(unit))

    def staged_views(self, unit: Unit, ring, index: int, at: int, at_byte: int) -> tuple:
        if unit.generation != ring.generation:
            unit.stage_views, unit.generation = {}, ring.generation
        views = unit.stage_views.get((index, at_byte))
        if views is None:
            staged = _stage_views(unit, ring.buffers(POOL, index)[1], at_byte)
            views = unit.stage_views[(index, at_byte)] = (staged, _copies(staged, unit.host))
        return views

    def host_views(self, unit: Unit) -> tuple:
        return unit.host, ()

    def stage_in(self, unit: Unit, views: tuple) -> None:
        for staged, host in views[1]:
            staged.copy_(host, non_blocking=True)

    def stage_out(self, unit: Unit, views: tuple) -> None:
        for staged, host in views[1]:
            host.copy_(staged, non_blocking=True)

    def step_args(self, inner, slots: list, units: list, groups: list, counts: list, amp_scale) -> list:
        made = {}
        for unit in units:  # (a row per group and count: the units of a step share them)
            key = (unit.group, int(counts[unit.slot.order]) + 1)
            if key not in made:
                made[key] = adamw8bit.coefficients(groups[key[0]], key[1])
        return [made[(u.group, int(counts[u.slot.order]) + 1)] for u in units]

    def to_device(self, args: list, ring) -> list:
        """Each distinct row as a device tensor, all in one copy: (row, its tensor)."""
        rows = list(dict.fromkeys(args))
        if not rows or not ring.is_async:
            return [(row, None) for row in args]
        host = torch.tensor(rows, dtype=torch.float32, pin_memory=True)
        table = dict(zip(rows, host.to(ring.device, non_blocking=True).unbind()))
        return [(row, table[row]) for row in args]

    def update(self, unit: Unit, views: tuple, grads: list, steps: list, found: torch.Tensor, args) -> None:
        row, on_device = args
        views = views[0]
        grad = grads[unit.at].view(-1)[unit.start:unit.end]
        numel = unit.slot.param.numel()  # (where the unit lies: stochastic rounding's place)
        if on_device is None:  # (tests on the CPU: the host update on the host state in place)
            if not float(found):
                if unit.eight_bit:
                    adamw8bit.update_8bit_(unit.param, grad, views[2], views[0], views[3], views[1], row,
                                           unit.start, numel)
                else:
                    adamw8bit.update_32bit_(unit.param, grad, *views, row, unit.start, numel)
            return
        from offload_plugin.formats.adamw8bit import gpu as adamw8bit_gpu  # (Triton: where the GPU is)

        maps = self._maps.get(unit.param.device)
        if maps is None:
            maps = self._maps[unit.param.device] = adamw8bit_gpu.GpuMaps(unit.param.device)
        place = dict(start=unit.start, numel=numel, seed=int(row[11]))
        if unit.eight_bit:
            absmax1, absmax2, state1, state2 = views
            adamw8bit_gpu.update_8bit_(unit.param, grad, state1, absmax1, state2, absmax2, on_device, found, maps,
                                       **place)
        else:
            adamw8bit_gpu.update_32bit_(unit.param, grad, *views, on_device, found, **place)


FORMAT = AdamW8bitFormat()
