"""One conformance suite over every state format and every path it runs on (issue 55).

Formats: exact AdamW (torch's layout), ``AdamW8bit`` (bitsandbytes' layout) and
``CompactAdamW``. Paths: the inner class used directly (where it is public; torch's AdamW
is the exact format's reference itself), CPUOffloadOptimizer's host update, the same with
``offload_gradients=True``, and the streamed update's code run on the host
(``streamed.config.on_cpu``, as tests/test_streamed.py runs it). Each check compares with a
reference: torch's ``AdamW(fused=True)``, bitsandbytes' ``AdamW8bit``, ``CompactAdamW``
loaded with the same state, an untouched twin, an uninterrupted run, or a snapshot taken
before a refused call.
"""

import copy
import logging

import pytest
import torch
from torch import nn

from offload_plugin import AdamW8bit, CompactAdamW, CPUOffloadOptimizer
from offload_plugin.engines import streamed
from offload_plugin.formats import registry
from state_snapshot import assert_unchanged, same, snapshot

KW = dict(lr=1e-2, weight_decay=0.1)
BF16 = torch.bfloat16


def _bnb_adamw8bit(params, **kw):
    return pytest.importorskip("bitsandbytes").optim.AdamW8bit(params, **kw)


# What each format is: its family (offload_plugin.formats.registry), its dtype, its optimizer_cls, its reference, its direct class (None:
# not public), a first- and a second-moment key of its entries, and the group settings its
# load_state_dict refuses in its own checkpoint (check 2).
FORMATS = {
    "exact": dict(family="adamw", dtype=torch.float32, cls="torch.optim.AdamW", direct=None,
                  reference=lambda params: torch.optim.AdamW(params, fused=True, **KW),
                  keys=("exp_avg", "exp_avg_sq"), refused={"amsgrad": True, "foreach": True}),
    "exact-bf16": dict(family="adamw", dtype=BF16, cls="torch.optim.AdamW", direct=None,
                       reference=lambda params: torch.optim.AdamW(params, fused=True, **KW),
                       keys=("exp_avg", "exp_avg_sq"), refused={"amsgrad": True}),
    "adamw8bit": dict(family="adamw8bit", dtype=BF16, cls="offload_plugin.AdamW8bit", direct=AdamW8bit,
                      reference=lambda params: _bnb_adamw8bit(params, **KW),
                      keys=("state1", "absmax1"), refused={"amsgrad": True, "maximize": True}),
    "compact": dict(family="compact", dtype=BF16, cls="offload_plugin.CompactAdamW", direct=CompactAdamW,
                    reference=lambda params: CompactAdamW(params, **KW),
                    keys=("exp_avg", "exp_avg_absmax"), refused={"amsgrad": True, "maximize": True}),
}
PATHS = ["direct", "host", "offload_gradients", "streamed"]


def test_every_registered_family_is_in_the_suite():
    """A new family (a folder under offload_plugin/formats/) joins the suite with its entry above."""
    assert {f["family"] for f in FORMATS.values()} == set(registry.FAMILIES)
CASES = [pytest.param(fmt, path, id=f"{fmt}-{path}")
         for fmt in FORMATS for path in PATHS if path != "direct" or FORMATS[fmt]["direct"] is not None]


def make_model(fmt, seed=0) -> nn.Module:
    """A weight above min_8bit_size (4096 elements: 8-bit state in the 8-bit formats) and
    three small tensors (fp32 state there)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 4)).to(FORMATS[fmt]["dtype"])


def build(fmt, path, model, monkeypatch):
    """``fmt``'s optimizer over ``model`` on ``path``."""
    monkeypatch.setattr(streamed.config, "enabled", path == "streamed")
    monkeypatch.setattr(streamed.config, "on_cpu", path == "streamed")
    # Weights in ranges; a multiple of the CPU kernel's vector width (test_streamed.py says why).
    monkeypatch.setattr(streamed.config, "stage_numel", 512)
    if path == "direct":
        return FORMATS[fmt]["direct"](list(model.parameters()), **KW)
    opt = CPUOffloadOptimizer(model.parameters(), optimizer_cls=FORMATS[fmt]["cls"],
                              offload_gradients=path == "offload_gradients", **KW)
    assert opt.engine.streams == (path == "streamed")
    return opt


def backward(model, step, skip=()):
    """Gradients of step ``step``'s batch; the parameters at the indices in ``skip`` get none."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 64, generator=g).to(next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()
    for i, p in enumerate(model.parameters()):
        if i in skip:
            p.grad = None


def run(model, opt, steps, start=0, skip=()):
    for step in range(start, start + steps):
        backward(model, step, skip)
        opt.step()
        opt.zero_grad()


def assert_same_run(model, opt, twin_model, twin_opt, groups=True):
    """Weights and state dicts bit for bit (tensors by dtype, shape and bits); ``groups``:
    the param groups too (not across classes, whose groups carry keys of their own)."""
    for name, p, q in zip(dict(model.named_parameters()), model.parameters(), twin_model.parameters()):
        assert same(p.detach(), q.detach()), f"weight {name}"
    ours, theirs = opt.state_dict(), twin_opt.state_dict()
    assert same(ours["state"], theirs["state"])
    if groups:
        assert same(ours["param_groups"], theirs["param_groups"])


def twins(fmt, path, monkeypatch):
    """Two models with the same weights, each with its optimizer on ``path``."""
    model, twin = make_model(fmt), make_model(fmt)
    return model, build(fmt, path, model, monkeypatch), twin, build(fmt, path, twin, monkeypatch)


# ---------------------------------------------------------------------------- 1. an empty entry
@pytest.mark.parametrize("fmt, path", CASES)
def test_an_entry_read_before_its_first_step_saves_loads_and_changes_nothing(fmt, path, monkeypatch):
    """``opt.state[p]`` read for a parameter that never stepped: state_dict() works and
    loads back into a fresh optimizer, which then trains as a twin that never read it."""
    model, opt, twin, twin_opt = twins(fmt, path, monkeypatch)
    never = list(model.parameters())[3]  # (the last bias: no gradient in the first 2 steps)
    for m, o in ((model, opt), (twin, twin_opt)):
        run(m, o, 2, skip={3})
    assert not opt.state[never]
    saved = copy.deepcopy(opt.state_dict())
    resumed_model = make_model(fmt, seed=1)
    resumed_model.load_state_dict(model.state_dict())
    resumed = build(fmt, path, resumed_model, monkeypatch)
    resumed.load_state_dict(saved)
    for m, o in ((resumed_model, resumed), (twin, twin_opt)):
        run(m, o, 2, start=2)
    assert_same_run(resumed_model, resumed, twin, twin_opt)


# ---------------------------------------------------------------------------- 2. an edited group
def _settings():
    return [pytest.param(fmt, path, key, value, id=f"{fmt}-{path}-{key}")
            for fmt, path in (c.values for c in CASES) for key, value in FORMATS[fmt]["refused"].items()]


@pytest.mark.parametrize("fmt, path, key, value", _settings())
def test_a_group_setting_load_refuses_is_refused_by_step_before_any_change(fmt, path, key, value, monkeypatch):
    """A group edited between steps to a setting that load_state_dict refuses in the
    optimizer's own checkpoint: step() refuses it too, with nothing changed."""
    model = make_model(fmt)
    opt = build(fmt, path, model, monkeypatch)
    run(model, opt, 1)
    carrying = copy.deepcopy(opt.state_dict())
    carrying["param_groups"][0][key] = value
    before = snapshot(opt)
    with pytest.raises(ValueError):
        opt.load_state_dict(carrying)
    assert_unchanged(before, snapshot(opt))
    opt.param_groups[0][key] = value
    backward(model, 1)
    before = snapshot(opt)
    with pytest.raises(Exception, match=key):
        opt.step()
    assert_unchanged(before, snapshot(opt))


# ---------------------------------------------------------------------------- 3. an edited entry
@pytest.mark.parametrize("edit", ["wrong shape", "wrong dtype"])
@pytest.mark.parametrize("fmt, path", CASES)
def test_a_hand_edited_entry_is_refused_before_any_update_and_put_back_steps_as_a_twin(fmt, path, edit, monkeypatch):
    """One tensor of one entry edited by hand (the last parameter's first-moment tensor to
    another shape; the 8-bit weight's second key to float64): step() refuses it with nothing
    changed, and with the tensor put back the run goes on as an untouched twin."""
    model, opt, twin, twin_opt = twins(fmt, path, monkeypatch)
    for m, o in ((model, opt), (twin, twin_opt)):
        run(m, o, 1)
    first, second = FORMATS[fmt]["keys"]
    params = list(model.parameters())
    p, key = (params[-1], first) if edit == "wrong shape" else (params[0], second)
    kept = opt.state[p][key]
    opt.state[p][key] = torch.zeros(3, dtype=kept.dtype) if edit == "wrong shape" else kept.double()
    backward(model, 1)
    before = snapshot(opt)
    with pytest.raises(Exception, match="optimizer.state\\[p\\]|state entry"):
        opt.step()
    assert_unchanged(before, snapshot(opt))
    opt.state[p][key] = kept
    opt.zero_grad()
    for m, o in ((model, opt), (twin, twin_opt)):
        run(m, o, 2, start=1)
    assert_same_run(model, opt, twin, twin_opt)


# ---------------------------------------------------------------------------- 4. resume
@pytest.mark.parametrize("order", ["model first", "optimizer first"])
@pytest.mark.parametrize("fmt, path", CASES)
def test_resume_in_either_load_order_is_the_uninterrupted_run(fmt, path, order, monkeypatch):
    """2 steps, save, a fresh model and optimizer loaded in ``order``, 2 more steps: the
    bits of 4 uninterrupted steps."""
    model, opt, whole, whole_opt = twins(fmt, path, monkeypatch)
    run(model, opt, 2)
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed_model = make_model(fmt, seed=1)
    resumed = build(fmt, path, resumed_model, monkeypatch)
    loads = [lambda: resumed_model.load_state_dict(msd), lambda: resumed.load_state_dict(osd)]
    for load in loads if order == "model first" else loads[::-1]:
        load()
    run(resumed_model, resumed, 2, start=2)
    run(whole, whole_opt, 4)
    assert_same_run(resumed_model, resumed, whole, whole_opt)


# ---------------------------------------------------------------------------- 5. a NaN gradient
@pytest.mark.parametrize("fmt, path", CASES)
def test_a_nan_gradient_skips_the_step_with_a_warning(fmt, path, monkeypatch, caplog):
    """A NaN in one parameter's gradient under nonfinite_grads="skip" (the default):
    nothing changes and a warning says so. The direct AdamW8bit follows bitsandbytes
    instead (bit for bit); CompactAdamW used directly has no reference and is left out."""
    if path == "direct" and fmt == "compact":
        pytest.skip("CompactAdamW used directly has no reference for a NaN gradient")
    model = make_model(fmt)
    opt = build(fmt, path, model, monkeypatch)
    run(model, opt, 2)
    if path == "direct":
        ref_model = copy.deepcopy(model)
        ref = FORMATS[fmt]["reference"](list(ref_model.parameters()))
        ref.load_state_dict(copy.deepcopy(opt.state_dict()))
        for m, o in ((model, opt), (ref_model, ref)):
            backward(m, 2)
            m[2].weight.grad[0, 0] = float("nan")
            o.step()
        assert_same_run(model, opt, ref_model, ref)
        return
    backward(model, 2)
    model[2].weight.grad[0, 0] = float("nan")
    before = snapshot(opt)
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        opt.step()
        after = snapshot(opt)  # (the streamed update reports at the next state read, docs/options.md)
    assert "the step was skipped" in caplog.text
    assert_unchanged(before, after)


# ---------------------------------------------------------------------------- 6. a written weight
@pytest.mark.parametrize("fmt, path", CASES)
def test_a_weight_written_between_steps_is_what_the_next_step_updates(fmt, path, monkeypatch):
    """A weight written in place under no_grad after 2 steps: the next step updates the
    written weight, as the format's reference does when given the same weights and state."""
    model = make_model(fmt)
    opt = build(fmt, path, model, monkeypatch)
    run(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    with torch.no_grad():
        model[0].weight.mul_(0.5)
        model[2].bias.add_(1.0)
    ref_model = copy.deepcopy(model)
    ref = FORMATS[fmt]["reference"](list(ref_model.parameters()))
    ref.load_state_dict(saved)
    for m, o in ((model, opt), (ref_model, ref)):
        run(m, o, 2, start=2)
    assert_same_run(model, opt, ref_model, ref)


# ---------------------------------------------------------------------------- 7. the reference's checkpoint
@pytest.mark.parametrize("fmt, path", CASES)
def test_the_references_checkpoint_loads_and_continues_its_run(fmt, path, monkeypatch):
    """The format's interop the other way round from check 6: the reference (torch's fused
    AdamW, bitsandbytes' AdamW8bit) trains 2 steps; its state dict loads into ours on this
    path, and both go on 2 more steps with the same bits."""
    ref_model = make_model(fmt)
    ref = FORMATS[fmt]["reference"](list(ref_model.parameters()))
    run(ref_model, ref, 2)
    model = copy.deepcopy(ref_model)
    opt = build(fmt, path, model, monkeypatch)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for m, o in ((model, opt), (ref_model, ref)):
        run(m, o, 2, start=2)
    assert_same_run(model, opt, ref_model, ref, groups=False)


# ---------------------------------------------------------------------------- 8. copies
@pytest.mark.parametrize("fmt, path", CASES)
def test_a_copy_is_refused_or_independent(fmt, path, monkeypatch):
    """copy.deepcopy: the offload optimizer refuses it (TypeError, nothing changed: its host
    buffers and worker are not copyable; save its state_dict()), as docs/options.md says; a
    format's class used directly copies as torch's optimizers do, into an optimizer whose
    steps leave the original alone."""
    model = make_model(fmt)
    opt = build(fmt, path, model, monkeypatch)
    run(model, opt, 1)
    if path != "direct":
        before = snapshot(opt)
        with pytest.raises(TypeError):
            copy.deepcopy(opt)
        assert_unchanged(before, snapshot(opt))
        return
    model_copy, opt_copy = copy.deepcopy((model, opt))
    before = snapshot(opt)
    run(model_copy, opt_copy, 1, start=1)
    assert_unchanged(before, snapshot(opt))
    twin = copy.deepcopy(model)
    twin_opt = FORMATS[fmt]["direct"](list(twin.parameters()), **KW)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(twin, twin_opt, 1, start=1)
    assert_same_run(model_copy, opt_copy, twin, twin_opt)
