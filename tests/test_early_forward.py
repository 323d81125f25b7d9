"""overlap_next_step(early_forward=True): step() returns with updates still running, the
rest is updated in forward order, and each module's next forward waits for its own
weights. Same results as waiting in step(), on CPU (where the host worker still runs
beside the training thread) and on CUDA."""

import copy
import threading

import pytest
import torch
from torch import nn

from offload_plugin.host.worker import HostUpdateError
import offload_plugin.host.inner_step as host_update
import offload_plugin.host.worker as host_worker
from reference_twin import DEVICES, assert_same_params, batch, make_model, offload, trainable


def _steps(model, opt, steps, accum, clip, early, start=0):
    """torchtune's order through the optimizer, with the last backward announced."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    losses = []
    for step in range(start, start + steps):
        for micro in range(accum):
            if micro == accum - 1:
                opt.overlap_next_step(grad_scale=1.0 / (8 * accum), clipping=clip is not None,
                                      early_forward=early)
            x, y = batch(step, micro, device, dtype)
            loss = ((model(x) - y) ** 2).sum()  # the first forward waits for the last step
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, True), (torch.bfloat16, True),
                                                  (torch.bfloat16, False)],
                         ids=["fp32", "bf16-masters", "bf16-no-masters"])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize("batch_numel", [0, None], ids=["one-per-job", "batched"])
def test_early_forward_gives_the_same_bits(device, dtype, master_weights, accum, clip, batch_numel,
                                           monkeypatch):
    if batch_numel is not None:
        monkeypatch.setattr(host_worker, "BATCH_NUMEL", batch_numel)
    kwargs = dict(lr=1e-2, weight_decay=0.1, fused=True, master_weights=master_weights,
                  offload_gradients=True)
    ref_model = make_model(device, dtype)
    model = copy.deepcopy(ref_model)
    ref, opt = offload(ref_model, **kwargs), offload(model, **kwargs)
    want = _steps(ref_model, ref, 4, accum, clip, early=False)
    got = _steps(model, opt, 4, accum, clip, early=True)
    assert opt.engine.returned_early is not None  # the last step returned before its updates were done
    opt.finish_step()
    assert got == want
    assert_same_params(ref_model, model, exact=True)
    for p, rp in zip(trainable(model), trainable(ref_model)):
        torch.testing.assert_close(opt.engine.slots[p].master, ref.engine.slots[rp].master, rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref.state[rp][key], rtol=0, atol=0)


class _HeldUpdates:
    """Wraps update_slots: every update waits until ``release`` is set; records the order."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        self.order = []
        real = host_update.update_slots

        def held(optimizer, groups, slots, grad_scale):
            self.release.wait(30)
            self.order.extend(slot.order for slot in slots)
            return real(optimizer, groups, slots, grad_scale)

        monkeypatch.setattr(host_update, "update_slots", held)


def _announced_step(model, opt, step=1):
    x, y = batch(step, 0, "cpu")
    opt.overlap_next_step(grad_scale=1.0 / 8, early_forward=True)
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    opt.zero_grad()


def _reference_stepped_and_twin():
    """A model stepped once the usual way (step() waits), and an untouched twin with its
    own optimizer."""
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = offload(ref_model, lr=1e-2, offload_gradients=True)
    opt = offload(model, lr=1e-2, offload_gradients=True)
    x, y = batch(1, 0, "cpu")
    ref.overlap_next_step(grad_scale=1.0 / 8)
    ((ref_model(x) - y) ** 2).sum().backward()
    ref.step()
    return ref_model, ref, model, opt


def test_step_returns_before_the_updates_and_the_next_forward_waits_for_them(monkeypatch):
    monkeypatch.setattr(host_worker, "BATCH_NUMEL", 0)
    ref_model, ref, model, opt = _reference_stepped_and_twin()

    held = _HeldUpdates(monkeypatch)
    opt.engine.worker.submit(lambda: held.release.wait(30))  # no update starts before step()
    _announced_step(model, opt)  # returns although no update can run yet
    assert opt.engine.returned_early is not None and held.order == []
    # The updates may proceed only after the forward below has started: it must wait.
    threading.Timer(0.3, held.release.set).start()
    probe, _ = batch(2, 0, "cpu")
    torch.testing.assert_close(model(probe), ref_model(probe), rtol=0, atol=0)
    assert opt.engine.returned_early is None  # every weight was waited for: the step is finished
    # What was left after backward was updated in forward (parameter) order.
    assert held.order == sorted(held.order) and len(held.order) == len(trainable(model))


@pytest.mark.parametrize("early", [True, False])
def test_backlog_left_after_backward_is_updated_in_forward_order(early, monkeypatch):
    """Gradients arrive last layer first; the updates still queued at step() go first
    layer first, since the next forward needs those first (else in arrival order)."""
    monkeypatch.setattr(host_worker, "BATCH_NUMEL", 0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    opt = offload(model, lr=1e-2, offload_gradients=True)
    held = _HeldUpdates(monkeypatch)
    opt.engine.worker.submit(lambda: held.release.wait(30))  # nothing runs before step()
    opt.overlap_next_step(grad_scale=0.25, early_forward=early)
    model(torch.randn(4, 8)).square().sum().backward()
    threading.Timer(0.2, held.release.set).start()
    opt.step()
    opt.finish_step()
    assert sorted(held.order) == list(range(12))
    assert (held.order == sorted(held.order)) == early


@pytest.mark.parametrize("early", [True, False])
def test_during_backward_the_newest_gradient_is_updated_first(early, monkeypatch):
    """With early_forward, updates that run during backward take the gradient that landed
    last: the parameters left for the next forward are then spread over the model, not
    bunched in its first layers. (Otherwise in arrival order.)"""
    monkeypatch.setattr(host_worker, "BATCH_NUMEL", 0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    opt = offload(model, lr=1e-2, offload_gradients=True)
    held = _HeldUpdates(monkeypatch)
    opt.engine.worker.submit(lambda: held.release.wait(30))
    opt.overlap_next_step(grad_scale=0.25, early_forward=early)
    model(torch.randn(4, 8)).square().sum().backward()
    held.release.set()
    opt.engine.worker.drain()  # every update ran before step(): all of them "during backward"
    newest_first = list(range(12))  # all landed (CPU copies are synchronous): forward order
    assert held.order == (newest_first if early else newest_first[::-1])
    opt.step()
    opt.finish_step()


def test_the_next_steps_lr_does_not_reach_updates_still_running(monkeypatch):
    """The scheduler changes the lr after step() returned early; the updates still queued
    use the lr of their own step, and the next step's use the new one."""
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = offload(ref_model, lr=1e-2, offload_gradients=True)
    opt = offload(model, lr=1e-2, offload_gradients=True)
    held = _HeldUpdates(monkeypatch)
    for optimizer, twin, early in ((ref, ref_model, False), (opt, model, True)):
        held.release.set() if not early else held.release.clear()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 10.0 ** -step)
        for step in range(2):
            optimizer.overlap_next_step(grad_scale=1.0 / 8, early_forward=early)
            if early and step == 1:  # step 0's updates may run only now, with lr 1e-3 set
                threading.Timer(0.3, held.release.set).start()
            x, y = batch(step, 0, "cpu")
            ((twin(x) - y) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    opt.finish_step()
    assert_same_params(ref_model, model, exact=True)
    for p, rp in zip(trainable(model), trainable(ref_model)):
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[rp]["exp_avg"], rtol=0, atol=0)


class _Attention(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight itself: out_proj's forward never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def test_a_weight_read_around_its_module_is_refused_after_a_complete_step():
    """early_forward cannot gate a weight that is read without its module's forward: the
    next backward raises instead of using a gradient made from a possibly stale weight,
    and the step before it is complete (the same weights as waiting in step())."""
    ref_model, model = _Attention(), _Attention()
    ref = offload(ref_model, lr=1e-2, offload_gradients=True)
    opt = offload(model, lr=1e-2, offload_gradients=True)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    for optimizer, twin, early in ((ref, ref_model, False), (opt, model, True)):
        optimizer.overlap_next_step(grad_scale=0.5, early_forward=early)
        twin(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    opt.overlap_next_step(grad_scale=0.5, early_forward=True)
    with pytest.raises(RuntimeError, match=r"early_forward.*out_proj\.weight"):
        model(x).square().sum().backward()
    assert_same_params(ref_model, model, exact=True)


def test_a_parameter_first_used_by_a_later_micro_batch_is_not_refused():
    """Only a gradient from the backward that ended the early step is checked: a
    parameter the first micro-batch did not use may be used (gated or not) by the next."""
    torch.manual_seed(0)
    models = [nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)}) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    weights = []
    for model, early in zip(models, (False, True)):
        opt = offload(model, lr=1e-2, offload_gradients=True)
        for step in range(3):
            # the first micro-batch uses only "a"; the second reads b.weight directly
            model["a"](x).square().sum().backward()
            opt.overlap_next_step(grad_scale=0.5, early_forward=early)
            (model["a"](x) @ model["b"].weight + model["b"](x)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        opt.finish_step()
        weights.append([p.detach().clone() for p in model.parameters()])
    for got, want in zip(weights[1], weights[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_failed_update_surfaces_from_the_next_forward(monkeypatch):
    model = make_model()
    opt = offload(model, lr=1e-2, offload_gradients=True)

    def broken(*args, **kwargs):
        raise ValueError("injected host-update failure")

    monkeypatch.setattr(host_update, "update_slots", broken)
    _announced_step(model, opt)
    with pytest.raises(HostUpdateError, match="injected host-update failure"):
        model(batch(2, 0, "cpu")[0])
    assert opt.engine.returned_early is None


def test_state_dict_and_saving_wait_for_the_step(monkeypatch):
    """Anything that reads the results finishes the step first: the same state dict."""
    ref_model, ref, model, opt = _reference_stepped_and_twin()
    held = _HeldUpdates(monkeypatch)
    _announced_step(model, opt)
    threading.Timer(0.3, held.release.set).start()
    got, want = opt.state_dict(), ref.state_dict()
    assert opt.engine.returned_early is None
    for index, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)
    assert_same_params(ref_model, model, exact=True)


def test_early_forward_with_delayed_update_is_refused_when_asked():
    """delayed_update's step() returns at once anyway: asking for early_forward too is
    refused with the fix, not silently ignored."""
    model = make_model()
    opt = offload(model, lr=1e-2, offload_gradients=True, delayed_update=True)
    with pytest.raises(ValueError, match="does not combine with delayed_update.*early_forward=False"):
        opt.overlap_next_step(grad_scale=0.5, early_forward=True)
    assert not opt.overlapping
