"""CompactAdamW's streamed update (offload_plugin.formats.compact.streamed): the compact state in
host memory, updated where the parameters are. Here the same code runs with CPU parameters
(``streamed.config.on_cpu``: no streams, the native CPU kernel on the host state in place), and
the reference is CompactAdamW's host update in the same optimizer, bit for bit: weights,
losses and every state tensor. test_streamed_gpu.py compares the GPU kernel with it."""

import copy

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.engines import streamed
from offload_plugin.formats.compact.optimizer import to_adamw_state_dict

KW = dict(lr=2e-3, weight_decay=0.1, optimizer_cls="offload_plugin.CompactAdamW")


@pytest.fixture(autouse=True)
def _streamed_on_cpu(monkeypatch):
    monkeypatch.setattr(streamed.config, "on_cpu", True)
    monkeypatch.setattr(streamed.config, "stage_numel", 2048)  # the 64x96 weight goes in 3 ranges


def make_model(seed=0) -> nn.Module:
    """bf16 layers above and below min_8bit_size (4096 elements), the first frozen."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 96), nn.Tanh(),
                          nn.Linear(96, 64), nn.Tanh(), nn.Linear(64, 4))
    model[0].requires_grad_(False)
    return model.to(torch.bfloat16)


def run(model, opt, steps, start=0, nonfinite_at=None):
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g).to(torch.bfloat16)
        y = torch.randn(8, 4, generator=g).to(torch.bfloat16)
        loss = ((model(x).float() - y.float()) ** 2).mean()
        loss.backward()
        if step == nonfinite_at:
            model[2].weight.grad[0, 0] = float("nan")
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def build(streamed_on: bool, monkeypatch, **kw):
    monkeypatch.setattr(streamed.config, "enabled", streamed_on)
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), **dict(KW, **kw))
    assert opt.engine.streams == streamed_on
    return model, opt


def assert_same(model_a, opt_a, model_b, opt_b):
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, entry in sb["state"].items():
        assert entry.keys() == sa["state"][index].keys(), index
        for key, value in entry.items():
            assert value.dtype == sa["state"][index][key].dtype, (index, key)
            assert torch.equal(sa["state"][index][key], value), (index, key)


@pytest.mark.parametrize("min_8bit_size", [4096, 0])
@pytest.mark.parametrize("master", [True, False])
def test_streamed_compact_is_the_host_update_bit_for_bit(monkeypatch, min_8bit_size, master):
    """Six steps with a non-finite gradient at the fourth (skipped, counts held): the same
    weights, losses and state as CompactAdamW's host update; compact layers go in ranges,
    small ones keep fp32 state (with the default min_8bit_size)."""
    kw = dict(min_8bit_size=min_8bit_size, master=master)
    host_model, host = build(False, monkeypatch, **kw)
    host_losses = run(host_model, host, 6, nonfinite_at=3)
    model, opt = build(True, monkeypatch, **kw)
    losses = run(model, opt, 6, nonfinite_at=3)
    assert losses == host_losses
    assert_same(model, opt, host_model, host)
    state = opt.state_dict()["state"]
    assert {float(e["step"]) for e in state.values()} == {5.0}
    exact = [e for e in state.values() if "exp_avg_absmax" not in e]
    assert len(exact) == (4 if min_8bit_size else 0)  # three biases and the 64x4 head
    units = next(iter(opt.engine._plans.values())).units
    assert any(u.start > 0 for u in units), "the 64x96 weight goes in ranges"


@pytest.mark.parametrize("via_optimizer", [False, True])
def test_schedule_accumulation_scaling_and_clipping_as_the_host_update(monkeypatch, via_optimizer):
    """torchtune's order (two micro-batches, scale by 1/tokens, clip, step, a warmup
    schedule), scaling and clipping by torchtune's functions or by the optimizer's: the host
    update's bits. (The schedule writes the lr into our param_groups; the first version
    read the host optimizer's, which only the host update brings up to date.)"""
    from reference_twin import train

    runs = []
    for streamed_on in (False, True):
        model, opt = build(streamed_on, monkeypatch)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        runs.append((model, opt, train(model, opt, 4, clip=0.05, sched=sched, via_optimizer=via_optimizer)))
    (host_model, host, host_out), (model, opt, out) = runs
    assert out == host_out
    assert_same(model, opt, host_model, host)


def test_resume_and_conversion(monkeypatch):
    """A resume from state_dict() continues bit for bit as the uninterrupted run, in a new
    optimizer, streamed or on the host; the state converts to torch's AdamW layout."""
    ref_model, ref = build(True, monkeypatch)
    run(ref_model, ref, 5)
    model, opt = build(True, monkeypatch)
    run(model, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    for streamed_on in (True, False):
        resumed_model, resumed = build(streamed_on, monkeypatch)
        resumed_model.load_state_dict(weights)
        resumed.load_state_dict(copy.deepcopy(saved))
        run(resumed_model, resumed, 2, start=3)
        assert_same(resumed_model, resumed, ref_model, ref)
    converted, _ = to_adamw_state_dict(ref.state_dict(), list(ref_model.parameters())[2:])
    assert all(e["exp_avg"].dtype == torch.float32 for e in converted["state"].values())


def test_weights_changed_outside_drop_the_remainder(monkeypatch):
    """Weights loaded into the model between steps are the truth: their remainders are
    dropped (the master restarts from them), as in CompactAdamW's host update."""
    host_model, host = build(False, monkeypatch)
    model, opt = build(True, monkeypatch)
    run(host_model, host, 2)
    run(model, opt, 2)
    fresh = make_model(seed=1).state_dict()
    host_model.load_state_dict(fresh)
    model.load_state_dict(fresh)
    with torch.no_grad():
        model[4].weight.mul_(1)  # (an in-place edit bumps the version too)
        host_model[4].weight.mul_(1)
    run(host_model, host, 2, start=2)
    run(model, opt, 2, start=2)
    assert_same(model, opt, host_model, host)


def test_weights_written_through_data_restart_the_masters_after_reload_weights(monkeypatch):
    """``param.data`` writes escape the version counters; ``reload_weights()`` is the call
    for them, and restarts every master from its weight, as the host update does for weights
    that changed."""
    runs = []
    for streamed_on in (False, True):
        model, opt = build(streamed_on, monkeypatch)
        run(model, opt, 2)
        fresh = make_model(seed=1)
        for p, q in zip(model.parameters(), fresh.parameters()):
            p.data.copy_(q)
        opt.reload_weights()
        run(model, opt, 2, start=2)
        runs.append((model, opt))
    assert_same(runs[1][0], runs[1][1], runs[0][0], runs[0][1])


def test_page_locked_blocks_live_as_long_as_the_state(monkeypatch):
    """The state's blocks are page-locked once and stay so while the state uses them: each
    block's unpinning runs when its tensor is collected (host_buffers._pin), and a view that
    changes the dtype would not keep that tensor alive (the first GPU run copied from
    pageable memory at a tenth of the bus's speed). Here pinning is recorded, not done."""
    import gc
    import weakref

    from offload_plugin.formats.compact import streamed as compact_streamed
    from offload_plugin.host import buffers as host_buffers

    pinned, unpinned = [], []

    def record_pin(block):
        pinned.append(block.dtype)
        weakref.finalize(block, unpinned.append, block.dtype)
        return True

    monkeypatch.setattr(host_buffers, "_pin", record_pin)
    monkeypatch.setattr(compact_streamed.HostState, "__init__",
                        lambda self, pin, _init=compact_streamed.HostState.__init__: _init(self, True))
    model, opt = build(True, monkeypatch)
    run(model, opt, 2)
    gc.collect()
    assert sorted(map(str, pinned)) == ["torch.float32", "torch.int16", "torch.uint8"]
    assert unpinned == []
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)  # (loaded entries are moved into new blocks at the next step)
    run(model, opt, 1, start=2)
    gc.collect()
    assert len(pinned) == 6 and sorted(map(str, unpinned)) == ["torch.float32", "torch.int16", "torch.uint8"]


def test_grad_scaler_scale_is_refused(monkeypatch):
    model, opt = build(True, monkeypatch)
    run(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.grad_scale = torch.tensor(1024.0)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="GradScaler"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _in_bwd(model, make):
    from torchtune import training  # imported late: torchtune takes ~5 s

    optims = {p: make([p]) for p in model.parameters() if p.requires_grad}
    training.register_optim_in_bwd_hooks(model, optims)
    return optims


def _backward_only(model, steps, nonfinite_at=None, start=0):
    """Backward passes whose hooks step (optimizer_in_bwd); a NaN in one input row at
    ``nonfinite_at`` reaches every gradient of that step."""
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g).to(torch.bfloat16)
        y = torch.randn(8, 4, generator=g).to(torch.bfloat16)
        x = x.to(next(model.parameters()).device)
        y = y.to(x.device)
        out = model(x).float()
        if step == nonfinite_at:
            out = out * float("nan")
        ((out - y.float()) ** 2).mean().backward()


def test_in_backward_is_the_host_update_bit_for_bit(monkeypatch):
    """torchtune's optimizer_in_bwd (one optimizer per parameter, stepped in its gradient's
    hook): the same bits as the host update stepped the same way, a non-finite step skipped
    by every parameter."""
    results = []
    for streamed_on in (False, True):
        monkeypatch.setattr(streamed.config, "enabled", streamed_on)
        model = make_model()
        optims = _in_bwd(model, lambda ps: CPUOffloadOptimizer(ps, **KW))
        assert all(o.engine.streams == streamed_on for o in optims.values())
        _backward_only(model, 4, nonfinite_at=2)
        for o in optims.values():
            o.finish_step()
        results.append((model, [o.state_dict() for o in optims.values()]))
    (host_model, host_states), (model, states) = results
    for a, b in zip(model.parameters(), host_model.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for ours, theirs in zip(states, host_states):
        for index, entry in theirs["state"].items():
            assert float(entry["step"]) == 3.0
            for key, value in entry.items():
                assert torch.equal(ours["state"][index][key], value), (index, key)


# ---------------------------------------------------------------------------- on a GPU
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the Triton kernel and the streams")


def _stepped_with_given_grads(device, steps, monkeypatch, **kw):
    """The model on ``device`` stepped with the same generated bf16 gradients every time
    (the GPU's own backward need not round like the host's), a NaN in one at step 2."""
    model = make_model().to(device)
    opt = CPUOffloadOptimizer(model.parameters(), **dict(KW, **kw))
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            g = (torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-4, 1, p.shape, generator=gen))
            p.grad = g.to(torch.bfloat16).to(device)
        if step == 2:
            params[1].grad[0] = float("inf")
        opt.step()
        opt.zero_grad()
    opt.finish_step()
    return model, opt


@CUDA
@pytest.mark.parametrize("master", [True, False])
def test_gpu_streamed_compact_has_the_host_updates_bits(monkeypatch, master):
    """The Triton kernel with the state streamed through small staging buffers (the layers
    in ranges, units sharing and cycling through the ring) against the native host kernel
    on the same gradients: every weight and state byte. With min_8bit_size=0 every tensor
    is compact; with the default, small ones take torch's fused AdamW on the GPU, whose
    bits may differ from its CPU kernel's in the last place."""
    monkeypatch.setattr(streamed.config, "on_cpu", True)
    monkeypatch.setattr(streamed.config, "stage_numel", 2048)
    for min_8bit_size in (0, 4096, 10**6):  # (10**6: all fp32, the large ones in ranges)
        kw = dict(master=master, min_8bit_size=min_8bit_size)
        cpu_model, cpu_opt = _stepped_with_given_grads("cpu", 5, monkeypatch, **kw)
        model, opt = _stepped_with_given_grads("cuda", 5, monkeypatch, **kw)
        assert opt.engine.streams and opt.engine.format.name == "compact"
        assert all(t.is_pinned() for e in opt.state.values() for k, t in e.items() if k != "step")
        cpu_state, state = cpu_opt.state_dict()["state"], opt.state_dict()["state"]
        for (index, entry), p, q in zip(cpu_state.items(), [p for p in model.parameters() if p.requires_grad],
                                         [p for p in cpu_model.parameters() if p.requires_grad]):
            exact = "exp_avg_absmax" not in entry
            assert float(state[index]["step"]) == 4.0
            if exact:
                torch.testing.assert_close(p.detach().cpu().float(), q.detach().float(), rtol=0, atol=1e-2)
                continue
            assert torch.equal(p.detach().cpu().view(torch.int16), q.detach().view(torch.int16)), index
            for key, value in entry.items():
                assert torch.equal(state[index][key].cpu(), value), (index, key, min_8bit_size)


@CUDA
def test_gpu_streamed_compact_in_backward_is_the_same_as_after_backward(monkeypatch):
    """On the GPU, optimizer_in_bwd (steps queued in the hooks, flushed in batches) gives
    the bits of one optimizer stepped after each backward, on the GPU's own gradients."""
    monkeypatch.setattr(streamed.config, "flush_numel", 5000)
    model = make_model().cuda()
    optims = _in_bwd(model, lambda ps: CPUOffloadOptimizer(ps, **KW))
    assert all(o.engine.streams and o.engine.format.name == "compact" for o in optims.values())
    ref_model = make_model().cuda()
    ref = CPUOffloadOptimizer(ref_model.parameters(), **KW)
    _backward_only(model, 4)
    for step in range(4):
        _backward_only(ref_model, 1, start=step)
        ref.step()
        ref.zero_grad()
    for o in optims.values():
        o.finish_step()
    ref.finish_step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    ref_state = ref.state_dict()["state"]  # (saved entries: with their weights' digests)
    for o, index in zip(optims.values(), sorted(ref_state)):
        (entry,) = o.state_dict()["state"].values()
        assert entry.keys() == ref_state[index].keys()
        for key, value in entry.items():
            assert torch.equal(value, ref_state[index][key]), key
