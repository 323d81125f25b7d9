"""Which optimizer updates a parameter, and what it says about the ones it does not.

Two CPUOffloadOptimizers over one parameter would each keep a host copy of its weight and
write it back whole, undoing each other's updates where torch's optimizers apply both: the
newer one updates it, and the older one refuses its next step with nothing changed (so
rebuilding an optimizer over the same model, before or after dropping the old one, works).
A parameter left out as frozen that gets a gradient later is not updated: a warning says so.
"""

import warnings

import pytest
import torch

from offload_plugin import CPUOffloadOptimizer


def _param(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Parameter(torch.randn(16))


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_the_older_of_two_optimizers_over_a_parameter_refuses_to_step(offload_gradients):
    """o1 and o2 over one parameter: o1.step() raises, changing nothing; o2 steps as torch's
    AdamW with o2's settings alone, its gradient untouched by o1's hooks."""
    p, ref = _param(), _param()
    o1 = CPUOffloadOptimizer([p], lr=1e-2, offload_gradients=offload_gradients)
    o2 = CPUOffloadOptimizer([p], lr=1e-3, offload_gradients=offload_gradients)
    torch_opt = torch.optim.AdamW([ref], lr=1e-3, fused=True)
    x = torch.randn(16)
    (p * x).sum().backward()
    (ref * x).sum().backward()
    before = p.detach().clone()
    with pytest.raises(ValueError, match="newer CPUOffloadOptimizer"):
        o1.step()
    assert torch.equal(p.detach(), before)
    o2.step()
    torch_opt.step()
    assert torch.equal(p.detach(), ref.detach())


def test_rebuilding_an_optimizer_over_the_same_parameters_works():
    """The usual rebuild (assigning a new optimizer to the same name, or dropping the old one
    first) steps as torch's AdamW does."""
    p, ref = _param(), _param()
    opt = CPUOffloadOptimizer([p], lr=1e-2)
    opt = CPUOffloadOptimizer([p], lr=1e-2)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    for _ in range(2):
        p.grad, ref.grad = torch.ones(16), torch.ones(16)
        opt.step()
        torch_opt.step()
    del opt
    opt = CPUOffloadOptimizer([p], lr=1e-2)
    opt.load_state_dict(torch_opt.state_dict())
    p.grad, ref.grad = torch.ones(16), torch.ones(16)
    opt.step()
    torch_opt.step()
    assert torch.equal(p.detach(), ref.detach())


def test_a_parameter_unfrozen_after_building_is_reported_once():
    """A bias frozen when the optimizer was built, unfrozen later: not updated (it was left
    out), and one warning says so and what to do; frozen parameters without gradients (QLoRA's
    base weights) cause none."""
    lin = torch.nn.Linear(4, 4)
    lin.bias.requires_grad_(False)
    opt = CPUOffloadOptimizer(lin.parameters(), lr=1e-2)
    lin(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # (the frozen bias has no gradient: nothing to say)
    lin.bias.requires_grad_(True)
    lin(torch.randn(2, 4)).sum().backward()
    bias = lin.bias.detach().clone()
    with pytest.warns(UserWarning, match="requires_grad=False when it was built.*add_param_group"):
        opt.step()
    assert torch.equal(lin.bias.detach(), bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # (once)


def test_a_parameter_unfrozen_and_added_is_updated_without_a_warning():
    """Unfreezing a layer and adding it with add_param_group (the documented fix) updates it
    as torch's AdamW does, and says nothing."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    for m in (lin, ref):
        m.bias.requires_grad_(False)
    opt = CPUOffloadOptimizer(lin.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW([ref.weight], lr=1e-2, fused=True)
    for m, o in ((lin, opt), (ref, torch_opt)):
        m.bias.requires_grad_(True)
        o.add_param_group({"params": [m.bias]})
    x = torch.randn(2, 4)
    for m in (lin, ref):
        m(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    torch_opt.step()
    assert torch.equal(lin.bias.detach(), ref.bias.detach()) and torch.equal(lin.weight.detach(), ref.weight.detach())
