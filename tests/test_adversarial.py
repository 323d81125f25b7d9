"""Things a user can do between steps that torch's AdamW either handles or refuses.

Each test does the same to ``torch.optim.AdamW(fused=True)`` and to CPUOffloadOptimizer:
where torch works, ours must give the same bits; where torch raises, ours must raise a
clear error, with nothing changed, so that training continues as if the failing call had
not been made.
"""

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer, HostUpdateError

LR = 1e-2


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _backward(model, i):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    ((model(x) - y) ** 2).sum().backward()


def _step(model, opt, i):
    _backward(model, i)
    opt.step()
    opt.zero_grad()


def _twins():
    ref_model = _model()
    ours_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)
    ours = CPUOffloadOptimizer(ours_model.parameters(), lr=LR)
    return (ref_model, ref), (ours_model, ours)


def _assert_same(ref_model, ref, ours_model, ours):
    for (name, p), q in zip(ref_model.named_parameters(), ours_model.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(ref_model.parameters(), ours_model.parameters()):
        for key, value in ref.state[p].items():
            assert torch.equal(ours.state[q][key], value), key


# ---------------------------------------------------------------- optimizer.state edits


# Run in a fresh process (a heap corruption is the failure): a wrongly sized moment put
# into optimizer.state by hand between two steps; prints REFUSED with the error, or ACCEPTED.
_WRONG_SHAPE = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_adversarial import {model} as make_model, {step} as step
    from offload_plugin import CPUOffloadOptimizer

    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2{options})
    step(model, opt, 0)
    opt.state[model[{index}].weight][{key!r}] = torch.zeros({size})
    try:
        step(model, opt, 1)
    except Exception as err:
        print("REFUSED", type(err).__name__, err)
    else:
        print("ACCEPTED")
    """
)


def _run_wrong_shape(model="_model", step="_step", options="", index=0, key="exp_avg", size=3):
    script = _WRONG_SHAPE.format(tests=str(Path(__file__).parent), model=model, step=step,
                                 options=options, index=index, key=key, size=size)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.parametrize("index,key,size", [(0, "exp_avg", 3), (2, "exp_avg_sq", 7), (0, "exp_avg", 1000)])
def test_wrongly_shaped_state_assigned_by_hand_is_refused_not_a_crash(index, key, size):
    """A moment of the wrong size put into ``optimizer.state[p]`` by hand: the fused kernels
    walk raw pointers, so it corrupted the heap ("malloc_consolidate(): invalid chunk size",
    the process died; torch's fused AdamW does the same). It must be a clear error naming
    the entry, in a process that stays alive (run in a fresh one: a crash is the failure)."""
    out = _run_wrong_shape(index=index, key=key, size=size)
    assert "REFUSED" in out, out
    assert key in out and "shape" in out, out


def test_noncontiguous_state_assigned_by_hand_continues_as_torch():
    """A moment replaced by a non-contiguous tensor with the same values (``.t().contiguous()
    .t()``): torch's loop AdamW and its fused one on a contiguous copy give the same result;
    ours raised "view size is not compatible" from deep inside the update. It must continue
    as torch's fused AdamW with the same values contiguous (torch's fused kernel itself
    misreads non-contiguous state: the reference gets the contiguous copy)."""
    (ref_model, ref), (ours_model, ours) = _twins()
    _step(ref_model, ref, 0)
    _step(ours_model, ours, 0)
    ref.state[ref_model[0].weight]["exp_avg"] = ref.state[ref_model[0].weight]["exp_avg"].clone()
    entry = ours.state[ours_model[0].weight]
    entry["exp_avg"] = entry["exp_avg"].t().contiguous().t()
    assert not entry["exp_avg"].is_contiguous()
    for i in (1, 2):
        _step(ref_model, ref, i)
        _step(ours_model, ours, i)
    _assert_same(ref_model, ref, ours_model, ours)


def _spoil(entry, case):
    if case == "float64 moment":
        entry["exp_avg"] = entry["exp_avg"].double()
    elif case == "step as int":
        entry["step"] = 1
    else:
        del entry[case[3:]]


@pytest.mark.parametrize("streaming", [False, True], ids=["host update", "streamed"])
@pytest.mark.parametrize("case", ["float64 moment", "step as int", "no exp_avg_sq", "no exp_avg", "no step"])
def test_unusable_state_assigned_by_hand_is_a_clear_error_changing_nothing(case, streaming, monkeypatch):
    """State entries torch's fused AdamW cannot step with either (it raises, at times after
    advancing its step counts): ours must raise a clear error naming the entry, with no
    step count or weight changed, so that once the entry is put right training continues
    exactly as torch's without the failed step. (The streamed update, on its CPU twin,
    went on from its own step count over a deleted or int "step", and raised a bare
    KeyError for a deleted moment.)"""
    from offload_plugin.engines import streamed

    monkeypatch.setattr(streamed.config, "on_cpu", streaming)
    (ref_model, ref), (ours_model, ours) = _twins()
    assert ours.engine.streams == streaming
    probe_model = copy.deepcopy(ref_model)
    probe = torch.optim.AdamW(probe_model.parameters(), lr=LR, fused=True)
    _step(probe_model, probe, 0)
    _spoil(probe.state[probe_model[2].weight], case)
    with pytest.raises(Exception):  # torch refuses it too
        _step(probe_model, probe, 1)

    for model, opt in ((ref_model, ref), (ours_model, ours)):
        _step(model, opt, 0)
    good = {k: v.clone() for k, v in ours.state[ours_model[2].weight].items()}
    _spoil(ours.state[ours_model[2].weight], case)
    with pytest.raises((ValueError, TypeError, HostUpdateError)) as info:
        _step(ours_model, ours, 1)
    message = str(info.value)
    assert "optimizer.state" in message and ("exp_avg" in message or "step" in message), message
    ours.zero_grad()
    ours.state[ours_model[2].weight] = good
    for i in (2, 3):  # the reference never saw the failed step
        _step(ref_model, ref, i)
        _step(ours_model, ours, i)
    _assert_same(ref_model, ref, ours_model, ours)


@pytest.mark.parametrize("streaming", [False, True], ids=["host update", "streamed"])
def test_amsgrad_switched_on_after_steps_is_a_clear_error_changing_nothing(streaming, monkeypatch):
    """``param_groups[0]["amsgrad"] = True`` after the first step: torch's AdamW raises
    KeyError('max_exp_avg_sq') before changing anything. Ours raised it from the host update
    after advancing a step count, so switching amsgrad back and training on diverged from
    torch. It must say what to do and change nothing. (The streamed update, on its CPU twin,
    stays streamed: only amsgrad loaded with its state hands it to the host update.)"""
    from offload_plugin.engines import streamed

    monkeypatch.setattr(streamed.config, "on_cpu", streaming)
    (ref_model, ref), (ours_model, ours) = _twins()
    assert ours.engine.streams == streaming
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        _step(model, opt, 0)
        opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(KeyError):
        _step(ref_model, ref, 1)
    with pytest.raises((ValueError, HostUpdateError), match="amsgrad"):
        _step(ours_model, ours, 1)
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        opt.zero_grad()
        opt.param_groups[0]["amsgrad"] = False
        for i in (2, 3):
            _step(model, opt, i)
    _assert_same(ref_model, ref, ours_model, ours)
    assert ours.engine.streams == streaming


# ---------------------------------------------------------------- param_groups edits


_BAD_HYPER = {
    "lr None": ("lr", None),
    "lr string": ("lr", "0.01"),
    "lr 2-element tensor": ("lr", torch.tensor([1e-2, 1e-3])),
    "betas of one": ("betas", (0.9,)),
    "betas of three": ("betas", (0.9, 0.99, 0.999)),
    "beta None": ("betas", (0.9, None)),
    "eps string": ("eps", "x"),
    "weight_decay None": ("weight_decay", None),
    "weight_decay 1-element 1-D tensor": ("weight_decay", torch.tensor([0.1])),
    "eps 1-element 1-D tensor": ("eps", torch.tensor([1e-8])),
    "maximize None": ("maximize", None),
}


@pytest.mark.parametrize("case", list(_BAD_HYPER))
def test_unusable_hyperparameter_between_steps_is_refused_before_anything_changes(case):
    """A hyperparameter the update cannot use, set in ``param_groups`` between steps: torch's
    fused AdamW raises (TypeError or ValueError; ``lr="0.01"`` included, which ours took as
    0.01). Ours raised from inside the host update, some step counts already advanced, so
    that after putting the value right training no longer matched torch. It must raise a
    clear error before any update, and continue as if that step had not been attempted."""
    key, value = _BAD_HYPER[case]
    (ref_model, ref), (ours_model, ours) = _twins()
    probe_model = copy.deepcopy(ref_model)
    probe = torch.optim.AdamW(probe_model.parameters(), lr=LR, fused=True)
    _step(probe_model, probe, 0)
    probe.param_groups[0][key] = value
    with pytest.raises((TypeError, ValueError, RuntimeError)):  # torch refuses it too
        _step(probe_model, probe, 1)

    for model, opt in ((ref_model, ref), (ours_model, ours)):
        _step(model, opt, 0)
    good = ours.param_groups[0][key]
    ours.param_groups[0][key] = value
    with pytest.raises((TypeError, ValueError), match=f"param_groups\\[0\\]\\['{key}'\\]"):
        _step(ours_model, ours, 1)
    ours.zero_grad()
    ours.param_groups[0][key] = good
    for i in (2, 3):  # the reference never saw the bad value
        _step(ref_model, ref, i)
        _step(ours_model, ours, i)
    _assert_same(ref_model, ref, ours_model, ours)


@pytest.mark.parametrize("key,value", [("lr", torch.tensor(3e-3)), ("lr", 0), ("betas", (torch.tensor(0.5), 0.6)),
                                        ("weight_decay", torch.tensor(0.3)), ("eps", torch.tensor(1e-3))])
def test_hyperparameters_torch_takes_are_taken(key, value):
    """Numbers and one-element tensors, as torch's fused AdamW takes them: same bits."""
    (ref_model, ref), (ours_model, ours) = _twins()
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        _step(model, opt, 0)
        opt.param_groups[0][key] = value
        for i in (1, 2):
            _step(model, opt, i)
    _assert_same(ref_model, ref, ours_model, ours)


# ---------------------------------------------------------------- constructor options


@pytest.mark.parametrize("option", ["offload_gradients", "master_weights", "pin_memory",
                                    "check_host_memory", "delayed_update"])
@pytest.mark.parametrize("value", ["false", "no", None])
def test_flags_that_are_not_booleans_are_refused(option, value):
    """``master_weights="false"`` (a quoted YAML value, a CLI string) was taken as True: a
    silent wrong option. A flag must be True or False (or 0/1)."""
    with pytest.raises(TypeError, match=option):
        CPUOffloadOptimizer(_model().parameters(), lr=LR, **{option: value})


def test_host_threads_true_is_refused():
    """``host_threads=True`` is not a thread count (bool is an int subclass)."""
    with pytest.raises(ValueError, match="host_threads"):
        CPUOffloadOptimizer(_model().parameters(), lr=LR, host_threads=True)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_muon_over_matrices_is_accepted_and_matches_torch():
    """torch.optim.Muon takes 2-D parameters only. Built over matrices, ours refused it
    ("Muon only supports 2D parameters ... torch.Size([1])"): the options were checked on a
    1-element probe tensor. It must train as torch's Muon does, and load its own state."""
    torch.manual_seed(0)
    ref_params = [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4, 4))]
    ours_params = [nn.Parameter(p.detach().clone()) for p in ref_params]
    ref = torch.optim.Muon(ref_params, lr=LR)
    ours = CPUOffloadOptimizer(ours_params, optimizer_cls=torch.optim.Muon, lr=LR)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        grads = [torch.randn(p.shape, generator=g) for p in ref_params]
        for params, opt in ((ref_params, ref), (ours_params, ours)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
            opt.zero_grad()
    for p, q in zip(ref_params, ours_params):
        assert torch.equal(p, q)
    ours.load_state_dict(copy.deepcopy(ours.state_dict()))


def test_capturable_is_refused_at_construction():
    """``capturable=True``: torch's AdamW on host tensors fails every step with an
    AssertionError ("params and state_steps must be on supported devices"), which ours
    passed on from the host update at the first step. Refused when built, saying why."""
    with pytest.raises(ValueError, match="capturable"):
        CPUOffloadOptimizer(_model().parameters(), lr=LR, capturable=True)


# ---------------------------------------------------------------- CompactAdamW


def _compact_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)


def _compact_step(model, opt, i):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(5, 8, generator=g).bfloat16(), torch.randn(5, 4, generator=g).bfloat16()
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_compact_wrongly_shaped_state_assigned_by_hand_is_refused_not_a_crash():
    """CompactAdamW's fp32 layout (small parameters) runs torch's fused kernel on its state:
    a moment of the wrong size assigned by hand corrupted the heap ("corrupted double-linked
    list"). It must be a clear error naming the entry (fresh process: a crash fails)."""
    out = _run_wrong_shape(model="_compact_model", step="_compact_step",
                           options=', optimizer_cls="offload_plugin.CompactAdamW"')
    assert "REFUSED" in out and "'exp_avg'" in out, out


@pytest.mark.parametrize("case", ["lr None", "non-contiguous moment"])
def test_compact_unusable_group_or_state_changes_nothing(case):
    """CompactAdamW steps parameter by parameter: an unusable lr (or a state entry it cannot
    read) failed after the parameters before it were updated, so that training on after
    putting it right differed from never having tried. It must raise before any update."""
    ref_model, ours_model = _compact_model(), _compact_model()
    ref = CPUOffloadOptimizer(ref_model.parameters(), optimizer_cls="offload_plugin.CompactAdamW", lr=LR)
    ours = CPUOffloadOptimizer(ours_model.parameters(), optimizer_cls="offload_plugin.CompactAdamW", lr=LR)
    _compact_step(ref_model, ref, 0)
    _compact_step(ours_model, ours, 0)
    entry = ours.state[ours_model[2].bias]
    good = dict(entry)
    if case == "lr None":
        ours.param_groups[0]["lr"] = None
    else:
        entry["exp_avg"] = torch.stack([entry["exp_avg"]] * 2, dim=1)[:, 0]  # stride 2
        assert not entry["exp_avg"].is_contiguous()
    with pytest.raises((ValueError, TypeError, HostUpdateError)) as info:
        _compact_step(ours_model, ours, 1)
    assert "param_groups[0]['lr']" in str(info.value) or "optimizer.state" in str(info.value)
    ours.zero_grad()
    ours.param_groups[0]["lr"] = LR
    entry.update(good)
    for i in (2, 3):
        _compact_step(ref_model, ref, i)
        _compact_step(ours_model, ours, i)
    for p, q in zip(ref_model.parameters(), ours_model.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- param_groups["params"] edits


@pytest.mark.parametrize("then", ["step", "state_dict", "load_state_dict"])
def test_tensor_appended_to_a_group_directly_is_refused_not_ignored(then):
    """``param_groups[0]["params"].append(w)`` instead of ``add_param_group``: torch's AdamW
    updates ``w`` from the next step on; ours has no host copy of it, so step() silently
    left it unchanged, and state_dict() failed with AttributeError. It must be a clear
    error saying to use add_param_group, with nothing changed."""
    model = _model()
    opt = CPUOffloadOptimizer(list(model[0].parameters()), lr=LR)
    _step(model, opt, 0)
    saved = copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["params"].append(model[2].weight)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, 1)
    with pytest.raises(ValueError, match="add_param_group"):
        if then == "step":
            opt.step()
        elif then == "state_dict":
            opt.state_dict()
        else:
            opt.load_state_dict(saved)
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)


def test_state_of_a_tensor_not_held_is_a_keyerror_that_says_why():
    """``optimizer.state[q]`` for a tensor the optimizer does not update (here a frozen
    weight, which ours leaves out): torch's defaultdict makes an empty entry; ours has no
    entry to make, and raised ``KeyError(<the tensor's repr>)``. It says why now, and
    ``q in optimizer.state`` is False without raising."""
    model = _model()
    model[0].weight.requires_grad_(False)
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR)
    _step(model, opt, 0)
    assert model[0].weight not in opt.state and model[2].weight in opt.state
    with pytest.raises(KeyError, match="not among the parameters this CPUOffloadOptimizer updates"):
        opt.state[model[0].weight]
