"""The ``"compact"`` state format (offload_plugin.formats.registry): ``CompactAdamW``'s state,
which the streamed update keeps in host memory and passes through the GPU, where ``compact_gpu``'s kernel updates it next to the
bf16 weight and gradient the GPU holds.

The host update of the compact state reads and writes about 14 bytes of host memory per
parameter with the host's cores, which bound it (3.9 G parameters/s in Llama-3.1-8B
training on the H200 machine). Streamed, the host keeps 4 bytes per parameter (the int16
remainder that makes the weight an exact fp32 master, and the two 8-bit moments with one
fp32 absmax per 256 elements for each), which cross the bus both ways each step by DMA;
no weight or gradient crosses it, and the host's cores do no arithmetic. The kernel gives
the host update's bits (compact_gpu), so the same state moves between the two.

This module holds what differs from other formats (offload_plugin.engines.streamed queues, orders
and settles them all): the host state's layout in page-locked memory, the units it is cut
into, the staging of each unit, and the kernels. Parameters under
``min_8bit_size`` elements keep fp32 state (fp32 moments), as ``CompactAdamW`` keeps it:
torch's fused AdamW updates their fp32 master (weight plus remainder) on the GPU, as
torch's ``AdamW(fused=True)`` would there (on the host it is torch's CPU kernel, whose bits
may differ in the last place).

The bias corrections come from each parameter's step count, known on the host: the count
of the last step is settled (its inf/NaN verdict read) before the next step is queued,
which the streamed update does anyway. A step skipped for a non-finite gradient writes
nothing, decided on the GPU.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch

from offload_plugin.formats.adam_args import Settings
from offload_plugin.formats.base import HostState, StateFormat, device_refusal
from offload_plugin.formats.compact import native as compact_adam
from offload_plugin.formats.compact.native import BLOCK
from offload_plugin.formats.compact.optimizer import check_live_entry, fp32_update
from offload_plugin.host.buffers import HostSlot

__all__ = ["POOL", "CompactUnit", "Coefficients", "stage_layout", "CompactFormat",
           "FORMAT", "update_", "coefficients_key"]


POOL = "compact"  # the staging ring's pool for compact units (see stage_layout)
_BYTE_ALIGN = 64


@dataclasses.dataclass(eq=False)
class CompactUnit:
    """Elements ``[start, end)`` of one parameter, and their state's host spans (flat):
    ``(remainder or None, exp_avg_absmax, exp_avg_sq_absmax, exp_avg, exp_avg_sq)`` for
    compact state, ``(remainder or None, exp_avg, exp_avg_sq)`` for fp32 (small) state."""

    group: int
    slot: HostSlot
    start: int
    end: int
    fp32: bool  # the fp32 layout (parameters under min_8bit_size), else 8-bit codes
    host: tuple
    param: torch.Tensor  # the device weight's flat view [start, end)
    at: int = 0  # the slot's place among the step's gradients
    stage_views: dict = dataclasses.field(default_factory=dict)
    generation: int = -1

    @property
    def numel(self) -> int:
        return self.end - self.start


def stage_layout(chunk_numel: int) -> list:
    """The staging pair of the compact pool, for units of up to ``chunk_numel`` elements
    (a multiple of BLOCK): int16 remainders, and bytes for the absmax and codes (compact)
    or the fp32 moments (fp32 units, under 4096 elements)."""
    return [(chunk_numel, torch.int16), (2 * chunk_numel + 8 * (chunk_numel // BLOCK), torch.uint8)]


def _stage_need(unit: CompactUnit) -> tuple[int, int]:
    """(remainder elements, bytes) the unit takes in a staging pair, rounded so that the
    next unit's views stay aligned (blocks of 256 elements; 64 bytes)."""
    n = -(-unit.numel // BLOCK) * BLOCK
    nbytes = 8 * unit.numel if unit.fp32 else 2 * n + 8 * (n // BLOCK)
    return n, -(-nbytes // _BYTE_ALIGN) * _BYTE_ALIGN


def _stage_views(unit: CompactUnit, rem: torch.Tensor, raw: torch.Tensor, at: int, at_byte: int) -> tuple:
    """The unit's host spans' twins in a staging pair, from ``at`` (remainder elements)
    and ``at_byte`` (bytes)."""
    n = unit.numel
    remainder = rem[at:at + n] if unit.host[0] is not None else None
    raw = raw[at_byte:]
    if unit.fp32:
        return remainder, raw[:4 * n].view(torch.float32), raw[4 * n:8 * n].view(torch.float32)
    nb = -(-n // BLOCK)
    return (remainder, raw[:4 * nb].view(torch.float32), raw[4 * nb:8 * nb].view(torch.float32),
            raw[8 * nb:8 * nb + n], raw[8 * nb + n:8 * nb + 2 * n])


# ---------------------------------------------------------------------------- coefficients
class Coefficients:
    """The kernel's fp32 scalars (compact_adam._coefficients) of each (group settings, step
    count), made once; a flush's rows go to the device in one copy."""

    def __init__(self) -> None:
        self._rows: dict = {}

    def row(self, group: dict, step: int) -> tuple:
        key = coefficients_key(Settings.adamw(group), step)
        row = self._rows.get(key)
        if row is None:
            if len(self._rows) > 4096:  # (a schedule changes lr every step)
                self._rows.clear()
            row = self._rows[key] = tuple(compact_adam._coefficients(
                *key[:5], step, True, False, None, None).tolist())
        return row


# ---------------------------------------------------------------------------- the format
class CompactFormat(StateFormat):
    """CompactAdamW's state as a state format (offload_plugin.formats.registry)."""

    name = "compact"
    needs = ("init_state", "before_update", "weight_replaced", "check_state_entry", "saved_entry")
    counts_on_host = True  # (the coefficients come from each parameter's count)
    watches_weights = True  # (a written weight restarts its master: its remainder goes)
    takes_grad_scale = False  # (its parameters are bf16, which needs no loss scaling)
    kernel_text = "by the compact kernel"

    def __init__(self) -> None:
        self._host_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # inner -> HostState
        self._coefficients = Coefficients()

    def refuses(self, params, settings: dict, on_cpu: bool) -> Optional[str]:
        if not all(p.dtype == torch.bfloat16 for p in params):
            return "CompactAdamW updates bf16 parameters"
        return device_refusal(params[0].device, on_cpu)

    def state_bytes(self, param: torch.Tensor) -> int:
        return 4  # (remainder 2, codes 1 + 1, the block scales 8 per 256)

    def entries(self, inner, slots: list, group_of: list, pin: bool) -> list[dict]:
        """As the format's, with every entry the user may have edited checked as
        CompactAdamW.step checks it, all before any changes (issue 55: an entry edited by hand
        to another shape or dtype reached the kernel's raw pointers unchecked)."""
        groups = [inner.param_groups[g] for g in group_of]
        for slot, group in zip(slots, groups):
            if inner.state.get(slot.master):
                check_live_entry(slot.master, inner.state[slot.master], group)
        host = self._host_states.get(inner)
        if host is None:
            host = self._host_states[inner] = HostState(pin=pin)
        return host.ensure(inner, slots, groups)

    def cut(self, slots: list, entries: list, group_of: list, chunk_numel: int) -> list[CompactUnit]:
        """One unit per parameter, or per range of a larger one: ``chunk_numel`` elements in
        the compact layout (rounded up to whole blocks, so that every unit's blocks are whole
        blocks of the parameter), a quarter of that in the fp32 layout. Empty parameters have
        none (their counts go on, as CompactAdamW's)."""
        units = []
        for at, (slot, entry, group) in enumerate(zip(slots, entries, group_of)):
            n = slot.param.numel()
            fp32 = "exp_avg_absmax" not in entry
            remainder = entry.get("remainder")
            flat = [None if remainder is None else remainder.view(-1)]
            if fp32:
                flat += [entry["exp_avg"].view(-1), entry["exp_avg_sq"].view(-1)]
            else:
                flat += [entry[k].view(-1) for k in ("exp_avg_absmax", "exp_avg_sq_absmax", "exp_avg", "exp_avg_sq")]
            param = slot.param.detach().view(-1)
            # (fp32 state takes 8 bytes an element where a staging pair holds about 2 per
            # element of chunk_numel: a quarter as many elements a range)
            step = max(chunk_numel // 4, 1) if fp32 else -(-chunk_numel // BLOCK) * BLOCK
            for a in range(0, n, step):
                b = min(n, a + step)
                if fp32:
                    host = tuple(None if t is None else t[a:b] for t in flat)
                else:
                    a_blk, b_blk = a // BLOCK, -(-b // BLOCK)
                    host = (None if flat[0] is None else flat[0][a:b], flat[1][a_blk:b_blk],
                            flat[2][a_blk:b_blk], flat[3][a:b], flat[4][a:b])
                units.append(CompactUnit(group, slot, a, b, fp32, host, param[a:b], at))
        return units

    def reserve(self, ring, unit: CompactUnit) -> None:
        need, _ = _stage_need(unit)
        ring.reserve(POOL, 4 * need if unit.fp32 else need, layout=stage_layout)

    def stage_size(self, unit: CompactUnit) -> tuple:
        return (POOL, *_stage_need(unit))

    def staged_views(self, unit: CompactUnit, ring, index: int, at: int, at_byte: int) -> tuple:
        if unit.generation != ring.generation:
            unit.stage_views, unit.generation = {}, ring.generation
        views = unit.stage_views.get((index, at, at_byte))
        if views is None:
            rem, raw = ring.buffers(POOL, index)
            views = unit.stage_views[(index, at, at_byte)] = _stage_views(unit, rem, raw, at, at_byte)
        return views

    def host_views(self, unit: CompactUnit) -> tuple:
        return unit.host

    def stage_in(self, unit: CompactUnit, views: tuple) -> None:
        for host, staged in zip(unit.host, views):
            if host is not None:
                staged.copy_(host, non_blocking=True)

    def stage_out(self, unit: CompactUnit, views: tuple) -> None:
        for host, staged in zip(unit.host, views):
            if host is not None:
                host.copy_(staged, non_blocking=True)

    def step_args(self, inner, slots: list, units: list, groups: list, counts: list, amp_scale) -> list:
        for slot in slots:  # (a remainder loaded with its weight's digest: checked now)
            inner.before_update(slot.master, slot.param)
        made, args = {}, []
        for unit in units:  # (a row per group and count: the units of a step share them)
            key = (unit.group, int(counts[unit.slot.order]) + 1)
            if not unit.fp32 and key not in made:
                made[key] = self._coefficients.row(groups[key[0]], key[1])
            args.append((None if unit.fp32 else made[key], Settings.adamw(groups[unit.group])))
        return args

    def to_device(self, args: list, ring) -> list:
        """The rows in one copy: each distinct row -> its tensor on the device."""
        rows = list(dict.fromkeys(row for row, _ in args if row is not None))
        if not rows:
            return args
        host = torch.tensor(rows, dtype=torch.float32, pin_memory=ring.is_async)
        table = dict(zip(rows, (host.to(ring.device, non_blocking=True) if ring.is_async else host).unbind()))
        return [(None if row is None else table[row], settings) for row, settings in args]

    def update(self, unit: CompactUnit, views: tuple, grads: list, steps: list, found: torch.Tensor,
               args) -> None:
        """Compact state by compact_gpu's kernel (the native CPU kernel in tests), fp32
        state by torch's fused AdamW on the fp32 master (weight plus remainder)."""
        coeffs, settings = args
        grad = grads[unit.at].view(-1)[unit.start:unit.end]
        if unit.fp32:
            remainder, exp_avg, exp_avg_sq = views
            fp32_update(unit.param, remainder, grad, exp_avg, exp_avg_sq, steps[unit.at], settings,
                         found_inf=found)
            return
        remainder, m_absmax, v_absmax, m_codes, v_codes = views
        update_(unit.param, remainder, grad, m_codes, m_absmax, v_codes, v_absmax, coeffs, found)

    def weights_written(self, inner, slots: list) -> None:
        for slot in slots:
            inner.weight_replaced(slot.master, slot.param)


FORMAT = CompactFormat()


def coefficients_key(settings: Settings, step: int) -> tuple:
    """The compact kernel's inputs at ``step`` (AdamW's decay, never maximize), as floats:
    a key for a table of its coefficients."""
    return (float(settings.lr), settings.beta1, settings.beta2, float(settings.weight_decay), float(settings.eps), step)


_gpu_maps: dict = {}


def update_(weight: torch.Tensor, remainder: Optional[torch.Tensor], grad: torch.Tensor,
            exp_avg: torch.Tensor, exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor,
            exp_avg_sq_absmax: torch.Tensor, coeffs: torch.Tensor, found: torch.Tensor) -> None:
    """The compact update on flat tensors of one device (bf16 weight and gradient, int16 remainder or
    None, uint8 codes, fp32 block absmax), with ``coeffs`` (:func:`coefficients_key`) and
    the step's verdict ``found``: nonzero writes nothing. On CUDA queued on the current
    stream (never waits); on the host by the native kernel."""
    if weight.device.type == "cuda":
        from offload_plugin.formats.compact import gpu as compact_gpu  # (needs Triton: imported on a GPU only)
        maps = _gpu_maps.get(weight.device)
        if maps is None:
            maps = _gpu_maps[weight.device] = compact_gpu.GpuMaps(weight.device)
        compact_gpu.update_(weight, remainder, grad, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax,
                            coeffs, found, maps)
        return
    if not float(found):
        state = compact_adam.CompactAdamState(weight, remainder, exp_avg, exp_avg_absmax, exp_avg_sq,
                                              exp_avg_sq_absmax)
        compact_adam.update_(state, grad, coeffs, adamw=True)
