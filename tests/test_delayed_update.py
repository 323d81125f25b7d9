"""delayed_update=True: each gradient applied one step late, exactly so.

The reference is torch's AdamW applying gradient t after the backward of step t+1, which
is what the mode promises (DeepSpeed's delayed parameter update): the same weights, bit
for bit on CPU (on CUDA the reference's GPU kernels round differently, so within
tolerance), with accumulation, scaling and clipping; a checkpoint completes the pending
update; a resume continues like the run that saved.
"""

import copy

import pytest
import torch

from offload_plugin import CPUOffloadOptimizer
from reference_twin import DEVICES, assert_same_params, batch, make_model, offload, reference, trainable


class StaleByOne:
    """torch's AdamW (or ``cls``) fed each step's (scaled, clipped) gradients one step late."""

    def __init__(self, model, cls=torch.optim.AdamW, **kwargs):
        self.params = trainable(model)
        self.opt = reference(cls, self.params, **kwargs)
        self.pending = None

    def step(self):
        current = [p.grad.clone() for p in self.params]
        self.opt.zero_grad()
        self.flush()
        self.pending = current

    def flush(self):
        """Apply the pending gradients, if any."""
        if self.pending is not None:
            for p, g in zip(self.params, self.pending):
                p.grad = g
            self.opt.step()
            self.opt.zero_grad()
            self.pending = None


def _train(model, opt, steps, *, start=0, accum=3, clip=None, ours=True, scale_in_overlap=False):
    """torchtune's order; ours announces the last backward as our recipes do, with the
    gradient scale given there (``scale_in_overlap``, our recipes without clipping) or
    applied by scale_grads."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    for step in range(start, start + steps):
        for micro in range(accum):
            if ours and opt.offload_gradients and micro == accum - 1:
                opt.overlap_next_step(grad_scale=1.0 / (8 * accum) if scale_in_overlap else None)
            x, y = batch(step, micro, device, dtype)
            ((model(x) - y) ** 2).sum().backward()
        if ours:
            if not scale_in_overlap:
                opt.scale_grads(1.0 / (8 * accum))
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            for p in trainable(model):
                p.grad.mul_(1.0 / (8 * accum))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(trainable(model), clip)
            opt.step()


KW = {"lr": 1e-2, "weight_decay": 0.1}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "grads", [{}, {"offload_gradients": True},
              {"offload_gradients": True, "accumulate_on_device": True}],
    ids=["device-grads", "offload_gradients", "accumulate_on_device"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_applies_each_gradient_one_step_late_exactly(device, grads, clip):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = offload(model, delayed_update=True, **grads, **KW)
    ref = StaleByOne(ref_model, **KW)
    for step in range(5):
        _train(model, opt, 1, start=step, clip=clip)
        _train(ref_model, ref, 1, start=step, clip=clip, ours=False)
        if device == "cuda":
            torch.cuda.synchronize()
        # On CUDA the reference updates on the GPU and we on the host: other kernels.
        assert_same_params(model, ref_model, exact=device == "cpu")
    assert not torch.equal(trainable(model)[0], trainable(make_model(device))[0])
    opt.state_dict()  # completes the pending update
    ref.flush()
    assert_same_params(model, ref_model, exact=device == "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate_on_device", [False, True])
def test_scale_given_to_overlap_is_applied_in_the_jobs_exactly(device, accumulate_on_device, monkeypatch):
    """overlap_next_step(grad_scale) without scale_grads or clipping: step() reads no
    gradient (each job scales and checks its own); still gradient t applied at t+1."""
    import offload_plugin.host.grad_checks as grad_checks

    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = offload(model, delayed_update=True, offload_gradients=True,
                  accumulate_on_device=accumulate_on_device, **KW)
    ref = StaleByOne(ref_model, **KW)
    checked_on = []
    check = grad_checks.all_finite

    def spy(grads):
        import threading
        checked_on.append(threading.current_thread().name)
        return check(grads)

    monkeypatch.setattr(grad_checks, "all_finite", spy)
    for step in range(4):
        _train(model, opt, 1, start=step, scale_in_overlap=True)
        _train(ref_model, ref, 1, start=step, ours=False)
        if device == "cuda":
            torch.cuda.synchronize()
        assert_same_params(model, ref_model, exact=device == "cpu")
    opt.state_dict()
    ref.flush()
    assert_same_params(model, ref_model, exact=device == "cpu")
    assert checked_on and set(checked_on) == {"offload-host-update"}, set(checked_on)


def test_nonfinite_gradient_checked_in_the_jobs_spares_its_parameter(caplog):
    """A NaN reaching a delayed update that checks its own gradient: that parameter keeps
    its weight and state, the others update, and the next step() warns."""
    model = make_model()
    opt = offload(model, delayed_update=True, offload_gradients=True, **KW)
    _train(model, opt, 1, scale_in_overlap=True)
    opt.state_dict()  # completes step 0's update: state exists and is at rest
    opt.overlap_next_step(grad_scale=0.5)
    x, y = batch(1, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    bad = opt.engine.slots[trainable(model)[0]]
    bad.grad.view(-1)[0] = float("nan")  # arrived on the host
    before = {k: v.clone() for k, v in opt.state[trainable(model)[0]].items()}
    others = [opt.engine.slots[p].master.clone() for p in trainable(model)[1:]]
    opt.step()  # returns at once; the update runs in the background
    opt.zero_grad()
    with caplog.at_level("WARNING"):
        opt.state_dict()  # completes the pending update
    after = opt.state[trainable(model)[0]]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not torch.equal(a, opt.engine.slots[p].master) for a, p in zip(others, trainable(model)[1:]))
    assert "1 parameters had an inf or NaN gradient" in caplog.text


def test_differs_from_exact_mode():
    """Not a renamed exact mode: after two steps the weights differ from immediate updates."""
    a, b = make_model(), make_model()
    opt_a, opt_b = offload(a, **KW), offload(b, delayed_update=True, **KW)
    _train(a, opt_a, 2)
    _train(b, opt_b, 2)
    assert not torch.equal(trainable(a)[-1], trainable(b)[-1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["finish-then-save", "model-saved-first"])
def test_resume_continues_from_the_saved_model(device, order, tmp_path):
    """finish_step() before saving the model (our recipes' order) puts the pending update in
    the model checkpoint, and a resume continues exactly. Saved before it (torchtune's stock
    order), the model checkpoint is one update behind the optimizer's state: the resume
    continues from the model as saved (the parameter is the truth), like a run whose weights
    were reloaded from that checkpoint."""
    _assert_resume_continues(lambda seed: make_model(device, seed=seed),
                             lambda m: offload(m, delayed_update=True, offload_gradients=True, **KW),
                             _train, order, tmp_path)


def _assert_resume_continues(make, build, train, order, tmp_path):
    """Save after 3 steps in ``order``, train 3 more; a fresh model (``make(seed)``) and
    optimizer (``build(model)``) loaded from the checkpoint train the same 3 bit for bit."""
    model = make(0)
    opt = build(model)
    train(model, opt, 3)
    if order == "finish-then-save":
        opt.finish_step()
    model_sd = copy.deepcopy(model.state_dict())
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    if order == "model-saved-first":
        model.load_state_dict(model_sd)  # the uninterrupted run, from the same weights
    train(model, opt, 3, start=3)

    resumed = make(1)
    resumed.load_state_dict(model_sd)
    opt2 = build(resumed)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    train(resumed, opt2, 3, start=3)
    assert_same_params(model, resumed, exact=True)


def test_scale_given_twice_is_refused():
    model = make_model()
    opt = offload(model, delayed_update=True, offload_gradients=True, **KW)
    opt.overlap_next_step(grad_scale=0.5)
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    with pytest.raises(RuntimeError, match="already applied"):
        opt.scale_grads(0.5)


@pytest.mark.slow  # (starts a process: left out of the quick lane)
def test_process_exits_cleanly_with_an_update_pending():
    """Exit while the background update may still run: the worker is joined, no abort at exit."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from offload_plugin import CPUOffloadOptimizer\n"
        "from offload_plugin.host import process\n"
        "process._INLINE_ON_CPU = False\n"  # the host thread, whose update is still running
        "m = torch.nn.Linear(512, 512)\n"
        "opt = CPUOffloadOptimizer(m.parameters(), lr=1e-3, fused=True, delayed_update=True)\n"
        "for _ in range(3):\n"
        "    m(torch.randn(4, 512)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "print('done')\n"
    )
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("cls", ["offload_plugin.CompactAdamW", "offload_plugin.AdamW8bit"])
@pytest.mark.parametrize("order", ["finish-then-save", "model-saved-first"])
def test_resume_with_an_eight_bit_state(cls, order, tmp_path):
    """The classes that keep their own state layout resume a delayed run as AdamW does: the
    checkpoint loads into the configuration that wrote it and continues exactly."""
    def bf16_model(seed):
        torch.manual_seed(seed)  # one layer big enough for 8-bit moments (4096 elements and up)
        return torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(),
                                   torch.nn.Linear(128, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 4)).to(torch.bfloat16)

    def run(model, opt, steps, start=0):
        for step in range(start, start + steps):
            x, y = batch(step, 0, "cpu", torch.bfloat16)
            ((model(x) - y) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()

    _assert_resume_continues(bf16_model, lambda m: CPUOffloadOptimizer(
        m.parameters(), optimizer_cls=cls, delayed_update=True, **KW), run, order, tmp_path)
