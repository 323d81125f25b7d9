"""CPUOffloadOptimizer's options: each checked alone at construction, with the fix in each
message, and the table of how they combine (``COMBINATIONS``).

``COMBINATIONS`` is the one place that says which combinations of options, parameters and
calls are refused (and what to do instead), and which update engine runs the others: the
*streamed* engine (``offload_plugin.engines.streamed``: the state in host memory, updated on the
GPU) or the *host* engine (``optimizer_cls.step`` on host copies; its step schedules are
chosen in ``offload_plugin.engines.schedules``). The functions below apply it where each rule can be
judged: :class:`Options` at construction, :func:`check_device_share` and
:func:`check_host_only` for each parameter group, :func:`engine_for` to choose a group's
engine, :func:`check_overlap` in ``overlap_next_step()`` and :func:`check_amp_scaler` in
``step()``. docs/options.md's table of combinations is :func:`combinations_markdown`'s
output (tests/test_options_table.py compares them).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
from collections.abc import Iterable
from itertools import chain
from types import SimpleNamespace
from typing import Callable, Optional, Union

import torch
from torch.optim import Optimizer

from offload_plugin.distributed import DTensor
from offload_plugin.formats import registry
from offload_plugin.formats.inner import contract
from offload_plugin.host.grad_checks import NONFINITE_POLICIES

__all__ = [
    "Options", "OWN_OPTIONS", "resolve_optimizer_cls", "check_trainable", "Rule", "COMBINATIONS",
    "check_device_share", "check_host_only", "engine_for", "check_overlap", "check_amp_scaler",
    "combinations_markdown",
]

# Optimizers whose step is not a per-parameter update that can run on host copies.
_UNSUPPORTED = {
    torch.optim.LBFGS: "it re-evaluates the model through a closure inside step()",
    torch.optim.SparseAdam: "it needs sparse gradients, which are not offloaded",
}


# The on/off options (each must be a bool).
_FLAGS = ("offload_gradients", "master_weights", "pin_memory", "check_host_memory",
          "delayed_update", "accumulate_on_device")


@dataclasses.dataclass
class Options:
    """The constructor's options (see CPUOffloadOptimizer for what each does)."""

    optimizer_cls: type
    optimizer_kwargs: dict
    offload_gradients: bool = False
    master_weights: bool = False
    pin_memory: bool = True
    nonfinite_grads: str = "skip"
    check_host_memory: bool = True
    delayed_update: bool = False
    host_threads: Optional[int] = None
    accumulate_on_device: bool = False
    device_fraction: float = 0.0

    def __post_init__(self) -> None:
        self.optimizer_cls = resolve_optimizer_cls(self.optimizer_cls)
        _check_option_names(self.optimizer_cls, self.optimizer_kwargs)
        for name in _FLAGS:
            value = getattr(self, name)
            # bool("false") is True: a quoted YAML value or a CLI string would silently
            # turn the option on. (0 and 1 are taken, as bool() reads them.)
            if not isinstance(value, bool) and not (isinstance(value, int) and value in (0, 1)):
                raise TypeError(
                    f"{name} must be True or False, got {value!r} ({type(value).__name__}). "
                    f"In a YAML config, write {name}: true or {name}: false, unquoted."
                )
        if self.optimizer_kwargs.get("capturable"):
            # torch's step asserts on host tensors ("If capturable=True, params and
            # state_steps must be on supported devices"), at every step.
            raise ValueError(
                "capturable=True does not apply: the update runs on host (CPU) copies, which "
                "CUDA graphs cannot capture. Leave capturable unset (False)."
            )
        if self.nonfinite_grads not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite_grads must be one of {NONFINITE_POLICIES}, got {self.nonfinite_grads!r}"
            )
        if not (isinstance(self.device_fraction, (int, float)) and 0 <= self.device_fraction < 1):
            raise ValueError(
                f"device_fraction must be in [0, 1), got {self.device_fraction!r}; to keep the "
                "whole optimizer on the device, use optimizer_cls directly."
            )
        host_threads = self.host_threads
        if host_threads is not None and (
                not isinstance(host_threads, int) or isinstance(host_threads, bool) or host_threads < 1):
            raise ValueError(f"host_threads must be a positive int or None, got {host_threads!r}")
        _apply("Options", accumulate_on_device=self.accumulate_on_device,
               offload_gradients=self.offload_gradients, device_fraction=self.device_fraction,
               host_only=_host_only(self.optimizer_cls), cls=self.optimizer_cls.__name__)
        self.offload_gradients, self.master_weights = bool(self.offload_gradients), bool(self.master_weights)
        self.delayed_update = bool(self.delayed_update)
        self.accumulate_on_device = bool(self.accumulate_on_device)
        self.device_fraction = float(self.device_fraction)
        if (issubclass(self.optimizer_cls, torch.optim.Adam)
                and not {"fused", "foreach", "capturable", "differentiable"} & self.optimizer_kwargs.keys()):
            # No speed flag needed: Adam(W) without a choice of implementation runs torch's
            # fused kernel on the host (and the one-pass native update where it applies),
            # bit-identical to torch.optim.AdamW(fused=True) on the same tensors; torch's
            # own default there is a per-tensor loop several times slower (FACTS: 0.81 vs 4.64
            # G params/s on the H200 host). fused=False or foreach keeps torch's loop.
            self.optimizer_kwargs = dict(self.optimizer_kwargs, fused=True)

    def defaults(self) -> dict:
        """``optimizer_cls``'s defaults with these hyperparameters, checked by the class itself
        ("Invalid learning rate: -1.0") before anything is allocated or hooked."""
        # A 1x1 matrix: classes for matrices (torch.optim.Muon) refuse a 1-D probe.
        return dict(self.optimizer_cls([torch.zeros(1, 1)], **self.optimizer_kwargs).defaults)


OWN_OPTIONS = ["optimizer_cls"] + [f.name for f in dataclasses.fields(Options)
                                   if f.name not in ("optimizer_cls", "optimizer_kwargs")]


def resolve_optimizer_cls(optimizer_cls: Union[str, type]) -> type:
    """The class for a dotted path or a class; refused if it cannot run on host copies."""
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
    contract(optimizer_cls)  # (what it declares for the offload optimizer, checked: offload_plugin.formats.inner)
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
            close = difflib.get_close_matches(name, OWN_OPTIONS + theirs, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"CPUOffloadOptimizer got an unknown option {name!r}: it is neither one of its "
                f"own ({', '.join(OWN_OPTIONS)}) nor an argument of "
                f"{optimizer_cls.__name__} ({', '.join(theirs)}).{hint}"
            )


def check_trainable(params: list[torch.Tensor], held: Iterable[torch.Tensor] = ()) -> None:
    """Refuse, before anything is allocated, tensors the host update cannot train, or not on
    the device of the others (``held``: those already given)."""
    devices = {p.device for p in chain(params, held)}
    if len(devices) > 1:
        raise ValueError(
            "CPUOffloadOptimizer needs all trainable parameters on one device, got "
            f"{sorted(map(str, devices))}. Move the model with model.to(device) first."
        )
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


# ------------------------------------------------------------------ combinations

REFUSED, HOST, STREAMED = "refused", "host", "streamed"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of :data:`COMBINATIONS`."""

    check: str  # the function that applies the row (so also when: see _WHEN)
    combination: str  # what is combined, as docs/options.md shows it (markdown)
    update: str  # REFUSED (raises ValueError), or the engine that runs: HOST or STREAMED
    when: Callable[[SimpleNamespace], bool]  # on the facts that ``check`` gathers
    text: str  # REFUSED: the error, saying what to do ({name}: a fact); else why this engine


# When each check runs (the docs' "checked" column).
_WHEN = {
    "Options": "construction",
    "check_device_share": "each param group",
    "check_host_only": "each param group",
    "engine_for": "each param group",
    "check_overlap": "`overlap_next_step()`",
    "check_amp_scaler": "`step()`",
}

# Every rule about how options, parameters and calls combine. Each check reads its own rows
# in order; the first row whose condition holds decides (engine_for falls through to the
# streamed engine only at its last row). The comments say why a rule exists.
# The state families' own optimizers (bf16_host_only), as the rows name them.
_OWN = registry.optimizer_names()

COMBINATIONS: tuple[Rule, ...] = (
    # Without offload_gradients the gradients stay on the device anyway: nothing to accumulate
    # there instead of on the host.
    Rule("Options", "`accumulate_on_device` without `offload_gradients`", REFUSED,
         lambda f: f.accumulate_on_device and not f.offload_gradients,
         "accumulate_on_device=True only applies with offload_gradients=True (without "
         "it, gradients stay on the device anyway)."),
    # CompactAdamW and AdamW8bit (bf16_host_only) have no device implementation for the kept share.
    Rule("Options", f"`device_fraction` with {_OWN}", REFUSED,
         lambda f: f.device_fraction and f.host_only,
         "optimizer_cls={cls} updates host tensors only; it "
         "does not combine with device_fraction. Use device_fraction=0."),
    # The device share keeps whole tensors in an ordinary optimizer on their device; a
    # DTensor's state would have to be sharded there too, which is not built.
    Rule("check_device_share", "`device_fraction` with FSDP2 (DTensor) parameters", REFUSED,
         lambda f: f.dtensor_kept,
         "device_fraction is not supported with DTensor (FSDP2) parameters yet; "
         "use device_fraction=0."),
    # CompactAdamW and AdamW8bit keep one fp32 scale per block of a row: a shard must hold whole rows.
    Rule("check_host_only", f"{_OWN} with DTensor parameters sharded other than by rows",
         REFUSED, lambda f: f.host_only and f.placements is not None,
         "a parameter is sharded as {placements}: state kept per row (8-bit state's "
         "block scales) needs parameters sharded along dim 0 only, as FSDP2's fully_shard "
         "shards them."),
    # Adafactor keeps row and column statistics: on a shard each rank would compute them
    # from its own rows, and its state is not shaped like the shard to save by rows.
    Rule("check_host_only", "`torch.optim.Adafactor` (factored state) with FSDP2 (DTensor) parameters",
         REFUSED, lambda f: f.factored and f.sharded,
         "optimizer_cls={cls} keeps factored state (row and column statistics), which each rank "
         "could only compute from its own rows: it does not combine with DTensor (FSDP2) "
         "parameters. Use an optimizer_cls whose state is shaped like the parameter (AdamW, "
         "AdamW8bit, CompactAdamW, SGD, ...)."),
    # CompactAdamW's master is the bf16 weight plus its own 16-bit remainder; AdamW8bit is
    # bitsandbytes' update on the bf16 weight itself.
    Rule("check_host_only", f"{_OWN} with parameters not bf16, or `master_weights`",
         REFUSED, lambda f: f.host_only and (f.master_weights or set(f.dtypes) - {"torch.bfloat16"}),
         "optimizer_cls={cls} updates bf16 host copies and keeps the master itself: it "
         "needs bf16 parameters (got {dtypes_list}) and master_weights=False (the "
         "default; got {master_weights}). Convert the model with "
         "model.to(torch.bfloat16) (torchtune: dtype=bf16)."),
    # Only the offload_gradients backward hooks bring the gradients to the host early.
    Rule("check_overlap", "`overlap_next_step()` without `offload_gradients`", REFUSED,
         lambda f: not f.offload_gradients,
         "overlap_next_step() needs CPUOffloadOptimizer(offload_gradients=True)."),
    # delayed_update's step() returns at once anyway: early_forward would add nothing.
    Rule("check_overlap", "`overlap_next_step(early_forward=True)` with `delayed_update`",
         REFUSED, lambda f: f.early_forward and f.delayed_update,
         "overlap_next_step(early_forward=True) does not combine with delayed_update=True, "
         "whose step() returns at once anyway; pass early_forward=False (`early_forward: "
         "False` in our recipes)."),
    # Each rank's next forward would wait on weights that the other ranks' updates gate,
    # unseen by this rank's hooks.
    Rule("check_overlap", "`overlap_next_step(early_forward=True)` with FSDP2 (DTensor) "
         "parameters", REFUSED, lambda f: f.early_forward and f.sharded,
         "overlap_next_step(early_forward=True) is not supported with DTensor (FSDP2) "
         "parameters; pass early_forward=False (`early_forward: False` in our recipes)."),
    # GradScaler checks and unscales the gradients on the model, where offloaded gradients
    # of DTensor parameters leave nothing (the others leave a handle it unscales: grad_handle).
    Rule("check_amp_scaler", "torch.amp `GradScaler` with `offload_gradients` and DTensor (FSDP2) "
         "parameters", REFUSED,
         lambda f: f.grad_scale is not None and f.offload_gradients and f.hidden_grads,
         "torch.amp.GradScaler with offload_gradients=True and DTensor (FSDP2) parameters: "
         "their gradients are moved to host memory during backward, where GradScaler cannot "
         "check or unscale them. Use offload_gradients=False with GradScaler, or train in "
         "bf16 without a scaler (as torchtune does). Nothing was updated."),
    # A format's kernel may take no scale to divide by (CompactAdamW's: bf16 needs no loss
    # scaling); torch's fused AdamW kernel divides by it.
    Rule("check_amp_scaler", "torch.amp `GradScaler` on the streamed engine with a state format "
         f"whose kernel takes no scale ({_OWN})",
         REFUSED, lambda f: f.grad_scale is not None and not f.format_takes_scale and f.engine == STREAMED,
         "CPUOffloadOptimizer: the streamed update of optimizer_cls={cls} takes no GradScaler scale (its parameters are bf16, which needs no loss scaling): leave the GradScaler "
         "out, or unscale the gradients with scaler.unscale_(optimizer) first. Nothing "
         "was updated."),
    # The engines: the first row that holds decides. The streamed engine is torch's fused
    # AdamW kernel (or CompactAdamW's) on the GPU over the parameters and their gradients
    # where backward left them, with only the optimizer state in host memory.
    Rule("engine_for", "`OFFLOAD_PLUGIN_STREAMED=0` in the environment", HOST,
         lambda f: not f.streaming_on, "asked for (to compare the two engines)"),
    Rule("engine_for", "a group without parameters for the engines (all frozen, or kept on "
         "the device)", STREAMED, lambda f: f.empty,
         "nothing to update: the other groups decide"),
    Rule("engine_for", "parameters not on a CUDA device", HOST,
         lambda f: not f.device_streams, "the streamed engine runs its kernel on a GPU"),
    Rule("engine_for", "`offload_gradients`", HOST, lambda f: f.offload_gradients,
         "the gradients are in host memory; the streamed engine reads them on the GPU"),
    Rule("engine_for", "`master_weights`", HOST, lambda f: f.master_weights,
         "the fp32 masters are host copies; the streamed engine keeps none"),
    Rule("engine_for", "`delayed_update`", HOST, lambda f: f.delayed_update,
         "the update runs during the next step, on host copies of weights and gradients"),
    Rule("engine_for", "`device_fraction` keeping parameters on the device", HOST,
         lambda f: f.kept_on_device,
         "it shortens the host update's tail, which the streamed engine does not have"),
    # What the streamed engine moves through the GPU is a state format (state_formats): one
    # module per format says what its kernel takes (refuses), so a new format adds no row.
    Rule("engine_for", "an `optimizer_cls` with no streamed state format (torch's Adam and "
         "AdamW move the `adamw` format, `CompactAdamW` its `compact` one; SGD and others "
         "have none)", HOST, lambda f: f.format is None,
         "the streamed engine moves a state format through the GPU; another optimizer steps "
         "on the host"),
    Rule("engine_for", "a parameter not a plain contiguous tensor (DTensor, NF4, a transposed "
         "view, ...)", HOST, lambda f: not f.plain,
         "the streamed engine's kernels update whole, contiguous local tensors"),
    Rule("engine_for", "what the state format refuses (its `refuses()`: Adam(W) without `fused` "
         "(the default sets it), or with `amsgrad`, `capturable` or `differentiable`, or not "
         "fp32, bf16 or fp16; `CompactAdamW` without Triton)", HOST,
         lambda f: f.format_refuses is not None,
         "each format's module says what its kernel takes"),
    Rule("engine_for", "any other combination (a state format on a GPU)",
         STREAMED, lambda f: True,
         "the state passes through the GPU, 8 bytes per parameter each step, and no host "
         "core works; Adam(W) is bit for bit torch's `AdamW(fused=True)` there"),
)

def _host_only(optimizer_cls: type) -> bool:
    return contract(optimizer_cls).bf16_host_only  # (CompactAdamW)


def _apply(check: str, **facts) -> Optional[Rule]:
    """The first of ``check``'s rows that holds for ``facts``; ValueError if it refuses."""
    f = SimpleNamespace(**facts)
    for rule in COMBINATIONS:
        if rule.check == check and rule.when(f):
            if rule.update == REFUSED:
                raise ValueError(rule.text.format(**facts))
            return rule
    return None


def check_device_share(params_kept_on_device: list[torch.Tensor]) -> None:
    """Refuse what the device share (``device_fraction``) cannot keep."""
    _apply("check_device_share", dtensor_kept=any(isinstance(p, DTensor) for p in params_kept_on_device))


def check_host_only(optimizer_cls: type, master_weights: bool, params: list[torch.Tensor]) -> None:
    """Refuse parameters that a ``bf16_host_only`` class (CompactAdamW) cannot update, and
    DTensor parameters to a class with factored state, before anything is allocated."""
    placements = next((tuple(p.placements) for p in params if isinstance(p, DTensor)
                       and any(q.is_shard() and q.dim != 0 for q in p.placements)), None)
    dtypes = sorted({str(p.dtype) for p in params})
    _apply("check_host_only", host_only=_host_only(optimizer_cls), cls=optimizer_cls.__name__,
           master_weights=master_weights, placements=placements, dtypes=dtypes,
           dtypes_list=", ".join(dtypes), factored=issubclass(optimizer_cls, torch.optim.Adafactor),
           sharded=any(isinstance(p, DTensor) for p in params))


def engine_for(options: Options, settings: dict, params: list[torch.Tensor], *, kept_on_device: bool,
               streaming_on: bool, device_streams: bool, on_cpu: bool = False) -> str:
    """``"streamed"`` or ``"host"``: the engine that updates ``params``, a group whose
    hyperparameters are ``settings`` (the group's, over the optimizer's defaults).

    The device's facts are inputs: ``kept_on_device`` (device_fraction keeps some parameters
    on the device), ``streaming_on`` (the streamed engine is switched on), ``device_streams``
    (the parameters are where its kernels run) and ``on_cpu`` (tests run them on the host)."""
    cls = options.optimizer_cls
    fmt = registry.for_optimizer(contract(cls), cls)
    plain = all((type(p) is torch.nn.Parameter or type(p) is torch.Tensor) and p.is_contiguous()
                for p in params)
    return _apply(
        "engine_for", streaming_on=streaming_on, empty=not params, device_streams=device_streams,
        offload_gradients=options.offload_gradients, master_weights=options.master_weights,
        delayed_update=options.delayed_update, kept_on_device=kept_on_device, format=fmt,
        plain=plain, format_refuses=fmt.refuses(params, settings, on_cpu) if fmt and plain and params else None,
    ).update


def check_overlap(options: Options, *, early_forward: bool, sharded: bool) -> None:
    """Refuse an ``overlap_next_step(early_forward=...)`` these options cannot run;
    ``sharded``: the parameters are DTensors (FSDP2)."""
    _apply("check_overlap", offload_gradients=options.offload_gradients,
           delayed_update=options.delayed_update, early_forward=early_forward, sharded=sharded)


def check_amp_scaler(options: Options, grad_scale: Optional[torch.Tensor], engine: str = HOST,
                     format_takes_scale: bool = True, hidden_grads: bool = False) -> None:
    """Refuse torch.amp.GradScaler's scale (``optimizer.grad_scale``, handed to ``step()``)
    where the update cannot take it; ``engine``: the one that runs this step, with a state
    format whose kernel takes a scale or not (``format_takes_scale``); ``hidden_grads``:
    offloaded gradients leave no handle on ``.grad`` (grad_handle)."""
    if grad_scale is None:  # (every step asks, one optimizer per parameter under optimizer_in_bwd)
        return
    _apply("check_amp_scaler", grad_scale=grad_scale, offload_gradients=options.offload_gradients,
           format_takes_scale=format_takes_scale, engine=engine, hidden_grads=hidden_grads,
           cls=getattr(options.optimizer_cls, "__name__", options.optimizer_cls))


def combinations_markdown() -> str:
    """docs/options.md's table of combinations, from :data:`COMBINATIONS`."""
    lines = ["| combination | update | checked | why, or what to do |", "|---|---|---|---|"]
    for rule in COMBINATIONS:
        update = "refused (`ValueError`)" if rule.update == REFUSED else rule.update
        text = re.sub(r"\{\w+\}", "…", rule.text).replace("|", "\\|")
        lines.append(f"| {rule.combination} | {update} | {_WHEN[rule.check]} | {text} |")
    return "\n".join(lines) + "\n"
