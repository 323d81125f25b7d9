"""step() from a gradient hook (torchtune's optimizer_in_bwd: one optimizer per parameter,
stepped in its post-accumulate-grad hook) queues the update and returns; the backward's
end waits for it. Same bits as torch's AdamW stepped the same way."""

import logging

import pytest
import torch

from offload_plugin import CPUOffloadOptimizer
import offload_plugin.host.inner_step as host_update
from reference_twin import DEVICES, assert_same_params, batch, make_model, trainable, twins

KW = dict(lr=1e-2, weight_decay=0.1)


def _in_bwd(model, make):
    from torchtune import training  # imported late: torchtune takes ~5 s

    optims = {p: make([p]) for p in trainable(model)}
    training.register_optim_in_bwd_hooks(model, optims)
    return optims


def _train(model, steps, device):
    for step in range(steps):
        x, y = batch(step, 0, device)
        ((model(x) - y) ** 2).sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_optimizer_in_backward_matches_torch_adamw_stepped_the_same_way(device, fused, offload_gradients):
    ref_model, model = twins(device)
    if device == "cuda":  # torch's GPU kernels need not round like the host's: twin on the host
        ref_model = ref_model.cpu()
    _in_bwd(ref_model, lambda ps: torch.optim.AdamW(ps, fused=fused, **KW))
    ours = _in_bwd(model, lambda ps: CPUOffloadOptimizer(ps, fused=fused, offload_gradients=offload_gradients, **KW))
    assert len({id(o.engine.worker) for o in ours.values()}) == 1  # one host worker for all
    _train(ref_model, 3, "cpu")
    _train(model, 3, device)
    for o in ours.values():
        assert o.engine.streams or o.engine.in_backward == []  # the backward's end waited for every update
    if device == "cpu":
        assert_same_params(ref_model, model, exact=True)
    else:
        assert_same_params(ref_model, model.cpu(), exact=False)


def test_step_in_backward_returns_before_its_update_is_done(monkeypatch):
    """The first parameter's update is held back until the backward has stepped every
    other parameter: with a step() that waited, this backward could not finish."""
    import threading

    release, started = threading.Event(), []
    real = host_update.update_slots

    def held(*args, **kwargs):
        started.append(True)
        assert release.wait(10), "the backward waited for a held update"
        return real(*args, **kwargs)

    model = make_model()
    ours = _in_bwd(model, lambda ps: CPUOffloadOptimizer(ps, **KW))
    params = trainable(model)
    last_hook = params[0]  # backward reaches the first layer last
    last_hook.register_post_accumulate_grad_hook(lambda p: release.set())
    monkeypatch.setattr(host_update, "update_slots", held)
    _train(model, 1, "cpu")
    assert started and release.is_set()
    assert all(o.engine.in_backward == [] for o in ours.values())


def test_a_nonfinite_gradient_in_backward_spares_that_parameter(caplog):
    model = make_model()
    ours = _in_bwd(model, lambda ps: CPUOffloadOptimizer(ps, **KW))
    _train(model, 1, "cpu")
    bad = model[4].weight
    before = bad.detach().clone()
    bad.register_hook(lambda g: torch.full_like(g, float("nan")))
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        _train(model, 1, "cpu")
    assert "1 parameters had an inf or NaN gradient" in caplog.text
    assert torch.equal(bad.detach(), before)
    assert all(torch.isfinite(p).all() for p in model.parameters())
