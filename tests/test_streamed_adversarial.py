"""Things a user can do between steps of the streamed update (offload_plugin.engines.streamed, the
default on a GPU), here on its CPU twin (``streamed.config.on_cpu``) against torch's
``AdamW(fused=True)`` on the CPU, bit for bit: where torch works, ours gives the same bits;
where torch raises, ours raises a clear error with nothing changed (weights, moments, step
counts), so that training continues as if the call had not been made. test_adversarial.py
holds the same for the host update."""

import copy

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.engines import streamed
from test_adversarial import _backward, _step  # (inputs of 8 features, targets of 4)

LR = 1e-2


@pytest.fixture(autouse=True)
def _streamed_on_cpu(monkeypatch):
    monkeypatch.setattr(streamed.config, "on_cpu", True)
    # The 32x32 weight goes in ranges (see test_streamed.py).
    monkeypatch.setattr(streamed.config, "stage_numel", 640)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _twins(params=lambda m: m.parameters(), **kwargs):
    kwargs = dict(dict(lr=LR, weight_decay=0.1), **kwargs)
    ref_model = _model()
    ours_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(params(ref_model), fused=True, **kwargs)
    ours = CPUOffloadOptimizer(params(ours_model), **kwargs)
    assert ours.engine.streams
    return (ref_model, ref), (ours_model, ours)


def _assert_same(ref_model, ref, ours_model, ours):
    for (name, p), q in zip(ref_model.named_parameters(), ours_model.parameters()):
        assert torch.equal(p, q), name
    for (name, p), q in zip(ref_model.named_parameters(), ours_model.parameters()):
        assert (p in ref.state) == (q in ours.state), name
        for key, value in ref.state.get(p, {}).items():
            assert torch.equal(ours.state[q][key], value), (name, key)


def test_group_added_after_a_step_steps_without_a_state_read_between():
    """``add_param_group`` after a step, then the next step with no read of the state in
    between: the step crashed with IndexError (the host counts were brought up to date
    for every slot, the new group's too, from device counts that cover only the old
    ones). It must continue as torch's AdamW, the new group at its own hyperparameters."""
    (ref_model, ref), (ours_model, ours) = _twins(lambda m: m[0].parameters())
    for i in range(5):
        for model, opt in ((ref_model, ref), (ours_model, ours)):
            if i == 2:
                opt.add_param_group({"params": list(model[2].parameters()), "lr": 3e-3, "betas": (0.8, 0.9)})
            if i == 3:
                opt.add_param_group({"params": list(model[4].parameters()), "lr": torch.tensor(5e-3),
                                     "weight_decay": 0.3, "maximize": True})
            _step(model, opt, i)
    _assert_same(ref_model, ref, ours_model, ours)


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            {i: {k: v.clone() for k, v in entry.items()} for i, entry in opt.state_dict()["state"].items()})


def _assert_unchanged(model, opt, snapshot):
    weights, state = snapshot
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys()
    for index, entry in state.items():
        for key, value in entry.items():
            assert torch.equal(now[index][key], value), (index, key)


_BAD_HYPER = {
    "lr None": ("lr", None),
    "lr string": ("lr", "0.01"),
    "lr 2-element tensor": ("lr", torch.tensor([1e-2, 1e-3])),
    "betas of one": ("betas", (0.9,)),
    "beta None": ("betas", (0.9, None)),
    "eps string": ("eps", "x"),
    "eps 2-element tensor": ("eps", torch.tensor([1e-8, 1e-8])),
    "weight_decay None": ("weight_decay", None),
    "weight_decay 1-element 1-D tensor": ("weight_decay", torch.tensor([0.1])),
    "eps 1-element 1-D tensor": ("eps", torch.tensor([1e-8])),
    "maximize None": ("maximize", None),
    "maximize 1": ("maximize", 1),
}


@pytest.mark.parametrize("case", list(_BAD_HYPER))
def test_unusable_hyperparameter_between_steps_is_refused_before_anything_changes(case):
    """A hyperparameter torch's fused AdamW refuses, set in ``param_groups`` between steps:
    the streamed update raised torch's kernel's TypeError ("received an invalid combination
    of arguments") after it had advanced every step count (and updated the units before the
    failing group's), so that after putting the value right training no longer matched
    torch's. It must say which entry and what it needs, before anything changes."""
    key, value = _BAD_HYPER[case]
    probe_model = _model()
    probe = torch.optim.AdamW(probe_model.parameters(), lr=LR, fused=True)
    _step(probe_model, probe, 0)
    probe.param_groups[0][key] = value
    with pytest.raises((TypeError, ValueError, RuntimeError)):  # torch refuses it too
        _step(probe_model, probe, 1)

    (ref_model, ref), (ours_model, ours) = _twins()
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        _step(model, opt, 0)
    before = _snapshot(ours_model, ours)
    good = ours.param_groups[0][key]
    ours.param_groups[0][key] = value
    _backward(ours_model, 1)
    with pytest.raises((TypeError, ValueError), match=f"param_groups\\[0\\]\\['{key}'\\]"):
        ours.step()
    ours.param_groups[0][key] = good
    _assert_unchanged(ours_model, ours, before)
    ours.zero_grad()
    for i in (2, 3):  # the reference never saw the bad value
        _step(ref_model, ref, i)
        _step(ours_model, ours, i)
    _assert_same(ref_model, ref, ours_model, ours)


@pytest.mark.parametrize("layer", [2, 4], ids=["in ranges", "whole"])
def test_parameter_data_replaced_between_steps_is_what_the_next_step_updates(layer):
    """``p.data = t`` between steps (what ``module.to()`` and many init or loading helpers
    do): torch's AdamW updates the parameter's new memory. The streamed update kept
    updating views of the old memory cut when it planned the step, so the parameter was
    silently never updated again."""
    (ref_model, ref), (ours_model, ours) = _twins()
    for i in range(4):
        for model, opt in ((ref_model, ref), (ours_model, ours)):
            if i == 2:
                weight = model[layer].weight
                weight.data = weight.detach() * 0.5  # new memory, same shape and dtype
            _step(model, opt, i)
    _assert_same(ref_model, ref, ours_model, ours)


def test_parameter_converted_to_another_dtype_between_steps_is_refused_changing_nothing():
    """``module.to(torch.bfloat16)`` after steps assigns each parameter's ``.data``: torch's
    fused AdamW then raises (its float32 moments do not match the bf16 weight). Ours raised
    the kernel's RuntimeError after advancing every step count; it must raise a clear error
    saying what to do before anything changes."""
    model = _model()
    probe = copy.deepcopy(model)
    probe_opt = torch.optim.AdamW(probe.parameters(), lr=LR, fused=True)
    _step(probe, probe_opt, 0)
    probe[4].to(torch.bfloat16)
    for p in probe.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError):  # torch refuses it too
        probe_opt.step()

    opt = CPUOffloadOptimizer(model.parameters(), lr=LR)
    _step(model, opt, 0)
    before = _snapshot(model, opt)
    kept = [(p, p.data) for p in model[4].parameters()]
    model[4].to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="given as torch.float32 of shape .4, 32. is now torch.bfloat16"):
        opt.step()
    for p, data in kept:  # (converting back would round the weights through bf16)
        p.data = data
    _assert_unchanged(model, opt, before)


@pytest.mark.parametrize("fused", [False, None])
def test_fused_switched_off_between_steps_continues_as_torch(fused, caplog):
    """``param_groups[0]["fused"] = False`` (or None) after steps: torch's AdamW goes on with
    its for-loop implementation, whose bits differ from the fused kernel's. The streamed
    update went on with the fused kernel (a silent difference); it must continue as torch
    does, as the host update (what building with fused=False gives) does."""
    (ref_model, ref), (ours_model, ours) = _twins()
    for i in range(4):
        for model, opt in ((ref_model, ref), (ours_model, ours)):
            if i == 1:
                opt.param_groups[0]["fused"] = fused
            _step(model, opt, i)
    _assert_same(ref_model, ref, ours_model, ours)
    assert not ours.engine.streams
    assert "the update runs on the host from now on" in caplog.text
    assert "set param_groups[i]['fused'] = True after loading" in caplog.text


def test_state_dict_of_unfused_adamw_keeps_streaming_when_fused_is_set_back():
    """A state dict of torch's AdamW built without fused (its groups say fused=None) loaded
    into ours: the warning at the next step says to set fused back to True after loading;
    done before that step, the update stays streamed, as torch's fused AdamW given the
    same state and setting."""
    (ref_model, ref), (ours_model, ours) = _twins()
    donor_model = _model()
    donor = torch.optim.AdamW(donor_model.parameters(), lr=LR, weight_decay=0.1)
    for i in range(2):
        _step(donor_model, donor, i)
    saved = donor.state_dict()
    assert saved["param_groups"][0]["fused"] is None
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        model.load_state_dict(donor_model.state_dict())
        opt.load_state_dict(copy.deepcopy(saved))
        for group in opt.param_groups:
            group["fused"] = True
    for i in range(2, 5):
        for model, opt in ((ref_model, ref), (ours_model, ours)):
            _step(model, opt, i)
    assert ours.engine.streams
    _assert_same(ref_model, ref, ours_model, ours)


def test_differentiable_switched_on_between_steps_is_refused_changing_nothing():
    """``param_groups[0]["differentiable"] = True`` after steps: torch's fused AdamW raises
    ("does not support differentiable=True") before changing anything; the streamed update
    ignored it. It must raise, saying what to do, with nothing changed."""
    probe_model = _model()
    probe = torch.optim.AdamW(probe_model.parameters(), lr=LR, fused=True)
    _step(probe_model, probe, 0)
    probe.param_groups[0]["differentiable"] = True
    with pytest.raises(RuntimeError, match="differentiable"):  # torch refuses it
        _step(probe_model, probe, 1)

    (ref_model, ref), (ours_model, ours) = _twins()
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        _step(model, opt, 0)
    before = _snapshot(ours_model, ours)
    ours.param_groups[0]["differentiable"] = True
    _backward(ours_model, 1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['differentiable'\]"):
        ours.step()
    _assert_unchanged(ours_model, ours, before)
    ours.zero_grad()
    ours.param_groups[0]["differentiable"] = False
    for i in (2, 3):
        _step(ref_model, ref, i)
        _step(ours_model, ours, i)
    _assert_same(ref_model, ref, ours_model, ours)


def test_state_dict_of_amsgrad_adamw_loaded_continues_as_torch(caplog):
    """A state dict of torch's AdamW(amsgrad=True) loaded between steps: torch's AdamW takes
    its groups' amsgrad=True and goes on with the loaded max_exp_avg_sq. The streamed update
    (which has no amsgrad) loaded it and then refused every step ("amsgrad was turned on
    after the optimizer was built"); the host update takes over now, bit for bit torch's."""
    source_model = _model(seed=1)
    source = torch.optim.AdamW(source_model.parameters(), lr=LR, fused=True, amsgrad=True)
    for i in range(2):
        _step(source_model, source, i)
    saved = source.state_dict()
    (ref_model, ref), (ours_model, ours) = _twins()
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        _step(model, opt, 0)
        opt.load_state_dict(copy.deepcopy(saved))
        for i in (1, 2):
            _step(model, opt, i)
    _assert_same(ref_model, ref, ours_model, ours)
    assert "the update runs on the host from now on" in caplog.text



def test_parameter_data_replaced_by_a_noncontiguous_tensor_is_a_clear_error_changing_nothing():
    """``w.data = w.t().contiguous().t()`` (the same values, transposed strides): the
    streamed update cuts flat views of each parameter and failed with "view size is not
    compatible with input tensor's size and stride" (torch's fused CPU kernel misreads such
    a weight as flat). It must say what to do, with nothing changed; with the same values
    made contiguous again training goes on bit for bit as torch's AdamW."""
    (ref_model, ref), (ours_model, ours) = _twins()
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        _step(model, opt, 0)
    before = _snapshot(ours_model, ours)
    weight = ours_model[2].weight
    weight.data = weight.detach().t().contiguous().t()
    _backward(ours_model, 1)
    with pytest.raises(ValueError, match="not contiguous"):
        ours.step()
    weight.data = weight.detach().contiguous()
    _assert_unchanged(ours_model, ours, before)
    ours.zero_grad()
    for i in (2, 3):
        _step(ref_model, ref, i)
        _step(ours_model, ours, i)
    _assert_same(ref_model, ref, ours_model, ours)


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "host update"])
def test_parameter_moved_to_another_group_takes_that_groups_hyperparameters(streaming, monkeypatch):
    """A parameter moved by hand from one group's ``params`` list to another's: torch's
    AdamW updates it with its new group's lr from then on. Both updates kept the group
    each parameter had when planned (the streamed update's units, the host optimizer's
    groups), a silent difference; they follow the groups now."""
    monkeypatch.setattr(streamed.config, "enabled", streaming)

    def groups(model):
        return [{"params": list(model[0].parameters())},
                {"params": [*model[2].parameters(), *model[4].parameters()], "lr": 1e-3}]

    ref_model = _model()
    ours_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(groups(ref_model), lr=LR, fused=True)
    ours = CPUOffloadOptimizer(groups(ours_model), lr=LR)
    assert ours.engine.streams == streaming
    for i in range(5):
        for model, opt in ((ref_model, ref), (ours_model, ours)):
            if i == 2:
                opt.param_groups[1]["params"].remove(model[2].weight)
                opt.param_groups[0]["params"].append(model[2].weight)
            if i == 3:
                opt.param_groups[0]["params"].reverse()
            _step(model, opt, i)
    _assert_same(ref_model, ref, ours_model, ours)
    assert ours.state_dict()["param_groups"] == ref.state_dict()["param_groups"]


@pytest.mark.parametrize("edit", ["taken out", "in two groups"])
def test_parameter_taken_out_of_the_groups_or_doubled_is_refused_changing_nothing(edit):
    """A parameter taken out of every group's list by hand (torch's AdamW then leaves it
    alone), or put into a second group's list too (torch's updates it twice): both updates
    went on updating it once, silently. Ours cannot follow (its state and slot stay), so it
    says so before anything changes."""
    model = _model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR)
    opt.add_param_group({"params": [], "lr": 1e-3})
    _step(model, opt, 0)
    before = _snapshot(model, opt)
    if edit == "taken out":
        assert opt.param_groups[0]["params"].pop(2) is model[2].weight
    else:
        opt.param_groups[1]["params"].append(model[2].weight)
    _backward(model, 1)
    with pytest.raises(ValueError, match="taken out|more than one"):
        opt.step()
    if edit == "taken out":  # (put back where it was)
        opt.param_groups[0]["params"].insert(2, model[2].weight)
    else:
        opt.param_groups[1]["params"].pop()
    _assert_unchanged(model, opt, before)


def test_what_the_streamed_update_already_did_as_torch():
    """The review's other checks, which found the streamed update right (kept as guards):
    gradients that are None for some parameters in some steps, a layer frozen
    mid-training and back, ``zero_grad(set_to_none=False)`` and a step over its zeros,
    each hyperparameter changed between steps per group (lr as a float and as a 0-dim
    tensor, betas, eps, weight_decay, maximize), groups of float32, bfloat16 and float16,
    and gradients of other strides (against torch given the same values contiguous:
    torch's fused CPU kernel reads a gradient's memory as if it were contiguous)."""
    def groups(model):
        model[2].to(torch.bfloat16)
        model[4].to(torch.float16)
        return [{"params": list(model[i].parameters())} for i in (0, 2, 4)]

    (ref_model, ref), (ours_model, ours) = _twins(groups)
    changes = {1: (0, "lr", 3e-3), 2: (1, "lr", torch.tensor(2e-3)), 3: (2, "betas", (0.8, 0.95)),
               4: (0, "eps", 1e-3), 5: (1, "weight_decay", 0.5), 6: (2, "maximize", True)}
    for i in range(8):
        for model, opt in ((ref_model, ref), (ours_model, ours)):
            if i in changes:
                index, key, value = changes[i]
                opt.param_groups[index][key] = value
            model[2].requires_grad_(i not in (3, 4))
            g = torch.Generator().manual_seed(i)
            for p in model.parameters():
                if p.requires_grad and not (i == 2 and p is model[0].bias):
                    grad = torch.randn(p.shape[::-1], generator=g).to(p.dtype).t()  # (strides reversed)
                    p.grad = grad.contiguous() if opt is ref else grad
            opt.step()
            opt.zero_grad(set_to_none=i % 2 == 1)
    _assert_same(ref_model, ref, ours_model, ours)


@pytest.mark.parametrize("dtype, init_scale", [(torch.float16, 2.0 ** 24), (torch.float32, 1000.0)],
                         ids=["fp16 weights, overflowing first", "fp32 weights, scale not a power of 2"])
def test_grad_scaler_steps_as_with_torch_fused_adamw(dtype, init_scale):
    """torch.amp.GradScaler: torch's fused AdamW takes the scale into its kernel (it divides
    the gradients by it) instead of having GradScaler unscale them. Ours had GradScaler
    unscale first: with fp16 weights GradScaler then refused ("Attempting to unscale FP16
    gradients"), and a scale that is not a power of two gave other bits. The streamed
    update takes the scale as torch's does now; steps whose scaled gradients overflowed are
    skipped as torch skips them."""
    ref_model = _model().to(dtype)
    ours_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    ours = CPUOffloadOptimizer(ours_model.parameters(), lr=LR, weight_decay=0.1)
    for model, opt in ((ref_model, ref), (ours_model, ours)):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=1.5, growth_interval=2)
        for i in range(6):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(5, 8, generator=g).to(dtype), torch.randn(5, 4, generator=g).to(dtype)
            scaler.scale(((model(x) - y) ** 2).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if dtype == torch.float16:
            assert scaler.get_scale() < init_scale  # (some steps overflowed and were skipped)
    _assert_same(ref_model, ref, ours_model, ours)
