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

What the state is, how it is cut into units, staged and updated, is the inner optimizer's
state format (offload_plugin.formats.registry: torch's moments above, CompactAdamW's compact
state); this module queues, orders and settles the units of every format alike.

Everything is queued on three side streams (moments in; the kernels; moments out) and
ordered by events: ``step()`` never waits for the GPU. Device memory holds only a small
ring of staging buffers shared by all optimizers of a process (torchtune's
``optimizer_in_bwd`` builds one per parameter), plus the step counts. The step counts and
the inf/NaN verdict live on the device; the host copies of the counts are brought up to
date (and a skipped step reported) when the state is read, at the next step, or by
:meth:`StreamedEngine.settle`.

Inside a backward (torchtune's ``optimizer_in_bwd``: one optimizer per parameter, each
stepped in its gradient's hook) a step only checks its gradient and queues it on the ring;
the queued steps go to the GPU together once they hold config.flush_numel elements, and when the
backward ends. Their verdicts, step counts and small moments then cost a few launches for
many parameters instead of a dozen each, which kept the backward's launches waiting on the
hooks' Python (stock 1B full fine-tuning ran at 0.85-0.88x the same recipe without
``optimizer_in_bwd``). Each parameter still gets its own verdict, as torch's
per-parameter optimizers would.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
from typing import Optional

import torch

from offload_plugin.engines.base import Engine
from offload_plugin.formats import inner, registry as state_formats
from offload_plugin.formats.base import ALIGN
from offload_plugin.formats.group_checks import check_fused_flags, check_hyperparameters
from offload_plugin.host.buffers import HostSlot
from offload_plugin.host.gradients import check_dense
from offload_plugin.host.inner_step import forget_batches
from offload_plugin.host.weights import WeightTracker, version
from offload_plugin.options import STREAMED, Options, check_amp_scaler, engine_for

__all__ = ["eligible", "StagingRing", "StreamedEngine", "StreamedConfig", "config", "configured"]

log = logging.getLogger(__name__)

@dataclasses.dataclass
class StreamedConfig:
    """The streamed engine's tunables, in one object that the engine reads at each use.
    Three come from the environment at import, for benchmarks that run inside a recipe's
    process; tests and benchmarks change them with :func:`configured` (or pytest's
    ``monkeypatch.setattr(streamed.config, ...)``)."""

    # Elements per staging buffer: a copy of 16 MiB (bf16) takes ~0.3 ms at the H200
    # machine's 55 GB/s each way, far above a copy's fixed cost, and the ring (ring_size
    # buffers of two moments) costs 96 MiB of device memory for bf16 parameters.
    stage_numel: int = 1 << 23
    # Buffer pairs per pool: how many units' copies in may run ahead of their kernels (and of
    # their gradients). A unit's copy in is queued with its flush, once its gradient exists.
    ring_size: int = 3
    # Queued steps inside a backward go to the GPU once they hold this many elements (64 MiB
    # of bf16 gradients: a 1B transformer layer's tensors in two or three flushes). Each flush
    # costs the autograd thread a dozen launches and some Python, which delays backward's own
    # launches: with 4 M elements (about 100 flushes a 1B backward) the stock 1B full drop-in
    # ran 0.78x and 0.87x our recipe in two calls, with 32 M 1.05x and 0.99x (bench/run_h200.sh
    # inbwdsweep). OFFLOAD_PLUGIN_FLUSH_NUMEL sets it.
    flush_numel: int = 1 << 25
    # Inside a backward, the hooks wait once the gradients handed to the update stream and not
    # yet read by it exceed this many bytes: the update runs at the bus's pace, backward can
    # run ahead of it, and each gradient's memory is free only once its update has read it.
    # Without a bound all of them could wait at once (16 GB for an 8B model).
    # OFFLOAD_PLUGIN_IN_FLIGHT_MIB sets it (in MiB).
    in_flight_bytes: int = 1 << 30
    # Tests turn this on to run the same code with parameters on the CPU (no streams).
    on_cpu: bool = False
    # Off, the host update runs where this one would (benchmarks time the two on one
    # machine); OFFLOAD_PLUGIN_STREAMED=0 turns it off.
    enabled: bool = True

    @classmethod
    def from_environment(cls, env=os.environ) -> "StreamedConfig":
        return cls(flush_numel=int(env.get("OFFLOAD_PLUGIN_FLUSH_NUMEL", str(1 << 25))),
                   in_flight_bytes=int(env.get("OFFLOAD_PLUGIN_IN_FLIGHT_MIB", "1024")) << 20,
                   enabled=env.get("OFFLOAD_PLUGIN_STREAMED", "1") != "0")


config = StreamedConfig.from_environment()


@contextlib.contextmanager
def configured(**changes):
    """``config`` with ``changes`` (field names) for the duration of the block."""
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"StreamedConfig has no {', '.join(unknown)}; its fields: {', '.join(sorted(fields))}")
    saved = dataclasses.asdict(config)
    for key, value in changes.items():
        setattr(config, key, value)
    try:
        yield config
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


def eligible(options: Options, defaults: dict, group: dict, params: list[torch.Tensor],
             keeps_some: bool = False) -> bool:
    """Whether an optimizer with ``options`` (and ``defaults``) may update ``params`` (of
    ``group``) this way: AdamW's exact result on the device, with the state in host memory;
    else the host update runs. ``keeps_some``: device_fraction keeps some on the device.
    The rules are options.COMBINATIONS'; the device's facts are read here."""
    device = params[0].device if params else None
    return engine_for(
        options, dict(defaults, **{k: v for k, v in group.items() if k != "params"}), params,
        kept_on_device=keeps_some, streaming_on=config.enabled,
        device_streams=device is not None and (device.type == "cuda" or (config.on_cpu and device.type == "cpu")),
        on_cpu=config.on_cpu,
    ) == STREAMED


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
        # A unit's hand-offs (copies in -> kernel -> copies out), recorded anew for each unit:
        # a stream's wait takes the record of the moment it is queued, so one event per
        # hand-off serves them all, and no event is made per unit.
        self.loaded = torch.cuda.Event() if self.is_async else None
        self.updated = torch.cuda.Event() if self.is_async else None

    def reserve(self, dtype, numel: int, layout=None) -> None:
        """Buffers of at least ``numel`` elements (grown by doubling up to config.stage_numel, or
        to a larger unit's size: StateFormat.stage_scale). ``dtype`` names the pool;
        ``layout(numel)``, if given, lists the pair's (size, dtype)
        (compact_streamed.stage_layout), else two buffers of ``numel`` elements of ``dtype``."""
        have = self.numel.get(dtype, 0)
        if numel <= have or not self.is_async:
            return
        numel = max(numel, min(2 * have, config.stage_numel))
        shapes = layout(numel) if layout is not None else [(numel, dtype)] * 2
        pairs = []
        for _ in range(config.ring_size):
            pair = tuple(torch.empty(size, dtype=kind, device=self.device) for size, kind in shapes)
            for buf in pair:  # freed while queued work may still use them: not reused before
                for stream in (self.load, self.update, self.store):
                    buf.record_stream(stream)
            pairs.append(pair)
        self._pools[dtype] = [pairs, [None] * config.ring_size, 0]
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
        pool[2] = (index + 1) % config.ring_size
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
        wait for the oldest until at most config.in_flight_bytes remain (see there)."""
        self.in_flight.append((record(self.update), nbytes))
        self.in_flight_bytes += nbytes
        while self.in_flight_bytes > config.in_flight_bytes and len(self.in_flight) > 1:
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
class _Plan:
    """What a step over one set of parameters needs besides the gradients, worked out the
    first time that set steps (the same set steps every time in training)."""

    slots: list  # the stepping slots, in parameter order
    entries: list  # their state dicts
    held: list  # the state tensors the units were cut from (StateFormat.hold)
    units: list  # the format's
    ring: StagingRing
    steps: list  # each slot's step count on the device (views of one tensor)
    params: list = dataclasses.field(default_factory=list)  # the slots' parameters
    data_ptrs: list = dataclasses.field(default_factory=list)  # their memory when the units were cut


@dataclasses.dataclass(eq=False)
class _Job:
    """One optimizer's step, checked, whose GPU work is not queued yet (see _run_jobs)."""

    owner: "StreamedEngine"
    plan: _Plan
    grads: list  # the plan's slots' gradients, in its order
    args: list  # each unit's kernel arguments at step() time (StateFormat.step_args)
    whole_step: bool  # False inside a backward: a parameter's verdict is its own


@dataclasses.dataclass
class _Verdict:
    """A step whose inf/NaN verdict is still on its way to the host."""

    done: Optional[object]  # event after the copy (None: synchronous)
    found: torch.Tensor  # host flags of the steps queued together, this one's at ``index``
    index: int
    count: int  # parameters judged
    whole_step: bool
    orders: Optional[list] = None  # the slots whose host step counts it settles (counts_on_host)


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
        # The inner optimizer's state format (offload_plugin.formats.registry): everything that
        # depends on the kind of state.
        self.format = state_formats.for_optimizer(inner.contract(options.optimizer_cls), options.optimizer_cls)
        # Each slot's weight (by slot.order) as our last update left it, for a format whose
        # state derives from the weight (StateFormat.watches_weights).
        self._weights = WeightTracker(version)

    @property
    def where_text(self) -> str:
        return f"with the state in host memory, updated on the device {self.format.kernel_text} (the state streamed through it)"

    @property
    def takes_amp_scale(self) -> bool:
        return True  # (the fused kernel divides by the scale: see CPUOffloadOptimizer's)

    def accepts(self, group: dict, params: list[torch.Tensor]) -> bool:
        return eligible(self.options, self.defaults, group, params)

    def still_applies(self) -> bool:
        """Whether every group, as edited or loaded since, still asks for what the format's
        update does here (StateFormat.leaves); else the host update takes over, as building
        with that setting gives (see eligible)."""
        for index, group in enumerate(self.param_groups):
            why = self.format.leaves(self.inner, index, group)
            if why is None:
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
            # made anew checks the entry, adamw_moments._check_adam_state, and refuses it as torch does)
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
        marks do not see it (through another view, or a raw pointer): the format drops what
        its state derived from every weight (CompactAdamW's remainders: each master restarts
        from its weight)."""
        if self.format.watches_weights:
            self._take_new_weights(self.slots)

    def forget_state(self) -> None:
        """The host state was replaced (load_state_dict, ``state[p] = ...``) after a
        settle(): read the step counts and moments from it anew."""
        forget_batches(self.inner)
        self._device_steps, self._step_views, self._steps_moved = None, [], False
        self._plans.clear()
        # (a loaded remainder: CompactAdamW decides at its next update, see before_update)
        self._weights.clear()
        if self.format.watches_weights:
            for slot in self.slots:
                self._weights.matched(slot.order, slot.param)

    def _take_verdict(self, counted: bool = False) -> None:
        """Report the last step's verdict (its copy is long done when the next step starts),
        and where the format keeps counts on the host advance those of the slots it stepped,
        unless ``counted``: read from the device just now."""
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
            scaling.report_skipped_step(count=verdict.count)
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
        if plan is not None and not (self.format.current(plan.entries, plan.held) and _params_unmoved(plan)):
            self._plans.clear()  # (state replaced in a state dict, or weights: cut anew)
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
        own_check = inner.contract(type(self.inner)).hook(self.inner, "check_group")
        for index, group in enumerate(groups):
            check_hyperparameters(index, group)
            if isinstance(self.inner, torch.optim.Adam):  # (the adamw format: torch's own rules)
                check_fused_flags(index, group)
            if own_check is not None:
                own_check(index, group)
        amp_scale = self.amp_scale
        check_amp_scaler(self.options, amp_scale, engine=STREAMED,
                         format_takes_scale=self.format.takes_grad_scale)
        self.scaling.apply_clip_now(grads)
        if plan is None:
            plan = self._plans[key] = self._plan(stepping)
        ring = plan.ring
        # A weight written outside the optimizer since our last update is the truth now:
        # what the state derived from the old one goes before the arguments are read.
        self.adopt_changed_weights(plan.slots)
        if in_backward:
            _flush_when_backward_ends(ring)
        # torch.amp.GradScaler's scale, handed over instead of unscaling the gradients (see
        # CPUOffloadOptimizer._step_supports_amp_scaling): the kernel divides by it, as torch's
        # fused AdamW's does. (Its found_inf is the verdict on these same gradients that
        # ours takes: a step it flags is skipped here too, the counts left as they were.)
        args = self.format.step_args(self.inner, plan.slots, plan.units, groups, self._host_counts, amp_scale)
        ring.queued.append(_Job(self, plan, grads, args, whole_step=not in_backward))
        ring.queued_numel += sum(g.numel() for g in grads)
        self._queued_on = ring
        self._steps_moved = True
        if in_backward:
            if ring.queued_numel >= config.flush_numel:
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
        index_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        group_of = [index_of[id(s.param)] for s in slots]
        fmt = self.format
        entries = fmt.entries(self.inner, slots, group_of, pin=ring.is_async and self.arena.pin)
        units = fmt.cut(slots, entries, group_of, config.stage_numel * fmt.stage_scale)
        for unit in units:
            fmt.reserve(ring, unit)
        if fmt.watches_weights:
            for slot in slots:
                if not self._weights.watches(slot.order):
                    self._weights.matched(slot.order, slot.param)
        params = [s.param for s in slots]
        return _Plan(slots, entries, fmt.hold(entries), units, ring, self._steps_of(slots), params,
                     list(map(torch.Tensor.data_ptr, params)))

    def adopt_changed_weights(self, slots: Optional[list[HostSlot]] = None) -> None:
        """Weights written outside the optimizer since our last update (their version
        counters moved): the format drops what its state derived from them (CompactAdamW's
        remainders, unless a resume's digest keeps them), before an update, or a state dict,
        reads it."""
        if not self.format.watches_weights:
            return
        slots = self.slots if slots is None else slots
        changed = [s for s in slots if self._weights.changed(s.order, s.param)]
        if changed:
            self._take_new_weights(changed)

    def _take_new_weights(self, slots: list[HostSlot]) -> None:
        """The weights of ``slots`` are new: the state follows them."""
        self.settle()  # (no copy into the host state in flight)
        self.format.weights_written(self.inner, slots)
        for slot in slots:
            self._weights.matched(slot.order, slot.param)

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
    """Queue the GPU work of ``jobs``: their verdicts at once, each unit's state in, its
    kernel and its state out, the step counts, and the verdicts' copy to the host.

    The current stream is switched by hand (_use), not by ``with torch.cuda.stream(...)``:
    inside a backward this runs on the thread that launches backward's kernels, and the
    contexts cost a third of a unit's host time there. The caller's stream is restored."""
    caller = (torch.cuda.current_device(), torch.cuda.current_stream(ring.device)) if ring.is_async else None
    try:
        if caller is not None:
            ring.update.wait_stream(caller[1])  # the gradients are written there
            for job in jobs:  # the last copies into host memory of the moments read now
                if job.owner._written is not None:
                    ring.load.wait_event(job.owner._written)
        steps = [s for job in jobs for s in job.plan.steps]
        _use(ring, ring.update)
        each, flags = _verdicts(jobs)
        torch._foreach_add_(steps, 1)
        args = _args_on_device(jobs, ring)
        filling: dict = {}  # pool -> (buffer index, elements used, bytes used): small units share a buffer
        for job, found, job_args in zip(jobs, each, args):
            fmt = job.owner.format
            for unit, arg in zip(job.plan.units, job_args):
                _run_unit(fmt, unit, job, ring, found, arg, filling)
            if fmt.watches_weights:  # (our own writes leave the version counters as they were)
                for slot in job.plan.slots:
                    job.owner._weights.matched(slot.order, slot.param)
        for pool, (index, *_) in filling.items():
            ring.release(pool, index)
        _use(ring, ring.update)
        torch._foreach_sub_(steps, [found for job, found in zip(jobs, each) for _ in job.plan.steps])
        host = torch.empty(len(jobs), dtype=torch.float32, pin_memory=ring.is_async)
        done = None
        if caller is not None:
            ring.store.wait_event(record(ring.update))
            _use(ring, ring.store)
            host.copy_(flags, non_blocking=True)
            # (flags were made on the update stream, whose next flush would reuse their memory
            # while this copy, behind the copies out, may not have read them yet)
            flags.record_stream(ring.store)
            done = record(ring.store)
        else:
            host.copy_(flags)
    finally:
        if caller is not None:
            torch.cuda.set_stream(caller[1])
            if caller[0] != ring.device.index:
                torch.cuda.set_device(caller[0])
    for i, job in enumerate(jobs):
        job.owner._written = done
        orders = [s.order for s in job.plan.slots] if job.owner.format.counts_on_host else None
        job.owner._verdict = _Verdict(done, host, i, len(job.plan.steps), job.whole_step, orders)


def _use(ring: StagingRing, stream) -> None:
    """Make ``stream`` current (nothing on the CPU, where there are no streams)."""
    if ring.is_async:
        torch.cuda.set_stream(stream)


def _args_on_device(jobs: list[_Job], ring: StagingRing) -> list:
    """Each job's units' arguments on the ring's device, each format's in as few copies as
    it can (StateFormat.to_device) for all its jobs together."""
    by_format: dict = {}
    for k, job in enumerate(jobs):
        by_format.setdefault(job.owner.format, []).append(k)
    out = [None] * len(jobs)
    for fmt, ks in by_format.items():
        flat = fmt.to_device([arg for k in ks for arg in jobs[k].args], ring)
        at = 0
        for k in ks:
            out[k], at = flat[at:at + len(jobs[k].args)], at + len(jobs[k].args)
    return out


def _run_unit(fmt, unit, job: _Job, ring: StagingRing, found: torch.Tensor, arg, filling: dict) -> None:
    """Queue one unit of format ``fmt``: its state in, the kernel, its state out.
    ``filling``: per pool the staging pair being filled and how much of it is used; a unit
    that does not fit takes the next pair (the caller releases the last ones)."""
    if not ring.is_async:  # (tests on the CPU: the kernel updates the host state in place)
        fmt.update(unit, fmt.host_views(unit), job.grads, job.plan.steps, found, arg)
        return
    pool, numel, nbytes = fmt.stage_size(unit)
    index, used, used_bytes = filling.get(pool, (None, 0, 0))
    if (index is None or used + numel > ring.numel[pool]
            or (nbytes and used_bytes + nbytes > ring.buffers(pool, index)[1].numel())):
        if index is not None:
            ring.release(pool, index)
        index, used, used_bytes = ring.take(pool), 0, 0
    filling[pool] = (index, used + -(-numel // ALIGN) * ALIGN, used_bytes + nbytes)
    views = fmt.staged_views(unit, ring, index, used, used_bytes)
    torch.cuda.set_stream(ring.load)  # (by hand: see _run_jobs, which restores the caller's)
    fmt.stage_in(unit, views)
    ring.loaded.record(ring.load)
    ring.update.wait_event(ring.loaded)
    torch.cuda.set_stream(ring.update)
    fmt.update(unit, views, job.grads, job.plan.steps, found, arg)
    ring.updated.record(ring.update)
    ring.store.wait_event(ring.updated)
    torch.cuda.set_stream(ring.store)
    fmt.stage_out(unit, views)


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


def _params_unmoved(plan: _Plan) -> bool:
    """Whether each stepping parameter still has the memory the plan's units were cut from:
    ``p.data = t`` (``module.to()`` does it) gives it new memory, which torch's AdamW
    updates (or refuses, for another dtype); the units' views would go on updating the old.
    (One C-level pass: about 0.1 us a parameter.)"""
    return list(map(torch.Tensor.data_ptr, plan.params)) == plan.data_ptrs


def _nonfinite_each(grads: list[torch.Tensor]) -> torch.Tensor:
    """A float vector on the gradients' device (one dtype, none empty): 1.0 where a
    gradient holds an inf or NaN, else 0.0, without waiting. The largest magnitude of each
    is finite exactly when all its elements are (NaN propagates through the maximum; a sum
    of magnitudes could overflow for finite values)."""
    largest = torch._foreach_norm(grads, math.inf)
    return (~torch.stack(largest).isfinite()).float()
