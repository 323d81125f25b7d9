"""Property (issue 40): every state-dict layout the loaders take, mutated at random in any
field, is either refused with parameters, state and groups bitwise unchanged, or loads and
continues exactly as loading the dict it stands for.

Layouts, each loaded into the optimizers that take it: ours exact (CPUOffloadOptimizer's
default, and with master_weights=True), ours compact (from CPUOffloadOptimizer with
CompactAdamW and from CompactAdamW used directly, each into both), torch's AdamW, torchao's
CPUOffloadOptimizer (one AdamW per large tensor, one for the rest) and bitsandbytes'
AdamW8bit and PagedAdamW8bit (a real run on CPU tensors; into both compact targets).

The target first loads the unmutated dict (so that it has state to keep), then the
mutated one. What a mutated dict stands for is decided here from the layout's rules
(_conforms, _groups_ok), not from the loaders:

* it must be refused if any value breaks its layout: another dtype (torch's layout: not
  floating point), another shape (transposed, flattened, reshaped to the same count, one
  more dimension, another size), NaN or inf, a negative second moment, block scale or
  count, a fractional count where the update counts whole steps, a bitsandbytes map that
  is not one; a key missing or extra; an invalid hyperparameter, or a setting CompactAdamW
  cannot honour (maximize, amsgrad, capturable, differentiable, Adam's L2 decay,
  AdEMAMix); torchao tensors of one group with different settings;
* otherwise it stands for the unmutated dict with each mutated value as the layout reads
  it: a cast of torch's layout to another floating dtype is its values in the state's
  dtype (so a lossless cast is the unmutated dict), a non-contiguous or requires-grad
  tensor its values, the count as a Python number or a one-element tensor that number,
  CompactAdamW's remainder as bf16 bits (as sharded checkpoints carry it) the int16
  remainder, another valid value (a first moment negated, a larger block scale) itself;
  dropped entries, a dropped master weight or weight digest and group changes stay as
  they are. Refusing such a dict is allowed (the loaders may be stricter); loading it
  must continue exactly as the reference that loads what it stands for.
"""

import copy
import functools
import math
import numbers

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from offload_plugin import CompactAdamW, CPUOffloadOptimizer
from state_snapshot import assert_unchanged, same, snapshot

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")

LR = 1e-2
WRAPPED = "__bnb_optimizer_quant_state__"


def _model():
    """(128, 32): 4096 elements, compact (and 8-bit in bitsandbytes, offloaded by torchao);
    (128,), (8, 128) and (8,): exact. All bf16, none square (a transpose changes shapes)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)).to(torch.bfloat16)


def _set_grads(params, step):
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)


def _train(model, step_fn, steps=2):
    for step in range(steps):
        _set_grads(model.parameters(), step)
        step_fn()


@functools.lru_cache(maxsize=None)
def _source(name):
    """(model as saved, state dict) of each layout, made once."""
    model = _model()
    if name == "torchao":
        # What torchao's CPUOffloadOptimizer saves (it needs a GPU to run; these are the
        # torch optimizers it builds, with its default fused=True and minimal_size 4096).
        params = list(model.parameters())
        big = [torch.optim.AdamW([{"params": [p]}], lr=LR, fused=True) for p in params if p.numel() >= 4096]
        small = torch.optim.AdamW([{"params": [p for p in params if p.numel() < 4096]}], lr=LR, fused=True)
        _train(model, lambda: [o.step() for o in (*big, small)])
        return model, {"offloaded": [o.state_dict() for o in big], "on-device": small.state_dict()}
    opt = {
        "ours exact": lambda: CPUOffloadOptimizer(model.parameters(), lr=LR),
        "ours exact, master weights": lambda: CPUOffloadOptimizer(model.parameters(), lr=LR, master_weights=True),
        "ours compact": lambda: CPUOffloadOptimizer(model.parameters(), optimizer_cls=CompactAdamW, lr=LR),
        "ours compact, direct": lambda: CompactAdamW(model.parameters(), lr=LR),
        "torch AdamW": lambda: torch.optim.AdamW(model.parameters(), lr=LR, fused=True),
        "bitsandbytes AdamW8bit": lambda: bnb.optim.AdamW8bit(model.parameters(), lr=LR),
        "bitsandbytes PagedAdamW8bit": lambda: bnb.optim.PagedAdamW8bit(model.parameters(), lr=LR),
    }[name]()
    _train(model, opt.step)
    return model, copy.deepcopy(opt.state_dict())


TARGETS = {
    "exact": lambda m: CPUOffloadOptimizer(m.parameters(), lr=LR),
    "exact, master weights": lambda m: CPUOffloadOptimizer(m.parameters(), lr=LR, master_weights=True),
    "compact": lambda m: CPUOffloadOptimizer(m.parameters(), optimizer_cls=CompactAdamW, lr=LR),
    "compact, direct": lambda m: CompactAdamW(m.parameters(), lr=LR),
}
COMPACT = ["compact", "compact, direct"]
# layout name -> (its rules, the targets that load it)
LAYOUTS = {
    "ours exact": ("torch", ["exact"]),
    "ours exact, master weights": ("torch", ["exact, master weights"]),
    "ours compact": ("compact", COMPACT),
    "ours compact, direct": ("compact", COMPACT),
    "torch AdamW": ("torch", ["exact", "exact, master weights"]),
    "torchao": ("torch", ["exact"]),
    "bitsandbytes AdamW8bit": ("bnb", COMPACT),
    "bitsandbytes PagedAdamW8bit": ("bnb", COMPACT),
}


# ---------------------------------------------------------------- addressing a layout

def _entries(sd) -> dict:
    """Parameter position -> its state entry (the dicts inside ``sd``)."""
    if "offloaded" in sd:  # torchao
        out = {}
        for k, o in enumerate(sd["offloaded"][:1]):
            pid = (o["param_groups"][0].get("params") or [None])[0]
            if pid in o["state"]:
                out[k] = o["state"][pid]
        device = sd.get("on-device", {"state": {}, "param_groups": [{}]})
        for k, pid in enumerate(device["param_groups"][0].get("params", []), start=1):
            if pid in device["state"]:
                out[k] = device["state"][pid]
        return out
    return {k: v for k, v in sd.get("state", {}).items() if isinstance(k, int) and isinstance(v, dict)}


def _groups(sd) -> list:
    if "offloaded" in sd:
        return [o["param_groups"][0] for o in sd["offloaded"]] + sd.get("on-device", {}).get("param_groups", [])
    groups = sd.get("param_groups")
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


def _paths(entry) -> list:
    """Each value's path in an entry: (key,), or (wrapper, key) inside bitsandbytes' wrapper."""
    out = []
    for key in sorted(entry, key=str):
        if key == WRAPPED and isinstance(entry[key], dict):
            out += [(key, k) for k in sorted(entry[key], key=str)]
        else:
            out.append((key,))
    return out


def _get(entry, path):
    return entry[path[0]] if len(path) == 1 else entry[path[0]][path[1]]


def _has(entry, path):
    return path[0] in entry and (len(path) == 1 or isinstance(entry[path[0]], dict) and path[1] in entry[path[0]])


def _put(entry, path, value):
    (entry if len(path) == 1 else entry[path[0]])[path[-1]] = value


# ---------------------------------------------------------------- mutations

VALUE_KINDS = ["float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "uint8", "bool",
               "complex", "bf16 bits", "non-contiguous", "requires grad", "transposed", "flat", "halves",
               "extra dim", "wrong size", "0-d", "nan", "inf", "negative", "big", "expanded", "list",
               "none", "string", "meta", "sparse"]
STEP_KINDS = ["python int", "python float", "shape (1,)", "fractional", "nan", "inf", "negative",
              "two elements", "string", "none", "bool"]
GROUP_VALUES = {
    "lr": [3e-3, 0.0, -1.0, float("nan"), float("inf"), "0.01", None],
    "betas": [(0.8, 0.95), (1.5, 0.9), (0.9,), "ab"],
    "eps": [1e-6, -1e-8, float("nan")],
    "weight_decay": [0.0, 0.3, -0.1, float("inf")],
    "maximize": [True, False], "amsgrad": [True, False], "capturable": [True], "differentiable": [True],
    "foreach": [True, False, None], "fused": [True, False, None], "decoupled_weight_decay": [False, True],
    "alpha": [0.0, 5.0], "initial_lr": [0.5],
}
DROPPABLE_GROUP_KEYS = ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "fused", "foreach",
                        "master", "params"]
# Keys an entry may lack: the master weight (a resume restarts it from the weight) and
# CompactAdamW's weight digest (the remainder then belongs to the weight as it is).
OPTIONAL_KEYS = {("master_weight",), ("weight_digest",)}
# Structure mutations: name -> whether the result must be refused (else it stands for itself).
STRUCTURES = {
    "drop entry": False, "entry given to another": True, "unknown index": True, "duplicate index": True,
    "extra group": True, "no state": True, "string indices": True, "entry not a dict": True,
}
TORCHAO_STRUCTURES = {
    "drop an on-device entry": False, "no offloaded": True, "extra offloaded": True, "no on-device": True,
    "stray on-device state": True, "one tensor's lr": True,
}


def _value(v, kind):
    """``v`` changed as ``kind`` says, or ``v`` itself where the kind does not apply."""
    if not isinstance(v, torch.Tensor):
        return v
    t = v.detach()
    floating = t.is_floating_point()
    return {
        "float64": lambda: t.double(), "float32": lambda: t.float(), "bfloat16": lambda: t.bfloat16(),
        "float16": lambda: t.half(), "int64": lambda: t.long(), "int32": lambda: t.int(),
        "int16": lambda: t.short(), "uint8": lambda: t.to(torch.uint8), "bool": lambda: t != 0,
        "complex": lambda: t.to(torch.complex64),
        "bf16 bits": lambda: t.view(torch.bfloat16) if t.dtype == torch.int16 else t,
        "non-contiguous": lambda: t.t().contiguous().t() if t.dim() == 2 else t,
        "requires grad": lambda: t.clone().requires_grad_() if floating else t,
        "transposed": lambda: t.t().clone() if t.dim() == 2 else t,
        "flat": lambda: t.reshape(-1).clone(),
        "halves": lambda: t.reshape(2, -1).clone() if t.numel() % 2 == 0 and t.numel() else t,
        "extra dim": lambda: t.unsqueeze(0).clone(),
        "wrong size": lambda: torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if t.numel() else t,
        "0-d": lambda: t.reshape(-1)[0].clone() if t.numel() else t,
        "nan": lambda: t.clone().reshape(-1).index_fill(0, torch.tensor([0]), float("nan")).view(t.shape) if floating and t.numel() else t,
        "inf": lambda: t.clone().reshape(-1).index_fill(0, torch.tensor([0]), float("inf")).view(t.shape) if floating and t.numel() else t,
        "negative": lambda: -t.abs() - 1 if floating else t,
        "big": lambda: t * 1e30 if floating else t,
        "expanded": lambda: t.reshape(-1)[:1].expand(t.shape) if t.dim() and t.numel() else t,
        "list": lambda: t.tolist(), "none": lambda: None, "string": lambda: "x",
        "meta": lambda: t.to("meta"), "sparse": lambda: t.to_sparse() if t.dim() else t,
    }[kind]()


def _step_value(v, kind):
    n = float(v) if _count(v, whole=False) else 2.0
    return {"python int": lambda: int(n), "python float": lambda: n, "shape (1,)": lambda: torch.tensor([n]),
            "fractional": lambda: n + 0.5, "nan": lambda: float("nan"), "inf": lambda: torch.tensor(float("inf")),
            "negative": lambda: -1.0, "two elements": lambda: torch.tensor([n, n]), "string": lambda: str(n),
            "none": lambda: None, "bool": lambda: True}[kind]()


def _structure(sd, name):
    """Apply a structure mutation (in place)."""
    if "offloaded" in sd:
        off, dev = sd["offloaded"], sd["on-device"]
        if name == "drop an on-device entry" and dev["state"]:
            dev["state"].pop(sorted(dev["state"])[0])
        elif name == "no offloaded":
            off.clear()
        elif name == "extra offloaded" and off:
            off.append(copy.deepcopy(off[0]))
        elif name == "no on-device":
            del sd["on-device"]
        elif name == "stray on-device state":
            dev["state"][99] = copy.deepcopy(next(iter(dev["state"].values()), {}))
        elif name == "one tensor's lr" and off:
            off[0]["param_groups"][0]["lr"] = 3e-3
        return
    state, groups = sd["state"], sd["param_groups"]
    if name == "drop entry":
        state.pop(2, None)
    elif name == "entry given to another":
        state[1] = copy.deepcopy(state.get(0, {}))
    elif name == "unknown index":
        state[7] = copy.deepcopy(state.get(3, {}))
    elif name == "duplicate index":
        groups[0]["params"] = [0, 0, 2, 3]
    elif name == "extra group":
        groups.append(dict(groups[0], params=[]))
    elif name == "no state":
        del sd["state"]
    elif name == "string indices":
        sd["state"] = {str(k): v for k, v in state.items()}
    elif name == "entry not a dict":
        state[1] = [1, 2]


# ---------------------------------------------------------------- the layouts' rules

def _tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_meta


def _count(v, whole: bool) -> bool:
    """A step count as the loaders take it: a number or one-element real tensor, finite, >= 0."""
    if isinstance(v, torch.Tensor):
        if not _tensor(v) or v.numel() != 1 or v.dtype == torch.bool or v.is_complex():
            return False
        v = v.item()
    return (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            and (not whole or v == int(v)))


def _conforms(rules: str, path: tuple, value, base, compact_entry: bool) -> bool:
    """Whether ``value`` at ``path`` is valid in the layout (``base``: the unmutated value)."""
    key = path[-1]
    if key == "step":
        return _count(value, whole=rules == "bnb" or (rules == "compact" and compact_entry))
    if not _tensor(value):
        return False
    if rules == "torch":  # torch's layout: floating point, cast to the state's dtype
        if not value.is_floating_point() or value.shape != base.shape:
            return False
        v = value.detach().to(base.dtype)
    elif key == "weight_digest":
        return value.dtype == torch.int64 and value.numel() == 1
    else:  # CompactAdamW's and bitsandbytes' dtypes are exact (a remainder may be its bf16 bits)
        bits = key == "remainder" and value.dtype == torch.bfloat16
        if (value.dtype != base.dtype and not bits) or value.shape != base.shape:
            return False
        v = value.detach()
    if v.is_floating_point() and key != "remainder":
        if not bool(torch.isfinite(v).all()):
            return False
        if key in ("exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "state2", "absmax1", "absmax2") and bool((v < 0).any()):
            return False
        if key in ("qmap1", "qmap2"):
            return bool((v[1:] >= v[:-1]).all()) and float(v[-1]) == 1.0 and (float(v[0]) < 0) == (key == "qmap1")
    return True


def _as_read(rules: str, path: tuple, value, base):
    """What a valid ``value`` stands for, in ``base``'s form (the reference loads this)."""
    if isinstance(base, torch.Tensor) and isinstance(value, torch.Tensor):
        v = value.detach()
        if rules == "torch" and path == ("step",):
            pass  # torch's AdamW keeps a count tensor's dtype (casting it only for fused groups)
        elif base.dtype == torch.int16 and v.dtype == torch.bfloat16:
            v = v.view(torch.int16)  # (CompactAdamW's remainder as its bits)
        else:
            v = v.to(base.dtype)
        return v.reshape(base.shape).contiguous().clone()
    if isinstance(base, torch.Tensor):  # a count given as a number
        return torch.tensor(float(value), dtype=base.dtype).reshape(base.shape)
    return int(value.item() if isinstance(value, torch.Tensor) else value)  # (bitsandbytes' int count)


def _number(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and v.is_floating_point() and bool(torch.isfinite(v))
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _groups_ok(groups: list, target: str) -> bool:
    """Whether the groups hold valid hyperparameters the target honours."""
    compact = target in COMPACT
    needs = {"params", "lr", "betas", "eps", "weight_decay"} | (set() if compact else {"amsgrad"})
    for g in groups:
        if not needs <= g.keys():
            return False
        betas = g["betas"]
        if not (all(_number(g[k]) and float(g[k]) >= 0 for k in ("lr", "eps", "weight_decay"))
                and isinstance(betas, (list, tuple)) and len(betas) == 2
                and all(_number(b) and 0 <= float(b) < 1 for b in betas)):
            return False
        if compact and (any(g.get(k) for k in ("maximize", "amsgrad", "capturable", "differentiable", "alpha"))
                        or g.get("decoupled_weight_decay", True) is False and float(g["weight_decay"]) != 0):
            return False
    return True


# ---------------------------------------------------------------- the property

def mutations(layout):
    kinds = [
        st.tuples(st.just("value"), st.integers(0, 3), st.integers(0, 9), st.sampled_from(VALUE_KINDS)),
        # (again, the kinds that stand for valid values: most others are refused in every layout)
        st.tuples(st.just("value"), st.integers(0, 3), st.integers(0, 9), st.sampled_from(
            ["non-contiguous", "requires grad", "bf16 bits", "float32", "negative", "big", "expanded"])),
        st.tuples(st.just("step"), st.integers(0, 3), st.sampled_from(STEP_KINDS)),
        st.tuples(st.just("drop key"), st.integers(0, 3), st.integers(0, 9)),
        st.tuples(st.just("extra key"), st.integers(0, 3)),
        st.tuples(st.just("group"), st.sampled_from(sorted(GROUP_VALUES)), st.integers(0, 6)),
        st.tuples(st.just("drop group key"), st.sampled_from(DROPPABLE_GROUP_KEYS)),
        st.tuples(st.just("structure"), st.sampled_from(sorted(TORCHAO_STRUCTURES if layout == "torchao" else STRUCTURES))),
    ]
    return st.lists(st.one_of(kinds), min_size=1, max_size=3)


def _mutate(base: dict, rules: str, target: str, program: list) -> tuple[dict, dict, bool]:
    """(mutated dict, the dict it stands for, whether it must be refused)."""
    bad, ref = copy.deepcopy(base), copy.deepcopy(base)
    refuse, touched = False, set()
    for m in program:
        if m[0] in ("value", "step", "drop key", "extra key"):
            entry = _entries(bad).get(m[1])
            if entry is None:
                continue
            paths = _paths(entry)
            if m[0] == "extra key":
                _put(entry, (WRAPPED, "bogus") if isinstance(entry.get(WRAPPED), dict) else ("bogus",), torch.zeros(1))
            elif m[0] == "drop key" and paths:
                path = paths[m[2] % len(paths)]
                (entry if len(path) == 1 else entry[path[0]]).pop(path[-1])
            elif m[0] == "step":
                _put(entry, ("step",), _step_value(entry.get("step"), m[2]))
                touched.add((m[1], ("step",)))
            else:
                path = paths[m[2] % len(paths)]
                if path == (WRAPPED,):
                    continue
                _put(entry, path, _value(_get(entry, path), m[3]))
                touched.add((m[1], path))
        elif m[0] == "group":
            values = GROUP_VALUES[m[1]]
            for sd in (bad, ref):
                for g in _groups(sd):
                    g[m[1]] = copy.deepcopy(values[m[2] % len(values)])
        elif m[0] == "drop group key":
            for sd in (bad, ref):
                for g in _groups(sd):
                    g.pop(m[1], None)
        else:
            rules_table = TORCHAO_STRUCTURES if "offloaded" in base else STRUCTURES
            if not isinstance(bad.get("state" if rules_table is STRUCTURES else "on-device"), dict):
                continue  # (no longer there to address)
            _structure(bad, m[1])
            if rules_table[m[1]]:
                refuse = True
            else:
                _structure(ref, m[1])
    base_entries, bad_entries, ref_entries = _entries(base), _entries(bad), _entries(ref)
    for index, entry in bad_entries.items():  # keys added or dropped, whatever the order
        if not entry and index in ref_entries:
            ref_entries[index].clear()  # (empty: not stepped yet, as a dropped entry)
        elif index in base_entries and index in ref_entries:
            was, now = set(_paths(base_entries[index])), set(_paths(entry))
            dropped = was - now
            # (an entry of optional keys alone is one not stepped yet: the master, if any, kept)
            refuse |= bool(now - was) or bool(dropped - OPTIONAL_KEYS and now - OPTIONAL_KEYS)
            for path in dropped:  # (the dict stands for itself)
                (ref_entries[index] if len(path) == 1 else ref_entries[index][path[0]]).pop(path[-1])
    for index, path in touched:
        entry = bad_entries.get(index)
        if entry is None or not _has(entry, path) or not _has(base_entries[index], path):
            continue
        value, was = _get(entry, path), _get(base_entries[index], path)
        compact_entry = "exp_avg_absmax" in base_entries[index]
        if _conforms(rules, path, value, was, compact_entry):
            if _has(ref_entries.get(index, {}), path):
                _put(ref_entries[index], path, _as_read(rules, path, value, was))
        else:
            refuse = True
    if not _groups_ok(_groups(bad), target) or ("offloaded" in base and "on-device" not in bad):
        refuse = True
    return bad, ref, refuse


def _continue(model, opt):
    for step in range(10, 12):
        _set_grads(model.parameters(), step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _check(name: str, target: str, program: list) -> None:
    rules, _ = LAYOUTS[name]
    saved_model, base = _source(name)
    bad, ref, refuse = _mutate(base, rules, target, program)
    model = copy.deepcopy(saved_model)
    opt = TARGETS[target](model)
    opt.load_state_dict(copy.deepcopy(base))  # (state to keep)
    before = snapshot(opt)
    try:
        opt.load_state_dict(bad)
    except (ValueError, TypeError) as err:
        assert str(err)
        assert_unchanged(before, snapshot(opt))
        event("refused" if refuse else "refused, though valid")
        return
    assert not refuse, f"loaded a malformed state dict: {program}"
    ref_model = copy.deepcopy(saved_model)
    ref_opt = TARGETS[target](ref_model)
    ref_opt.load_state_dict(copy.deepcopy(base))
    ref_opt.load_state_dict(ref)  # (refusing what the loaded dict stands for fails the test)
    assert same(_continue(model, opt), _continue(ref_model, ref_opt)), f"continues otherwise than {program} stands for"
    event("loaded, continued as the dict it stands for")


@pytest.mark.parametrize("name", list(LAYOUTS))
@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_state_dict_is_refused_unchanged_or_continues_as_what_it_stands_for(name, data):
    rules, targets = LAYOUTS[name]
    target = data.draw(st.sampled_from(targets), label="target")
    program = data.draw(mutations("torchao" if name == "torchao" else rules), label="program")
    _check(name, target, program)
