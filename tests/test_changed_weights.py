"""Weights changed outside the optimizer between steps are what the next step updates, as
with torch's AdamW: ``model.load_state_dict`` after building the optimizer, in-place edits
under no_grad, ``torch.nn.init``, a replaced ``param.data``, a resume in either order.

The reference (``HostTwin``) is torch's fused AdamW on host copies: without master weights
the copy is re-read from the parameter at every step, which is torch's AdamW on the
parameter itself (bit for bit on CPU); with master weights an fp32 master restarts from
the weight whenever the weight is no longer the master rounded, which is the documented
behaviour. On CUDA the same twin keeps the comparison bitwise (torch's GPU kernel need not
round like the CPU kernel the host update uses).
"""

import copy

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.engines import streamed
from reference_twin import DEVICES, batch, make_model

LR, WD, SCALE = 1e-2, 0.1, 1.0 / 16  # a power of two: scaling is exact wherever it happens


class HostTwin:
    """torch's fused AdamW on host copies of ``model``'s trainable parameters."""

    def __init__(self, model: nn.Module, master_weights: bool) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        widen = [master_weights and p.dtype == torch.bfloat16 for p in self.params]
        self.host = [p.detach().to("cpu", torch.float32 if w else p.dtype).clone().requires_grad_()
                     for p, w in zip(self.params, widen)]
        self.opt = torch.optim.AdamW(self.host, lr=LR, weight_decay=WD, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        for p, h in zip(self.params, self.host):
            weight = p.detach().cpu()
            if not torch.equal(h.to(p.dtype).view(torch.uint8), weight.view(torch.uint8)):
                h.copy_(weight)  # changed outside: read it (a master restarts from it)
            h.grad = (p.grad.cpu() * SCALE).to(h.dtype)
        self.opt.step()
        for p, h in zip(self.params, self.host):
            p.copy_(h)
            p.grad, h.grad = None, None


def _edit(model: nn.Module, step: int, pretrained: dict) -> None:
    """What users do to weights between steps (the same on both models)."""
    if step == 0:  # the plain-PyTorch order: build the optimizer, then load the weights
        model.load_state_dict(pretrained)
    elif step == 1:
        with torch.no_grad():
            model[2].weight.mul_(0.5)
    elif step == 2:
        torch.nn.init.normal_(model[4].bias)  # (no_grad inside)
    elif step == 3:
        g = torch.Generator().manual_seed(7)
        new = torch.randn(model[4].weight.shape, generator=g)
        model[4].weight.data = new.to(model[4].weight.device, model[4].weight.dtype)
    elif step == 4:  # the same values again (a reload): masters keep their extra bits
        model.load_state_dict(copy.deepcopy(model.state_dict()))


def _train(model, step_fn, steps, accum, edit, overlap=None):
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    pretrained = make_model(device, dtype, seed=1).state_dict()
    for step in range(steps):
        edit(model, step, pretrained)
        for micro in range(accum):
            if overlap is not None and micro == accum - 1:
                overlap()
            x, y = batch(step, micro, device, dtype)
            ((model(x) - y) ** 2).sum().backward()
        step_fn()


MODES = {
    "grads-on-device": dict(kwargs={}, how="scale"),
    "offloaded-grads": dict(kwargs=dict(offload_gradients=True), how="scale"),
    "overlapped": dict(kwargs=dict(offload_gradients=True), how="overlap"),
    "overlapped-accumulate-on-device": dict(
        kwargs=dict(offload_gradients=True, accumulate_on_device=True), how="overlap"),
    "early-returning": dict(kwargs=dict(offload_gradients=True), how="early"),
    "partial-offload": dict(kwargs=dict(device_fraction=0.5), how="scale"),
    "partial-offload-offloaded-grads": dict(
        kwargs=dict(device_fraction=0.5, offload_gradients=True), how="scale"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, True), (torch.bfloat16, True),
                                                  (torch.bfloat16, False)],
                         ids=["fp32", "bf16-masters", "bf16-no-masters"])
@pytest.mark.parametrize("mode", list(MODES))
def test_weights_changed_between_steps_are_what_the_next_step_updates(device, dtype, master_weights,
                                                                      mode, monkeypatch):
    spec = MODES[mode]
    # The host twin reproduces the host update's bits; on a GPU, settings that the streamed
    # update takes (torch's GPU kernel: test_streamed_gpu.py) run the host update here.
    monkeypatch.setattr(streamed.config, "enabled", False)
    if device == "cuda" and "partial" in mode and dtype == torch.bfloat16 and master_weights:
        pytest.skip("the device share's masters update with torch's GPU kernel, which the "
                    "host twin does not reproduce bit for bit")
    ref_model = make_model(device, dtype)
    model = copy.deepcopy(ref_model)
    twin = HostTwin(ref_model, master_weights)
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR, weight_decay=WD, fused=True,
                              master_weights=master_weights, **spec["kwargs"])
    if device == "cuda" and "partial" in mode:
        pytest.skip("the device share updates with torch's GPU kernel (see above)")

    def step():
        if spec["how"] == "scale":
            opt.scale_grads(SCALE) if opt.offload_gradients else [
                p.grad.mul_(SCALE) for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
        opt.finish_step()  # early-returning: edits come after the step has finished

    overlap = None
    if spec["how"] in ("overlap", "early"):
        overlap = lambda: opt.overlap_next_step(grad_scale=SCALE, early_forward=spec["how"] == "early")
    accum = 2
    _train(ref_model, twin.step, 6, accum, _edit)
    _train(model, step, 6, accum, _edit, overlap)
    for (name, want), got in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(want.view(torch.uint8), got.detach().view(torch.uint8)), name


def test_pretrained_weights_loaded_after_building_are_kept_as_torch_keeps_them():
    """The report's case: a Linear(8, 4), the optimizer built first, then load_state_dict."""
    torch.manual_seed(0)
    pretrained = nn.Linear(8, 4).state_dict()
    models = [nn.Linear(8, 4), nn.Linear(8, 4)]
    opts = [torch.optim.AdamW(models[0].parameters(), lr=0.1),
            CPUOffloadOptimizer(models[1].parameters(), lr=0.1)]
    for model, opt in zip(models, opts):
        model.load_state_dict(pretrained)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
    for want, got in zip(*(m.parameters() for m in models)):
        assert torch.equal(want, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["optimizer-then-model", "model-then-optimizer"])
@pytest.mark.parametrize("master_weights", [True, False], ids=["masters", "no-masters"])
def test_resume_in_either_order_continues_bit_exactly(device, order, master_weights):
    """A bf16 model with fp32 masters: loading the model after the optimizer must not
    throw the masters' extra bits away (the weights are the masters rounded)."""
    kwargs = dict(lr=LR, weight_decay=WD, fused=True, master_weights=master_weights,
                  offload_gradients=True)

    def run(model, opt, start, steps):
        for step in range(start, start + steps):
            x, y = batch(step, 0, device, torch.bfloat16)
            ((model(x) - y) ** 2).sum().backward()
            opt.scale_grads(SCALE)
            opt.step()
            opt.zero_grad()

    whole = make_model(device, torch.bfloat16)
    whole_opt = CPUOffloadOptimizer(whole.parameters(), **kwargs)
    run(whole, whole_opt, 0, 3)
    model_sd = copy.deepcopy(whole.state_dict())
    opt_sd = copy.deepcopy(whole_opt.state_dict())
    run(whole, whole_opt, 3, 3)

    resumed = make_model(device, torch.bfloat16, seed=5)  # other initial weights
    opt = CPUOffloadOptimizer(resumed.parameters(), **kwargs)
    if order == "optimizer-then-model":
        opt.load_state_dict(opt_sd)
        resumed.load_state_dict(model_sd)
    else:
        resumed.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
    run(resumed, opt, 3, 3)
    for want, got in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(want.view(torch.int16), got.detach().view(torch.int16))


def test_a_changed_weight_is_in_the_saved_master():
    """state_dict() saves masters that match the model's weights, even right after an edit."""
    model = make_model(dtype=torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR, master_weights=True)
    with torch.no_grad():
        model[2].weight.fill_(0.25)
    index = [p for p in model.parameters() if p.requires_grad].index(model[2].weight)
    master = opt.state_dict()["state"][index]["master_weight"]
    assert master.dtype == torch.float32 and bool((master == 0.25).all())


def test_writes_through_data_are_taken_over_by_reload_weights():
    """``param.data`` has a version counter of its own (by torch's design): such a write
    is not seen by the next step unless reload_weights() is called."""
    models = [make_model(), make_model()]
    opts = [torch.optim.AdamW(models[0].parameters(), lr=LR, fused=True),
            CPUOffloadOptimizer(models[1].parameters(), lr=LR, fused=True)]
    for model, opt in zip(models, opts):
        model[2].weight.data.mul_(0.5)
        if isinstance(opt, CPUOffloadOptimizer):
            opt.reload_weights()
        x, y = batch(0, 0, "cpu")
        ((model(x) - y) ** 2).sum().backward()
        opt.step()
    for want, got in zip(*(m.parameters() for m in models)):
        assert torch.equal(want, got)


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_parameter_converted_after_building_is_refused_with_the_fix(change):
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR)
    w = model[2].weight
    w.data = w.data.double() if change == "dtype" else torch.zeros(3, 3)
    with pytest.raises(ValueError, match=f"{change} changed.*then build the optimizer"):
        opt.state_dict()


def test_delayed_update_leaves_a_weight_changed_meanwhile_to_the_change_and_says_so():
    """delayed_update, as early_forward: the pending update of a weight changed before it was
    copied back does not overwrite the change (the parameter is the truth); the master
    restarts from it, and finishing the step raises with the fix, the others updated."""
    model = make_model(dtype=torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR, offload_gradients=True,
                              delayed_update=True)
    for step in range(2):
        x, y = batch(step, 0, "cpu", torch.bfloat16)
        ((model(x) - y) ** 2).sum().backward()
        opt.scale_grads(SCALE)
        opt.step()  # returns at once; the update runs in the background
        opt.zero_grad()
    with torch.no_grad():
        model[2].weight.fill_(0.5)
    with pytest.raises(RuntimeError, match=r"1 parameters were changed.*delayed_update.*finish_step"):
        opt.finish_step()
    opt.finish_step()  # (done: nothing left to refuse)
    assert bool((model[2].weight == 0.5).all())
    index = [p for p in model.parameters() if p.requires_grad].index(model[2].weight)
    assert bool((opt.state_dict()["state"][index]["master_weight"] == 0.5).all())
    other = model[4].weight.detach().clone()
    assert not torch.equal(other, make_model(dtype=torch.bfloat16)[4].weight)  # others updated


def test_a_change_while_an_early_returning_step_still_writes_weights_is_refused():
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR, offload_gradients=True)
    x, y = batch(0, 0, "cpu")
    opt.overlap_next_step(grad_scale=SCALE, early_forward=True)
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    with torch.no_grad():
        model[2].weight.zero_()  # before finish_step(): the step may still be writing it
    with pytest.raises(RuntimeError, match="finish_step"):
        opt.finish_step()
    # Afterwards the optimizer follows the weight as it is (zeros, or the new weight if
    # that landed after the edit).
    assert torch.equal(opt.engine.slots[model[2].weight].master, model[2].weight.detach())


def test_a_change_after_overlap_next_step_is_refused():
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR, offload_gradients=True)
    x, y = batch(0, 0, "cpu")
    opt.overlap_next_step(grad_scale=SCALE)
    ((model(x) - y) ** 2).sum().backward()  # updates start here
    with torch.no_grad():
        model[2].weight.zero_()
    with pytest.raises(RuntimeError, match="after overlap_next_step"):
        opt.step()
