"""The streamed update on a GPU (the default there wherever it applies): bit for bit torch's
fused AdamW on the GPU, with the state in host memory, ordered against the recipe's work
by streams and events. test_streamed.py runs the same code on the CPU."""

import copy

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.engines import streamed
from reference_twin import CUDA, assert_same_params, train, trainable, trained_in_two_groups, twins

pytestmark = CUDA
KW = dict(lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_gpu_streamed_update_is_torch_fused_adam_on_the_gpu(monkeypatch, dtype, cls):
    """Two groups, accumulation, torchtune's scaling, torch's clipping, a scheduler; weights
    in ranges and small ones packed: the same bits as torch's fused kernel on the GPU,
    and the same state, which lives in host memory."""
    monkeypatch.setattr(streamed.config, "stage_numel", 300)
    ref_model, ref, model, opt, ref_run, run = trained_in_two_groups("cuda", dtype, cls, **KW)
    assert opt.engine.streams
    assert_same_params(ref_model, model, exact=True)
    assert run == ref_run
    ours, theirs = opt.state_dict(), ref.state_dict()
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            assert ours["state"][index][key].device.type == "cpu"
            assert torch.equal(ours["state"][index][key], value.cpu()), (index, key)
    assert all(s.moments[0].is_pinned() for s in opt.engine.slots)


def test_gpu_streamed_optimizer_in_backward_is_torch_stepped_the_same_way():
    """torchtune's optimizer_in_bwd: bit for bit torch's fused AdamW in the same hooks; the
    gradients are freed in the hook while their update is still queued."""
    from torchtune import training

    ref_model, model = twins("cuda", torch.bfloat16)
    for m, make in ((ref_model, lambda ps: torch.optim.AdamW(ps, fused=True, **KW)),
                    (model, lambda ps: CPUOffloadOptimizer(ps, **KW))):
        optims = {p: make([p]) for p in trainable(m)}
        training.register_optim_in_bwd_hooks(m, optims)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(64, 16, generator=g).to("cuda", torch.bfloat16)
        for m in (ref_model, model):
            m(x).square().sum().backward()
    assert_same_params(ref_model, model, exact=True)


def test_gpu_next_forward_sees_the_new_weights_and_grads_wait_for_the_recipe():
    """Work queued on .grad right before step() (behind a GPU sleep) is what the update
    reads; a read right after step() (no sync) sees the updated weights. 64 Mi elements of
    fp32 state cross the bus each way, so a missing wait would show."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, lr=1e-3)
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3)
    x = torch.randn(64, 2048, device="cuda")
    for m, o in ((ref_model, ref), (model, opt)):
        for _ in range(2):
            m(x).square().mean().backward()
            torch.cuda._sleep(100_000_000)
            for p in m.parameters():
                p.grad *= 1e-3
            o.step()
            o.zero_grad()
            snapshot = [p.detach().clone() for p in m.parameters()]
        if o is ref:
            expected = snapshot
    for a, b in zip(expected, snapshot):
        assert torch.equal(a, b)


def test_gpu_streamed_at_lora_scale_is_torch_fused_adamw_step_after_step():
    """torchtune's 1B LoRA config's sizes and settings (bf16 adapters of 42M elements, so
    the moments cycle through the ring several times a step at real copy times; a warmup
    schedule; weight decay 0.01): bit for bit torch's fused AdamW after every one of 16
    steps, with the loss read right after each step as the recipe does."""
    torch.manual_seed(0)
    shapes = [(64, 2048), (2048, 64), (64, 8192), (8192, 64)] * 32  # 128 tensors, 42M elements
    params = [nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    twin = [nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(twin, lr=3e-4, weight_decay=0.01, fused=True)
    opt = CPUOffloadOptimizer(params, lr=3e-4, weight_decay=0.01)
    warmup = lambda step: min(1.0, (step + 1) / 100)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in (ref, opt)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for step in range(16):
        grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-2 for s in shapes]
        for ps, o, sched in zip((twin, params), (ref, opt), schedules):
            torch.cuda._sleep(20_000_000)  # gradients still being written when step() is called
            for p, grad in zip(ps, grads):
                p.grad = grad.clone()
            o.step()
            o.zero_grad(set_to_none=True)
            sched.step()
            ps[0].float().sum().item()  # the recipe's loss.item() right after the step
        for a, b in zip(twin, params):
            assert torch.equal(a, b), step
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    for index, entry in theirs.items():
        for key, value in entry.items():
            assert torch.equal(ours[index][key], value.cpu()), (index, key)


def test_gpu_streamed_skips_a_nonfinite_step_on_the_device(caplog):
    """An inf gradient: nothing changes (weights, moments, counts), reported next."""
    model, _ = twins("cuda", torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), **KW)
    train(model, opt, 2)
    before = [p.clone() for p in trainable(model)]
    state = copy.deepcopy(opt.state_dict())
    for p in trainable(model):
        p.grad = torch.ones_like(p)
    trainable(model)[0].grad[0, 0] = float("inf")
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, trainable(model)))
    after = opt.state_dict()
    assert "the step was skipped" in caplog.text
    for index, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][index][key], value)


def test_gpu_streamed_update_adds_only_its_staging_ring_to_device_memory():
    """The moments stay in host memory: the device holds the staging ring (shared by every
    optimizer of the process) and the step counts, whatever the model's size."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(4)]).cuda().to(torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    ring = streamed.config.ring_size * 2 * min(streamed.config.stage_numel, 4096 * 4096) * 2
    added = torch.cuda.memory_allocated() - base
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert added <= ring + (1 << 20) < moments, (added, ring, moments)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), None])
def test_gpu_streamed_verdict_is_exact(dtype, bad):
    """The device's verdict: any inf or NaN anywhere (one tensor or many, first or last
    element), and never for finite values however large."""
    big = torch.finfo(dtype).max
    for count in (1, 5):
        for where in (0, -1):
            grads = [torch.full((1000 + i,), big / 2, dtype=dtype, device="cuda") for i in range(count)]
            if bad is not None:
                grads[where].view(-1)[where] = bad
            found = streamed._nonfinite_each(grads).amax()
            assert float(found) == (0.0 if bad is None else 1.0)


def test_gpu_weights_changed_outside_are_what_the_next_step_updates():
    """A pretrained load after building the optimizer and an in-place edit: kept, as torch
    keeps them (the device weights are what the streamed update reads)."""
    ref_model, model = twins("cuda", torch.bfloat16)
    ref = torch.optim.AdamW(trainable(ref_model), fused=True, **KW)
    opt = CPUOffloadOptimizer(model.parameters(), **KW)
    pretrained = copy.deepcopy(twins("cuda", torch.bfloat16)[0])
    with torch.no_grad():
        for p in pretrained.parameters():
            p.mul_(1.5)
    for m, o in ((ref_model, ref), (model, opt)):
        train(m, o, 1)
        m.load_state_dict(pretrained.state_dict())
        with torch.no_grad():
            m[2].weight.mul_(0.5)
        train(m, o, 2, start=1)
    assert_same_params(ref_model, model, exact=True)


def _peak_during_in_backward_steps(limit: int) -> int:
    """Peak active device bytes above the start over one backward under optimizer_in_bwd whose
    updates wait behind a 100 ms GPU sleep on the update stream, with ``limit`` gradient
    bytes allowed in flight."""
    from torchtune import training

    streamed.config.in_flight_bytes = limit
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)]).cuda().bfloat16()
    optims = {p: CPUOffloadOptimizer([p], lr=1e-3) for p in model.parameters()}
    training.register_optim_in_bwd_hooks(model, optims)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    model(x).float().square().mean().backward()  # (first steps: state, ring, plans)
    torch.cuda.synchronize()
    ring = next(iter(optims.values())).engine.resources.ring
    torch.cuda.reset_peak_memory_stats()
    # "active" bytes: a freed block that a stream still uses (record_stream) counts until
    # that stream's work is done, where "allocated" bytes drop at once.
    start = torch.cuda.memory_stats()["active_bytes.all.current"]
    with torch.cuda.stream(ring.update):
        torch.cuda._sleep(200_000_000)
    model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["active_bytes.all.peak"] - start


def test_gpu_gradients_waiting_for_their_update_inside_backward_are_bounded(monkeypatch):
    """Inside a backward the gradients handed to the update stream, and so kept, are at
    most config.in_flight_bytes (plus the flush that crossed it): 16 gradients of 2 MiB behind a
    stalled update stream, 4 MiB allowed, against all of them without the bound."""
    monkeypatch.setattr(streamed.config, "in_flight_bytes", streamed.config.in_flight_bytes)
    monkeypatch.setattr(streamed.config, "flush_numel", 1)  # (one gradient per flush)
    unbounded = _peak_during_in_backward_steps(1 << 40)
    bounded = _peak_during_in_backward_steps(4 << 20)
    grad = 1024 * 1024 * 2
    assert unbounded >= 14 * grad, unbounded
    assert bounded <= unbounded - 8 * grad, (bounded, unbounded)


@pytest.mark.parametrize("optimizer_cls", [None, "offload_plugin.AdamW8bit", "offload_plugin.CompactAdamW"],
                         ids=["default", "AdamW8bit", "CompactAdamW"])
def test_gpu_in_backward_verdicts_arrive_as_computed_behind_a_slow_copy_stream(monkeypatch, caplog, optimizer_cls):
    """Inside a backward each flush's inf/NaN verdicts reach the host on the copy-out stream,
    which can lag far behind the update stream (an 8B step's moments queue there). Held
    behind a GPU sleep, with a flush per gradient: no finite gradient is reported as a
    skipped step, and every weight is the reference's, stepped in the same hooks on the same
    gradients (torch's fused AdamW on the GPU for the default; AdamW8bit's and CompactAdamW's
    host updates, whose coefficients come from the step counts these verdicts advance)."""
    import logging

    from torchtune import training

    import offload_plugin

    monkeypatch.setattr(streamed.config, "flush_numel", 1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)]).cuda().bfloat16()
    if optimizer_cls is None:
        twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
        refs = [torch.optim.AdamW([t], lr=1e-3, fused=True) for t in twin]
    else:
        twin = [p.detach().cpu().requires_grad_() for p in model.parameters()]
        cls = getattr(offload_plugin, optimizer_cls.rsplit(".", 1)[1])
        refs = [cls([t], lr=1e-3) for t in twin]
    kw = {} if optimizer_cls is None else dict(optimizer_cls=optimizer_cls)
    optims = {p: CPUOffloadOptimizer([p], lr=1e-3, **kw) for p in model.parameters()}
    for p, t, ref in zip(model.parameters(), twin, refs):
        def same_step(p, t=t, ref=ref):  # (registered first: runs before the step below)
            t.grad = p.grad.to(t.device, copy=True)
            ref.step()
            ref.zero_grad(set_to_none=True)
        p.register_post_accumulate_grad_hook(same_step)
    training.register_optim_in_bwd_hooks(model, optims)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    model(x).float().square().mean().backward()  # (first steps: the ring and the plans)
    ring = next(iter(optims.values())).engine.resources.ring
    caplog.set_level(logging.WARNING, logger="offload_plugin")
    for _ in range(3):
        with torch.cuda.stream(ring.store):
            torch.cuda._sleep(100_000_000)
        model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    for opt in optims.values():
        opt.finish_step()
    assert not [r for r in caplog.records if "inf or NaN" in r.getMessage()]
    for p, t in zip(model.parameters(), twin):
        assert torch.equal(p.detach().cpu().view(torch.int16), t.detach().cpu().view(torch.int16))
