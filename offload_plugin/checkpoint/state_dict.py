"""Loading a state dict into CPUOffloadOptimizer: everything checked and copied first.

torch's ``Optimizer.load_state_dict`` checks group and parameter counts only. It takes
a tensor of the wrong shape as it is, and a fused update then reads and writes past the
end of it. It takes NaN too, which reaches the weights one step later. Here, for each
entry, :func:`validate` checks what the optimizer class needs (keys, types, dtypes, exact
shapes, finite values) and converts the entry into new host tensors. Only then does
:func:`apply_state` replace anything, and nothing a checkpoint holds can make it fail.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer

from offload_plugin import distributed
from offload_plugin.checkpoint.torchao import convert_torchao_state_dict, is_torchao_state_dict
from offload_plugin.distributed import DTensor, local_part
from offload_plugin.formats import registry
from offload_plugin.formats.inner import contract
from offload_plugin.host.buffers import HostSlot
from offload_plugin.host.weights import bits_equal

__all__ = ["LoadPlan", "prepare_load", "validate", "apply_state", "write_weights", "with_masters"]

# State-dict key of the fp32 master weight, saved so that a resume continues exactly.
MASTER_KEY = "master_weight"
# Group keys that torch added over releases; a state dict from an older torch may lack them.
KEYS_TORCH_MAY_LACK = {
    "foreach", "fused", "capturable", "differentiable", "maximize",
    "decoupled_weight_decay", "param_names",
}


def _adam_keys(group: dict) -> tuple[set, set]:
    return {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group["amsgrad"] else set()), set()


def _rmsprop_keys(group: dict) -> tuple[set, set]:
    keys = {"step", "square_avg"}
    if group["momentum"] > 0:
        keys.add("momentum_buffer")
    if group["centered"]:
        keys.add("grad_avg")
    return keys, set()


# torch's optimizers whose per-parameter state we know: (required keys, optional keys) of
# an entry that is not empty (an empty one means "not stepped yet"), given its group. Keys
# in _SCALAR_KEYS hold one number; all others are shaped exactly like the parameter.
# A subclass may keep more, so it gets the generic rules (see _check_value).
_STATE_KEYS = {
    torch.optim.Adam: _adam_keys,
    torch.optim.AdamW: _adam_keys,
    torch.optim.RAdam: lambda g: ({"step", "exp_avg", "exp_avg_sq"}, set()),
    torch.optim.NAdam: lambda g: ({"step", "mu_product", "exp_avg", "exp_avg_sq"}, set()),
    torch.optim.Adamax: lambda g: ({"step", "exp_avg", "exp_inf"}, set()),
    torch.optim.Adagrad: lambda g: ({"step", "sum"}, set()),
    torch.optim.Adadelta: lambda g: ({"step", "square_avg", "acc_delta"}, set()),
    torch.optim.RMSprop: _rmsprop_keys,
    torch.optim.ASGD: lambda g: ({"step", "eta", "mu", "ax"}, set()),
    torch.optim.Rprop: lambda g: ({"step", "prev", "step_size"}, set()),
    # SGD keeps a buffer only with momentum; older torch saved None before the first step.
    torch.optim.SGD: lambda g: (set(), {"momentum_buffer"}),
}
_SCALAR_KEYS = {"step", "mu_product", "eta", "mu"}
# Second moments (square roots and divisions are taken of them) and step counts.
_NONNEGATIVE = {"step", "exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg", "acc_delta", "exp_inf"}


@dataclasses.dataclass
class LoadPlan:
    """What a validated state dict changes, all in new tensors."""

    groups: list[dict]  # each outer param group's new hyperparameters (no "params")
    inner: list[tuple[Optimizer, dict]]  # a state dict for each inner optimizer
    masters: dict  # parameter -> its saved master weight, converted


def prepare_load(engine, state_dict: Any, torchao_minimal_size: int, allow_nonfinite: bool,
                 pre_hooks: Iterable[Callable] = ()) -> LoadPlan:
    """Pre-hooks (the optimizer's, each given the state dict), torchao conversion and
    :func:`validate`; changes nothing of ``engine``."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "load_state_dict expects an optimizer state dict (a dict with 'state' and "
            f"'param_groups', as optimizer.state_dict() returns), got {type(state_dict).__name__}."
        )
    state_dict = dict(state_dict)  # shallow, as torch does: hooks may replace entries
    for hook in pre_hooks:
        result = hook(state_dict)
        if result is not None:
            state_dict = result
    if not is_torchao_state_dict(state_dict):
        return validate(engine, state_dict, allow_nonfinite)
    prefix = "cannot load this torchao CPUOffloadOptimizer checkpoint"
    try:
        state_dict = convert_torchao_state_dict(state_dict, engine.param_groups, torchao_minimal_size)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"{prefix}: {type(err).__name__}: {err}") from None
    for saved, group in zip(state_dict["param_groups"], engine.param_groups):
        if not saved["params"]:  # a group torchao held no tensor of: its settings are ours
            saved.update({k: v for k, v in group.items() if k != "params"})
    try:
        return validate(engine, state_dict, allow_nonfinite)
    except ValueError as err:
        raise ValueError(f"{prefix}: {err}") from None


def validate(engine, state_dict: Mapping, allow_nonfinite: bool = False) -> LoadPlan:
    """Check ``state_dict`` against ``engine`` and convert it; raises ValueError or TypeError
    saying what differs. Reads ``engine`` only."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        keys = sorted(map(str, state_dict))[:8] if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(
            "not an optimizer state dict: expected the keys 'state' and 'param_groups' "
            f"(torch's layout), got {keys}."
        )
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in saved_groups
    ):
        raise ValueError("the state dict's 'param_groups' must be a list of dicts, each with a 'params' list.")
    if not isinstance(saved_state, Mapping):
        raise ValueError(f"the state dict's 'state' must be a dict, got {type(saved_state).__name__}.")
    if len(saved_groups) != len(engine.param_groups):
        raise ValueError(
            f"state dict has {len(saved_groups)} parameter groups, this optimizer has "
            f"{len(engine.param_groups)}; build the optimizer over the same groups."
        )
    groups, eager = [], False
    position_of = {}  # saved index -> (group, position among all trainable parameters)
    params = list(engine.params())
    for i, (saved, group) in enumerate(zip(saved_groups, engine.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"parameter group {i}: state dict has {len(saved['params'])} parameters, "
                f"this optimizer has {len(group['params'])} trainable ones. Was it saved "
                "for another model, or with different parameters frozen?"
            )
        hyper, creates_state = _check_group(engine, i, saved, allow_nonfinite)
        groups.append(hyper)
        eager |= creates_state
        for index in saved["params"]:
            try:
                seen = index in position_of
            except TypeError:
                raise ValueError(f"parameter group {i} lists {index!r}, which is not a valid index.") from None
            if seen:
                raise ValueError(f"parameter index {index!r} appears more than once in the state dict's groups.")
            position_of[index] = (i, len(position_of))

    entries, masters = {}, {}
    for index in saved_state:
        if index not in position_of:
            raise ValueError(
                f"state dict has state for unknown parameter index {index!r}; its groups list "
                f"{sorted(map(repr, position_of))[:8]}."
            )
    meshes = engine.slots.meshes
    if meshes:  # (each rank checks its own part: see _agreed)
        saved_state = _laid_out_as_params(saved_state, position_of, params)
    refusal = None
    for index, entry in saved_state.items():
        g, pos = position_of[index]
        try:
            entries[index], master = _check_entry(engine, index, pos, params[pos], entry, groups[g], allow_nonfinite)
        except (ValueError, TypeError) as err:
            if not meshes:
                raise
            refusal = refusal or err  # (the other entries' collectives still run, as on every rank)
            continue
        if master is not None:
            masters[params[pos]] = master
    if meshes:
        _agreed(refusal, meshes)
    if eager:  # e.g. Adagrad: its step needs state it creates in __init__, never on the fly
        lacking = [index for index in position_of if not {k for k in entries.get(index, {}) if k != MASTER_KEY}]
        if lacking:
            raise ValueError(
                f"{engine.options.optimizer_cls.__name__} needs state for every parameter, the state dict "
                f"has none for {lacking[:8]}."
            )

    # One state dict per inner optimizer (host, and the device share's), each over its
    # own parameters, with the groups as the class itself normalized them.
    on_host = {index for index, (_, pos) in position_of.items() if params[pos] in engine.slots}
    owners = [(engine.inner, lambda index: index in on_host)]
    if engine.device_share is not None:
        owners.append((engine.device_share.optimizer, lambda index: index not in on_host))
    inner = [
        (optimizer, {
            "state": {index: entry for index, entry in entries.items() if mine(index)},
            "param_groups": [dict(hyper, params=[index for index in saved["params"] if mine(index)])
                             for hyper, saved in zip(groups, saved_groups)],
        })
        for optimizer, mine in owners
    ]
    return LoadPlan(groups=groups, inner=inner, masters=masters)


def _laid_out_as_params(saved_state: Mapping, position_of: dict, params: list) -> dict:
    """Sharded (FSDP2): each DTensor value laid out as its parameter is (redistributed, or
    gathered for a plain parameter) before any check, so that every rank makes these
    collectives, in one order, whatever its own part holds."""
    out = {}
    for index, entry in saved_state.items():
        param = params[position_of[index][1]]
        if isinstance(entry, Mapping):
            entry = {key: _as_param_is(value, param) for key, value in entry.items()}
        out[index] = entry
    return out


def _as_param_is(value: Any, param: torch.Tensor) -> Any:
    if not isinstance(value, DTensor):
        return value
    if not isinstance(param, DTensor):
        return value.full_tensor()
    if value.device_mesh == param.device_mesh and tuple(value.placements) != tuple(param.placements):
        return value.redistribute(param.device_mesh, param.placements)
    return value


def _agreed(refusal: Optional[Exception], meshes: list) -> None:
    """Sharded: each rank checks its own part of the state, so a bad value refuses the load
    on one rank only; loaded on the others, the ranks' states would differ (and the next
    collective could hang). Every rank refuses if any does."""
    if distributed.any_rank(refusal is not None, meshes):
        if refusal is not None:
            raise refusal
        raise ValueError("another rank refused this state dict (its error says why); nothing was "
                         "loaded on this rank either, so that the ranks keep one state.")


def _nonfinite(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1:
        return not bool(torch.isfinite(value).all())
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isfinite(value)


def _writer(group: Mapping) -> str:
    """Which family's optimizer a saved group's keys tell, and where its state loads."""
    hint = registry.whose_checkpoint(group_keys=group.keys())
    return " " + hint if hint else ""


def _check_group(engine, i: int, saved: Mapping, allow_nonfinite: bool) -> tuple[dict, bool]:
    """The group's hyperparameters as ``optimizer_cls`` itself takes and normalizes them
    (AdamW sets decoupled_weight_decay=True on loading, whatever the checkpoint says), and
    whether the class creates its state in ``__init__``."""
    cls = engine.options.optimizer_cls
    # A class may name group keys that checkpoints of its peers lack (CompactAdamW's
    # "master": a bitsandbytes AdamW8bit checkpoint loads into it).
    optional = KEYS_TORCH_MAY_LACK | set(contract(cls).optional_group_keys)
    missing = (set(engine.defaults) - optional) - saved.keys()
    if missing:
        raise ValueError(
            f"state dict was written by another optimizer class: parameter group {i} "
            f"lacks {sorted(missing)}, which {cls.__name__} needs (it "
            f"has {sorted(k for k in saved if k != 'params')}). Load it into the class "
            "that wrote it, or start this optimizer fresh."
            + _writer(saved)
        )
    hyper = {k: v for k, v in saved.items() if k != "params"}
    for key in set(contract(cls).optional_group_keys) - saved.keys():
        if key in engine.param_groups[i]:
            # This optimizer's own setting holds where the checkpoint has none (a bitsandbytes
            # group's "master"), not the class's default.
            hyper[key] = engine.param_groups[i][key]
    if not allow_nonfinite:
        for key, value in hyper.items():
            if _nonfinite(value):
                raise ValueError(f"parameter group {i}: {key}={value!r} is not finite.")
    # A throwaway instance over one zero: the class's own checks ("Invalid learning rate"),
    # its own normalization (__setstate__, through load_state_dict), and one step, which
    # catches what only step() checks (capturable=True on the host, ...).
    accepted = inspect.signature(cls.__init__).parameters
    try:
        dtype = torch.bfloat16 if contract(cls).bf16_host_only else torch.float32  # (CompactAdamW)
        # (1x1: classes for matrices, torch.optim.Muon, refuse a 1-D probe)
        probe = cls([torch.zeros(1, 1, dtype=dtype)], **{k: v for k, v in hyper.items() if k in accepted and k != "params"})
        creates_state = bool(probe.state)
        own = probe.state_dict()
        probe.load_state_dict({"state": own["state"],
                               "param_groups": [dict(hyper, params=own["param_groups"][0]["params"])]})
        normalized = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
        probe.param_groups[0]["params"][0].grad = torch.zeros(1, 1, dtype=dtype)
        probe.step()
    except Exception as err:  # whatever the class raises, this group cannot be used
        raise ValueError(
            f"parameter group {i} of the state dict does not work with {cls.__name__}: "
            f"{type(err).__name__}: {err}"
        ) from None
    return normalized, creates_state


def _check_entry(
    engine, index, pos: int, param: torch.Tensor, entry: Any, group: dict, allow_nonfinite: bool
) -> tuple[dict, Optional[torch.Tensor]]:
    """One parameter's state, checked and converted: (state for the inner optimizer, master)."""
    where = f"state entry {index!r}"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} is a {type(entry).__name__}, not a dict of per-parameter state.")
    slot = engine.slots.get(param)
    target = slot.master if slot is not None else engine.device_share.target[param]
    cls = engine.options.optimizer_cls
    owner = engine.inner if slot is not None else engine.device_share.optimizer
    own_check = contract(cls).hook(owner, "check_state_entry")  # a class that checks its own entries
    if own_check is not None and entry:
        if MASTER_KEY in entry:
            raise ValueError(f"{where} has a {MASTER_KEY!r}, which {cls.__name__} does not keep.")
        # This rank's part of each value (DTensors, or full values of a sharded parameter).
        local = {k: distributed.to_local_value(v, param, rows_only=True) if isinstance(v, torch.Tensor) else v
                 for k, v in entry.items()}
        return own_check(where, local, target, group), None
    rules = _STATE_KEYS.get(cls)
    keys = set(entry) - {MASTER_KEY}
    if rules is not None and keys:
        required, optional = rules(group)
        if not required <= keys <= required | optional:
            settings = " with amsgrad=True" if "max_exp_avg_sq" in required else ""
            lacks, extra = sorted(map(str, required - keys)), sorted(map(str, keys - required - optional))
            raise ValueError(
                f"{where} has the keys {sorted(map(str, keys))}"
                + (f", lacking {lacks}" if lacks else "") + (f", with {extra} too" if extra else "")
                + f": {cls.__name__}{settings} keeps {sorted(required | optional)} per parameter. "
                + (registry.whose_checkpoint(entry_keys=keys)
                   or "The checkpoint is incomplete or from another optimizer class or setting.")
            )
    out, master = {}, None
    for key, value in entry.items():
        if key == MASTER_KEY:
            master = _check_master(where, pos, param, value, slot, engine, allow_nonfinite)
        else:
            out[key] = _check_value(where, key, pos, param, target, value, rules is not None, allow_nonfinite)
    return out, master


def _elements(t: torch.Tensor) -> str:
    return "1 element" if t.numel() == 1 else f"{t.numel()} elements"


def _describe(pos: int, param: torch.Tensor) -> str:
    return f"parameter {pos} (shape {tuple(param.shape)}, {_elements(param)})"


def _shape_error(where: str, key: str, value: torch.Tensor, pos: int, param: torch.Tensor) -> ValueError:
    if isinstance(param, DTensor) and not isinstance(value, DTensor) and value.shape == local_part(param).shape:
        return ValueError(
            f"{where} ({key!r}) is a plain tensor shaped like this rank's shard "
            f"{tuple(value.shape)}, not like the parameter {tuple(param.shape)}: which part of "
            "the parameter it holds is unknown. Pass DTensors (torch.distributed.checkpoint."
            "state_dict.get_optimizer_state_dict) or full tensors."
        )
    if value.numel() == param.numel():
        hint = ("the same number of elements in another shape; if it holds the parameter's "
                "values in order, reshape it to the parameter's shape")
    else:
        hint = ("the checkpoint belongs to another model, or its parameters are in another "
                "order (indices follow the order of the optimizer's trainable parameters)")
    return ValueError(
        f"{where} ({key!r}) has shape {tuple(value.shape)} ({_elements(value)}), "
        f"{_describe(pos, param)} needs exactly its shape: {hint}."
    )


def _plain_tensor(where: str, key: str, value: torch.Tensor, param: torch.Tensor) -> None:
    """Refuse tensors whose data cannot be read or compared as a dense array."""
    if isinstance(value, DTensor) and isinstance(param, DTensor) and value.device_mesh != param.device_mesh:
        raise ValueError(
            f"{where} ({key!r}) is a DTensor on {value.device_mesh}, its parameter is on "
            f"{param.device_mesh}: load full tensors, or state from get_optimizer_state_dict "
            "on this model, instead."
        )
    if value.layout != torch.strided or value.is_meta or value.is_quantized:
        raise ValueError(
            f"{where} ({key!r}) is a {value.layout} tensor on {value.device} (quantized: "
            f"{value.is_quantized}); it needs a dense tensor with data."
        )
    if value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"{where} ({key!r}) has dtype {value.dtype}; it needs real numbers.")


def _check_finite(where: str, key: str, t: torch.Tensor, allow_nonfinite: bool, nonnegative: bool) -> None:
    if t.is_floating_point() and not allow_nonfinite:
        bad = t.numel() - int(torch.isfinite(t).sum())
        if bad:
            raise ValueError(
                f"{where} ({key!r}) holds {bad} inf or NaN value(s) (after conversion to "
                f"{t.dtype}): the next step would carry them into the weights. Load a checkpoint "
                "from before, or pass allow_nonfinite=True to load it anyway."
            )
    if nonnegative and bool((t < 0).any()):
        raise ValueError(
            f"{where} ({key!r}) holds {int((t < 0).sum())} negative value(s); it cannot be "
            "negative (a step count, or a second moment whose square root is taken)."
        )


def _check_value(
    where: str, key: str, pos: int, param: torch.Tensor, target: torch.Tensor, value: Any,
    known: bool, allow_nonfinite: bool,
) -> Any:
    """One state value, as the inner optimizer should get it: a new host tensor in the
    host state's dtype (torch casts to the parameter's dtype on loading as well)."""
    scalar = key in _SCALAR_KEYS
    nonnegative = known and key in _NONNEGATIVE
    if not isinstance(value, torch.Tensor):
        if not known:
            return value  # another class's own business, kept as torch keeps it
        if value is None and key == "momentum_buffer":
            return value  # SGD before its first step, as older torch saved it
        if scalar and isinstance(value, numbers.Real) and not isinstance(value, bool):
            _check_finite(where, key, torch.tensor(float(value)), allow_nonfinite, nonnegative)
            return value  # the class's __setstate__ turns it into a tensor, as for torch
        needs = "a number or a one-element tensor" if scalar else f"a tensor shaped like {_describe(pos, param)}"
        raise ValueError(f"{where} ({key!r}) is {type(value).__name__} {value!r:.40}; it needs {needs}.")
    _plain_tensor(where, key, value, param)
    shape = param.shape  # global for a DTensor, as is a DTensor value's
    if known and scalar:
        if value.numel() != 1:
            raise ValueError(
                f"{where} ({key!r}) has {_elements(value)} (shape {tuple(value.shape)}); "
                "it needs one number."
            )
    elif known:
        if not value.is_floating_point():
            raise ValueError(f"{where} ({key!r}) has dtype {value.dtype}; it needs a floating-point tensor.")
        if value.shape != shape:
            raise _shape_error(where, key, value, pos, param)
    elif value.dim() > 0:
        # Another class: state may be factored (Adafactor's row and column variances), so
        # it need not be shaped like the parameter, but it must broadcast to it.
        sizes = list(zip(reversed(value.shape), reversed(shape)))
        if value.dim() > len(shape) or any(v not in (1, p) for v, p in sizes):
            if not (isinstance(param, DTensor) and value.shape == local_part(param).shape):
                raise ValueError(
                    f"{where} ({key!r}) has shape {tuple(value.shape)}, which does not fit "
                    f"{_describe(pos, param)} (each dimension must be its size or 1)."
                )
            raise _shape_error(where, key, value, pos, param)
    local = distributed.to_local_value(value, param).detach()
    if known and not scalar and local.shape != target.shape:
        raise ValueError(
            f"{where} ({key!r}) gives this rank a part of shape {tuple(local.shape)}, its "
            f"shard of the parameter is {tuple(target.shape)}."
        )
    # Copies: the source may live on a GPU, or be another optimizer's live state, which
    # must not be stepped twice. Contiguous: the fused update views state as flat vectors.
    # "step" keeps its dtype: torch's loading casts it only for fused/capturable groups.
    dtype = local.dtype if key == "step" else target.dtype
    converted = local.to("cpu", dtype=dtype, copy=True, memory_format=torch.contiguous_format)
    if known and scalar:
        converted = converted.reshape(())  # one number, as the class creates it
    _check_finite(where, key, converted, allow_nonfinite, nonnegative)
    return converted


def _check_master(where, pos, param, value, slot, engine, allow_nonfinite) -> torch.Tensor:
    key = MASTER_KEY
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{where} ({key!r}) is {type(value).__name__}; it needs a tensor shaped like {_describe(pos, param)}."
        )
    _plain_tensor(where, key, value, param)
    if not value.is_floating_point():
        raise ValueError(f"{where} ({key!r}) has dtype {value.dtype}; it needs a floating-point tensor.")
    if value.shape != param.shape:
        raise _shape_error(where, key, value, pos, param)
    local = distributed.to_local_value(value, param).detach()
    target = slot.master if slot is not None else engine.device_share.target[param]
    if local.shape != target.shape:
        raise ValueError(
            f"{where} ({key!r}) gives this rank a part of shape {tuple(local.shape)}, its "
            f"shard of the parameter is {tuple(target.shape)}."
        )
    converted = local.to("cpu", dtype=target.dtype, copy=True, memory_format=torch.contiguous_format)
    _check_finite(where, key, converted, allow_nonfinite, nonnegative=False)
    return converted


def apply_state(engine, plan: LoadPlan) -> None:
    """Install a validated plan's state and hyperparameters (not the weights: see
    :func:`write_weights`). Only torch's own loading runs here, on checked values."""
    for optimizer, state_dict in plan.inner:
        optimizer.load_state_dict(state_dict)
    for group, hyper in zip(engine.param_groups, plan.groups):
        params, names = group["params"], group.get("param_names")
        group.clear()
        group.update(hyper)
        group["params"] = params
        if names is not None and "param_names" not in hyper:  # as torch keeps them
            group["param_names"] = names
    for slot in engine.slots:  # loaded moments go back into their huge pages
        entry = engine.inner.state.get(slot.master)
        for key, view in zip(("exp_avg", "exp_avg_sq"), slot.moments or ()):
            loaded = entry.get(key) if entry else None
            if loaded is not None and loaded.shape == view.shape and loaded.dtype == view.dtype:
                entry[key] = view.copy_(loaded)


@torch.no_grad()
def write_weights(engine, plan: LoadPlan) -> None:
    """Masters after loading; the parameters are left as they are, as torch's optimizers
    leave them (the parameter is the truth, see weight_sync).

    A saved master is taken as it is when the weight is that master rounded (a resume that
    loaded the model first). Otherwise it is taken for now and the slot marked as changed,
    so that the next step's check decides: a model loaded after the optimizer (the weight
    is then the master rounded) keeps the master's extra bits; a weight still different
    (the model was never loaded, or holds other weights) is what the step updates. Without
    a saved master the host copy restarts from the weight.
    """
    if not engine.keeps_host_weights:
        return  # no host copies of the weights (a saved master is ignored, as torch's AdamW does)
    for param in engine.params():
        slot = engine.slots.get(param)
        saved = plan.masters.get(param)
        if slot is None:
            engine.device_share.load_master(param, saved)
            continue
        weight = slot.device_weight()
        if saved is None:
            slot.master.copy_(weight)
            engine.weights.matched(slot.order, param)
            continue
        slot.master.copy_(saved)
        if bits_equal(slot.master.to(weight.dtype), weight.cpu()):
            engine.weights.matched(slot.order, param)
        else:
            engine.weights.unknown(slot.order)


def with_masters(engine, sd: dict) -> dict:
    """``engine``'s state dict from torch's packing (``sd``), with each master weight added and
    DTensor parameters' state laid out as DTensors (see CPUOffloadOptimizer.state_dict)."""
    # torch's packing hands out the inner optimizer's live per-parameter dicts: copy them
    # before adding keys, so the live state never holds the master or DTensors.
    sd["state"] = {index: dict(entry) for index, entry in sd["state"].items()}
    saved_entry = contract(type(engine.inner)).hook(engine.inner, "saved_entry")
    for index, param in enumerate(engine.params()):
        slot = engine.slots.get(param)
        if slot is None:  # updated on the device (device_fraction)
            master = engine.device_share.master(param)
            if master is not None:
                sd["state"].setdefault(index, {})[MASTER_KEY] = master
            continue
        # delayed_update saves every host weight: a model checkpoint written before this
        # call holds the weights from before the update it just completed. Not for a class
        # with its own entries (CompactAdamW, AdamW8bit): its host copy is the parameter's
        # dtype, so a saved copy could only repeat the weight or be dropped on load for the
        # model's (the parameter is the truth), and bitsandbytes' layout has no place for it.
        if slot.weight_stage is not None or (engine.options.delayed_update and saved_entry is None):
            sd["state"].setdefault(index, {})[MASTER_KEY] = slot.master
        if saved_entry is not None and index in sd["state"]:  # (CompactAdamW: its remainder's weight)
            sd["state"][index] = saved_entry(slot.master, sd["state"][index], local_part(slot.param))
        if engine.slots.sharded and index in sd["state"]:
            sd["state"][index] = _shard_state(index, slot, sd["state"][index])
    return sd


def _shard_state(index: int, slot: HostSlot, entry: dict[str, Any]) -> dict[str, Any]:
    shard = slot.master.shape
    out = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.dtype == torch.int16:
                # (CompactAdamW's remainders) NCCL and gloo have no 16-bit integers, so a
                # gathered (full_state_dict) checkpoint could not hold them: the same bits
                # travel as bf16, which the optimizer's own check reads back as int16.
                value = value.view(torch.bfloat16)
            if value.shape != shard and len(shard) > 0 and value.shape[0] == shard[0]:
                # Kept per row of the shard (CompactAdamW's block scales): sharded by rows.
                out[key] = distributed.shard_like(value, slot.param, rows_only=True)
                continue
            if value.shape != shard:
                raise ValueError(
                    f"state {index}[{key!r}] has shape {tuple(value.shape)}, but its "
                    f"parameter's local shard is {tuple(shard)}: a sharded checkpoint "
                    f"cannot hold it. {type(slot.param).__name__} parameters need an "
                    "optimizer_cls whose state is shaped like the parameter (AdamW, SGD, ...)."
                )
            value = distributed.shard_like(value, slot.param)
        out[key] = value
    return out

