"""The streamed update: Adam's state lives in host memory and passes through the GPU for
the update, which torch's own fused CUDA kernel makes there.

The host update reads and writes about 14 bytes of host memory per bf16 parameter (the
gradient in, the weight and two moments read and written) and takes the host's cores; on
the H200 machine it runs at 5-6 G parameters/s, close to the host's memory bandwidth. When
the gradients are on the GPU anyway (no ``offload_gradients``) and the weights need no
fp32 master, the state can travel instead: the two moments come over (4 bytes per bf16
parameter), ``torch._fused_adamw_`` updates weight and moments on the GPU, and the moments
go back (4 bytes), the copies in both directions at once and overlapping the kernels. The
host's memory then moves 8 bytes per parameter by DMA and its cores do nothing; no
gradient or weight crosses the bus, so nothing the recipe does to the weights between steps
can be overwritten (the parameter is the truth). The result is bit for bit torch's
``AdamW(fused=True)`` on the GPU, the optimizer the user would otherwise run there.

Everything is queued on two side streams (moments in plus the kernels; moments out) and
ordered by events: ``step()`` never waits for the GPU. Device memory holds only a small
ring of staging buffers shared by all optimizers of a process (torchtune's
``optimizer_in_bwd`` builds one per parameter), plus the step counts. The step counts and
the inf/NaN verdict live on the device; the host copies of the counts are brought up to
date (and a skipped step reported) when the state is read, at the next step, or by
:meth:`StreamedUpdate.settle`.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from typing import Optional

import torch

from offload_plugin.host_buffers import HostSlot, back_to_back
from offload_plugin.gradients import check_dense
from offload_plugin.host_update import _adam_state

__all__ = ["eligible", "StagingRing", "StreamedUpdate"]

# Elements per staging buffer: a copy of 16 MiB (bf16) takes ~0.3 ms at the H200 machine's
# 55 GB/s each way, far above a copy's fixed cost, and the ring (RING_SIZE buffers of two
# moments) costs 96 MiB of device memory for bf16 parameters.
CHUNK_NUMEL = 1 << 23
RING_SIZE = 3
# Tests turn this on to run the same code with parameters on the CPU (no streams).
_ON_CPU = False
# Benchmarks switch this off to time the host update on the same machine.
ENABLED = True


def eligible(opt, group: dict, params: list[torch.Tensor]) -> bool:
    """Whether ``opt`` may update ``params`` (of ``group``) this way: AdamW's exact result
    on the device, with the state in host memory; else the host update runs."""
    if not ENABLED:
        return False
    if not params:
        return True
    device = params[0].device
    if not (device.type == "cuda" or (_ON_CPU and device.type == "cpu")):
        return False
    if (opt.offload_gradients or opt.master_weights or opt.delayed_update
            or opt._keep_ids or getattr(opt.optimizer_cls, "bf16_host_only", False)):
        return False
    if not issubclass(opt.optimizer_cls, torch.optim.Adam):
        return False
    settings = dict(opt.defaults, **{k: v for k, v in group.items() if k != "params"})
    if (not settings.get("fused") or settings.get("amsgrad") or settings.get("capturable")
            or settings.get("differentiable")):
        return False
    return all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in params) and all(
        p.is_contiguous() and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for p in params)


class StagingRing:
    """Device buffers that moments pass through, and the two streams that fill and empty
    them; one per device and dtype, shared by the optimizers of a process."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.is_async = device.type == "cuda"
        self.load = torch.cuda.Stream(device) if self.is_async else None  # moments in, kernels
        self.store = torch.cuda.Stream(device) if self.is_async else None  # moments out
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._freed: list[Optional[object]] = []  # each buffer's last copy out
        self._next = 0
        self.numel = 0
        self.generation = 0  # counts replacements of the buffers (views of them go stale)
        self.backward_task = -1  # the backward whose end already orders the compute stream

    def reserve(self, numel: int) -> None:
        """Buffers of at least ``numel`` elements each (grown by doubling, at most
        CHUNK_NUMEL: units are never larger)."""
        if numel <= self.numel or not self.is_async:
            return
        numel = min(max(numel, 2 * self.numel), CHUNK_NUMEL)
        self.buffers = []
        for _ in range(RING_SIZE):
            pair = tuple(torch.empty(numel, dtype=self.dtype, device=self.device) for _ in range(2))
            for buf in pair:  # freed while queued work may still use them: not reused before
                buf.record_stream(self.load)
                buf.record_stream(self.store)
            self.buffers.append(pair)
        self._freed = [None] * RING_SIZE
        self.numel, self.generation, self._next = numel, self.generation + 1, 0

    def take(self) -> int:
        """The index of the next buffer pair, the load stream ordered after its last copy out."""
        index = self._next
        self._next = (index + 1) % len(self.buffers)
        if self._freed[index] is not None:
            self.load.wait_event(self._freed[index])
        return index

    def release(self, index: int) -> None:
        """The copies out of buffer ``index`` are queued on the store stream."""
        self._freed[index] = record(self.store)


def record(stream) -> object:
    event = torch.cuda.Event()
    event.record(stream)
    return event


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
    stage_views: dict = dataclasses.field(default_factory=dict)  # buffer index -> (ms, vs)
    generation: int = -1  # of the ring whose buffers stage_views cut


@dataclasses.dataclass
class _Verdict:
    """A step whose inf/NaN verdict is still on its way to the host."""

    done: Optional[object]  # event after the copy (None: synchronous)
    skipped: torch.Tensor  # host: 1.0 if the step was skipped
    count: int  # parameters judged
    whole_step: bool


class StreamedUpdate:
    """One optimizer's streamed updates (see the module docstring)."""

    def __init__(self, opt) -> None:
        self._opt = opt
        self._device_steps: Optional[torch.Tensor] = None  # one per slot, by slot.order
        self._step_views: list = []
        self._steps_moved = False  # the device counts changed since the host's were set
        self._units: dict = {}  # stepping slots -> units
        self._written: Optional[object] = None  # the last copy of state into host memory
        self._verdict: Optional[_Verdict] = None

    # ------------------------------------------------------------------ host view
    def settle(self) -> None:
        """Bring the host state up to date: wait for the copies out, copy the step counts
        into the state, report a skipped step. Cheap when nothing is in flight."""
        if self._written is not None:
            self._written.synchronize()
            self._written = None
        if self._steps_moved:
            self._steps_moved = False
            steps = self._device_steps.cpu()
            state = self._opt._host_optimizer.state
            for slot in self._opt._slots:
                entry = state.get(slot.master)
                if entry and "step" in entry:
                    entry["step"].copy_(steps[slot.order])
        self._take_verdict()

    def forget_state(self) -> None:
        """The host state was replaced (load_state_dict, ``state[p] = ...``) after a
        settle(): read the step counts and moments from it anew."""
        self._device_steps, self._step_views, self._steps_moved = None, [], False
        self._units.clear()

    def _take_verdict(self) -> None:
        """Report the last step's verdict (its copy is long done when the next step starts)."""
        verdict, self._verdict = self._verdict, None
        if verdict is None:
            return
        if verdict.done is not None:
            verdict.done.synchronize()
        if not float(verdict.skipped):
            return
        scaling = self._opt._scaling
        if verdict.whole_step:
            scaling.report_step_skipped(verdict.count)
        else:
            scaling.report_spared(0, verdict.count)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, in_backward: bool) -> None:
        """Queue the update of every parameter with a gradient; never waits for the GPU.
        Inside a backward (torchtune's ``optimizer_in_bwd``) the compute stream is ordered
        after the updates when that backward ends, else at once."""
        opt = self._opt
        self._take_verdict()
        slots, grads = [], []
        for slot in opt._slots.in_order(opt._params()):
            grad = slot.param.grad
            if grad is not None:
                if grad.is_sparse:
                    check_dense(grad)
                slots.append(slot)
                grads.append(grad if grad.is_contiguous() else grad.contiguous())
        if not slots:
            return
        opt._scaling.apply_clip_now(grads)
        groups = {id(p): g for g in opt.param_groups for p in g["params"]}
        for slot in slots:
            if groups[id(slot.param)].get("amsgrad"):
                raise ValueError(
                    "CPUOffloadOptimizer: amsgrad was turned on after the optimizer was built; "
                    "pass amsgrad=True when building it.")
            _adam_state(opt._host_optimizer, slot, False)
        steps = self._steps_of(slots)
        device = slots[0].param.device
        units = self._units_for(slots, groups, device)
        rings = {u.exp_avg.dtype: self._ring(device, u.exp_avg.dtype) for u in units}
        load = next(iter(rings.values())).load
        compute = torch.cuda.current_stream(device) if load is not None else None
        if load is not None:
            load.wait_stream(compute)  # the gradients are written there
            if self._written is not None:  # this optimizer's last copies into host memory
                load.wait_event(self._written)
        position = {id(s): i for i, s in enumerate(slots)}
        with torch.cuda.stream(load) if load is not None else nullcontext():
            # One verdict for the set: a whole step, or inside backward the parameters of
            # this optimizer (one each for torchtune's optimizer_in_bwd, as torch's would).
            found = _nonfinite(grads)
            torch._foreach_add_(steps, 1)
            for unit in units:
                at = [position[id(s)] for s, _, _ in unit.items]
                self._run_unit(unit, [grads[i] for i in at], [steps[i] for i in at],
                               rings[unit.exp_avg.dtype], found, opt.param_groups[unit.group])
            torch._foreach_sub_(steps, [found] * len(steps))
        self._steps_moved = True
        self._send_verdict(rings, found, len(slots), whole_step=not in_backward)
        if load is not None:
            for ring in rings.values():
                if ring.load is not load:
                    load.wait_stream(ring.load)
            if in_backward:
                for grad in grads:  # torchtune frees it in the same hook; backward goes on
                    grad.record_stream(load)
                self._order_at_backward_end(next(iter(rings.values())), compute)
            else:
                compute.wait_stream(load)  # later work (the next forward) sees the new weights
        if opt.nonfinite_grads == "raise":
            self.settle()

    def _order_at_backward_end(self, ring: StagingRing, compute) -> None:
        """Once per backward: when it ends, order the compute stream after every update
        queued on the ring (the weights of the next forward)."""
        task = torch._C._current_graph_task_id()
        if ring.backward_task != task:
            ring.backward_task = task
            load = ring.load
            torch.autograd.Variable._execution_engine.queue_callback(lambda: compute.wait_stream(load))

    def _run_unit(self, unit: _Unit, grads: list, steps: list, ring: StagingRing,
                  found: torch.Tensor, group: dict) -> None:
        if ring.is_async:
            index = ring.take()
            m_stage, v_stage = ring.buffers[index]
            m_stage[:unit.numel].copy_(unit.exp_avg, non_blocking=True)
            v_stage[:unit.numel].copy_(unit.exp_avg_sq, non_blocking=True)
            ms, vs = self._stage_views(ring, index, unit)
        else:  # (tests on the CPU: the kernel updates the host moments in place)
            ms, vs = _item_views(unit, unit.exp_avg), _item_views(unit, unit.exp_avg_sq)
        gs = [g if a == 0 and b == g.numel() else g.view(-1)[a:b]
              for g, (_, a, b) in zip(grads, unit.items)]
        decoupled = group.get("decoupled_weight_decay",
                              isinstance(self._opt._host_optimizer, torch.optim.AdamW))
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.to(ring.device)
        beta1, beta2 = group["betas"]
        kernel(unit.params, gs, ms, vs, [], steps, amsgrad=False, lr=lr, beta1=float(beta1),
               beta2=float(beta2), weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group["maximize"], grad_scale=None, found_inf=found)
        if ring.is_async:
            ring.store.wait_stream(ring.load)
            with torch.cuda.stream(ring.store):
                unit.exp_avg.copy_(m_stage[:unit.numel], non_blocking=True)
                unit.exp_avg_sq.copy_(v_stage[:unit.numel], non_blocking=True)
            ring.release(index)

    def _send_verdict(self, rings: dict, found: torch.Tensor, count: int, whole_step: bool) -> None:
        """Start the verdict's copy to the host; mark where this optimizer's state is written."""
        ring = next(iter(rings.values()))
        host = torch.empty((), dtype=torch.float32, pin_memory=ring.is_async)
        if ring.is_async:
            store = ring.store
            for other in rings.values():
                store.wait_stream(other.store)
            store.wait_stream(ring.load)
            with torch.cuda.stream(store):
                host.copy_(found, non_blocking=True)
            self._written = record(store)
        else:
            host.copy_(found)
        self._verdict = _Verdict(self._written, host, count, whole_step)

    # ------------------------------------------------------------------ bookkeeping
    def _ring(self, device: torch.device, dtype: torch.dtype) -> StagingRing:
        rings = self._opt._shared.staging
        key = (str(device), dtype)
        if key not in rings:
            rings[key] = StagingRing(device, dtype)
        return rings[key]

    def _steps_of(self, slots: list[HostSlot]) -> list[torch.Tensor]:
        """Each slot's step count on the device (taken from the host state the first time)."""
        opt = self._opt
        if self._device_steps is None or len(self._step_views) < len(opt._slots):
            self.settle()  # (the host counts current, if the table grew)
            state = opt._host_optimizer.state
            counts = [float(state[s.master]["step"]) if "step" in state.get(s.master, {}) else 0.0
                      for s in opt._slots]
            self._device_steps = torch.tensor(counts, dtype=torch.float32).to(slots[0].param.device)
            self._step_views = list(self._device_steps.unbind())
        return [self._step_views[s.order] for s in slots]

    def _units_for(self, slots: list[HostSlot], groups: dict, device: torch.device) -> list[_Unit]:
        key = tuple(s.order for s in slots)
        units = self._units.get(key)
        if units is None:
            units = self._units[key] = _plan_units(slots, self._opt.param_groups, groups,
                                                   self._opt._host_optimizer.state)
            for unit in units:
                self._ring(device, unit.exp_avg.dtype).reserve(unit.numel)
        return units

    @staticmethod
    def _stage_views(ring: StagingRing, index: int, unit: _Unit) -> tuple[list, list]:
        if unit.generation != ring.generation:
            unit.stage_views, unit.generation = {}, ring.generation
        views = unit.stage_views.get(index)
        if views is None:
            m_stage, v_stage = ring.buffers[index]
            views = unit.stage_views[index] = (_item_views(unit, m_stage[:unit.numel]),
                                               _item_views(unit, v_stage[:unit.numel]))
        return views


def _plan_units(slots: list[HostSlot], param_groups: list, groups: dict, state: dict) -> list[_Unit]:
    """Cut the stepping slots into units: neighbours in one group and dtype whose moments
    follow each other in host memory share one, up to a quarter of CHUNK_NUMEL elements (so
    that even a step over small adapters has several units, whose copies in and out
    overlap); a parameter of CHUNK_NUMEL or more is cut into ranges of that size."""
    pack_numel = max(1, CHUNK_NUMEL // 4)
    group_index = {id(g): i for i, g in enumerate(param_groups)}
    units: list[_Unit] = []
    run: list[HostSlot] = []

    def close_run() -> None:
        if run:
            units.append(_unit(group_index[id(groups[id(run[0].param)])],
                               [(s, 0, s.param.numel()) for s in run], state))
            run.clear()

    for slot in slots:
        n = slot.param.numel()
        if n >= CHUNK_NUMEL:
            close_run()
            g = group_index[id(groups[id(slot.param)])]
            for a in range(0, n, CHUNK_NUMEL):
                units.append(_unit(g, [(slot, a, min(n, a + CHUNK_NUMEL))], state))
            continue
        if run:
            last = run[-1]
            together = (groups[id(last.param)] is groups[id(slot.param)]
                        and last.param.dtype == slot.param.dtype
                        and sum(s.param.numel() for s in run) + n <= pack_numel
                        and all(back_to_back([state[last.master][k], state[slot.master][k]]) is not None
                                for k in ("exp_avg", "exp_avg_sq")))
            if not together:
                close_run()
        run.append(slot)
    close_run()
    return units


def _unit(group: int, items: list, state: dict) -> _Unit:
    def span(key: str) -> torch.Tensor:
        parts = [state[s.master][key].view(-1)[a:b] for s, a, b in items]
        return parts[0] if len(parts) == 1 else back_to_back(parts)

    params = [s.param.detach() if (a, b) == (0, s.param.numel()) else s.param.detach().view(-1)[a:b]
              for s, a, b in items]
    return _Unit(group, items, sum(b - a for _, a, b in items), span("exp_avg"), span("exp_avg_sq"), params)


def _item_views(unit: _Unit, flat: torch.Tensor) -> list[torch.Tensor]:
    """``flat`` cut into one tensor per item, shaped like what the kernel pairs it with."""
    views, at = [], 0
    for (_, a, b), param in zip(unit.items, unit.params):
        views.append(flat[at:at + b - a].view(param.shape))
        at += b - a
    return views


def _nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """1.0 (a 0-d tensor on the gradients' device) if any holds an inf or NaN, else 0.0,
    without waiting: the largest magnitude of each is finite exactly when all its elements
    are (NaN propagates through the maximum; a sum of magnitudes could overflow for finite
    values)."""
    by_dtype: dict = {}
    for g in grads:
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(g)
    found = None
    for group in by_dtype.values():
        largest = torch._foreach_norm(group, math.inf)
        bad = (~torch.stack(largest).isfinite()).any() if len(largest) > 1 else ~largest[0].isfinite()
        found = bad if found is None else found | bad
    if found is None:
        return torch.zeros((), dtype=torch.float32, device=grads[0].device)
    return found.float()
