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

Everything is queued on three side streams (moments in; the kernels; moments out) and
ordered by events: ``step()`` never waits for the GPU. Device memory holds only a small
ring of staging buffers shared by all optimizers of a process (torchtune's
``optimizer_in_bwd`` builds one per parameter), plus the step counts. The step counts and
the inf/NaN verdict live on the device; the host copies of the counts are brought up to
date (and a skipped step reported) when the state is read, at the next step, or by
:meth:`StreamedEngine.settle`.

Inside a backward (torchtune's ``optimizer_in_bwd``: one optimizer per parameter, each
stepped in its gradient's hook) a step only checks its gradient and queues it on the ring;
the queued steps go to the GPU together once they hold FLUSH_NUMEL elements, and when the
backward ends. Their verdicts, step counts and small moments then cost a few launches for
many parameters instead of a dozen each, which kept the backward's launches waiting on the
hooks' Python (stock 1B full fine-tuning ran at 0.85-0.88x the same recipe without
``optimizer_in_bwd``). Each parameter still gets its own verdict, as torch's
per-parameter optimizers would.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
from contextlib import nullcontext
from typing import Optional

import torch

from offload_plugin import compact_streamed
from offload_plugin.engine import Engine
from offload_plugin.host_buffers import HostSlot, back_to_back
from offload_plugin.gradients import check_dense
from offload_plugin.host_update import _adam_state, check_hyperparameters, forget_batches
from offload_plugin.options import Options

__all__ = ["eligible", "StagingRing", "StreamedEngine"]

log = logging.getLogger(__name__)

# Elements per staging buffer: a copy of 16 MiB (bf16) takes ~0.3 ms at the H200 machine's
# 55 GB/s each way, far above a copy's fixed cost, and the ring (RING_SIZE buffers of two
# moments) costs 96 MiB of device memory for bf16 parameters.
CHUNK_NUMEL = 1 << 23
RING_SIZE = 3
# Queued steps inside a backward go to the GPU once they hold this many elements (64 MiB of
# bf16 gradients: a 1B transformer layer's tensors in two or three flushes). Each flush costs
# the autograd thread a dozen launches and some Python, which delays backward's own
# launches: with 4 M elements (about 100 flushes a 1B backward) the stock 1B full drop-in
# ran 0.78x and 0.87x our recipe in two calls, with 32 M 1.05x and 0.99x (2026-12-03,
# bench/run_h200.sh inbwdsweep).
# Benchmarks set OFFLOAD_PLUGIN_FLUSH_NUMEL in a recipe's environment to try others.
FLUSH_NUMEL = int(os.environ.get("OFFLOAD_PLUGIN_FLUSH_NUMEL", str(1 << 25)))
# Staging offsets are multiples of this many elements (the kernels' vectorized loads).
ALIGN = 64
# Inside a backward, the hooks wait once the gradients handed to the update stream and not
# yet read by it exceed this many bytes: the update runs at the bus's pace, backward can run
# ahead of it, and each gradient's memory is free only once its update has read it. Without
# a bound all of them could wait at once (16 GB for an 8B model). Benchmarks set
# OFFLOAD_PLUGIN_IN_FLIGHT_MIB in a recipe's environment to try other bounds.
IN_FLIGHT_BYTES = int(os.environ.get("OFFLOAD_PLUGIN_IN_FLIGHT_MIB", "1024")) << 20
# Tests turn this on to run the same code with parameters on the CPU (no streams).
_ON_CPU = False
# Benchmarks switch this off (or set OFFLOAD_PLUGIN_STREAMED=0 in a recipe's environment) to
# time the host update on the same machine.
ENABLED = os.environ.get("OFFLOAD_PLUGIN_STREAMED", "1") != "0"


def eligible(options: Options, defaults: dict, group: dict, params: list[torch.Tensor],
             keeps_some: bool = False) -> bool:
    """Whether an optimizer with ``options`` (and ``defaults``) may update ``params`` (of
    ``group``) this way: AdamW's exact result on the device, with the state in host memory;
    else the host update runs. ``keeps_some``: device_fraction keeps some on the device."""
    if not ENABLED:
        return False
    if not params:
        return True
    device = params[0].device
    if not (device.type == "cuda" or (_ON_CPU and device.type == "cpu")):
        return False
    if options.offload_gradients or options.master_weights or options.delayed_update or keeps_some:
        return False
    optimizer_cls = options.optimizer_cls
    if getattr(optimizer_cls, "streams_compact", False):  # CompactAdamW: compact_streamed
        if compact_streamed.applies(optimizer_cls, device, _ON_CPU) is not None:
            return False
        dtypes = (torch.bfloat16,)
    elif getattr(optimizer_cls, "bf16_host_only", False) or not issubclass(optimizer_cls, torch.optim.Adam):
        return False
    else:
        settings = dict(defaults, **{k: v for k, v in group.items() if k != "params"})
        if (not settings.get("fused") or settings.get("amsgrad") or settings.get("capturable")
                or settings.get("differentiable")):
            return False
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return all((type(p) is torch.nn.Parameter or type(p) is torch.Tensor) and p.is_contiguous()
               and p.dtype in dtypes for p in params)


class StagingRing:
    """Device buffers that moments pass through (a few per dtype), three streams (moments
    in, the kernels, moments out), and the steps queued inside a backward. One per device,
    shared by the optimizers of a process.

    The copies in wait for nothing but a free buffer (the state does not depend on the
    gradient), so they run ahead of the kernels, which wait for the gradients and for their
    buffer's copy in; the copies out wait for their kernel. Each direction of the bus then
    stays busy, also while backward is still producing the gradients of later parameters."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_async = device.type == "cuda"
        self.load = torch.cuda.Stream(device) if self.is_async else None  # moments in
        self.update = torch.cuda.Stream(device) if self.is_async else None  # kernels
        self.store = torch.cuda.Stream(device) if self.is_async else None  # moments out
        self._pools: dict = {}  # dtype -> [buffer pairs, each one's last copy out, next index]
        self.numel: dict = {}  # dtype -> elements per buffer
        self.generation = 0  # counts replacements of buffers (views of them go stale)
        self.backward_task = -1  # the backward whose end flushes the queue and orders the compute stream
        self.queued: list = []  # _Jobs not yet on the GPU (steps taken inside a backward)
        self.queued_numel = 0
        self.in_flight: collections.deque = collections.deque()  # (event after a flush's kernels, its gradients' bytes)
        self.in_flight_bytes = 0

    def reserve(self, dtype, numel: int, layout=None) -> None:
        """Buffers of at least ``numel`` elements (grown by doubling, at most CHUNK_NUMEL:
        units are never larger). ``dtype`` names the pool; ``layout(numel)``, if given,
        lists the pair's (size, dtype) (compact_streamed.stage_layout), else two buffers
        of ``numel`` elements of ``dtype``."""
        have = self.numel.get(dtype, 0)
        if numel <= have or not self.is_async:
            return
        numel = min(max(numel, 2 * have), CHUNK_NUMEL)
        shapes = layout(numel) if layout is not None else [(numel, dtype)] * 2
        pairs = []
        for _ in range(RING_SIZE):
            pair = tuple(torch.empty(size, dtype=kind, device=self.device) for size, kind in shapes)
            for buf in pair:  # freed while queued work may still use them: not reused before
                for stream in (self.load, self.update, self.store):
                    buf.record_stream(stream)
            pairs.append(pair)
        self._pools[dtype] = [pairs, [None] * RING_SIZE, 0]
        self.numel[dtype] = numel
        self.generation += 1
        # Their memory may have served tensors that work queued on the compute stream still
        # uses: copies into them wait for that work (the other streams wait for these copies).
        self.load.wait_stream(torch.cuda.current_stream(self.device))

    def take(self, dtype: torch.dtype) -> int:
        """The index of the next buffer pair of ``dtype``, the load stream ordered after its
        last copy out."""
        pool = self._pools[dtype]
        index = pool[2]
        pool[2] = (index + 1) % RING_SIZE
        if pool[1][index] is not None:
            self.load.wait_event(pool[1][index])
        return index

    def buffers(self, dtype: torch.dtype, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pools[dtype][0][index]

    def release(self, dtype: torch.dtype, index: int) -> None:
        """The copies out of buffer ``index`` are queued on the store stream."""
        self._pools[dtype][1][index] = record(self.store)

    def hold(self, nbytes: int) -> None:
        """Gradients of ``nbytes`` were just handed to the update stream inside a backward:
        wait for the oldest until at most IN_FLIGHT_BYTES remain (see there)."""
        self.in_flight.append((record(self.update), nbytes))
        self.in_flight_bytes += nbytes
        while self.in_flight_bytes > IN_FLIGHT_BYTES and len(self.in_flight) > 1:
            done, freed = self.in_flight.popleft()
            done.synchronize()
            self.in_flight_bytes -= freed

    def order_after_updates(self, compute) -> None:
        """``compute`` (the stream the weights are used on next) waits for every update;
        the gradients' memory is then reused in its order, none held any more."""
        compute.wait_stream(self.update)
        self.in_flight.clear()
        self.in_flight_bytes = 0


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
    at: list = dataclasses.field(default_factory=list)  # each item's place among the step's gradients
    stage_views: dict = dataclasses.field(default_factory=dict)  # (buffer index, offset) -> (ms, vs)
    generation: int = -1  # of the ring whose buffers stage_views cut


@dataclasses.dataclass(eq=False)
class _Plan:
    """What a step over one set of parameters needs besides the gradients, worked out the
    first time that set steps (the same set steps every time in training)."""

    slots: list  # the stepping slots, in parameter order
    entries: list  # their state dicts, with the moments the units' spans were cut from
    moments: list
    units: list
    ring: StagingRing
    steps: list  # each slot's step count on the device (views of one tensor)
    params: list = dataclasses.field(default_factory=list)  # the slots' parameters
    data_ptrs: list = dataclasses.field(default_factory=list)  # their memory when the units were cut
    compact: bool = False  # compact_streamed's units (CompactAdamW's state)


@dataclasses.dataclass(eq=False)
class _Job:
    """One optimizer's step, checked, whose GPU work is not queued yet (see _run_jobs)."""

    owner: "StreamedEngine"
    plan: _Plan
    grads: list  # the plan's slots' gradients, in its order
    hyper: list  # per param group: the kernel and its arguments at step() time
    whole_step: bool  # False inside a backward: a parameter's verdict is its own
    rows: list = dataclasses.field(default_factory=list)  # compact: each unit's coefficients (None: exact unit)


@dataclasses.dataclass
class _Verdict:
    """A step whose inf/NaN verdict is still on its way to the host."""

    done: Optional[object]  # event after the copy (None: synchronous)
    found: torch.Tensor  # host flags of the steps queued together, this one's at ``index``
    index: int
    count: int  # parameters judged
    whole_step: bool
    orders: Optional[list] = None  # compact: the slots whose host step counts it settles


class StreamedEngine(Engine):
    """One optimizer's streamed updates (see the module docstring and ``engine.Engine``)."""

    streams = True

    def __init__(self, optimizer, options: Options) -> None:
        super().__init__(optimizer, options)
        self._device_steps: Optional[torch.Tensor] = None  # one per slot, by slot.order
        self._step_views: list = []
        self._steps_moved = False  # the device counts changed since the host's were set
        self._host_counts: list = []  # the counts as the host state last had them, by slot.order
        self._counts_shown = False  # the host state went to the user since the last step
        self._plans: dict = {}  # which slots step (a tuple of bools) -> _Plan
        self._written: Optional[object] = None  # the last copy of state into host memory
        self._verdict: Optional[_Verdict] = None
        self._queued_on: Optional[StagingRing] = None  # a step of ours waits in its queue
        # CompactAdamW's state (compact_streamed): where it lives, the kernel's scalars
        # (from the host step counts, which each verdict settles), and each slot's weight
        # version after our last update (a weight changed since drops its remainder).
        self._compact = bool(getattr(options.optimizer_cls, "streams_compact", False))
        self._host_state: Optional[compact_streamed.HostState] = None
        self._coefficients = compact_streamed.Coefficients()
        self._versions: dict = {}

    def still_applies(self) -> bool:
        """Whether every group still asks for what the fused kernel does here. ``fused`` set
        to False (or None) between steps makes torch's AdamW go on with its for-loop, other
        bits; amsgrad=True loaded with its state (a state dict of torch's AdamW(amsgrad=True))
        makes it go on with amsgrad, which this kernel call has not. The host update then
        takes over, as building with that setting gives (see eligible). (A state dict of
        torch's AdamW built without fused=True loads fused=None. amsgrad switched on by hand
        over state without max_exp_avg_sq stays here: step() refuses it, as torch does.)"""
        if self._compact:
            return True  # (CompactAdamW's update is the same kernel whatever its groups say)
        state = self.inner.state
        for index, group in enumerate(self.param_groups):
            if not group.get("fused"):
                why = f"['fused'] is {group.get('fused')!r}, so torch's AdamW would go on with its for-loop"
            elif group.get("amsgrad") and all(
                    "max_exp_avg_sq" in state[m] for m in self.inner.param_groups[index]["params"]
                    if state.get(m)):
                why = "['amsgrad'] is True with its state, so torch's AdamW would go on with amsgrad"
            else:
                continue
            log.warning(
                "CPUOffloadOptimizer: param_groups[%d]%s (set by hand, or loaded from a state "
                "dict): the update runs on the host from now on, no longer streamed, and much "
                "slower. To keep it streamed (torch's fused kernel, as before the load), set "
                "param_groups[i]['fused'] = True after loading and before the next step().",
                index, why)
            return False
        return True

    # ------------------------------------------------------------------ host view
    def settle(self, for_user: bool = False) -> None:
        """Bring the host state up to date: send a queued step to the GPU, wait for the
        copies out, copy the step counts into the state, report a skipped step. Cheap when
        nothing is in flight. ``for_user``: the state is handed to the user, who may edit
        the step counts before the next step (see _adopt_edited_counts)."""
        self._counts_shown = self._counts_shown or for_user
        if self._queued_on is not None:
            _flush(self._queued_on)
        if self._written is not None:
            self._written.synchronize()
            self._written = None
        counted = self._steps_moved
        if self._steps_moved:
            self._steps_moved = False
            steps = self._device_steps.cpu()
            self._host_counts = steps.tolist()
            state = self.inner.state
            # Only the slots the device counts cover: a group added since has none there
            # (its state, made by the next step's plan, holds its own counts until then).
            for slot in self.slots.ordered[:len(steps)]:
                entry = state.get(slot.master)
                if entry and "step" in entry:
                    entry["step"].copy_(steps[slot.order])
        self._take_verdict(counted=counted)

    def _adopt_edited_counts(self) -> None:
        """Step counts the user changed in the host state since it was handed out (in place
        or replaced, as torch's AdamW takes them) are read anew, with the plans: the device
        holds the counts between steps, and would go on from its own."""
        self._counts_shown = False
        if self._device_steps is None or len(self._host_counts) < len(self.slots):
            return  # (read from the host state at this step anyway: see _steps_of)
        state = self.inner.state
        for slot in self.slots:
            entry = state.get(slot.master)
            if not entry:
                continue
            step = entry.get("step")
            # (a count deleted, or made something the kernel cannot count with: the plan
            # made anew checks the entry, _check_adam_state, and refuses it as torch does)
            if (not isinstance(step, torch.Tensor) or step.numel() != 1 or not step.is_floating_point()
                    or float(step) != self._host_counts[slot.order]):
                self.forget_state()
                return

    # ------------------------------------------------------------------ the engine interface
    def finish(self) -> None:
        self.settle()

    def state_of(self, param: torch.Tensor):
        where = super().state_of(param)
        if where is not None:  # the state as the last step left it
            self.settle(for_user=True)
        return where

    def regroup(self) -> None:
        """The groups' members changed (see CPUOffloadOptimizer._regroup): cut the units anew."""
        super().regroup()
        self._plans.clear()

    def reload_weights(self) -> None:
        """CPUOffloadOptimizer.reload_weights(): weights may have been written where the
        version counters do not see it (``param.data``). Compact state drops every remainder,
        so that each master restarts from its weight; exact state keeps no master."""
        if self._compact:
            self._drop_remainders(self.slots)

    def forget_state(self) -> None:
        """The host state was replaced (load_state_dict, ``state[p] = ...``) after a
        settle(): read the step counts and moments from it anew."""
        forget_batches(self.inner)
        self._device_steps, self._step_views, self._steps_moved = None, [], False
        self._plans.clear()
        # (a loaded remainder: CompactAdamW decides at its next update, see before_update)
        self._versions = {s.order: s.param._version for s in self.slots}

    def _take_verdict(self, counted: bool = False) -> None:
        """Report the last step's verdict (its copy is long done when the next step starts),
        and for compact state advance the host step counts of the slots it stepped, unless
        ``counted``: read from the device just now."""
        verdict, self._verdict = self._verdict, None
        if verdict is None:
            return
        if verdict.done is not None:
            verdict.done.synchronize()
        if not float(verdict.found[verdict.index]):
            if verdict.orders is not None and not counted:
                for order in verdict.orders:
                    self._host_counts[order] += 1
            return
        scaling = self.scaling
        if verdict.whole_step:
            scaling.report_step_skipped(verdict.count)
        else:
            scaling.report_spared(0, verdict.count)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """Check the gradients and queue the update of every parameter with one; never
        waits for the GPU. Inside a backward (torchtune's ``optimizer_in_bwd``) the update
        joins the ring's queue (see the module docstring), and the compute stream is ordered
        after the updates when that backward ends; otherwise at once."""
        in_backward = torch._C._current_graph_task_id() != -1
        if self._queued_on is not None:  # (a second step inside one backward)
            _flush(self._queued_on)
        if self._verdict is not None:
            self._take_verdict()
        if self._counts_shown:
            self._adopt_edited_counts()
        slots = self.slots.ordered  # (in parameter order: no device_fraction here)
        grads = [slot.param.grad for slot in slots]
        key = tuple(g is not None for g in grads)
        grads = [g for g in grads if g is not None]
        if not grads:
            return
        plan = self._plans.get(key)
        if plan is not None and not (_moments_unchanged(plan) and _params_unmoved(plan)):
            self._plans.clear()  # (moments replaced in a state dict, or weights: cut anew)
            plan = None
        stepping = plan.slots if plan is not None else [s for s, has in zip(slots, key) if has]
        for i, (g, slot) in enumerate(zip(grads, stepping)):
            if g.is_sparse:
                check_dense(g)
            if g.dtype != slot.param.dtype or g.shape != slot.param.shape:
                raise ValueError(
                    f"CPUOffloadOptimizer: a gradient of dtype {g.dtype} and shape {tuple(g.shape)} "
                    f"for a parameter of dtype {slot.param.dtype} and shape {tuple(slot.param.shape)}; "
                    "set .grad to a tensor like the parameter. Nothing was updated.")
            if not g.is_contiguous():
                grads[i] = g.contiguous()
        groups = self.param_groups
        if any(g.get("amsgrad") for g in groups):
            raise ValueError(
                "CPUOffloadOptimizer: amsgrad was turned on after the optimizer was built; "
                "pass amsgrad=True when building it.")
        for index, group in enumerate(groups):
            if group.get("differentiable"):  # (torch's fused AdamW raises before any change too)
                raise ValueError(
                    f"param_groups[{index}]['differentiable'] is True, which the fused update "
                    "cannot take (torch's fused AdamW refuses it too): set it back to False, or "
                    "set 'fused' to False as well. Nothing was updated.")
        # Groups are the user's to edit between steps: a value the kernel refuses would
        # raise from it after the step counts advanced (torch's fused AdamW too), or inside
        # a backward's flush with other optimizers' steps. Refused here, nothing changed.
        for index, group in enumerate(groups):
            check_hyperparameters(index, group)
        amp_scale = self.amp_scale
        if self._compact and amp_scale is not None:
            raise ValueError(
                "CPUOffloadOptimizer: CompactAdamW's streamed update takes no GradScaler scale "
                "(its parameters are bf16, which needs no loss scaling): leave the GradScaler "
                "out, or unscale the gradients with scaler.unscale_(optimizer) first. Nothing "
                "was updated.")
        self.scaling.apply_clip_now(grads)
        if plan is None:
            plan = self._plans[key] = self._plan(stepping)
        ring = plan.ring
        rows = self._compact_rows(plan) if self._compact else []
        if in_backward:
            _flush_when_backward_ends(ring)
        # torch.amp.GradScaler's scale, handed over instead of unscaling the gradients (see
        # CPUOffloadOptimizer._step_supports_amp_scaling): the kernel divides by it, as torch's
        # fused AdamW's does. (Its found_inf is the verdict on these same gradients that
        # ours takes: a step it flags is skipped here too, the counts left as they were.)
        hyper = [] if self._compact else [_hyperparameters(g, self.inner, amp_scale) for g in groups]
        ring.queued.append(_Job(self, plan, grads, hyper, whole_step=not in_backward, rows=rows))
        ring.queued_numel += sum(g.numel() for g in grads)
        self._queued_on = ring
        self._steps_moved = True
        if in_backward:
            if ring.queued_numel >= FLUSH_NUMEL:
                _flush(ring, in_backward=True)
        else:
            _flush(ring, in_backward=False)
        if self.options.nonfinite_grads == "raise":
            self.settle()

    def _plan(self, slots: list[HostSlot]) -> _Plan:
        for slot in slots:
            # The state is keyed and checked by the slot's placeholder, shaped as the
            # parameter was when given: one converted since (``p.data = t``, module.to())
            # would meet moments of the old dtype or size in the kernel, after the counts
            # advanced (torch's fused AdamW raises there too).
            p, was = slot.param, slot.master
            if p.dtype != was.dtype or p.shape != was.shape:
                raise ValueError(
                    f"CPUOffloadOptimizer: a parameter given as {was.dtype} of shape {tuple(was.shape)} "
                    f"is now {p.dtype} of shape {tuple(p.shape)} (its .data was replaced, e.g. by "
                    "module.to()); its optimizer state is of the old kind. Convert it back before "
                    "the next step(), or build the optimizer after converting the model. Nothing "
                    "was updated.")
            if not p.is_contiguous():  # (the units cut flat views of it; eligible asked once)
                raise ValueError(
                    f"CPUOffloadOptimizer: a parameter of shape {tuple(p.shape)} is not contiguous "
                    "now (its .data was replaced); the streamed update reads parameters as flat "
                    "memory. Assign a contiguous tensor (t.contiguous()). Nothing was updated.")
        shared = self.resources  # (one device's resources: one ring)
        if shared.ring is None:
            shared.ring = StagingRing(slots[0].param.device)
        ring = shared.ring
        position = {id(s): i for i, s in enumerate(slots)}
        if self._compact:
            units = self._compact_units(slots, ring)
            for unit in units:
                unit.at = position[id(unit.slot)]
        else:
            for slot in slots:  # the state torch's fused AdamW creates at a parameter's first step
                _adam_state(self.inner, slot, False)
            groups = {id(p): g for g in self.param_groups for p in g["params"]}
            units = _plan_units(slots, self.param_groups, groups, self.inner.state)
            for unit in units:
                unit.at = [position[id(s)] for s, _, _ in unit.items]
                ring.reserve(unit.exp_avg.dtype, unit.numel)
        entries = [self.inner.state[s.master] for s in slots]
        moments = [(e["exp_avg"], e["exp_avg_sq"]) for e in entries]
        params = [s.param for s in slots]
        return _Plan(slots, entries, moments, units, ring, self._steps_of(slots), params,
                     list(map(torch.Tensor.data_ptr, params)), compact=self._compact)

    # ------------------------------------------------------------------ compact state
    def _compact_units(self, slots: list[HostSlot], ring: StagingRing) -> list:
        """CompactAdamW's state for ``slots`` (made, or moved into page-locked memory) and
        the units it is cut into (compact_streamed)."""
        host_opt = self.inner
        index_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        group_of = [index_of[id(s.param)] for s in slots]
        if self._host_state is None:
            self._host_state = compact_streamed.HostState(pin=ring.is_async and self.arena.pin)
        entries = self._host_state.ensure(host_opt, slots, [host_opt.param_groups[g] for g in group_of])
        units = compact_streamed.plan_units(slots, entries, group_of, CHUNK_NUMEL)
        for unit in units:
            need, _ = compact_streamed.stage_need(unit)
            ring.reserve(compact_streamed.POOL, 4 * need if unit.exact else need,
                         layout=compact_streamed.stage_layout)
        for slot in slots:
            self._versions.setdefault(slot.order, slot.param._version)
        return units

    def _compact_rows(self, plan: _Plan) -> list:
        """Each compact unit's kernel scalars for this step; before that, the remainder of
        a weight changed outside the optimizer since our last update is dropped: the
        weight is the master now (the parameter is the truth)."""
        self.adopt_changed_weights(plan.slots)
        host_opt = self.inner
        for slot in plan.slots:  # (a remainder loaded with its weight's digest: checked now)
            host_opt.before_update(slot.master, slot.param)
        groups = self.param_groups  # (schedulers write ours; the host optimizer's lag)
        counts, made, rows = self._host_counts, {}, []
        for unit in plan.units:  # (a row per group and count: the units of a step share them)
            if unit.exact:
                rows.append(None)
                continue
            key = (unit.group, int(counts[unit.slot.order]) + 1)
            if key not in made:
                made[key] = self._coefficients.row(groups[key[0]], key[1])
            rows.append(made[key])
        return rows

    def adopt_changed_weights(self, slots: Optional[list[HostSlot]] = None) -> None:
        """Compact state: the remainders of weights written outside the optimizer since our
        last update (their version counters moved) are dropped, or kept by a resume's digest
        (CompactAdamW.weight_replaced): before an update, or a state dict, reads them."""
        if not self._compact:
            return
        slots = self.slots if slots is None else slots
        changed = [s for s in slots if self._versions.get(s.order, s.param._version) != s.param._version]
        if changed:
            self._drop_remainders(changed)

    def _drop_remainders(self, slots: list[HostSlot]) -> None:
        """The weights of ``slots`` are new: each master restarts from its weight."""
        self.settle()  # (no copy into the host state in flight)
        for slot in slots:
            self.inner.weight_replaced(slot.master, slot.param)
            self._versions[slot.order] = slot.param._version

    # ------------------------------------------------------------------ bookkeeping
    def _steps_of(self, slots: list[HostSlot]) -> list[torch.Tensor]:
        """Each slot's step count on the device (taken from the host state the first time)."""
        if self._device_steps is None or len(self._step_views) < len(self.slots):
            self.settle()  # (the host counts current, if the table grew)
            state = self.inner.state
            counts = [float(state[s.master]["step"]) if "step" in state.get(s.master, {}) else 0.0
                      for s in self.slots]
            self._host_counts = counts
            self._device_steps = torch.tensor(counts, dtype=torch.float32).to(slots[0].param.device)
            self._step_views = list(self._device_steps.unbind())
            self._plans.clear()  # (their step views are of the old tensor)
        return [self._step_views[s.order] for s in slots]


def _flush_when_backward_ends(ring: StagingRing) -> None:
    """Once per backward: when it ends, send what is still queued to the GPU and order the
    compute stream after every update (the weights of the next forward)."""
    task = torch._C._current_graph_task_id()
    if ring.backward_task == task:
        return
    ring.backward_task = task
    _flush(ring, in_backward=True)  # (left by a backward that raised: its end never came)
    compute = torch.cuda.current_stream(ring.device) if ring.is_async else None

    def at_end() -> None:
        _flush(ring, in_backward=True)
        if compute is not None:
            ring.order_after_updates(compute)

    torch.autograd.Variable._execution_engine.queue_callback(at_end)


def _flush(ring: StagingRing, in_backward: Optional[bool] = None) -> None:
    """Send the ring's queued steps to the GPU. Inside a backward the gradients are marked
    in use by the update stream (torchtune frees each in its hook, and backward goes on);
    after it the compute stream waits for the updates at once."""
    jobs, ring.queued, ring.queued_numel = ring.queued, [], 0
    if not jobs:
        return
    for job in jobs:
        job.owner._queued_on = None
    if in_backward is None:
        in_backward = torch._C._current_graph_task_id() != -1
    _run_jobs(ring, jobs)
    if not ring.is_async:
        return
    if not in_backward:
        ring.order_after_updates(torch.cuda.current_stream(ring.device))
        return
    nbytes = 0
    for job in jobs:
        for grad in job.grads:
            grad.record_stream(ring.update)
            nbytes += grad.numel() * grad.element_size()
    ring.hold(nbytes)


@torch.no_grad()
def _run_jobs(ring: StagingRing, jobs: list[_Job]) -> None:
    """Queue the GPU work of ``jobs``: their verdicts at once, each unit's moments in, its
    kernel and its moments out, the step counts, and the verdicts' copy to the host."""
    if ring.is_async:
        ring.update.wait_stream(torch.cuda.current_stream(ring.device))  # the gradients are written there
        for job in jobs:  # the last copies into host memory of the moments read now
            if job.owner._written is not None:
                ring.load.wait_event(job.owner._written)
    steps = [s for job in jobs for s in job.plan.steps]
    with _on(ring.update):
        each, flags = _verdicts(jobs)
        torch._foreach_add_(steps, 1)
        coeffs = _compact_coefficients(jobs, ring)
    filling: dict = {}  # pool -> [buffer index, elements used, ...]: small units share a buffer
    for job, found in zip(jobs, each):
        if job.plan.compact:
            for unit, row in zip(job.plan.units, job.rows):
                _run_compact_unit(unit, job, ring, found, coeffs[row] if row is not None else None, filling)
            job.owner._versions.update((s.order, s.param._version) for s in job.plan.slots)
            continue
        for unit in job.plan.units:
            _run_unit(unit, job.grads, job.plan.steps, ring, found, job.hyper[unit.group], filling)
    for dtype, (index, *_) in filling.items():
        ring.release(dtype, index)
    with _on(ring.update):
        torch._foreach_sub_(steps, [found for job, found in zip(jobs, each) for _ in job.plan.steps])
    host = torch.empty(len(jobs), dtype=torch.float32, pin_memory=ring.is_async)
    done = None
    if ring.is_async:
        ring.store.wait_stream(ring.update)
        with torch.cuda.stream(ring.store):
            host.copy_(flags, non_blocking=True)
        done = record(ring.store)
    else:
        host.copy_(flags)
    for i, job in enumerate(jobs):
        job.owner._written = done
        orders = [s.order for s in job.plan.slots] if job.plan.compact else None
        job.owner._verdict = _Verdict(done, host, i, len(job.plan.steps), job.whole_step, orders)


def _compact_coefficients(jobs: list[_Job], ring: StagingRing) -> dict:
    """The compact units' kernel scalars on the device, in one copy: each distinct row of
    the jobs (a tuple, compact_streamed.Coefficients) -> its tensor there."""
    rows = list(dict.fromkeys(r for job in jobs if job.plan.compact for r in job.rows if r is not None))
    if not rows:
        return {}
    host = torch.tensor(rows, dtype=torch.float32, pin_memory=ring.is_async)
    table = host.to(ring.device, non_blocking=True) if ring.is_async else host
    return dict(zip(rows, table.unbind()))


def _run_compact_unit(unit, job: _Job, ring: StagingRing, found: torch.Tensor,
                      coeffs: Optional[torch.Tensor], filling: dict) -> None:
    """Queue one compact unit (compact_streamed): its state in, the kernel, its state out.
    Units share a staging pair while they fit (as _run_unit's)."""
    pool = compact_streamed.POOL
    grad = job.grads[unit.at].view(-1)[unit.start:unit.end]
    group = job.owner.param_groups[unit.group]  # (as the step found it: see _compact_rows)
    step = job.plan.steps[unit.at]
    if not ring.is_async:  # (tests on the CPU: the host state updated in place)
        compact_streamed.update(unit, unit.host, grad, coeffs, found, step, group)
        return
    need, need_bytes = compact_streamed.stage_need(unit)
    index, used, used_bytes = filling.get(pool, (None, 0, 0))
    capacity = ring.numel[pool]
    if index is None or used + need > capacity or used_bytes + need_bytes > ring.buffers(pool, index)[1].numel():
        if index is not None:
            ring.release(pool, index)
        index, used, used_bytes = ring.take(pool), 0, 0
    filling[pool] = (index, used + need, used_bytes + need_bytes)
    views = compact_streamed.views_in(unit, ring, index, used, used_bytes)
    with torch.cuda.stream(ring.load):
        compact_streamed.stage_in(unit, views)
    ring.update.wait_event(record(ring.load))
    with torch.cuda.stream(ring.update):
        compact_streamed.update(unit, views, grad, coeffs, found, step, group)
    ring.store.wait_stream(ring.update)
    with torch.cuda.stream(ring.store):
        compact_streamed.stage_out(unit, views)


def _verdicts(jobs: list[_Job]) -> tuple[list, torch.Tensor]:
    """Each job's verdict (a 0-d float tensor on the device: 1.0 if any of its gradients
    holds an inf or NaN), and all of them as one vector, without waiting."""
    flat, spans = [], []  # the non-empty gradients in job order; each job's [start, end) in flat
    for job in jobs:
        start = len(flat)
        flat += [g for g in job.grads if g.numel()]
        spans.append((start, len(flat)))
    device = jobs[0].grads[0].device
    if not flat:
        flags = torch.zeros(len(jobs), dtype=torch.float32, device=device)
        return list(flags.unbind()), flags
    by_dtype: dict = {}
    for k, g in enumerate(flat):
        by_dtype.setdefault(g.dtype, []).append(k)
    if len(by_dtype) == 1:
        per_grad = _nonfinite_each(flat)
    else:
        per_grad = torch.empty(len(flat), dtype=torch.float32, device=device)
        for positions in by_dtype.values():
            per_grad[positions] = _nonfinite_each([flat[k] for k in positions])
    if all(b - a == 1 for a, b in spans):  # one non-empty gradient each (optimizer_in_bwd)
        return list(per_grad.unbind()), per_grad
    each = [per_grad[a:b].amax() if b > a else torch.zeros((), dtype=torch.float32, device=device)
            for a, b in spans]
    return each, torch.stack(each)


def _moments_unchanged(plan: _Plan) -> bool:
    """Whether each stepping slot's state still holds the moments the plan was cut from
    (``optimizer.state[p]["exp_avg"] = ...`` replaces one)."""
    return all(e.get("exp_avg") is m and e.get("exp_avg_sq") is v  # (one deleted: re-planned, refused)
               for e, (m, v) in zip(plan.entries, plan.moments))


def _params_unmoved(plan: _Plan) -> bool:
    """Whether each stepping parameter still has the memory the plan's units were cut from:
    ``p.data = t`` (``module.to()`` does it) gives it new memory, which torch's AdamW
    updates (or refuses, for another dtype); the units' views would go on updating the old.
    (One C-level pass: about 0.1 us a parameter.)"""
    return list(map(torch.Tensor.data_ptr, plan.params)) == plan.data_ptrs


def _hyperparameters(group: dict, host_optimizer, grad_scale: Optional[torch.Tensor] = None) -> tuple:
    """The kernel and its keyword arguments for ``group`` as it is now (schedulers change it)."""
    decoupled = group.get("decoupled_weight_decay", isinstance(host_optimizer, torch.optim.AdamW))
    beta1, beta2 = group["betas"]
    return (torch._fused_adamw_ if decoupled else torch._fused_adam_,
            dict(amsgrad=False, lr=group["lr"], beta1=float(beta1), beta2=float(beta2),
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 grad_scale=grad_scale))


def _run_unit(unit: _Unit, grads: list, steps: list, ring: StagingRing, found: torch.Tensor,
              hyper: tuple, filling: dict) -> None:
    """Queue one unit: its moments in, the kernel, its moments out. ``filling``: per dtype
    the staging buffer being filled and how much of it is used; a unit that does not fit
    takes the next buffer (the caller releases the last ones)."""
    dtype = unit.exp_avg.dtype
    if ring.is_async:
        index, used = filling.get(dtype, (None, 0))
        if index is None or used + unit.numel > ring.numel[dtype]:
            if index is not None:
                ring.release(dtype, index)
            index, used = ring.take(dtype), 0
        filling[dtype] = (index, used + -(-unit.numel // ALIGN) * ALIGN)
        m_stage, v_stage = ring.buffers(dtype, index)
        with torch.cuda.stream(ring.load):
            m_stage[used:used + unit.numel].copy_(unit.exp_avg, non_blocking=True)
            v_stage[used:used + unit.numel].copy_(unit.exp_avg_sq, non_blocking=True)
        ring.update.wait_event(record(ring.load))
        ms, vs = _stage_views(ring, index, used, unit)
    else:  # (tests on the CPU: the kernel updates the host moments in place)
        ms, vs = _item_views(unit, unit.exp_avg), _item_views(unit, unit.exp_avg_sq)
    gs = []
    for i, (_, a, b) in zip(unit.at, unit.items):
        g = grads[i]
        gs.append(g if a == 0 and b == g.numel() else g.view(-1)[a:b])
    kernel, kwargs = hyper
    lr = kwargs["lr"]
    if isinstance(lr, torch.Tensor):
        kwargs = dict(kwargs, lr=lr.to(unit.params[0].device))
    with _on(ring.update):
        kernel(unit.params, gs, ms, vs, [], [steps[i] for i in unit.at], found_inf=found, **kwargs)
    if ring.is_async:
        ring.store.wait_stream(ring.update)
        with torch.cuda.stream(ring.store):
            unit.exp_avg.copy_(m_stage[used:used + unit.numel], non_blocking=True)
            unit.exp_avg_sq.copy_(v_stage[used:used + unit.numel], non_blocking=True)


def _on(stream):
    """``torch.cuda.stream(stream)``; nothing for the CPU (no stream)."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _stage_views(ring: StagingRing, index: int, offset: int, unit: _Unit) -> tuple[list, list]:
    """The unit's items in staging buffer ``index`` from ``offset`` on (kept: a training
    step places each unit the same way every time)."""
    if unit.generation != ring.generation:
        unit.stage_views, unit.generation = {}, ring.generation
    views = unit.stage_views.get((index, offset))
    if views is None:
        m_stage, v_stage = ring.buffers(unit.exp_avg.dtype, index)
        views = unit.stage_views[(index, offset)] = (
            _item_views(unit, m_stage[offset:offset + unit.numel]),
            _item_views(unit, v_stage[offset:offset + unit.numel]))
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


def _nonfinite_each(grads: list[torch.Tensor]) -> torch.Tensor:
    """A float vector on the gradients' device (one dtype, none empty): 1.0 where a
    gradient holds an inf or NaN, else 0.0, without waiting. The largest magnitude of each
    is finite exactly when all its elements are (NaN propagates through the maximum; a sum
    of magnitudes could overflow for finite values)."""
    largest = torch._foreach_norm(grads, math.inf)
    return (~torch.stack(largest).isfinite()).float()
