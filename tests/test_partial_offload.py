"""device_fraction (partial offload): the leading parameters update on their device.

References: torch's AdamW on the whole model (fp32, bit for bit), and the same model
fully offloaded (bf16 with fp32 masters: the device share's fused AdamW on its fp32
masters is the host's kernel, so both agree bit for bit), through accumulation, scaling,
clipping, overlapped steps, checkpoints in torch's layout and resume.
"""

import copy
import logging

import pytest
import torch

from reference_twin import (
    DEVICES, assert_same_params, batch, make_model, offload, reference, train, train_overlapped, trainable, twins,
)

KW = {"lr": 1e-2, "weight_decay": 0.1}
FRACTION = 0.9  # the model's first weight and bias (1,056 of 1,188 trainable elements)


def _kept(opt):
    return [p for p in trainable_params(opt) if p not in opt.engine.slots]


def trainable_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def test_keeps_the_leading_parameters_up_to_the_fraction(caplog):
    model = make_model()
    params = trainable(model)  # 32x32 weight (1024), bias 32, 4x32 weight (128), bias 4
    total = sum(p.numel() for p in params)
    with caplog.at_level(logging.INFO, logger="offload_plugin"):
        opt = offload(model, device_fraction=(1024 + 32) / total, **KW)
    assert _kept(opt) == params[:2]
    assert "and 2 (1,056 elements) on the device" in caplog.text
    assert "device_fraction=" in repr(opt)
    assert [p for p in params if p in opt.engine.slots] == params[2:]
    # A fraction smaller than the first tensor keeps nothing on the device.
    assert _kept(offload(make_model(), device_fraction=0.01, **KW)) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_matches_adamw_bitwise(device, offload_gradients, clip):
    """Bit for bit on CPU; on CUDA the host share runs CPU kernels, so within tolerance."""
    ref_model, model = twins(device)
    ref = reference(torch.optim.AdamW, trainable(ref_model), **KW)
    opt = offload(model, device_fraction=FRACTION, offload_gradients=offload_gradients, **KW)
    assert _kept(opt) and all(p.device.type == device for p in _kept(opt))
    ref_out = train(ref_model, ref, 4, accum=3, clip=clip)
    out = train(model, opt, 4, accum=3, clip=clip, via_optimizer=True)
    assert_same_params(ref_model, model, exact=device == "cpu")
    if device == "cpu":
        assert out == ref_out  # losses and clipping norms
    for p in _kept(opt):  # the device share's state lives on the device
        assert opt.state[p]["exp_avg"].device == p.device


def test_overlapped_step_matches_adamw_bitwise():
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), **KW)
    opt = offload(model, device_fraction=FRACTION, offload_gradients=True, **KW)
    train(ref_model, ref, 3, accum=3)
    for step in range(3):
        for micro in range(3):
            if micro == 2:
                opt.overlap_next_step(grad_scale=1.0 / 24)
            x, y = batch(step, micro, "cpu")
            ((model(x) - y) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert_same_params(ref_model, model, exact=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_bf16_with_masters_equals_full_offload(overlap):
    """The kept share runs fused AdamW on fp32 masters on the device, as the host does."""
    base = make_model(dtype=torch.bfloat16)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    full = offload(a, fused=True, offload_gradients=True, master_weights=True, **KW)
    part = offload(b, fused=True, offload_gradients=True, master_weights=True,
                   device_fraction=FRACTION, **KW)
    assert _kept(part) and part.state_dict() is not None
    for model, opt in ((a, full), (b, part)):
        train_overlapped(model, opt, 3, overlap)
    assert_same_params(a, b, exact=True)
    kept = _kept(part)[0]
    assert part.state_dict()["state"][0]["master_weight"].dtype == torch.float32
    assert torch.equal(part.engine.device_share.master(kept).to(torch.bfloat16), kept.detach())


def test_state_dict_is_torchs_layout_and_resumes_exactly(tmp_path):
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), **KW)
    opt = offload(model, device_fraction=FRACTION, **KW)
    train(ref_model, ref, 2)
    train(model, opt, 2)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for index, entry in ref_sd["state"].items():
        for key, value in entry.items():
            assert torch.equal(sd["state"][index][key], value), (index, key)
    assert len(opt.state) == len(trainable(model)) and all(p in opt.state for p in trainable(model))
    # Resume in a new optimizer (and into plain AdamW): continues like the run that saved.
    torch.save(sd, tmp_path / "opt.pt")
    resumed = copy.deepcopy(model)
    opt2 = offload(resumed, device_fraction=FRACTION, **KW)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    plain = copy.deepcopy(model)
    adamw = reference(torch.optim.AdamW, trainable(plain), **KW)
    adamw.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for m, o in ((model, opt), (resumed, opt2), (plain, adamw)):
        train(m, o, 2, start=2)
    assert_same_params(model, resumed, exact=True)
    assert_same_params(model, plain, exact=True)


def test_nonfinite_gradient_on_the_device_share_spares_it(caplog):
    """Overlapped step: a NaN in a kept parameter's gradient leaves the kept share as it
    was; the host parameters, already updating during backward, are updated."""
    model = make_model()
    opt = offload(model, device_fraction=FRACTION, offload_gradients=True, **KW)
    kept = _kept(opt)
    before = [p.detach().clone() for p in trainable(model)]
    opt.overlap_next_step(grad_scale=0.5)
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    kept[0].grad[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING):
        opt.step()
    for p, b in zip(trainable(model), before):
        assert torch.equal(p.detach(), b) == (id(p) in {id(k) for k in kept})
    assert f"{len(kept)} parameters had an inf or NaN gradient" in caplog.text


@pytest.mark.parametrize("fraction", [1.0, -0.1, "half"])
def test_bad_fraction_is_refused(fraction):
    with pytest.raises(ValueError, match="device_fraction must be in"):
        offload(make_model(), device_fraction=fraction)


def test_with_delayed_update_the_device_share_updates_at_once():
    """Kept parameters are not delayed: after one step they have moved, the host ones not yet."""
    model = make_model()
    opt = offload(model, device_fraction=FRACTION, delayed_update=True, **KW)
    kept = _kept(opt)
    before = [p.detach().clone() for p in trainable(model)]
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    on_device = {id(k) for k in kept}
    for p, b in zip(trainable(model), before):
        if id(p) in on_device:
            assert not torch.equal(p.detach(), b)
    opt.engine.worker.drain()
    assert all(torch.equal(p.detach(), b) for p, b in zip(trainable(model), before) if id(p) not in on_device)
    opt.state_dict()  # completes the delayed host update
    assert not any(torch.equal(p.detach(), b) for p, b in zip(trainable(model), before))
