"""Every framework's way with ``.grad`` gives torch's result, offloaded gradients included.

Hugging Face's ``Trainer`` clears with ``model.zero_grad()`` alone and clips through
``clip_grad_norm_(model.parameters())``; torchtitan clears with ``zero_grad(set_to_none=False)``;
Lightning steps with a closure; Accelerate unscales through GradScaler; torch's DCP helpers
step once at ``lr=0``. Each loop here is run twice, with torch's optimizer (or
bitsandbytes' for the 8-bit format) and with ours, and must give the same bits: weights,
losses and the gradient norms the loop would log.
"""

import copy

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer, OffloadedGrad
from reference_twin import DEVICES, batch, make_model, train

KWARGS = {"lr": 1e-2, "weight_decay": 0.1}

CLEARS = {
    "model.zero_grad()": lambda model, opt: model.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(set_to_none=False),
    "optimizer.zero_grad()": lambda model, opt: opt.zero_grad(),
    "optimizer.zero_grad(set_to_none=False)": lambda model, opt: opt.zero_grad(set_to_none=False),
    "p.grad = None": lambda model, opt: [setattr(p, "grad", None) for p in model.parameters()],
    "never (sums across steps)": lambda model, opt: None,
}
MODES = {
    "default": {},
    "offload_gradients": {"offload_gradients": True},
    "accumulate_on_device": {"offload_gradients": True, "accumulate_on_device": True},
}


def _loop(model, opt, clear, *, steps=4, accum=2, clip=None, device="cpu", dtype=torch.float32):
    """A plain loop as the frameworks write it: mean losses, backward per micro-batch,
    clip over model.parameters(), step, clear. Returns the losses and the norms."""
    losses, norms = [], []
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(step, micro, device, dtype)
            loss = ((model(x) - y) ** 2).mean() / accum
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        clear(model, opt)
    return losses, norms


class _HostAdamW:
    """The reference of the host update on a GPU: torch's fused AdamW stepping host copies of
    the parameters with their gradients, which is what that update computes (torch's CPU
    kernel, whose fp32 bits differ from its CUDA kernel's: README, "Choose a mode")."""

    def __init__(self, params, **kwargs):
        self.params = list(params)
        self.host = [p.detach().cpu() for p in self.params]
        self.inner = torch.optim.AdamW(self.host, fused=True, **kwargs)

    @torch.no_grad()
    def step(self):
        for p, h in zip(self.params, self.host):
            h.grad = None if p.grad is None else p.grad.cpu()
        self.inner.step()
        for p, h in zip(self.params, self.host):
            p.copy_(h)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()


def _twins(mode, device="cpu"):
    """A model with torch's fused AdamW (on a GPU, where ours updates on the host, its CPU
    kernel on host copies), and a deep copy with ours in ``mode``."""
    ref_model = make_model(device)
    model = copy.deepcopy(ref_model)
    trainable = [p for p in ref_model.parameters() if p.requires_grad]
    host_update = device != "cpu" and mode != "default"
    ref = _HostAdamW(trainable, **KWARGS) if host_update else torch.optim.AdamW(trainable, fused=True, **KWARGS)
    return ref_model, ref, model, CPUOffloadOptimizer(model.parameters(), **MODES[mode], **KWARGS)


def _same_run(ref_model, model, ref_run, run):
    assert repr(ref_run) == repr(run)  # losses and logged norms (repr: a NaN norm equals its twin)
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clear", CLEARS)
def test_every_way_of_clearing_and_clipping_gives_torchs_result(clear, mode, clip, device):
    """Whichever call clears the gradients (or none), and clipping over model.parameters(),
    give torch's fused AdamW's weights, losses and norms in every gradient mode."""
    ref_model, ref, model, opt = _twins(mode, device)
    ref_run = _loop(ref_model, ref, CLEARS[clear], clip=clip, device=device)
    _same_run(ref_model, model, ref_run, _loop(model, opt, CLEARS[clear], clip=clip, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_torchtunes_stock_scale_and_clip_reach_offloaded_gradients(device):
    """torchtune's stock recipes' training.scale_grads(model, 1/num_tokens) and
    clip_grad_norm_(model.parameters()) over offloaded gradients give torch's result."""
    ref_model, ref, model, opt = _twins("offload_gradients", device)
    _same_run(ref_model, model, train(ref_model, ref, 4, clip=0.05), train(model, opt, 4, clip=0.05))


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clear", ["model.zero_grad()", "model.zero_grad(set_to_none=False)"])
def test_the_8bit_format_under_model_zero_grad_and_clipping_is_bitsandbytes(clear, offload_gradients):
    """AdamW8bit on a bf16 model cleared by model.zero_grad() and clipped over
    model.parameters() gives bitsandbytes' AdamW8bit's bits."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)  # (weights of 4096+ elements: bitsandbytes' 8-bit state)
    ref_model = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 4)).to(torch.bfloat16)
    model = copy.deepcopy(ref_model)
    ref = bnb.optim.AdamW8bit(ref_model.parameters(), **KWARGS)
    opt = CPUOffloadOptimizer(model.parameters(), optimizer_cls="offload_plugin.AdamW8bit",
                              offload_gradients=offload_gradients, **KWARGS)
    run = lambda m, o: _loop(m, o, CLEARS[clear], clip=0.05, dtype=torch.bfloat16)  # noqa: E731
    _same_run(ref_model, model, run(ref_model, ref), run(model, opt))


def _assigned(params, step):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g) for p in params]


@pytest.mark.parametrize("when", ["after backward", "before backward"])
def test_an_assigned_gradient_replaces_the_offloaded_one(when):
    """``p.grad = g`` replaces the gradient, as in torch: after backward the step applies g
    alone; before backward autograd adds to g (it was added to the host gradient)."""
    ref_model, ref, model, opt = _twins("offload_gradients")
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    for m, o in ((ref_model, ref), (model, opt)):
        for step in range(3):
            if when == "before backward":
                for p, g in zip(trainable(m), _assigned(trainable(m), step)):
                    p.grad = g
            x, y = batch(step, 0, "cpu")
            ((m(x) - y) ** 2).mean().backward()
            if when == "after backward":
                for p, g in zip(trainable(m), _assigned(trainable(m), step)):
                    p.grad = g
            o.step()  # (never cleared: each step's assignment is what clears)
    _same_run(ref_model, model, (), ())


def test_an_offloaded_gradient_reads_as_its_values():
    """``.grad`` after offloading has no device memory, yet reading it (clone, norm, .data,
    comparisons) gives the gradient autograd made, and writing it (``mul_``) changes the
    gradient the step applies."""
    ref_model, ref, model, opt = _twins("offload_gradients")
    for m in (ref_model, model):
        x, y = batch(0, 0, "cpu")
        ((m(x) - y) ** 2).mean().backward()
    pairs = [(a, b) for a, b in zip(ref_model.parameters(), model.parameters()) if a.requires_grad]
    for a, b in pairs:
        assert type(b.grad) is OffloadedGrad and "host memory" in repr(b.grad)
        assert torch.equal(b.grad.clone(), a.grad) and torch.equal(b.grad.data.clone(), a.grad)
        assert torch.equal(b.grad.norm(), a.grad.norm()) and bool((b.grad == a.grad).all())
        a.grad.data.mul_(0.5)
        b.grad.data.mul_(0.5)
    ref.step()
    opt.step()
    _same_run(ref_model, model, (), ())


@pytest.mark.parametrize("unscale_and_clip", [False, True])
@pytest.mark.parametrize("mode", ["default", "offload_gradients"])
def test_grad_scaler_gives_torchs_result(mode, unscale_and_clip):
    """torch.amp.GradScaler (Accelerate's fp16 path), with and without unscale_() and a
    clip before step(), and a step whose scaled gradients overflow (skipped), as with
    torch's fused AdamW."""
    ref_model, ref, model, opt = _twins(mode)
    runs = []
    for m, o in ((ref_model, ref), (model, opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        norms, scales = [], []
        for step in range(4):
            x, y = batch(step, 0, "cpu")
            if step == 1:
                y = y * 1e36  # the scaled gradients overflow: the scaler skips this step
            scaler.scale(((m(x) - y) ** 2).mean()).backward()
            if unscale_and_clip:
                scaler.unscale_(o)
                norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).item())
            scaler.step(o)
            scaler.update()
            scales.append(scaler.get_scale())
            m.zero_grad()
        runs.append((norms, scales))
    assert runs[1][1][1] == runs[1][1][0] / 2  # (the overflow was seen)
    _same_run(ref_model, model, runs[0], runs[1])


@pytest.mark.parametrize("mode", MODES)
def test_step_with_a_closure_as_lightning_calls_it(mode):
    """step(closure): the closure clears, runs forward and backward and clips (Lightning's
    order); the result is torch's."""
    ref_model, ref, model, opt = _twins(mode)
    runs = []
    for m, o in ((ref_model, ref), (model, opt)):
        losses = []
        for step in range(3):
            def closure():
                o.zero_grad()
                x, y = batch(step, 0, "cpu")
                loss = ((m(x) - y) ** 2).mean()
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 0.05)
                return loss
            losses.append(o.step(closure).item())
        runs.append(losses)
    _same_run(ref_model, model, runs[0], runs[1])


def _dcp_run(make_opt):
    """Four steps through torch.distributed.checkpoint's helpers: get_optimizer_state_dict
    on the fresh optimizer (it steps once at lr=0 on zero gradients), two steps, a save,
    and a resume into a new model and optimizer with set_optimizer_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    clear = CLEARS["model.zero_grad()"]
    model = make_model()
    opt = make_opt(model)
    get_optimizer_state_dict(model, opt)
    _loop(model, opt, clear, steps=2)
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    resumed = make_model(seed=1)
    resumed.load_state_dict(model.state_dict())
    again = make_opt(resumed)
    set_optimizer_state_dict(resumed, again, saved)
    _loop(resumed, again, clear, steps=2)
    return resumed


@pytest.mark.parametrize("mode", ["default", "offload_gradients"])
def test_dcp_state_dict_helpers_give_torchs_result(mode):
    """A run saved and resumed through torch.distributed.checkpoint's
    get/set_optimizer_state_dict (FSDP users' path, HF's included) gives torch's bits."""
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    ref = _dcp_run(lambda m: torch.optim.AdamW(trainable(m), fused=True, **KWARGS))
    ours = _dcp_run(lambda m: CPUOffloadOptimizer(m.parameters(), **MODES[mode], **KWARGS))
    _same_run(ref, ours, (), ())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the state moved to it")
@pytest.mark.parametrize("mode", ["default", "offload_gradients"])
def test_state_moved_to_the_gpu_as_lightning_moves_it_stays_in_host_memory(mode):
    """Lightning's resume moves each state tensor to the GPU (``v[key] = val.to(device)``):
    the values land in the host state, which stays there, and training goes on as torch's."""
    ref_model, ref, model, opt = _twins(mode, "cuda")
    clear = CLEARS["optimizer.zero_grad()"]
    _loop(ref_model, ref, clear, steps=2, device="cuda")
    _loop(model, opt, clear, steps=2, device="cuda")
    for entry in opt.state.values():
        for key, value in entry.items():
            if key != "step":
                entry[key] = value.to("cuda")
    assert all(v.device.type == "cpu" for e in opt.state.values() for v in e.values() if isinstance(v, torch.Tensor))
    _same_run(ref_model, model, _loop(ref_model, ref, clear, steps=2, device="cuda"),
              _loop(model, opt, clear, steps=2, device="cuda"))


def test_a_clip_that_does_not_clip_leaves_the_host_gradients_alone(monkeypatch):
    """A clip whose coefficient clamps to 1.0 (HF takes the norm it logs through a clip at
    inf) multiplies by 1.0, which leaves every bit as it was: the host gradients are not
    written (no pass over host memory), and the step is torch's."""
    ref_model, ref, model, opt = _twins("offload_gradients")
    for m in (ref_model, model):
        x, y = batch(0, 0, "cpu")
        ((m(x) - y) ** 2).mean().backward()
    asked, host_grad = [], opt.engine.host_grad
    monkeypatch.setattr(opt.engine, "host_grad", lambda slot, writes: asked.append(writes) or host_grad(slot, writes))
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")) for m in (ref_model, model)]
    assert torch.equal(*norms) and asked and not any(asked)
    ref.step()
    opt.step()
    _same_run(ref_model, model, (), ())


@pytest.mark.parametrize("clear", ["model.zero_grad()", "optimizer.zero_grad()"])
def test_sharded_offloaded_gradients_carried_past_a_step_warn_once(one_rank, clear, caplog):
    """DTensor (FSDP2) parameters' offloaded gradients leave .grad as None, where
    model.zero_grad() cannot clear them: the first backward that adds to gradients from
    before a step says so, once, with the fix; after optimizer.zero_grad() nothing is said."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    weight = nn.Parameter(distribute_tensor(torch.randn(8, 4), one_rank, [Shard(0)]))
    model = nn.ParameterList([weight])
    opt = CPUOffloadOptimizer(model.parameters(), offload_gradients=True, lr=1e-2)
    with caplog.at_level("WARNING", logger="offload_plugin"):
        for _ in range(3):
            (weight * weight).sum().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            CLEARS[clear](model, opt)
    carried = [r for r in caplog.records if "adds to gradients from before it" in r.getMessage()]
    assert len(carried) == (1 if clear == "model.zero_grad()" else 0)
    assert not carried or "call optimizer.zero_grad() after each step" in carried[0].getMessage()
