"""CPUOffloadOptimizer against torch's own optimizers: results, API and bad input."""

import copy
import io
import logging
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer, OffloadedGrad
from offload_plugin.host import worker as host_worker
from reference_twin import (
    DEVICES, assert_same_params, batch, make_model, offload, reference, train, trainable, twins,
)

OPTIMIZERS = {
    # Adam(W) without a choice runs fused, the fast path (offload_plugin.host.inner_step); the
    # reference then is torch's fused kernel (reference_twin.reference).
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.99)}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "nesterov": True}),
    # fused=False keeps torch's per-tensor loop, through the host optimizer's own step().
    "AdamW-loop": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": False}),
    "Adam-foreach": (torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
    "Adam-fused-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "fused": True}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "offload_gradients,via_optimizer",
    [(False, False), (False, True), (True, True)],
    ids=["stock-helpers", "optimizer-helpers", "offload-gradients"],
)
def test_matches_reference_optimizer(device, name, offload_gradients, via_optimizer):
    """Frozen layer, accumulation, scaling, clipping and a scheduler: same weights as optimizer_cls."""
    cls, kwargs = OPTIMIZERS[name]
    ref_model, model = twins(device)
    ref = reference(cls, trainable(ref_model), **kwargs)
    opt = offload(model, optimizer_cls=cls, offload_gradients=offload_gradients, **kwargs)
    decay = lambda step: 0.8**step  # noqa: E731
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)

    ref_losses, ref_norms = train(ref_model, ref, 5, accum=3, clip=0.5, sched=ref_sched)
    losses, norms = train(
        model, opt, 5, accum=3, clip=0.5, sched=sched, via_optimizer=via_optimizer
    )

    exact = device == "cpu"  # the same CPU kernels run on both sides
    assert_same_params(ref_model, model, exact=exact)
    assert losses == pytest.approx(ref_losses, rel=0 if exact else 1e-5)
    assert norms == pytest.approx(ref_norms, rel=0 if exact else 1e-5)
    assert max(ref_norms) > 0.5, "clipping must actually have clipped in this test"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_bf16_default_is_torch_adamw_on_the_bf16_parameters(device, offload_gradients):
    """With no options, bf16 parameters train bit for bit as torch's AdamW trains them
    (a drop-in: same weights, same state layout, no master copies)."""
    ref_model, model = twins(device, torch.bfloat16)
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-3, weight_decay=0.1)
    opt = offload(model, offload_gradients=offload_gradients, lr=1e-3, weight_decay=0.1)
    ref_losses, _ = train(ref_model, ref, 6, clip=0.5)
    losses, _ = train(model, opt, 6, clip=0.5, via_optimizer=True)
    exact = device == "cpu"  # the same CPU kernels run on both sides
    assert_same_params(ref_model, model, exact=exact)
    assert losses == pytest.approx(ref_losses, rel=0 if exact else 1e-3)
    state = opt.state_dict()["state"]
    assert all("master_weight" not in s and s["exp_avg"].dtype == torch.bfloat16 for s in state.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_bf16_master_weights_beat_plain_bf16(device, offload_gradients):
    """bf16 parameters with fp32 master weights end closer to fp32 training than bf16 AdamW."""
    kwargs = {"lr": 1e-3}
    fp32 = make_model(device)
    bf16_plain = copy.deepcopy(fp32).to(torch.bfloat16)
    bf16_master = copy.deepcopy(fp32).to(torch.bfloat16)
    train(fp32, reference(torch.optim.AdamW, trainable(fp32), **kwargs), 30)
    train(bf16_plain, reference(torch.optim.AdamW, trainable(bf16_plain), **kwargs), 30)
    opt = offload(bf16_master, offload_gradients=offload_gradients, master_weights=True, **kwargs)
    train(bf16_master, opt, 30, via_optimizer=True)

    def error(model):
        return sum(
            (p.float() - q).abs().sum().item()
            for p, q in zip(trainable(model), trainable(fp32))
        )

    assert error(bf16_master) < 0.75 * error(bf16_plain)
    assert all(p.dtype == torch.bfloat16 for p in bf16_master.parameters())


def test_master_weights_off_matches_plain_bf16():
    """master_weights=False updates bf16 copies: bit-identical to AdamW on bf16 parameters."""
    ref_model, model = twins(dtype=torch.bfloat16)
    train(ref_model, reference(torch.optim.AdamW, trainable(ref_model), lr=1e-3), 5)
    train(model, offload(model, master_weights=False, lr=1e-3), 5)
    assert_same_params(ref_model, model, exact=True)


def test_is_a_real_torch_optimizer():
    """defaults, user's param groups and keys, state by parameter, hooks, zero_grad, repr."""
    model = make_model()
    groups = [
        {"params": model[2].parameters(), "lr": 1e-3, "name": "hidden"},
        {"params": model[4].parameters(), "name": "head"},
        {"params": model[0].parameters(), "name": "frozen"},
    ]
    opt = CPUOffloadOptimizer(groups, lr=1e-2, betas=(0.8, 0.9))
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults["lr"] == 1e-2 and opt.defaults["betas"] == (0.8, 0.9)
    assert [g["name"] for g in opt.param_groups] == ["hidden", "head", "frozen"]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2, 1e-2]
    assert opt.param_groups[0]["params"] == list(model[2].parameters())
    assert opt.param_groups[2]["params"] == []  # frozen parameters dropped, group kept

    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    assert len(opt.state) == 0
    train(model, opt, 1)
    assert calls == ["pre", "post"]
    assert set(opt.state) == set(trainable(model))
    w = model[2].weight
    assert opt.state[w]["exp_avg"].shape == w.shape
    assert opt.state[w]["exp_avg"].device.type == "cpu"

    extra = nn.Linear(4, 4)
    extra.bias.requires_grad_(False)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.5})
    assert opt.param_groups[-1]["params"] == [extra.weight]
    assert opt.param_groups[-1]["betas"] == (0.8, 0.9)  # defaults filled in

    model(torch.randn(2, 16)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert all(torch.all(p.grad == 0) for p in trainable(model))
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in trainable(model))
    text = repr(opt)
    assert text.startswith("CPUOffloadOptimizer(optimizer_cls=AdamW")
    assert "Parameter Group 2" in text and "name: frozen" in text


def _param_forms(model):
    return {
        "generator": lambda: model.parameters(),
        "list": lambda: list(model.parameters()),
        "groups": lambda: [{"params": m.parameters()} for m in (model[0], model[2], model[4])],
        "named": lambda: model.named_parameters(),
    }


@pytest.mark.parametrize("form", ["generator", "list", "groups", "named"])
def test_accepts_params_as_torchtune_passes_them(form, caplog):
    """A generator, a list, group dicts or named parameters; frozen ones dropped and counted."""
    ref_model, model = twins()
    with caplog.at_level(logging.INFO, logger="offload_plugin"):
        opt = CPUOffloadOptimizer(_param_forms(model)[form](), lr=1e-2)
    assert sum(len(g["params"]) for g in opt.param_groups) == 4
    assert "optimizing 4 tensors (1,188 elements)" in caplog.text
    assert "skipped 2 frozen tensors (544 elements)" in caplog.text
    train(ref_model, reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2), 3)
    train(model, opt, 3)
    assert_same_params(ref_model, model, exact=True)


def test_frozen_base_weights_get_no_hooks():
    """offload_gradients hooks only trainable tensors (hooking a frozen one raises in torch):
    two hooks each, before and after autograd adds a gradient."""
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), offload_gradients=True)
    assert len(opt.engine._hooks) == 2 * 4


def test_no_trainable_parameters_raises():
    """A model with everything frozen gets a ValueError naming the likely cause."""
    model = make_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters.*set_trainable_params"):
        CPUOffloadOptimizer(model.parameters())


def test_notice_without_accelerator(caplog):
    """On CPU parameters the optimizer says, once, that it runs without transfers."""
    with caplog.at_level(logging.INFO, logger="offload_plugin"):
        CPUOffloadOptimizer(make_model().parameters())
    assert "not a CUDA device" in caplog.text


def test_one_optimizer_per_parameter_logs_one_line(caplog, monkeypatch):
    """torchtune's optimizer_in_bwd builds an optimizer per parameter: one INFO line for all
    of them, each one's summary at DEBUG."""
    from offload_plugin import trainable as trainable_module

    monkeypatch.setattr(trainable_module, "_ONE_TENSOR_NOTED", False)
    params = trainable(make_model())
    with caplog.at_level(logging.DEBUG, logger="offload_plugin"):
        opts = {p: CPUOffloadOptimizer([p], lr=1e-3) for p in params}
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(info) == 1 and "one tensor each" in info[0], info
    assert sum("optimizing 1 tensors" in m for m in debug) == len(opts) == 4
    assert sum("not a CUDA device" in m for m in debug) == 4


def test_offload_gradients_frees_device_grads_and_accumulates():
    """With offload_gradients the model's .grad is a handle without device memory after
    backward; the host sums match autograd's."""
    ref_model, model = twins()
    opt = offload(model, offload_gradients=True)
    for micro in range(3):
        x, y = batch(0, micro, "cpu")
        ((model(x) - y) ** 2).sum().backward()
        ((ref_model(x) - y) ** 2).sum().backward()
        assert all(type(p.grad) is OffloadedGrad for p in trainable(model))
    opt.engine.complete_host_grads()
    for p, ref_p in zip(trainable(model), trainable(ref_model)):
        torch.testing.assert_close(opt.engine.slots[p].grad, ref_p.grad, rtol=0, atol=0)


def test_hyperparameter_change_takes_effect_next_step():
    """lr=0 written into param_groups freezes the weights at the next step; restoring it moves them."""
    model = make_model()
    opt = offload(model, lr=1e-2, weight_decay=0.0)
    opt.param_groups[0]["lr"] = 0.0
    before = [p.clone() for p in trainable(model)]
    train(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, trainable(model)))
    opt.param_groups[0]["lr"] = 1e-2
    train(model, opt, 1)
    assert not any(torch.equal(a, b) for a, b in zip(before, trainable(model)))


def test_optimizer_cls_by_dotted_string():
    """optimizer_cls may be a dotted path, as written in YAML."""
    ref_model, model = twins()
    opt = offload(model, optimizer_cls="torch.optim.SGD", lr=0.1, momentum=0.5)
    assert opt.optimizer_cls is torch.optim.SGD
    train(ref_model, torch.optim.SGD(trainable(ref_model), lr=0.1, momentum=0.5), 3)
    train(model, opt, 3)
    assert_same_params(ref_model, model, exact=True)


def _two_devices():
    a = nn.Parameter(torch.zeros(2))
    b = nn.Parameter(torch.zeros(2, device="meta"))
    return [a, b]


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (lambda m: ([*m.parameters()], {"lr": -1.0}), ValueError, "Invalid learning rate"),
        (lambda m: ([*m.parameters()], {"betas": (1.5, 0.9)}), ValueError, "Invalid beta"),
        (lambda m: ([*m.parameters()], {"bogus": 1}), TypeError, "bogus"),
        (lambda m: ([m[2].weight, m[2].weight], {}), ValueError, "more than once"),
        (
            lambda m: ([{"params": [m[2].weight]}, {"params": [m[2].weight]}], {}),
            ValueError, "more than one parameter group",
        ),
        (lambda m: (_two_devices(), {}), ValueError, "one device"),
        (lambda m: ([*m.parameters()], {"optimizer_cls": "torch.optim.Nope"}), ValueError,
         "does not resolve"),
        (lambda m: ([*m.parameters()], {"optimizer_cls": "nomodule.X"}), ValueError,
         "does not resolve"),
        (lambda m: ([*m.parameters()], {"optimizer_cls": nn.Linear}), TypeError, "Optimizer subclass"),
        (lambda m: ([*m.parameters()], {"optimizer_cls": torch.optim.LBFGS}), ValueError,
         "not supported"),
        (lambda m: (m[2].weight, {}), TypeError, "iterable"),
        (lambda m: ([{"params": set(m.parameters())}], {}), TypeError, "not a set"),
        (lambda m: (set(m.parameters()), {}), TypeError, "as a set.*pass a list"),
        (lambda m: ([*m.parameters()], {"optimizer_cls": type("MyLBFGS", (torch.optim.LBFGS,), {})}),
         ValueError, "MyLBFGS is not supported.*closure"),
        (lambda m: ([nn.Parameter(torch.zeros(3, dtype=torch.complex64))], {}), ValueError,
         "complex parameters.*view_as_real"),
        (lambda m: ([*nn.Linear(2, 2, device="meta").parameters()], {}), ValueError,
         "meta device.*to_empty"),
        (lambda m: ([*m.parameters()], {"offload_gradient": True}), TypeError,
         "unknown option 'offload_gradient'.*Did you mean 'offload_gradients'"),
        (lambda m: ([*m.parameters()], {"master_weight": False}), TypeError,
         "Did you mean 'master_weights'"),
        (lambda m: ([{"lr": 1e-3}], {}), ValueError, "needs a 'params' list"),
    ],
    ids=["lr", "betas", "unknown-kwarg", "twice-in-group", "twice-across-groups",
         "two-devices", "bad-class-name", "bad-module", "not-an-optimizer", "lbfgs",
         "bare-tensor", "set", "set-of-params", "lbfgs-subclass", "complex", "meta",
         "misspelt-own-option", "misspelt-master-weights", "group-without-params"],
)
def test_bad_input_raises_clear_error(make_args, error, match):
    """Each kind of bad input raises an exception whose message names the problem."""
    params, kwargs = make_args(make_model())
    with pytest.raises(error, match=match):
        CPUOffloadOptimizer(params, **kwargs)


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_sparse_gradients_raise(offload_gradients):
    """Sparse gradients are refused with a message saying how to avoid them."""
    emb = nn.Embedding(10, 4, sparse=True)
    opt = CPUOffloadOptimizer(emb.parameters(), offload_gradients=offload_gradients)
    with pytest.raises(RuntimeError, match="sparse=False"):
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()


def test_host_memory_bytes_counts_buffers_and_state():
    """host_memory_bytes covers the host buffers plus AdamW's two moments."""
    model = make_model()
    opt = offload(model)
    n = sum(p.numel() for p in trainable(model))
    assert opt.host_memory_bytes() == 2 * 4 * n  # fp32 master + grad, no state yet
    train(model, opt, 1)
    step_bytes = 4 * len(trainable(model))  # AdamW keeps `step` as a 0-d fp32 tensor
    assert opt.host_memory_bytes() == 4 * 4 * n + step_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_is_bitwise_torch_fused_adamw_across_chunks(dtype, monkeypatch):
    """Parameters spanning several chunks: the chunked update equals AdamW(fused=True) exactly."""
    import offload_plugin.host.inner_step as host_update

    monkeypatch.setattr(host_update, "CHUNK_NUMEL", 1000)  # many chunks, ragged last one
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 100), nn.Linear(100, 3)).to(dtype)
    ref_model = copy.deepcopy(model).float()  # fp32 reference = what the master weights see
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    ref = reference(torch.optim.AdamW, ref_model.parameters(), **kwargs)
    opt = CPUOffloadOptimizer(model.parameters(), master_weights=True, **kwargs)
    for step in range(3):
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(step))
        model(x.to(dtype)).square().sum().backward()
        for p, rp in zip(model.parameters(), ref_model.parameters()):
            rp.grad = p.grad.float()  # the same gradients on both sides
        opt.step()
        ref.step()
        opt.zero_grad()
    for p, rp in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(opt.engine.slots[p].master, rp.detach(), rtol=0, atol=0)
        torch.testing.assert_close(p, rp.detach().to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["AdamW", "AdamW-loop", "SGD-momentum"])
def test_overlap_next_step_matches_scale_then_step(name, monkeypatch):
    """Updates started during the last backward (overlap_next_step) equal scale-then-step."""
    # Every parameter its own job, as large ones are: small ones otherwise wait for a batch.
    monkeypatch.setattr(host_worker, "BATCH_NUMEL", 0)
    cls, kwargs = OPTIMIZERS[name]
    ref_model, model = twins()
    ref = reference(cls, trainable(ref_model), **kwargs)
    opt = offload(model, optimizer_cls=cls, offload_gradients=True, **kwargs)
    train(ref_model, ref, 4, accum=3)
    for step in range(4):
        before = [p.clone() for p in trainable(model)]
        for micro in range(3):
            if micro == 2:
                opt.overlap_next_step(grad_scale=1.0 / 24)  # 3 micro-batches of 8 rows
            x, y = batch(step, micro, "cpu")
            ((model(x) - y) ** 2).sum().backward()
        opt.engine.worker.drain()
        # Already updated before step() is called: the work ran alongside backward.
        assert not any(torch.equal(a, b) for a, b in zip(before, trainable(model)))
        opt.step()
        opt.zero_grad()
    assert_same_params(ref_model, model, exact=True)


@pytest.mark.parametrize("master_weights", [True, False], ids=["masters", "no-masters"])
def test_overlap_next_step_with_bf16_gradients_rounds_the_scale_as_scale_grads(master_weights, monkeypatch):
    """bf16 parameters: the update's grad_scale gives the bf16 gradient scale_grads would
    leave (scaled, then rounded to bf16), also when fp32 masters take it afterwards."""
    monkeypatch.setattr(host_worker, "BATCH_NUMEL", 0)
    kwargs = dict(lr=1e-2, weight_decay=0.1, fused=True, master_weights=master_weights)
    ref_model, model = twins(dtype=torch.bfloat16)
    ref = offload(ref_model, offload_gradients=True, **kwargs)
    opt = offload(model, offload_gradients=True, **kwargs)
    for step in range(3):
        x, y = batch(step, 0, "cpu")
        ((ref_model(x.bfloat16()) - y.bfloat16()) ** 2).sum().backward()
        ref.scale_grads(1 / 24)
        ref.step()
        ref.zero_grad()
        opt.overlap_next_step(grad_scale=1 / 24)
        ((model(x.bfloat16()) - y.bfloat16()) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert_same_params(ref_model, model, exact=True)
    for p, rp in zip(trainable(model), trainable(ref_model)):
        torch.testing.assert_close(opt.engine.slots[p].master, ref.engine.slots[rp].master, rtol=0, atol=0)


def _clipped_steps(model, opt, steps, accum, clip, announce, second_clip=None):
    """torchtune's order with clipping. ``announce``: overlap_next_step(clipping=True)
    before the last backward (the gradients are scaled and normed as they arrive) instead
    of scale_grads() after it. Returns the gradient norms clip_grad_norm_ returned."""
    norms = []
    for step in range(steps):
        rows = 0
        for micro in range(accum):
            x, y = batch(step, micro, "cpu", next(model.parameters()).dtype)
            rows += x.shape[0]
            if announce and micro == accum - 1:
                opt.overlap_next_step(grad_scale=1.0 / (8 * accum), clipping=True)  # 8 rows a micro-batch
            ((model(x) - y) ** 2).sum().backward()
        if announce and host_worker.BATCH_NUMEL == 0:  # the worker scaled and normed
            opt.engine.worker.drain()                          # every gradient during backward
            assert len(opt.engine.scaling.clip_norms.norms) == len(trainable(model))
        if not announce:
            opt.scale_grads(torch.tensor(1.0 / rows))
        norms.append(opt.clip_grad_norm_(clip))
        if second_clip is not None:
            norms.append(opt.clip_grad_norm_(second_clip))
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, True), (torch.bfloat16, True),
                                                  (torch.bfloat16, False)],
                         ids=["fp32", "bf16-masters", "bf16-no-masters"])
@pytest.mark.parametrize("accum,on_device", [(1, False), (3, False), (3, True)],
                         ids=["no-accumulation", "host-accumulation", "accumulate_on_device"])
@pytest.mark.parametrize("clip", [0.05, 1e6], ids=["clipping", "not-clipping"])
def test_clipped_step_announced_with_overlap_next_step_is_exact(dtype, master_weights, accum, on_device,
                                                                clip, monkeypatch):
    """overlap_next_step(clipping=True): scaling and norms during backward, the clip
    multiply inside the update jobs; the same bits as scale_grads, clip_grad_norm_, step
    (which equal torch's AdamW with clip_grad_norm_, tested above), norms included."""
    kwargs = dict(lr=1e-2, weight_decay=0.1, fused=True, master_weights=master_weights,
                  accumulate_on_device=on_device)
    ref_model, model = twins(dtype=dtype)
    ref = offload(ref_model, offload_gradients=True, **kwargs)
    opt = offload(model, offload_gradients=True, **kwargs)
    want = _clipped_steps(ref_model, ref, 4, accum, clip, announce=False)
    monkeypatch.setattr(host_worker, "BATCH_NUMEL", 0)  # each gradient its own job, as large ones are
    got = _clipped_steps(model, opt, 4, accum, clip, announce=True)
    assert [n.item() for n in got] == [n.item() for n in want] and got[0].dtype == want[0].dtype
    assert (max(n.item() for n in want) > clip) == (clip < 1)  # the small clip does clip
    assert_same_params(ref_model, model, exact=True)
    # The mode ends with its step.
    assert opt.engine.scaling.clip_coef is None and opt.engine.scaling.clip_norms is None


def test_clipping_announced_with_mixed_dtypes_sums_norms_in_torchs_order():
    """fp32 and bf16 parameters interleaved: get_total_norm stacks the norms grouped by
    dtype, and the sum of the precomputed norms must follow that order to the bit."""
    def mixed():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        m[2].to(torch.bfloat16)
        m[2].register_forward_pre_hook(lambda mod, args: (args[0].to(torch.bfloat16),))
        m[2].register_forward_hook(lambda mod, args, out: out.float())
        return m

    models = [mixed(), mixed()]
    opts = [offload(m, offload_gradients=True, lr=1e-2, fused=True) for m in models]
    norms = [_clipped_steps(m, o, 3, 2, 0.05, announce=a) for m, o, a in zip(models, opts, (False, True))]
    assert [n.item() for n in norms[1]] == [n.item() for n in norms[0]]
    assert_same_params(models[0], models[1], exact=True)


def test_a_second_clip_after_an_announced_one_sees_clipped_gradients():
    ref_model, model = twins()
    ref = offload(ref_model, offload_gradients=True, lr=1e-2)
    opt = offload(model, offload_gradients=True, lr=1e-2)
    want = _clipped_steps(ref_model, ref, 3, 2, 0.05, announce=False, second_clip=0.01)
    got = _clipped_steps(model, opt, 3, 2, 0.05, announce=True, second_clip=0.01)
    assert [n.item() for n in got] == [n.item() for n in want]
    assert_same_params(ref_model, model, exact=True)


def test_a_scale_after_clipping_announced_without_one_is_in_the_clip():
    """overlap_next_step(clipping=True) without grad_scale, then scale_grads: the norms
    taken during backward were of the unscaled gradients; the clip must see the scaled
    ones, as torch's scale-then-clip does."""
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2, weight_decay=0.1)
    opt = offload(model, offload_gradients=True, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x, y = batch(step, 0, "cpu")
        opt.overlap_next_step(clipping=True)
        ((model(x) - y) ** 2).sum().backward()
        opt.scale_grads(0.3)
        got = opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        ((ref_model(x) - y) ** 2).sum().backward()
        for p in trainable(ref_model):
            p.grad.mul_(0.3)
        want = torch.nn.utils.clip_grad_norm_(trainable(ref_model), 0.05)
        ref.step()
        ref.zero_grad()
        assert got.item() == want.item(), step
    assert_same_params(ref_model, model, exact=True)


@pytest.mark.parametrize("clipping", [False, True], ids=["during-backward", "clipping"])
def test_a_backward_that_raises_after_overlap_next_step_can_be_dropped(clipping, caplog):
    """overlap_next_step(), then a backward that raises part way (an OOM), then zero_grad()
    to drop the batch: training goes on. Updates that had started during that backward
    stay, as torch's AdamW stepped on the gradients that had arrived (and the log says so);
    with clipping nothing had started."""
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2, weight_decay=0.1)
    opt = offload(model, offload_gradients=True, lr=1e-2, weight_decay=0.1)

    def failing_backward(m):
        x, y = batch(9, 0, "cpu")
        hidden = m[2](m[1](m[0](x)))
        hidden.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("out of memory")))
        with pytest.raises(RuntimeError, match="out of memory"):
            ((m[4](m[3](hidden)) - y) ** 2).sum().backward()

    opt.overlap_next_step(grad_scale=1.0, clipping=clipping)
    failing_backward(model)
    with caplog.at_level(logging.WARNING, logger="offload_plugin.optimizer"):
        opt.zero_grad()
    failing_backward(ref_model)
    if not clipping:
        ref.step()  # (the last layer's gradients had arrived)
        assert "already updated during the backward" in caplog.text
    ref.zero_grad()
    assert not opt.overlapping
    for step in range(2):
        x, y = batch(step, 0, "cpu")
        for m, o in ((model, opt), (ref_model, ref)):
            ((m(x) - y) ** 2).sum().backward()
            o.step()
            o.zero_grad()
    assert_same_params(ref_model, model, exact=True)


def test_clipping_announced_refuses_a_second_scale():
    _, model = twins()
    opt = offload(model, offload_gradients=True, lr=1e-2)
    opt.overlap_next_step(grad_scale=0.5, clipping=True)
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    with pytest.raises(RuntimeError, match="already applied once"):
        opt.scale_grads(0.5)


def test_clipping_announced_skips_a_step_with_a_nan_gradient(caplog):
    """A NaN makes the global norm NaN: the step is skipped, as after scale, clip, step."""
    _, model = twins()
    opt = offload(model, offload_gradients=True, lr=1e-2)
    before = [p.detach().clone() for p in trainable(model)]
    opt.overlap_next_step(grad_scale=0.5, clipping=True)
    x, y = batch(0, 0, "cpu")
    x[0, 0] = float("nan")
    ((model(x) - y) ** 2).sum().backward()
    norm = opt.clip_grad_norm_(1.0)
    with caplog.at_level(logging.WARNING):
        opt.step()
    assert not torch.isfinite(norm) and "the step was skipped" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, trainable(model)))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_next_step", "step"])
def test_small_parameters_reach_the_worker_in_batches(overlap, monkeypatch):
    """Parameters are handed to the host worker in jobs of at least BATCH_NUMEL elements
    (a larger parameter alone), not one job each, and train exactly like AdamW."""
    monkeypatch.setattr(host_worker, "BATCH_NUMEL", 100)
    torch.manual_seed(0)
    sizes = [30, 30, 30, 30, 250, 10, 10]  # in this order: 30+30+30+30 | 250 | 10+10 (flushed)
    params = [nn.Parameter(torch.randn(n)) for n in sizes]
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    opt = CPUOffloadOptimizer(params, lr=1e-2, offload_gradients=True)
    ref = reference(torch.optim.AdamW, ref_params, lr=1e-2)
    jobs = []
    submit = opt.engine.worker.submit
    monkeypatch.setattr(opt.engine.worker, "submit", lambda job, urgent=False: (jobs.append(job), submit(job, urgent)))
    for step in range(3):
        for ps, o in ((params, opt), (ref_params, ref)):
            if o is opt and overlap:
                opt.overlap_next_step()
            # Gradients arrive last parameter first, as in a backward pass.
            sum((p * (i + 1)).square().sum() for i, p in enumerate(ps)).backward()
            if o is opt and not overlap:
                opt.scale_grads(1.0)
            o.step()
            o.zero_grad()
    # In parameter order (step) that is 3 jobs a step; during backward, gradients arrive in
    # autograd's order, which fills batches differently but never needs more than 3.
    assert len(jobs) == 3 * 3 if not overlap else 3 * 2 <= len(jobs) <= 3 * 3
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=0)


@pytest.mark.parametrize("announced", [True, False], ids=["overlap_next_step", "step-only"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_accumulate_on_device_keeps_grads_until_the_last_backward(announced, clip):
    """accumulate_on_device: .grad stays on the device for non-final micro-batches and is
    offloaded in the announced last backward (else when step/scale/clip need it); the
    result is torch's AdamW's, bit for bit, with and without clipping."""
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), **kwargs)
    opt = offload(model, offload_gradients=True, accumulate_on_device=True, **kwargs)
    train(ref_model, ref, 3, accum=3, clip=clip)
    for step in range(3):
        for micro in range(3):
            last = micro == 2
            if last and announced and clip is None:
                opt.overlap_next_step(grad_scale=1.0 / 24)
            x, y = batch(step, micro, "cpu")
            ((model(x) - y) ** 2).sum().backward()
            on_device = [type(p.grad) is torch.Tensor for p in trainable(model)]
            assert all(on_device) if not (last and opt.overlapping) else not any(on_device)
        if not opt.overlapping:
            opt.scale_grads(1.0 / 24)
            assert all(type(p.grad) is OffloadedGrad for p in trainable(model))  # now on the host
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    assert_same_params(ref_model, model, exact=True)
    with pytest.raises(ValueError, match="offload_gradients=True"):
        offload(make_model(), accumulate_on_device=True)


def test_overlap_refuses_late_scaling_or_clipping():
    """Once updates run during backward, scaling or clipping afterwards raises."""
    model = make_model()
    opt = offload(model, offload_gradients=True)
    opt.overlap_next_step(grad_scale=0.5)
    model(torch.randn(2, 16)).sum().backward()
    with pytest.raises(RuntimeError, match="overlap_next_step"):
        opt.clip_grad_norm_(1.0)
    opt.step()
    with pytest.raises(ValueError, match="offload_gradients=True"):
        offload(make_model()).overlap_next_step()


def test_failed_add_param_group_leaves_optimizer_unchanged():
    """add_param_group with a parameter on another device raises and leaves a working optimizer."""
    model = make_model()
    opt = offload(model, lr=1e-2)
    stray = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        opt.add_param_group({"params": [stray]})
    assert len(opt.param_groups) == 1
    train(model, opt, 1)
    assert len(opt.state_dict()["state"]) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_announced_clipping_norm_is_torchs_clip_grad_norm_on_the_device(device):
    """With clipping announced, each gradient is scaled and normed on its device on the way
    out; the total norm has the bits torch's clip_grad_norm_ gives over the model's own
    gradients scaled by torchtune's scale_grads, where they are (on the GPU too)."""
    from torchtune.training import scale_grads

    ref_model, model = twins(device)
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    opt = offload(model, lr=1e-2, offload_gradients=True)
    for step in range(3):
        for micro in range(2):
            if micro == 1:
                opt.overlap_next_step(grad_scale=1.0 / 16, clipping=True)
            x, y = batch(step, micro, device)
            ((ref_model(x) - y) ** 2).sum().backward()
            ((model(x) - y) ** 2).sum().backward()
        scale_grads(ref_model, torch.tensor(1.0 / 16))
        want = torch.nn.utils.clip_grad_norm_(trainable(ref_model), 0.05)
        got = opt.clip_grad_norm_(0.05)
        if step == 0 or device == "cpu":  # later GPU steps start from CPU-updated weights
            assert got.item() == want.item()
        ref.step()
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
    if device == "cpu":
        assert_same_params(ref_model, model, exact=True)


def _huge_page_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap ``tensor``'s bytes (/proc/self/smaps)."""
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < last and first < end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unavailable"
    return text.split("[")[1].split("]")[0]


@pytest.mark.skipif(_thp_mode() != "madvise",
                    reason="needs Linux transparent huge pages in 'madvise' mode (else the "
                           "kernel decides alone, with or without our advice)")
def test_host_buffers_and_state_are_backed_by_huge_pages():
    """The update streams through masters, gradients and moments every step; the optimizer
    asks for 2 MiB pages for all of them (plain allocations get none in madvise mode)."""
    from offload_plugin.host.buffers import _advise_huge_pages

    asked = torch.empty(1 << 23)
    _advise_huge_pages(asked)
    asked.zero_()
    if _huge_page_kib(asked) == 0:
        pytest.skip("the kernel gave no huge pages even when asked (no free 2 MiB pages?)")
    params = [nn.Parameter(torch.randn(1 << 22)), nn.Parameter(torch.randn(1 << 22))]
    plain = torch.zeros(1 << 23)
    opt = CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-3, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    slot = opt.engine.slots[params[0]]
    state = opt.state[params[0]]
    assert _huge_page_kib(plain) == 0  # the control: no advice, no huge pages
    for tensor in (slot.master, slot.grad, state["exp_avg"], state["exp_avg_sq"]):
        assert _huge_page_kib(tensor) >= 2048
    # State loaded from a checkpoint goes back into them, values and all.
    saved = {k: v.clone() for k, v in state.items()}
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    loaded = opt.state[params[0]]
    assert loaded["exp_avg_sq"].data_ptr() == slot.moments[1].data_ptr()
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)


_THREAD_COUNT_PROBE = """
import torch
from torch import nn
from offload_plugin import CPUOffloadOptimizer
from offload_plugin.demo import tiny_llama
from offload_plugin.host import process

process._INLINE_ON_CPU = False  # host_threads applies to the host thread (CPU parameters: inline)
torch.manual_seed(0)
probe = tiny_llama()
tokens = torch.randint(0, probe.tok_embeddings.num_embeddings, (2, 200))

def probe_grads():
    probe.zero_grad(set_to_none=True)
    probe(tokens).float().logsumexp(-1).sum().backward()
    return [p.grad.clone() for p in probe.parameters()]

model = nn.Linear(8, 8)
opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3, host_threads=torch.get_num_threads() + 1)
before = probe_grads()
model(torch.randn(4, 8)).sum().backward()
opt.step()  # the host worker's first job
after = probe_grads()
print("same" if all(torch.equal(a, b) for a, b in zip(before, after)) else "changed")
"""


@pytest.mark.slow  # (starts a process: left out of the quick lane)
def test_the_worker_sets_its_thread_count_while_the_optimizer_is_built():
    """torch.set_num_threads also changes process-wide state, and with it the bits of later
    CPU backward passes on the training thread. The host worker (host_threads other than
    the training thread's count) makes that call while the optimizer is built, so training
    itself sees one setting throughout. A fresh interpreter: an earlier call anywhere in
    this process would hide the change."""
    run = subprocess.run([sys.executable, "-c", _THREAD_COUNT_PROBE], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "same"


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy, pickle.dumps,
                                    lambda opt: torch.save(opt, io.BytesIO())],
                         ids=["copy", "deepcopy", "pickle", "torch.save"])
def test_copying_the_optimizer_is_refused_with_the_state_dict_route(copier):
    model = make_model()
    opt = offload(model, lr=1e-2)
    with pytest.raises(TypeError, match="cannot be copied or pickled.*state_dict"):
        copier(opt)
    train(model, opt, 1)  # the original is untouched and still trains


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap_next_step"])
def test_zero_grad_keeping_zeros_applies_them_as_torch_does(offload_gradients, overlap):
    """zero_grad(set_to_none=False) leaves zero gradients that the next step applies (its
    step count and weight decay), and that the next backward adds to."""
    if overlap and not offload_gradients:
        pytest.skip("overlap_next_step needs offload_gradients")
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2, weight_decay=0.5, fused=True)
    opt = offload(model, lr=1e-2, weight_decay=0.5, fused=True, offload_gradients=offload_gradients)
    for m, o in ((ref_model, ref), (model, opt)):
        x, y = batch(0, 0, "cpu")
        ((m(x) - y) ** 2).sum().backward()
        if o is opt and offload_gradients:
            o.scale_grads(0.125)
        else:
            [p.grad.mul_(0.125) for p in trainable(m)]
        o.step()
        o.zero_grad(set_to_none=False)
        o.step()  # zero gradients: only weight decay and the moments' decay move weights
        x, y = batch(1, 0, "cpu")
        if o is opt and overlap:
            o.overlap_next_step(grad_scale=0.125)
        ((m(x) - y) ** 2).sum().backward()  # adds to the zeros
        if not (o is opt and overlap):
            if o is opt and offload_gradients:
                o.scale_grads(0.125)
            else:
                [p.grad.mul_(0.125) for p in trainable(m)]
        o.step()
    assert_same_params(ref_model, model, exact=True)
    assert ref.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"] == 3


def test_nonfinite_warning_counts_only_the_bad_gradients(caplog):
    model = make_model()
    opt = offload(model, lr=1e-2)
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    model[4].bias.grad[0] = float("nan")
    opt.step()
    assert "1 of 4 parameters had an inf or NaN gradient" in caplog.text


@pytest.mark.parametrize("factor", [1 / 3, torch.tensor(1.0) / torch.tensor(7), 1 / torch.tensor(37),
                                    torch.tensor(1 / 3, dtype=torch.float64), torch.tensor([1 / 37])])
def test_scale_multiplier_is_the_value_scale_grads_multiplies_by(factor):
    """scale_grads' factor (a Python number or a CPU tensor, as recipes that count tokens on
    the host pass it) is used as the fp32 value torchtune's ``p.grad *= factor`` reads: as
    it is on the CPU; rounded to the gradient's dtype first for parameters on a GPU, whose
    kernel converts it so (tests/test_gpu.py checks the bits against torchtune's there)."""
    from offload_plugin.host.scaling import multiplier

    fp32 = torch.as_tensor(factor, dtype=torch.float32)
    assert multiplier(factor, torch.bfloat16, on_accelerator=False) == float(fp32)
    assert multiplier(factor, torch.float32, on_accelerator=True) == float(fp32)
    on_gpu = fp32.to(torch.bfloat16) if fp32.dim() == 0 else fp32  # (a dimension: promoted)
    assert multiplier(factor, torch.bfloat16, on_accelerator=True) == float(on_gpu)
    grad = torch.randn(1000, dtype=torch.bfloat16)
    expected = grad.clone()
    expected *= fp32.reshape(())  # torchtune's scale_grads on the CPU
    assert torch.equal(grad * multiplier(factor, grad.dtype, on_accelerator=False), expected)
