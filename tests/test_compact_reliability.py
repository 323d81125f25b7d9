"""CompactAdamW held to the exact mode's standard: a refused step changes nothing, copies
work, and a remainder follows one rule on every path (used directly, offloaded with the host
update, streamed): a weight written outside the optimizer restarts its master from the
written weight, except on a resume, where the saved remainder is kept for the weight it was
saved with, whichever of model and optimizer is loaded first."""

import copy
import pickle

import pytest
import torch
from torch import nn

from offload_plugin import CompactAdamW, CPUOffloadOptimizer
from offload_plugin.engines import streamed

KW = dict(lr=2e-3, weight_decay=0.1)
PATHS = ["direct", "host", "streamed"]


def make_model(seed=0) -> nn.Module:
    """bf16 layers above and below min_8bit_size (4096 elements): compact and fp32 state."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 4)).to(torch.bfloat16)


def build(model, path, monkeypatch):
    if path == "direct":
        return CompactAdamW(list(model.parameters()), **KW)
    monkeypatch.setattr(streamed.config, "on_cpu", path == "streamed")
    return CPUOffloadOptimizer(model.parameters(), optimizer_cls=CompactAdamW, **KW)


def run(model, opt, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_a_refused_step_changes_nothing():
    """A parameter the update cannot take (fp32, a sparse gradient) after one it can: the
    step raises before the first is updated or given state."""
    a = torch.randn(8192, dtype=torch.bfloat16, requires_grad=True)
    for bad in (torch.randn(64, requires_grad=True), torch.randn(64, dtype=torch.bfloat16, requires_grad=True)):
        opt = CompactAdamW([a, bad])
        a.grad = torch.randn_like(a)
        bad.grad = torch.randn_like(bad)
        if bad.dtype == torch.bfloat16:
            bad.grad = bad.grad.to_sparse()
        before = a.detach().clone()
        with pytest.raises(ValueError, match="Nothing was updated"):
            opt.step()
        assert torch.equal(a.detach(), before) and len(opt.state) == 0


@pytest.mark.parametrize("path", PATHS)
def test_a_group_edited_to_settings_the_constructor_refuses_is_refused_before_any_update(path, monkeypatch):
    """beta1 = 1 (the bias correction would divide by zero part way through the step)."""
    model = make_model()
    opt = build(model, path, monkeypatch)
    run(model, opt, 1)
    before, saved = weights(model), copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["betas"] = (1.0, 0.999)
    with pytest.raises(ValueError, match="betas"):
        run(model, opt, 1, start=1)
    assert_bitwise(before, weights(model))
    opt.param_groups[0]["betas"] = saved["param_groups"][0]["betas"]
    after = opt.state_dict()["state"]
    for index, entry in saved["state"].items():
        assert entry.keys() == after[index].keys()
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[index][key])), (index, key)


def test_a_non_contiguous_parameter_is_refused_saying_so():
    w = torch.randn(64, 64, dtype=torch.bfloat16).t().requires_grad_()
    opt = CompactAdamW([w])
    w.grad = torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not contiguous"):
        opt.step()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_step_as_the_original_does(how):
    """A deep copy or pickle round trip of a trained CompactAdamW (with its model) goes on
    with the same bits as the original."""
    model = make_model()
    opt = CompactAdamW(list(model.parameters()), **KW)
    run(model, opt, 3)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    run(model, opt, 3, start=3)
    run(model2, opt2, 3, start=3)
    assert_bitwise(weights(model), weights(model2))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("order", ["model first", "optimizer first"])
def test_resume_is_bitwise_in_either_load_order(path, order, monkeypatch):
    """Save after 3 steps, run 3 more; a fresh model and optimizer loaded from the save, in
    either order, give the same bits."""
    model = make_model()
    opt = build(model, path, monkeypatch)
    run(model, opt, 3)
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(model, opt, 3, start=3)

    model2 = make_model(seed=1)
    opt2 = build(model2, path, monkeypatch)
    if order == "model first":
        model2.load_state_dict(msd)
        opt2.load_state_dict(osd)
    else:
        opt2.load_state_dict(osd)
        model2.load_state_dict(msd)
    run(model2, opt2, 3, start=3)
    assert_bitwise(weights(model), weights(model2))


@pytest.mark.parametrize("path", PATHS)
def test_loaded_state_over_other_weights_restarts_their_masters(path, monkeypatch):
    """Optimizer state loaded where the model holds other weights (zeros, as LoRA's B): the
    saved remainders are not attached to them (a negative remainder on a zero weight would
    make a NaN master); the masters restart from the weights, as after any other write."""
    model = make_model()
    opt = build(model, path, monkeypatch)
    run(model, opt, 3)
    osd = copy.deepcopy(opt.state_dict())

    def fresh(load):
        m = make_model(seed=1)
        with torch.no_grad():
            m[0].weight.zero_()
        o = build(m, path, monkeypatch)
        load(o)
        run(m, o, 2, start=3)
        return m

    loaded = fresh(lambda o: o.load_state_dict(osd))
    no_remainders = copy.deepcopy(osd)
    for entry in no_remainders["state"].values():
        entry["remainder"].zero_()
        del entry["weight_digest"]
    assert_bitwise(weights(loaded), weights(fresh(lambda o: o.load_state_dict(no_remainders))))
    assert not any(bool(p.isnan().any()) for p in loaded.parameters())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("how", ["copy_", "data"])
def test_a_same_value_write_follows_one_rule_on_every_path(path, how, monkeypatch):
    """``p.copy_(p.clone())`` or ``p.data = p.clone()`` between steps counts as a write on
    every path: the master restarts from the weight (the same bits as zeroing the remainder
    by hand)."""
    def trained(write):
        model = make_model()
        opt = build(model, path, monkeypatch)
        run(model, opt, 3)
        write(model, opt)
        run(model, opt, 3, start=3)
        return weights(model)

    def rewrite(model, opt):
        with torch.no_grad():
            for p in model.parameters():
                if how == "copy_":
                    p.copy_(p.clone())
                else:
                    p.data = p.detach().clone()

    def zero_remainders(model, opt):
        for p in model.parameters():
            opt.state[p]["remainder"].zero_()

    rewritten = trained(rewrite)
    assert_bitwise(rewritten, trained(zero_remainders))
    if path != "direct":
        monkeypatch.undo()
        direct = make_model()
        direct_opt = CompactAdamW(list(direct.parameters()), **KW)
        run(direct, direct_opt, 3)
        rewrite(direct, direct_opt)
        run(direct, direct_opt, 3, start=3)
        assert_bitwise(rewritten, weights(direct))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
def test_gpu_weight_digest_is_the_hosts():
    """A checkpoint saved from GPU weights resumes on the host and back: one digest."""
    from offload_plugin.formats.compact.optimizer import weight_digest

    for n in (1, 255, 4097, 3 * (1 << 20) + 5):
        w = torch.randn(n, dtype=torch.bfloat16)
        assert weight_digest(w) == weight_digest(w.cuda())


@CUDA
@pytest.mark.parametrize("order", ["model first", "optimizer first"])
def test_gpu_streamed_compact_resume_is_bitwise_in_either_load_order(order):
    """The streamed compact update on the GPU (the default there): a resume in either order
    gives the uninterrupted run's bits, and a same-value write restarts the masters as on
    the host (the CPU tests check the host paths)."""
    def trained_on_gpu(model, opt, start, steps):
        for step in range(start, start + steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 64, generator=g).to("cuda", torch.bfloat16)
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    def build(seed):
        model = make_model(seed).cuda()
        return model, CPUOffloadOptimizer(model.parameters(), optimizer_cls=CompactAdamW, **KW)

    model, opt = build(0)
    assert opt.engine.streams  # (the streamed path is what this tests)
    trained_on_gpu(model, opt, 0, 3)
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    trained_on_gpu(model, opt, 3, 3)
    model2, opt2 = build(1)
    if order == "model first":
        model2.load_state_dict(msd)
        opt2.load_state_dict(osd)
    else:
        opt2.load_state_dict(osd)
        model2.load_state_dict(msd)
    trained_on_gpu(model2, opt2, 3, 3)
    assert_bitwise(weights(model), weights(model2))

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.clone())
    for p in model2.parameters():
        opt2.state[p]["remainder"].zero_()
    trained_on_gpu(model, opt, 6, 2)
    trained_on_gpu(model2, opt2, 6, 2)
    assert_bitwise(weights(model), weights(model2))


@pytest.mark.parametrize("count", [2.5, -1.0, float("nan")])
def test_a_step_count_the_update_cannot_use_is_refused(count):
    """A compact entry's count edited by hand to a fraction (the update counts whole steps
    and would cut it off), a negative number or NaN: the step raises, changing nothing."""
    p = torch.randn(8192, dtype=torch.bfloat16, requires_grad=True)
    opt = CompactAdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p]["step"].fill_(count)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="'step'"):
        opt.step()
    assert torch.equal(p.detach(), before)
