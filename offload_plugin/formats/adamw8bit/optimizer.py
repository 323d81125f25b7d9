"""``AdamW8bit``: bitsandbytes' AdamW8bit on bf16 weights, with its state in host memory.

torchtune's stock single-device full fine-tuning configs use bitsandbytes'
``PagedAdamW8bit``: AdamW with block-wise 8-bit moments (Dettmers et al., "8-bit Optimizers
via Block-wise Quantization", 2022), 2 bytes of state per parameter, on the GPU. This class
is that update as an ordinary ``torch.optim.Optimizer`` for ``CPUOffloadOptimizer``::

    CPUOffloadOptimizer(model.parameters(), optimizer_cls="offload_plugin.AdamW8bit", lr=2e-5)

or, in a torchtune config, ``optimizer.optimizer_cls=offload_plugin.AdamW8bit``. On a GPU the
offload optimizer keeps the state in host memory and streams it through the GPU each step,
where ``adamw8bit_gpu``'s kernel updates it next to the weights (``adamw8bit_streamed``): 2
bytes per parameter cross the bus each way, half of what exact AdamW's bf16 moments need.
Without a GPU it updates bf16 host copies with :meth:`AdamW8bit.step`.

The update is bitsandbytes 0.50's own, as its CPU backend computes it (the one backend whose
arithmetic is fully specified: its CUDA kernel is built with fast math and decays the
weight after the update), operation for operation: the moments dequantized (a code's value
in the map times its block's absmax), updated with the same fused multiply-adds, the weight
decayed and stepped in fp32 and rounded to bf16, and the moments quantized again by
bitsandbytes' 65,536-bin lookup table (:func:`quantize_`). From the same weights, gradients
and state, the weights, codes and scales are bitsandbytes' bit for bit
(tests/test_adamw8bit.py). Parameters under ``min_8bit_size`` elements (4096) keep fp32
moments and take bitsandbytes' 32-bit update, as there.

The state is bitsandbytes' too. Each entry holds ``step`` (a 0-d fp32 tensor, as torch's
optimizers count), ``state1`` and ``state2`` (uint8 codes of the signed and unsigned
dynamic maps, shaped like the parameter; fp32 moments for small parameters) and
``absmax1``/``absmax2`` (fp32, one per 256 elements). :meth:`state_dict` is bitsandbytes'
layout (its maps, a Python-int ``step``, the tensors under ``__bnb_optimizer_quant_state__``), so
bitsandbytes' ``AdamW8bit`` and ``PagedAdamW8bit`` continue a run of this class and this
class continues theirs; loading checks every field first and changes nothing if one is
wrong. It is not exact AdamW: the moments are quantized and the weight is rounded to bf16 at
every step, as with bitsandbytes on bf16 weights (the trade-off: docs/performance.md).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer

from offload_plugin.checkpoint import loading
from offload_plugin.formats import bnb_layout as bnb_state
from offload_plugin.formats import group_checks
from offload_plugin.formats.adamw8bit.native import update_8bit_
from offload_plugin.formats.adamw8bit.update import BLOCK, MIN_8BIT_SIZE, coefficients, dynamic_map, update_32bit_
from offload_plugin.formats.block_layout import BlockLayout
from offload_plugin.formats.inner import InnerOptimizer

__all__ = ["AdamW8bit", "check_live_entry"]

_FIX = "Load the checkpoint as it was saved, or start this optimizer's state fresh (del optimizer.state[p])."


# --- the optimizer -----------------------------------------------------------------------------

# bitsandbytes' constructor arguments, with the value (or values) this update follows (None:
# any). bitsandbytes 0.50's AdamW8bit takes optim_bits=32 alone (its default) and makes the
# 8-bit update whatever it says; older releases took 8 as well.
_BNB_ARGS = {"amsgrad": False, "optim_bits": (32, 8), "args": None, "percentile_clipping": 100,
             "block_wise": True, "is_paged": None, "fused": None, "foreach": None}
# The fields of bitsandbytes' ``args`` object: 0.50 reads the first four (in place of the
# keyword arguments), with the values this update follows (None: any); older releases read
# the last two, which this update follows at their defaults only.
_ARGS_FIELDS = {"optim_bits": (8, 32), "min_8bit_size": None, "max_unorm": 0.0, "skip_zeros": False,
                "percentile_clipping": 100, "block_wise": True}
_ARGS_READ = ("optim_bits", "min_8bit_size", "max_unorm", "skip_zeros")
# bitsandbytes' group keys for other optimizers of its family, and the value meaning AdamW.
_BNB_GROUP_KEYS = {"alpha": 0.0, "t_alpha": None, "t_beta3": None}
# torch's Adam(W) group keys, and the value meaning this update (a torch checkpoint's entries
# are refused anyway; its groups must not carry settings this update would silently drop).
_TORCH_GROUP_KEYS = {"maximize": False, "capturable": False, "differentiable": False,
                     "decoupled_weight_decay": True}


class AdamW8bit(Optimizer, InnerOptimizer):
    """bitsandbytes' AdamW8bit update on contiguous bf16 CPU tensors (see the module's docstring):
    the host copies ``CPUOffloadOptimizer`` updates, or, streamed, the state it moves.

    Args:
        params: bf16 CPU tensors or param groups.
        lr, betas, eps, weight_decay: as bitsandbytes' AdamW8bit (decoupled decay, 1e-2 by
            default).
        min_8bit_size (int): parameters with fewer elements keep fp32 moments. Default 4096.
        stochastic_rounding (bool): round each new weight to bf16 stochastically instead of
            to nearest (:func:`round_weight`), so that updates smaller than half a bf16 step
            add up in expectation instead of being lost. **Not bitsandbytes' bits** (what it
            changes in training: docs/performance.md). Default False: bitsandbytes' update.
        amsgrad, optim_bits, percentile_clipping, block_wise, is_paged, fused, foreach:
            bitsandbytes' and torch's arguments, taken so that configs written for them
            work; a value asking for another update (amsgrad=True, percentile clipping, ...)
            is refused. ``optim_bits`` is 32 (bitsandbytes' default) or 8: either way the
            8-bit update, as bitsandbytes' AdamW8bit makes it. Paging has nothing to do on
            the host.
        args: bitsandbytes' configuration object, followed as bitsandbytes 0.50 follows it:
            its ``min_8bit_size`` replaces the keyword's, and ``optim_bits=32`` keeps every
            parameter's state in fp32 (bitsandbytes' 32-bit update). It must have
            ``optim_bits`` (8 or 32), ``min_8bit_size``, ``max_unorm=0.0`` and
            ``skip_zeros=False`` (and, if present, ``percentile_clipping=100`` and
            ``block_wise=True``); other values are refused.
    """

    # Its contract with CPUOffloadOptimizer (offload_plugin.formats.inner says what each means).
    bf16_host_only = True
    state_format = "adamw8bit"
    scales_gradients_in_step = True
    optional_group_keys = ("min_8bit_size", "stochastic_rounding")  # (bitsandbytes' groups lack them)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, min_8bit_size: int = MIN_8BIT_SIZE,
                 stochastic_rounding: bool = False, **bnb_args) -> None:
        for key, value in bnb_args.items():
            if key not in _BNB_ARGS:
                raise TypeError(f"AdamW8bit got an unexpected keyword argument {key!r}")
            if _BNB_ARGS[key] is not None and not _means(value, _BNB_ARGS[key]):
                raise ValueError(f"AdamW8bit makes bitsandbytes' AdamW8bit update, which takes {key}="
                                 f"{_either(_BNB_ARGS[key])}; got {key}={value!r:.40}. Leave it out.")
        if bnb_args.get("args") is not None:
            min_8bit_size = _min_8bit_size_of(bnb_args["args"])
        for key, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
                raise ValueError(f"Invalid {key}: {value!r:.40} (a finite number >= 0)")
        if not isinstance(betas, (str, bytes)) and hasattr(betas, "__iter__"):
            betas = tuple(betas)  # (a config's list)
        defaults = dict(lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay, min_8bit_size=min_8bit_size,
                        stochastic_rounding=stochastic_rounding)
        problem = group_checks.settings_problem(defaults, flags=("stochastic_rounding",))
        if problem is not None:
            raise ValueError(f"Invalid {problem[0]}: {defaults[problem[0]]!r:.60} ({problem[1]})")
        defaults["stochastic_rounding"] = bool(stochastic_rounding)  # (a checked 1 or 0)
        super().__init__(params, defaults)
        self._blocks = BlockLayout(BLOCK)  # (which parameters are FSDP2 shards, and their full shapes)

    def __getstate__(self) -> dict:
        return dict(super().__getstate__(), _full_shapes=self._blocks.full_shapes,
                    _first_rows=self._blocks.first_rows)

    def __setstate__(self, state: dict) -> None:
        full_shapes, first_rows = state.pop("_full_shapes", {}), state.pop("_first_rows", {})
        super().__setstate__(state)
        self._blocks = BlockLayout(BLOCK, full_shapes, first_rows)

    # -- layout
    def shard_of(self, p: torch.Tensor, full_shape, first_row: int = 0) -> None:
        """``p`` is this rank's rows (FSDP2) of a parameter of ``full_shape``, from row
        ``first_row`` on: its state takes the layout every rank agrees on
        (offload_plugin.formats.block_layout), and stochastic rounding its elements' places."""
        self._blocks.shard_of(p, full_shape, first_row)

    def init_state(self, p: torch.Tensor, group: dict, empty: Callable = torch.empty) -> dict:
        """``p``'s state entry, made (zeros) if it has none, in tensors from
        ``empty(shape, dtype=...)`` (the streamed update makes them in page-locked memory).
        A checked entry (check_live_entry) is kept, its count made the fp32 tensor the update
        advances."""
        entry = self.state[p]
        if entry:
            if not isinstance(entry["step"], torch.Tensor):  # (a checked count, set as bitsandbytes keeps it)
                entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)
            return entry
        entry["step"] = torch.zeros((), dtype=torch.float32)
        if self._blocks.eight_bit_when_new(p, group.get("min_8bit_size", MIN_8BIT_SIZE)):
            scales = self._blocks.scale_shape(p)
            entry.update(state1=empty(p.shape, dtype=torch.uint8).zero_(),
                         state2=empty(p.shape, dtype=torch.uint8).zero_(),
                         absmax1=empty(scales, dtype=torch.float32).zero_(),
                         absmax2=empty(scales, dtype=torch.float32).zero_())
        else:
            entry.update(state1=empty(p.shape, dtype=torch.float32).zero_(),
                         state2=empty(p.shape, dtype=torch.float32).zero_())
        return entry

    # -- the step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: Optional[float] = None) -> Optional[Any]:
        """One step. ``grad_scale``: each gradient times it first, with the bits of
        ``p.grad.mul_(grad_scale)`` before the step, inside the update's pass."""
        loss = group_checks.checked_step(self, closure, _check_tensor, check_live_entry)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                entry = self.init_state(p, group)
                entry["step"] += 1
                coeffs = coefficients(group, int(entry["step"]), grad_scale)
                w, g = p.view(-1), p.grad.view(-1)
                place = self._blocks.place(p)  # (a shard's elements' places in the parameter)
                if entry["state1"].dtype == torch.uint8:
                    update_8bit_(w, g, entry["state1"].view(-1), entry["absmax1"].view(-1),
                                 entry["state2"].view(-1), entry["absmax2"].view(-1), coeffs, *place)
                else:
                    update_32bit_(w, g, entry["state1"].view(-1), entry["state2"].view(-1), coeffs, *place)
        return loss

    def check_group(self, index: int, group: dict) -> None:
        """Refuse settings edited into param_groups[index] that the constructor refuses, or
        that load_state_dict refuses (_group_refusal): every path's step() calls it before
        it updates anything."""
        group_checks.check_settings(index, group, flags=("stochastic_rounding",))
        problem = _group_refusal(group)
        if problem is not None:
            raise ValueError(f"param_groups[{index}] {problem}: set it back (or delete the key) before the next "
                             "step(). Nothing was updated.")

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with the group's settings checked as the constructor checks them."""
        if isinstance(param_group, dict):
            group = {**self.defaults, **param_group}
            problem = group_checks.settings_problem(group, flags=("stochastic_rounding",))
            if problem is not None:
                raise ValueError(f"the new parameter group has {problem[0]}={group[problem[0]]!r:.60}; it "
                                 f"needs {problem[1]}. Nothing was added.")
        super().add_param_group(param_group)

    # -- checkpoints
    def state_dict(self) -> dict:
        """bitsandbytes' layout: each entry ``{"step": int, "__bnb_optimizer_quant_state__":
        {state1, state2[, qmap1, qmap2, absmax1, absmax2]}}``."""
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        sd["state"] = {index: self.saved_entry(params[index], entry, params[index])
                       for index, entry in sd["state"].items()}
        return sd

    def saved_entry(self, p: torch.Tensor, entry: dict, weight: torch.Tensor) -> dict:
        """``p``'s entry in bitsandbytes' layout (a new dict). A shard's stays flat and
        without maps, each tensor shaped by the parameter's rows, as a sharded checkpoint
        needs (bitsandbytes cannot read those anyway). An empty entry (``optimizer.state[p]``
        read before ``p`` stepped) stays empty, as in bitsandbytes' and torch's state dicts."""
        if not entry:
            return {}
        tensors = {k: v for k, v in entry.items() if k != "step"}
        if self._blocks.is_shard(p):
            return dict(tensors, step=entry["step"].clone())
        if tensors.get("state1") is not None and tensors["state1"].dtype == torch.uint8:
            # (copies: a loader that writes into the dict in place must not change the maps)
            tensors.update(qmap1=dynamic_map(True).clone(), qmap2=dynamic_map(False).clone())
        return {"step": int(entry["step"]), bnb_state.WRAPPED: tensors}

    def load_state_dict(self, state_dict: dict) -> None:
        """bitsandbytes' AdamW8bit/PagedAdamW8bit state dicts and this class's own (the same
        layout), everything checked before anything changes (see check_state_entry).

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: it does not match this optimizer's groups and parameters, or a group
                or entry is malformed or asks for another update; the message says which.
        """
        loading.load_checked(self, state_dict, self._group_to_load, self.check_state_entry)

    def _group_to_load(self, i: int, saved: Mapping, current: dict) -> dict:
        """Group ``i`` as this optimizer takes it: bitsandbytes' keys of other updates must
        mean AdamW (and go), its own settings are checked by the constructor and finite."""
        hyper = {k: v for k, v in saved.items() if k != "params"}
        problem = _group_refusal(hyper)
        if problem is not None:
            raise ValueError(f"parameter group {i} of the state dict {problem}: load it into the optimizer that "
                             "wrote it. Nothing was loaded.")
        for key in _REFUSED_GROUP_KEYS:  # (meaning this update: they go)
            hyper.pop(key, None)
        # ("fused", "foreach", "is_paged" stay, as in bitsandbytes' groups: torchtitan's
        # checkpointer expects every key it saved back in the next state dict.)
        for key in self.optional_group_keys:
            hyper.setdefault(key, current[key])
        missing = sorted(set(self.defaults) - hyper.keys())
        if missing:
            raise ValueError(
                f"parameter group {i} of the state dict lacks {missing}, which AdamW8bit needs (it has "
                f"{sorted(map(str, hyper))}): it was written by another optimizer class. {_FIX}")
        try:
            own = type(self)([torch.zeros(1, dtype=torch.bfloat16)], **{k: hyper[k] for k in self.defaults}).param_groups[0]
            group_checks.check_hyperparameters(i, own)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"parameter group {i} of the state dict does not work with AdamW8bit: "
                             f"{type(err).__name__}: {err}") from None
        hyper.update({k: own[k] for k in self.defaults})
        return hyper

    def check_state_entry(self, where: str, entry: Mapping, param: torch.Tensor, group: dict) -> dict:
        """A checkpoint's entry for ``param``, checked and copied into new host tensors: the
        layout bitsandbytes writes (bnb_state says what each field must be), with its maps,
        which must be the dynamic maps (other maps would change what every code means), and
        one absmax per 256 elements; or the live layout (no maps). An 8-bit or a 32-bit entry is taken whatever the
        parameter's size, as bitsandbytes takes it. A shard's entry is flat, without maps
        (saved_entry).

        Raises:
            ValueError: naming ``where`` and the key, saying what is wrong and what to do.
        """
        if self._blocks.is_shard(param):
            return self._shard_entry(where, entry, param, group)
        if bnb_state.WRAPPED not in entry and "absmax1" in entry and not {"qmap1", "qmap2"} & entry.keys():
            # (this class's live layout, as CPUOffloadOptimizer hands a checked entry on: its maps)
            entry = dict(entry, qmap1=dynamic_map(True), qmap2=dynamic_map(False))
        read = bnb_state.read_state(where, entry, param.shape)
        out = {"step": torch.tensor(float(read.step), dtype=torch.float32)}
        out.update(state1=read.tensors["state1"], state2=read.tensors["state2"])
        if not read.quantized:
            return out
        if read.block != BLOCK:
            raise ValueError(f"{where} has one absmax per {read.block} elements; this update keeps one "
                             f"per {BLOCK}, as bitsandbytes since 0.43 does. {_FIX}")
        for k, signed in ((1, True), (2, False)):
            if not torch.equal(read.tensors[f"qmap{k}"].view(torch.int32), dynamic_map(signed).view(torch.int32)):
                raise ValueError(
                    f"{where} ('qmap{k}') is not bitsandbytes' {'signed' if signed else 'unsigned'} dynamic "
                    f"map (create_dynamic_map(signed={signed})): its codes mean other values. {_FIX}")
            out[f"absmax{k}"] = read.tensors[f"absmax{k}"]
        return out

    def _shard_entry(self, where: str, entry: Mapping, param: torch.Tensor, group: dict) -> dict:
        """A shard's entry as saved_entry writes it: step, state1/state2, and per-row absmax."""
        eight = self._blocks.eight_bit_when_new(param, group.get("min_8bit_size", MIN_8BIT_SIZE)) and any(
            isinstance(entry.get(k), torch.Tensor) and entry[k].dtype == torch.uint8 for k in ("state1", "state2"))
        want = {"state1": (torch.uint8 if eight else torch.float32, tuple(param.shape)),
                "state2": (torch.uint8 if eight else torch.float32, tuple(param.shape))}
        if eight:
            want.update(absmax1=(torch.float32, self._blocks.scale_shape(param)),
                        absmax2=(torch.float32, self._blocks.scale_shape(param)))
        if set(entry) != {"step", *want}:
            raise ValueError(f"{where} has the keys {sorted(map(str, entry))}; a sharded AdamW8bit entry holds "
                             f"{sorted(['step', *want])}. {_FIX}")
        out = {"step": torch.tensor(float(bnb_state.read_step(where, entry["step"])), dtype=torch.float32)}
        for key, (dtype, shape) in want.items():
            value = entry[key]
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != shape:
                got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{where} ({key!r}) is {got}; this shard needs {dtype} {shape}. {_FIX}")
            out[key] = value.detach().to("cpu", copy=True).contiguous()
            if dtype == torch.float32:
                _finite_nonnegative(where, key, out[key], nonnegative=key != "state1")
        return out


# Group keys of other updates, with the value (or values) meaning this one.
_REFUSED_GROUP_KEYS = {**_BNB_GROUP_KEYS, **{k: v for k, v in _BNB_ARGS.items() if v is not None}, **_TORCH_GROUP_KEYS}


def _group_refusal(group: Mapping) -> Optional[str]:
    """What in a group's keys asks for another update than this one (bitsandbytes'
    AdEMAMix, torch's maximize, amsgrad, Adam's L2 decay, ...), as the end of a sentence
    naming the group, or None. load_state_dict refuses such a saved group and step() such
    an edited one: the same check, so that a run never saves a checkpoint it cannot load."""
    for key, want in _REFUSED_GROUP_KEYS.items():
        if key not in group:
            continue
        if key == "decoupled_weight_decay" and _means(group.get("weight_decay"), 0.0):
            continue  # (without decay, Adam and AdamW are the same update)
        if not _means(group[key], want):
            return (f"has {key}={group[key]!r:.40}, which bitsandbytes' AdamW8bit does not do "
                    f"({'AdEMAMix' if key in _BNB_GROUP_KEYS else key})")
    return None


def _min_8bit_size_of(args: Any) -> int:
    """``min_8bit_size`` as bitsandbytes 0.50 follows its ``args`` object, which replaces the
    keyword arguments: ``args.min_8bit_size``, or, for ``args.optim_bits=32``, no parameter
    large enough for 8 bits (its 32-bit Adam on every parameter).

    Raises:
        ValueError: a field is missing, or asks for what this update does not do.
    """
    for key, want in _ARGS_FIELDS.items():
        if key not in _ARGS_READ and not hasattr(args, key):
            continue  # (a field older releases read: 0.50 makes its update without it)
        if not hasattr(args, key):
            raise ValueError(f"AdamW8bit: args has no {key!r}; bitsandbytes reads {', '.join(_ARGS_READ)} from "
                             "it (its first step raises without them). Give all four, or leave args out.")
        value = getattr(args, key)
        if want is not None and not _means(value, want):
            raise ValueError(f"AdamW8bit makes bitsandbytes' AdamW8bit update, which follows args.{key}="
                             f"{_either(want)} only; got args.{key}={value!r:.40}. Set it so, or leave args out.")
    # (32 bits: bitsandbytes keeps every parameter's state in fp32, as parameters under
    # min_8bit_size; a number no parameter reaches says the same here)
    return args.min_8bit_size if _means(args.optim_bits, 8) else sys.maxsize


def _either(want: Any) -> str:
    return " or ".join(map(repr, want)) if isinstance(want, tuple) else repr(want)


def _means(value: Any, want: Any) -> bool:
    """Whether ``value`` is ``want`` (one of them, for a tuple) as a setting (2 means 2.0)."""
    if isinstance(want, tuple):
        return any(_means(value, w) for w in want)
    try:
        return value is None if want is None else bool(value == want)
    except (TypeError, ValueError, RuntimeError):
        return False


def _finite_nonnegative(where: str, key: str, t: torch.Tensor, nonnegative: bool) -> None:
    bad = t.numel() - int(torch.isfinite(t).sum())
    if bad:
        raise ValueError(f"{where} ({key!r}) holds {bad} inf or NaN value(s). {_FIX}")
    if nonnegative and bool((t < 0).any()):
        raise ValueError(f"{where} ({key!r}) holds negative values; it cannot. {_FIX}")


def check_live_entry(p: torch.Tensor, entry: dict, group: dict) -> None:
    """``optimizer.state[p]`` as a step needs it (edited by hand, an entry of another shape
    or dtype would be read past its end or as something else). Every path checks every
    entry with it before it updates any parameter: ``AdamW8bit.step`` (direct, and the host
    update) and the streamed format (adamw8bit_streamed).

    Raises:
        ValueError: naming the key, what it holds and what it needs.
    """
    where = f"optimizer.state[p] of a parameter of shape {tuple(p.shape)}"
    step = entry.get("step")
    # (a Python int as bitsandbytes counts, or a float tensor as torch's optimizers count;
    # init_state makes an int the tensor once every entry is checked)
    count = step if isinstance(step, int) and not isinstance(step, bool) else (
        float(step) if isinstance(step, torch.Tensor) and step.numel() == 1 and step.is_floating_point() else None)
    if count is None or not (math.isfinite(count) and 0 <= count <= bnb_state.MAX_STEPS and count == int(count)):
        raise ValueError(f"{where}: 'step' is {step!r:.40}; it must be a whole count from 0 to "
                         f"{bnb_state.MAX_STEPS:,} (a Python int, or a one-element float tensor). {_FIX}")
    s1 = entry.get("state1")
    eight = isinstance(s1, torch.Tensor) and s1.dtype == torch.uint8
    n, blocks = p.numel(), -(-p.numel() // BLOCK)
    want = {"state1": (torch.uint8, n), "state2": (torch.uint8, n), "absmax1": (torch.float32, blocks),
            "absmax2": (torch.float32, blocks)} if eight else {"state1": (torch.float32, n), "state2": (torch.float32, n)}
    for key, (dtype, numel) in want.items():
        value = entry.get(key)
        if not (isinstance(value, torch.Tensor) and value.dtype == dtype and value.numel() == numel
                and value.is_contiguous() and value.device.type == "cpu"):
            got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise ValueError(f"{where}: {key!r} is {got}; AdamW8bit needs a contiguous {dtype} CPU tensor of "
                             f"{numel} elements there. Put back the full entry, or {_FIX[_FIX.index('start'):]}")


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if t.layout == torch.strided and t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous():
        return
    raise ValueError(
        f"AdamW8bit updates dense, contiguous bf16 CPU tensors; got a {what} of dtype {t.dtype} on "
        f"{t.device} (layout {t.layout}, contiguous: {t.is_contiguous()}). Nothing was updated. On a GPU, use "
        "it as CPUOffloadOptimizer's optimizer_cls with bf16 parameters (the default master_weights=False).")
