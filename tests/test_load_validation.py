"""load_state_dict checks every entry before changing anything (offload_plugin/checkpoint/state_dict.py).

Each accepted state dict must continue exactly as torch's AdamW loading the same dict
(bitwise: torch's fused CPU AdamW is deterministic); each refused one must raise
ValueError or TypeError and leave parameters, state and param groups bit for bit as
they were, and none may crash the process.
"""

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from offload_plugin import CPUOffloadOptimizer
from reference_twin import batch, make_model, trainable

LR = 1e-2


def _steps(model, opt, n, start=0):
    """Plain loop (no torchtune import): the same gradients for twins with the same weights."""
    for step in range(start, start + n):
        x, y = batch(step, 0, "cpu", next(model.parameters()).dtype)
        ((model(x) - y) ** 2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def saved():
    """A model after 2 fused steps and our state dict then (fp32: no master weights)."""
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR, fused=True)
    _steps(model, opt, 2)
    return model, copy.deepcopy(opt.state_dict())


def _fresh(model, **kwargs):
    copy_ = copy.deepcopy(model)
    return copy_, CPUOffloadOptimizer(copy_.parameters(), lr=LR, fused=True, **kwargs)


def _snapshot(model, opt):
    sd = opt.state_dict()
    return ([p.detach().clone() for p in model.parameters()],
            [s.master.clone() for s in opt.engine.slots],
            copy.deepcopy(sd["state"]), copy.deepcopy(sd["param_groups"]))


def _same(a, b):
    """Bitwise equality of nested state (tensors by bits, NaN included)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                        b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b or (a != a and b != b)


def _assert_unchanged(before, after):
    for name, x, y in zip(("params", "masters", "state", "param_groups"), before, after):
        assert _same(x, y), f"{name} changed by a refused load"


def _contiguous(value):
    """torch's fused CPU AdamW misreads non-contiguous state (it walks raw pointers); we copy
    state into contiguous tensors, so the twin gets the same values contiguous."""
    if isinstance(value, torch.Tensor):
        return value.contiguous() if value.layout == torch.strided and not value.is_meta else value
    if isinstance(value, dict):
        return {k: _contiguous(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_contiguous(v) for v in value]
    return value


def _check_against_torch(model, bad, steps=2):
    """Either refused (ValueError/TypeError, nothing changed) or continues as torch's AdamW."""
    ours_model, ours = _fresh(model)
    before = _snapshot(ours_model, ours)
    try:
        ours.load_state_dict(copy.deepcopy(bad))
    except (ValueError, TypeError) as err:
        assert str(err)
        _assert_unchanged(before, _snapshot(ours_model, ours))
        return False
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(trainable(ref_model), lr=LR, fused=True)
    ref.load_state_dict(_contiguous(copy.deepcopy(bad)))
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    _steps(ref_model, ref, steps, start=2)
    _steps(ours_model, ours, steps, start=2)
    for (name, p), q in zip(ref_model.named_parameters(), ours_model.parameters()):
        assert torch.equal(p, q), name
    ours_state = ours.state_dict()["state"]
    for index, entry in ref.state_dict()["state"].items():
        for key, value in entry.items():  # (a step loaded as shape (1,) is kept 0-d here)
            assert torch.equal(ours_state[index][key].float().reshape(value.shape), value.float()), (index, key)
    return True


# ---------------------------------------------------------------- the issue's cases


def _issue_cases():
    def swap_weight_bias(sd):
        sd["state"][0], sd["state"][1] = sd["state"][1], sd["state"][0]

    def flat_wrong_count(sd):
        sd["state"][2]["exp_avg"] = torch.zeros(4 * 32 - 1).reshape(-1, 1)[:, 0]

    def flat_same_count(sd):
        sd["state"][2]["exp_avg"] = sd["state"][2]["exp_avg"].reshape(-1)

    def zero_dim(sd):
        sd["state"][3]["exp_avg"] = torch.tensor(0.0)

    def same_dims_wrong_size(sd):
        sd["state"][0]["exp_avg_sq"] = torch.zeros(16, 8)

    def not_a_tensor(sd):
        sd["state"][1]["exp_avg"] = [0.0] * 32

    def no_step(sd):
        del sd["state"][3]["step"]

    def no_exp_avg_sq(sd):
        del sd["state"][3]["exp_avg_sq"]

    def exp_avg_none(sd):
        sd["state"][3]["exp_avg"] = None

    def nan_state(sd):
        sd["state"][2]["exp_avg"][1, 2] = float("nan")

    def inf_step(sd):
        sd["state"][0]["step"] = torch.tensor(float("inf"))

    def negative_second_moment(sd):
        sd["state"][1]["exp_avg_sq"] = -sd["state"][1]["exp_avg_sq"]

    def bad_lr(sd):
        sd["param_groups"][0]["lr"] = -1.0

    return {
        "swapped weight/bias": (swap_weight_bias, "state entry 0 \\('exp_avg'\\) has shape \\(32,\\)"),
        "flattened, wrong count": (flat_wrong_count, "has shape \\(127,\\) \\(127 elements\\), parameter 2 \\(shape \\(4, 32\\), 128 elements\\)"),
        "flattened, same count": (flat_same_count, "reshape it"),
        "0-d exp_avg": (zero_dim, "state entry 3 \\('exp_avg'\\) has shape \\(\\)"),
        "same dims, wrong size": (same_dims_wrong_size, "shape \\(16, 8\\)"),
        "list exp_avg": (not_a_tensor, "'exp_avg'\\) is list"),
        "no step": (no_step, "lacking \\['step'\\]"),
        "no exp_avg_sq": (no_exp_avg_sq, "lacking \\['exp_avg_sq'\\]"),
        "exp_avg None": (exp_avg_none, "'exp_avg'\\) is NoneType"),
        "NaN in exp_avg": (nan_state, "1 inf or NaN value.*allow_nonfinite=True"),
        "inf step": (inf_step, "'step'\\) holds 1 inf or NaN"),
        "negative exp_avg_sq": (negative_second_moment, "negative"),
        "negative lr": (bad_lr, "Invalid learning rate"),
    }


@pytest.mark.parametrize("case", list(_issue_cases()))
def test_malformed_entry_is_refused_before_anything_changes(saved, case):
    model, sd = saved
    mutate, message = _issue_cases()[case]
    bad = copy.deepcopy(sd)
    for group in bad["param_groups"]:
        group["lr"] = 123.0  # would show if the groups were replaced before the refusal
    mutate(bad)
    ours_model, ours = _fresh(model)
    _steps(ours_model, ours, 1)
    before = _snapshot(ours_model, ours)
    with pytest.raises(ValueError, match=message):
        ours.load_state_dict(bad)
    _assert_unchanged(before, _snapshot(ours_model, ours))
    _steps(ours_model, ours, 1, start=1)  # and it still trains


def test_none_and_non_dicts_are_a_clear_type_error(saved):
    model, _ = saved
    ours_model, ours = _fresh(model)
    before = _snapshot(ours_model, ours)
    for bad in (None, [1, 2], "optimizer.pt"):
        with pytest.raises(TypeError, match="expects an optimizer state dict"):
            ours.load_state_dict(bad)
    _assert_unchanged(before, _snapshot(ours_model, ours))


def _bf16_twins():
    model = make_model(dtype=torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR, fused=True)
    _steps(model, opt, 2)
    return model, opt


@pytest.mark.parametrize("value,message", [
    (torch.zeros(31, 32), "'master_weight'\\) has shape \\(31, 32\\)"),
    (torch.zeros(1024), "reshape it"),
    ("weights", "'master_weight'\\) is str"),
    (torch.zeros(32, 32, dtype=torch.int32), "floating-point"),
    (torch.full((32, 32), float("inf")), "1024 inf or NaN"),
])
def test_malformed_master_weight_is_refused(value, message):
    """bf16 parameters with fp32 masters: the master is checked like the state."""
    model, opt = _bf16_twins()
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["lr"] = 123.0
    bad["state"][0]["master_weight"] = value
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(bad)
    _assert_unchanged(before, _snapshot(model, opt))


def test_allow_nonfinite_loads_what_torch_loads(saved):
    """The opt-out: NaN state loads and behaves as in torch's AdamW (NaN in that weight)."""
    model, sd = saved
    bad = copy.deepcopy(sd)
    bad["state"][3]["exp_avg"][0] = float("nan")
    ours_model, ours = _fresh(model)
    ours.load_state_dict(copy.deepcopy(bad), allow_nonfinite=True)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(trainable(ref_model), lr=LR, fused=True)
    ref.load_state_dict(copy.deepcopy(bad))
    _steps(ref_model, ref, 1, start=2)
    _steps(ours_model, ours, 1, start=2)
    for p, q in zip(ref_model.parameters(), ours_model.parameters()):
        assert torch.equal(p, q) or (p.isnan() == q.isnan()).all() and torch.equal(p.nan_to_num(), q.nan_to_num())
    assert trainable(ours_model)[3].isnan().any()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_checkpoint_continues_as_torchs_adamw_does(fused, dtype):
    """torch's AdamW sets decoupled_weight_decay=True on loading (AdamW.__setstate__), keeping
    the rest of the Adam checkpoint's hyperparameters (its weight_decay included)."""
    source = make_model(dtype=dtype)
    adam = torch.optim.Adam(trainable(source), lr=LR, weight_decay=0.1, fused=fused)
    _steps(source, adam, 2)
    sd = adam.state_dict()
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    ref_model, ours_model = copy.deepcopy(source), copy.deepcopy(source)
    ref = torch.optim.AdamW(trainable(ref_model), lr=1e-3, fused=fused)
    # master_weights=False: the bf16 update runs in bf16, as torch's AdamW on bf16 does.
    ours = CPUOffloadOptimizer(ours_model.parameters(), lr=1e-3, fused=fused, master_weights=False)
    ref.load_state_dict(copy.deepcopy(sd))
    ours.load_state_dict(copy.deepcopy(sd))
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    assert ours.param_groups[0]["weight_decay"] == 0.1
    _steps(ref_model, ref, 3, start=2)
    _steps(ours_model, ours, 3, start=2)
    for (name, p), q in zip(ref_model.named_parameters(), ours_model.parameters()):
        assert torch.equal(p, q), name


def test_accepted_variants_continue_as_torchs_adamw(saved):
    """Entries torch's AdamW takes and converts, taken and converted the same way."""
    model, sd = saved
    variants = {
        "step as int": lambda s: s["state"][0].__setitem__("step", 2),
        "step shaped (1,)": lambda s: s["state"][0].__setitem__("step", torch.tensor([2.0])),
        "float64 moments": lambda s: s["state"][2].__setitem__("exp_avg", s["state"][2]["exp_avg"].double()),
        "non-contiguous moment": lambda s: s["state"][0].__setitem__("exp_avg", s["state"][0]["exp_avg"].t().contiguous().t()),
        "tensor lr": lambda s: s["param_groups"][0].__setitem__("lr", torch.tensor(3e-3)),
        "entry missing": lambda s: s["state"].pop(1),
        "extra group key": lambda s: s["param_groups"][0].__setitem__("initial_lr", 0.5),
        "decoupled False": lambda s: s["param_groups"][0].__setitem__("decoupled_weight_decay", False),
        "fused False": lambda s: s["param_groups"][0].__setitem__("fused", False),
    }
    for name, mutate in variants.items():
        bad = copy.deepcopy(sd)
        mutate(bad)
        assert _check_against_torch(model, bad), name


# ---------------------------------------------------------------- random malformed dicts

_KEYS = ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "bogus"]


def _value_for(kind, current, shape, rnd):
    """A replacement value of the given kind (current: the entry's tensor under that key)."""
    # (Detached: a value made from a "requires grad" one would otherwise have a grad_fn,
    # which copy.deepcopy refuses in this test's own copies.)
    like = current.detach() if isinstance(current, torch.Tensor) else torch.ones(shape)
    return {
        "none": lambda: None,
        "list": lambda: like.tolist(),
        "number": lambda: 2.5,
        "string": lambda: "x",
        "0-d": lambda: torch.tensor(0.5),
        "flat": lambda: like.reshape(-1).clone(),
        "transposed": lambda: like.t().clone() if like.dim() == 2 else like.clone(),
        "extra dim": lambda: like.unsqueeze(0).clone(),
        "wrong size": lambda: torch.ones([max(1, s + rnd.choice([-1, 1])) for s in like.shape] or [2]),
        "nan": lambda: like.clone().reshape(-1).index_fill(0, torch.tensor([0]), float("nan")).reshape(like.shape),
        "inf": lambda: like.clone().reshape(-1).index_fill(0, torch.tensor([0]), float("-inf")).reshape(like.shape),
        "negative": lambda: -like.abs() - 1,
        "float64": lambda: like.double(),
        "bfloat16": lambda: like.bfloat16(),
        "int64": lambda: like.long(),
        "bool": lambda: like > 0,
        "complex": lambda: like.to(torch.complex64),
        "non-contiguous": lambda: like.t().contiguous().t() if like.dim() == 2 else like.clone(),
        "expanded": lambda: like.reshape(-1)[:1].expand(like.shape) if like.dim() else like,
        "requires grad": lambda: like.clone().requires_grad_(),
        "meta": lambda: like.to("meta"),
        "sparse": lambda: like.to_sparse() if like.dim() else like,
        "shape (1,)": lambda: like.reshape(-1)[:1].clone(),
        "big": lambda: like * 1e30,
    }[kind]()


_VALUE_KINDS = ["none", "list", "number", "string", "0-d", "flat", "transposed", "extra dim",
                "wrong size", "nan", "inf", "negative", "float64", "bfloat16", "int64", "bool",
                "complex", "non-contiguous", "expanded", "requires grad", "meta", "sparse",
                "shape (1,)", "big"]
_GROUP_VALUES = {
    "lr": [-1.0, float("nan"), float("inf"), 0.0, 3e-3, "0.01", None, torch.tensor(3e-3), True],
    "betas": [(0.9,), (1.5, 0.9), [0.8, 0.99], (0.5, 0.9, 0.1), "ab", (torch.tensor(0.8), torch.tensor(0.95))],
    "eps": [-1e-8, 0.0, 1e-3, float("nan")],
    "weight_decay": [-0.1, 0.0, 0.5, float("inf")],
    "amsgrad": [True, False],
    "maximize": [True, False],
    "foreach": [True, False, None],
    "fused": [False, None],
    "capturable": [True, False],
    "differentiable": [True],
    "decoupled_weight_decay": [False, True],
    "initial_lr": [0.1],
}


@st.composite
def _mutations(draw):
    """A list of mutations (name, arguments), applied in order to a copy of the state dict."""
    kinds = st.one_of(
        st.tuples(st.just("value"), st.integers(0, 3), st.sampled_from(_KEYS), st.sampled_from(_VALUE_KINDS)),
        st.tuples(st.just("delete"), st.integers(0, 3), st.sampled_from(_KEYS)),
        st.tuples(st.just("group"), st.sampled_from(sorted(_GROUP_VALUES)), st.integers(0, 8)),
        st.tuples(st.just("drop group key"), st.sampled_from(sorted(_GROUP_VALUES) + ["params"])),
        st.tuples(st.just("structure"), st.sampled_from([
            "swap entries", "drop entry", "unknown entry", "duplicate id", "reorder ids",
            "entry not a dict", "state not a dict", "groups not a list", "extra group",
            "no state key", "params not a list", "string ids",
        ])),
    )
    return draw(st.lists(kinds, min_size=1, max_size=3))


def _apply(sd, mutations, rnd):
    for m in mutations:
        if m[0] == "value":
            _, index, key, kind = m
            entry = sd["state"].get(index)
            if isinstance(entry, dict):
                shape = tuple(entry["exp_avg"].shape) if isinstance(entry.get("exp_avg"), torch.Tensor) else (3,)
                entry[key] = _value_for(kind, entry.get(key), shape, rnd)
        elif m[0] == "delete":
            entry = sd["state"].get(m[1])
            if isinstance(entry, dict):
                entry.pop(m[2], None)
        elif m[0] == "group":
            values = _GROUP_VALUES[m[1]]
            sd["param_groups"][0][m[1]] = copy.deepcopy(values[m[2] % len(values)])
        elif m[0] == "drop group key":
            sd["param_groups"][0].pop(m[1], None)
        else:
            what, state, group = m[1], sd["state"], sd["param_groups"][0]
            if what == "swap entries":
                state[0], state[1] = state.get(1, {}), state.get(0, {})
            elif what == "drop entry":
                state.pop(2, None)
            elif what == "unknown entry":
                state[7] = copy.deepcopy(state.get(3, {}))
            elif what == "duplicate id":
                group["params"] = [0, 0, 2, 3]
            elif what == "reorder ids":
                group["params"] = [1, 0, 2, 3]
            elif what == "entry not a dict":
                state[1] = [1, 2]
            elif what == "state not a dict":
                sd["state"] = list(state.values())
            elif what == "groups not a list":
                sd["param_groups"] = group
            elif what == "extra group":
                sd["param_groups"] = [group, dict(group, params=[])]
            elif what == "no state key":
                sd.pop("state")
            elif what == "params not a list":
                group["params"] = 0
            elif what == "string ids":
                sd["state"] = {str(k): v for k, v in state.items()}
        if not isinstance(sd.get("param_groups"), list) or not isinstance(sd.get("state"), dict):
            break  # later mutations would address what is no longer there
    return sd


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutations=_mutations(), rnd=st.randoms(use_true_random=False))
def test_random_malformed_state_dicts_load_like_torch_or_change_nothing(saved, mutations, rnd):
    model, sd = saved
    bad = _apply(copy.deepcopy(sd), mutations, rnd)
    event("loaded like torch" if _check_against_torch(model, bad, steps=1) else "refused, unchanged")


# ---------------------------------------------------------------- fresh process

_NO_CRASH = textwrap.dedent(
    """
    import copy, sys, torch
    sys.path.insert(0, {tests!r})
    from reference_twin import batch, make_model
    from offload_plugin import CPUOffloadOptimizer
    from offload_plugin.formats.adamw import native as native_adam
    # fp32: torch's fused kernel, which writes out of bounds without checking; bf16 with
    # fp32 masters: our native kernel (when it compiled).
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model(dtype=dtype)
        opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2, fused=True)
        def step():
            x, y = batch(0, 0, "cpu", dtype)
            ((model(x) - y) ** 2).sum().backward()
            opt.step(); opt.zero_grad()
        step()
        good = copy.deepcopy(opt.state_dict())
        bad = []
        s = copy.deepcopy(good); s["state"][0], s["state"][1] = s["state"][1], s["state"][0]; bad.append(s)
        s = copy.deepcopy(good); s["state"][0]["exp_avg"] = torch.zeros(100); bad.append(s)
        s = copy.deepcopy(good); s["state"][0]["exp_avg_sq"] = torch.zeros(2, 2); bad.append(s)
        s = copy.deepcopy(good); s["state"][2]["exp_avg"] = torch.tensor(1.0); bad.append(s)
        s = copy.deepcopy(good); s["state"][3]["exp_avg"] = torch.zeros(4, dtype=torch.int64); bad.append(s)
        s = copy.deepcopy(good); s["state"][0]["master_weight"] = torch.zeros(5, 5); bad.append(s)
        for i, s in enumerate(bad):
            try:
                opt.load_state_dict(s)
            except ValueError:
                pass
            else:
                raise SystemExit(f"malformed state dict {{i}} was accepted ({{dtype}})")
            for _ in range(3):
                step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    print("native kernel:", native_adam.kernel() is not None)
    print("SURVIVED")
    """
)


@pytest.mark.slow  # (starts a process: left out of the quick lane)
def test_malformed_checkpoints_never_crash_a_fresh_process():
    """Before the checks, these aborted the process (malloc_consolidate, munmap_chunk) or
    segfaulted in the next fused step. A fresh interpreter: heap damage would show there."""
    script = _NO_CRASH.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SURVIVED" in out.stdout


# ---------------------------------------------------------------- other optimizer classes

_CLASSES = {
    "SGD": (torch.optim.SGD, {"momentum": 0.9}, "momentum_buffer"),
    "RMSprop": (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}, "grad_avg"),
    "Adagrad": (torch.optim.Adagrad, {}, "sum"),
    "NAdam": (torch.optim.NAdam, {}, "exp_avg_sq"),
    # Factored state, not shaped like the parameter: the generic rule (broadcastable).
    "Adafactor": (torch.optim.Adafactor, {}, "row_var"),
}


@pytest.mark.parametrize("name", list(_CLASSES))
def test_other_classes_load_like_torch_and_refuse_wrong_shapes(name):
    cls, kwargs, shaped_key = _CLASSES[name]
    source = make_model()
    plain = cls(trainable(source), lr=LR, **kwargs)
    _steps(source, plain, 2)
    sd = plain.state_dict()
    ref_model, ours_model = copy.deepcopy(source), copy.deepcopy(source)
    ref = cls(trainable(ref_model), lr=LR, **kwargs)
    ours = CPUOffloadOptimizer(ours_model.parameters(), optimizer_cls=cls, lr=LR, **kwargs)
    bad = copy.deepcopy(sd)
    bad["state"][0][shaped_key] = torch.zeros(3, 5, 7)
    before = _snapshot(ours_model, ours)
    with pytest.raises(ValueError, match=f"'{shaped_key}'\\) has shape \\(3, 5, 7\\)"):
        ours.load_state_dict(bad)
    _assert_unchanged(before, _snapshot(ours_model, ours))
    ref.load_state_dict(copy.deepcopy(sd))
    ours.load_state_dict(copy.deepcopy(sd))
    _steps(ref_model, ref, 2, start=2)
    _steps(ours_model, ours, 2, start=2)
    for (pname, p), q in zip(ref_model.named_parameters(), ours_model.parameters()):
        assert torch.equal(p, q), pname


def test_sgd_buffer_none_as_older_torch_saved_it_loads():
    model = make_model()
    ours = CPUOffloadOptimizer(model.parameters(), optimizer_cls=torch.optim.SGD, lr=LR, momentum=0.9)
    sd = copy.deepcopy(ours.state_dict())
    sd["state"] = {i: {"momentum_buffer": None} for i in range(4)}
    ours.load_state_dict(sd)
    _steps(model, ours, 1)
    assert all(ours.state[p]["momentum_buffer"] is not None for p in trainable(model))


# ---------------------------------------------------------------- torchao's layout

def _torchao_state_dict(model, minimal_size=512):
    """What torchao's CPUOffloadOptimizer saves (it needs a GPU; these are the optimizers it
    builds): one fused AdamW per tensor of at least ``minimal_size`` elements, one for the rest."""
    params = trainable(model)
    big = [torch.optim.AdamW([{"params": [p]}], lr=LR, fused=True) for p in params if p.numel() >= minimal_size]
    small = torch.optim.AdamW([{"params": [p for p in params if p.numel() < minimal_size]}], lr=LR, fused=True)

    class Both:
        def step(self):
            for o in (*big, small):
                o.step()

        def zero_grad(self, set_to_none=True):
            for o in (*big, small):
                o.zero_grad(set_to_none)

    _steps(model, Both(), 2)
    return {"offloaded": [o.state_dict() for o in big], "on-device": small.state_dict()}


@pytest.mark.parametrize("case,message", [
    ("no lr anywhere", "lacks \\['lr'\\]"),
    ("one tensor's lr", "different \\['lr'\\]"),
    ("state beside its tensor", "does not list"),
])
def test_torchao_checkpoint_is_refused_where_it_does_not_say_one_thing_per_group(case, message):
    """Its groups were filled in from this optimizer's own (a checkpoint without 'lr' loaded
    with the live lr), and one group's tensors took the first one's settings, silently."""
    sd = _torchao_state_dict(make_model())
    if case == "no lr anywhere":
        for group in [o["param_groups"][0] for o in sd["offloaded"]] + sd["on-device"]["param_groups"]:
            del group["lr"]
    elif case == "one tensor's lr":
        sd["on-device"]["param_groups"][0]["lr"] = 3e-3
    else:
        sd["offloaded"][0]["state"][7] = copy.deepcopy(sd["offloaded"][0]["state"][0])
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=5e-3, fused=True)
    _steps(model, opt, 1)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd, torchao_minimal_size=512)
    _assert_unchanged(before, _snapshot(model, opt))
