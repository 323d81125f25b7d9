"""Property: any sequence of what a user may do between and around steps leaves the 8-bit
optimizers' weights and state with the same bits on every path: used directly on the bf16
parameters (the reference), inside CPUOffloadOptimizer with the host update, and streamed
(the GPU's path, here its CPU twin ``streamed.config.on_cpu``, in units small enough to cut the
parameters into ranges); for AdamW8bit also bitsandbytes' own AdamW8bit, the reference there.

Operations: training steps (accumulation, torchtune's scaling, clipping), weights edited in
place, rewritten with their own values, or replaced by another model's, lr and other
hyperparameters changed, the state saved and loaded back, a parameter's state deleted, and a
resume into a new model and optimizer loaded in either order. CompactAdamW's remainder rule (a
write restarts the master; a resume keeps it for the weight it was saved with) is what makes
its paths agree: test_compact_reliability.py checks the rule itself.
"""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_plugin import AdamW8bit, CompactAdamW, CPUOffloadOptimizer
from offload_plugin.engines import streamed
from reference_twin import make_model, train, trainable

PATHS = {CompactAdamW: ("direct", "host", "streamed"), AdamW8bit: ("bitsandbytes", "direct", "host", "streamed")}

OPERATIONS = st.one_of(
    st.tuples(st.just("train"), st.integers(1, 2), st.integers(1, 2), st.sampled_from([None, 0.05])),
    st.tuples(st.just("edit weight"), st.integers(0, 3), st.sampled_from([0.5, -1.0, 0.0])),
    st.tuples(st.just("rewrite weight"), st.integers(0, 3)),
    st.tuples(st.just("load weights"), st.integers(1, 3)),
    st.tuples(st.just("lr"), st.sampled_from([0.0, 1e-3, 3e-2])),
    st.tuples(st.just("hyperparameter"), st.sampled_from(["weight_decay", "eps", "betas"])),
    st.tuples(st.just("save and load")),
    st.tuples(st.just("restart state"), st.integers(0, 3)),
    st.tuples(st.just("resume"), st.booleans()),
)
HYPERPARAMETERS = {"weight_decay": 0.3, "eps": 1e-3, "betas": (0.8, 0.99)}


def _build(cls, model, path, kw, monkeypatch):
    if path == "bitsandbytes":
        return pytest.importorskip("bitsandbytes").optim.AdamW8bit(trainable(model), **kw)
    if path == "direct":
        return cls(trainable(model), **kw)
    monkeypatch.setattr(streamed.config, "on_cpu", path == "streamed")  # (read when built)
    return CPUOffloadOptimizer(model.parameters(), optimizer_cls=cls, **kw)


def _apply(cls, op, twins, kw, monkeypatch, step):
    kind = op[0]
    for i, (path, model, opt) in enumerate(twins):
        params = trainable(model)
        if kind == "train":
            train(model, opt, op[1], start=step, accum=op[2], clip=op[3])
        elif kind in ("edit weight", "rewrite weight"):
            with torch.no_grad():
                p = params[op[1]]
                p.mul_(op[2]) if kind == "edit weight" else p.copy_(p.clone())
        elif kind == "load weights":
            model.load_state_dict(make_model(dtype=torch.bfloat16, seed=op[1]).state_dict())
        elif kind == "lr":
            for group in opt.param_groups:
                group["lr"] = op[1]
        elif kind == "hyperparameter":
            for group in opt.param_groups:
                group[op[1]] = HYPERPARAMETERS[op[1]]
        elif kind == "save and load":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        elif kind == "restart state":
            p = params[op[1]]
            if p in opt.state:
                del opt.state[p]
        elif kind == "resume":
            msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            model = make_model(dtype=torch.bfloat16, seed=9)
            opt = _build(cls, model, path, kw, monkeypatch)
            if op[1]:
                model.load_state_dict(msd)
                opt.load_state_dict(osd)
            else:
                opt.load_state_dict(osd)
                model.load_state_dict(msd)
            twins[i] = (path, model, opt)


def _assert_same(twins):
    (_, ref_model, ref_opt), *others = twins
    ref_state = ref_opt.state_dict()["state"]
    for path, model, opt in others:
        for a, b in zip(trainable(ref_model), trainable(model)):
            assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16)), path
        _assert_same_entry(opt.state_dict()["state"], ref_state, (path,))
        for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
            for key in ("lr", "betas", "eps", "weight_decay"):
                assert group[key] == ref_group[key], (path, key)


def _assert_same_entry(value, ref, where):
    """The same keys, types and values, tensors bit for bit (bitsandbytes' layout nests its
    tensors under one key)."""
    assert type(value) is type(ref), where
    if isinstance(ref, dict):
        assert value.keys() == ref.keys(), where
        for key in ref:
            _assert_same_entry(value[key], ref[key], where + (key,))
    elif isinstance(ref, torch.Tensor):
        assert value.dtype == ref.dtype and value.shape == ref.shape, where
        assert torch.equal(value.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), where
    else:
        assert value == ref, where


@pytest.mark.parametrize("cls,min_8bit_size", [(CompactAdamW, 0), (CompactAdamW, 4096), (AdamW8bit, 0), (AdamW8bit, 4096)],
                         ids=["compact", "compact-small-exact", "adamw8bit", "adamw8bit-small-32bit"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=st.lists(OPERATIONS, min_size=1, max_size=8))
def test_every_path_gives_the_same_bits(cls, min_8bit_size, program, monkeypatch):
    """A random program on twins: direct, offloaded (host update), streamed (CPU twin, in
    ranges: units of 64 elements, or 256 for AdamW8bit's 8-bit state), and bitsandbytes."""
    monkeypatch.setattr(streamed.config, "stage_numel", 64)
    kw = dict(lr=1e-2, weight_decay=0.1, min_8bit_size=min_8bit_size)
    twins = []
    for path in PATHS[cls]:
        model = make_model(dtype=torch.bfloat16)
        twins.append((path, model, _build(cls, model, path, kw, monkeypatch)))
    step = 0
    for op in program + [("train", 1, 1, None)]:
        _apply(cls, op, twins, kw, monkeypatch, step)
        step += 2
        _assert_same(twins)
