"""OptimizerInBackward: each parameter updated during backward gives what torch's AdamW gives
stepping after backward; what it cannot do (a clip or a scale after backward) is refused."""

import copy

import pytest
import torch

from offload_plugin import CPUOffloadOptimizer, OptimizerInBackward
from reference_twin import batch, make_model, trainable

KWARGS = {"lr": 1e-2, "weight_decay": 0.1}
MODES = {"default": {}, "offload_gradients": {"offload_gradients": True}}


def _loop(model, opt, accum, steps=4, clear=lambda model, opt: model.zero_grad(), start=0):
    """Mean losses, backward per micro-batch, the norm a trainer logs (a clip at inf), step,
    an LR schedule, a clear. Returns the losses and norms."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for _ in range(start):
        sched.step()
    losses, norms = [], []
    for step in range(start, start + steps):
        for micro in range(accum):
            x, y = batch(step, micro, "cpu")
            loss = ((model(x) - y) ** 2).mean() / accum
            loss.backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
        sched.step()
        clear(model, opt)
    return losses, norms


def _same(ref_model, model):
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("clear", ["model.zero_grad()", "optimizer.zero_grad()"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("accum", [1, 2])
def test_updates_in_backward_give_torchs_result(accum, mode, clear):
    """Accumulation (updates in the last backward of each window), an LR schedule, weight
    decay, the logged norm, either way of clearing: torch's fused AdamW's bits."""
    clear = {"model.zero_grad()": lambda m, o: m.zero_grad(), "optimizer.zero_grad()": lambda m, o: o.zero_grad()}[clear]
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(trainable(ref_model), fused=True, **KWARGS)
    opt = OptimizerInBackward(model.parameters(), accumulation_steps=accum, **MODES[mode], **KWARGS)
    assert _loop(ref_model, ref, accum, clear=clear) == _loop(model, opt, accum, clear=clear)
    _same(ref_model, model)


def test_the_weights_change_during_backward():
    """The update runs in the gradient hook: the weights are new before step() is called."""
    model = make_model()
    opt = OptimizerInBackward(model.parameters(), **KWARGS)
    before = [p.detach().clone() for p in trainable(model)]
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).mean().backward()
    assert all(not torch.equal(a, b) for a, b in zip(before, trainable(model)))
    assert all("ran in backward" in repr(p.grad) for p in trainable(model))
    opt.step()


@pytest.mark.parametrize("after_backward", ["clip", "torchtune's scale_grads", "add"])
def test_changing_an_applied_gradient_is_refused_with_the_fix(after_backward):
    """A clip that would clip, a scale or any other change of a gradient already applied in
    backward raises, naming the fix, instead of being silently dropped."""
    model = make_model()
    opt = OptimizerInBackward(model.parameters(), **KWARGS)  # noqa: F841  (its hooks hold it weakly)
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match="already updated during backward.*max_grad_norm=0"):
        if after_backward == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        elif after_backward == "add":
            trainable(model)[0].grad.add_(1.0)
        else:
            from torchtune.training import scale_grads

            scale_grads(model, torch.tensor(0.5))


@pytest.mark.parametrize("source", ["ours", "torch's AdamW"])
def test_a_resume_from_its_state_dict_or_torchs_continues_exactly(source):
    """Two steps, a state dict (ours, or torch's AdamW's over the same parameters), a new
    model and optimizer loaded from it, two more steps: the uninterrupted run's bits."""
    ref_model = make_model()
    ref = torch.optim.AdamW(trainable(ref_model), fused=True, **KWARGS)
    _loop(ref_model, ref, 1, steps=4)
    first = make_model()
    opt = (OptimizerInBackward(first.parameters(), **KWARGS) if source == "ours"
           else torch.optim.AdamW(trainable(first), fused=True, **KWARGS))
    _loop(first, opt, 1, steps=2)
    saved = copy.deepcopy(opt.state_dict())
    resumed = make_model(seed=1)
    resumed.load_state_dict(first.state_dict())
    again = OptimizerInBackward(resumed.parameters(), **KWARGS)
    again.load_state_dict(saved)
    _loop(resumed, again, 1, steps=2, start=2)
    _same(ref_model, resumed)


def test_a_refused_part_loads_nothing():
    """A state dict with one parameter's entry malformed is refused, naming it, and no
    parameter's state changed (every part is checked before any loads)."""
    model = make_model()
    opt = OptimizerInBackward(model.parameters(), **KWARGS)
    _loop(model, opt, 1, steps=1)
    saved = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    for entry in saved["state"].values():
        entry["exp_avg"] = entry["exp_avg"] + 1.0
    saved["state"][3]["exp_avg_sq"] = torch.zeros(1)
    with pytest.raises(ValueError, match="parameter 3 of the state dict"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    for index, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(after["state"][index][key]), torch.as_tensor(value)), (index, key)


def test_what_it_refuses():
    """No trainable parameters, or accumulation_steps that is not a positive integer."""
    with pytest.raises(ValueError, match="no trainable parameters"):
        OptimizerInBackward(make_model().requires_grad_(False).parameters(), **KWARGS)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="accumulation_steps"):
            OptimizerInBackward(make_model().parameters(), accumulation_steps=bad, **KWARGS)


def test_optimizers_maps_each_trainable_parameter_to_its_own_optimizer_read_only():
    """``optimizers``: each trainable parameter's CPUOffloadOptimizer, one per parameter, as
    torchtune's wrapper's optim_map (benchmarks read what each moves there); not writable."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)
    opt = OptimizerInBackward(model.parameters(), lr=1e-3)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert list(opt.optimizers) == trainable
    assert all(isinstance(o, CPUOffloadOptimizer) and o.param_groups[0]["params"] == [p]
               for p, o in opt.optimizers.items())
    assert len({id(o) for o in opt.optimizers.values()}) == len(trainable)
    with pytest.raises(TypeError):
        opt.optimizers[model[0].bias] = None
