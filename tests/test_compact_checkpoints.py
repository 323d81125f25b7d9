"""Loading into CompactAdamW (issue 40): exact shapes, and group settings it cannot honour.

Held to the standard of the exact mode (checkpoint.py): an entry of the right element count
in another shape is refused as torch's layout is; a setting the update would silently
ignore (maximize, amsgrad, Adam's L2 decay, ...) is refused with what to do, one that
changes nothing (foreach, fused) is dropped; conversions to torch's AdamW keep ``fused``, so
that the exact-layout tensors continue bit for bit. Each refusal leaves parameters, state
and groups bitwise as they were, for CompactAdamW used directly and through
CPUOffloadOptimizer.
"""

import copy

import pytest
import torch

from offload_plugin import CompactAdamW, CPUOffloadOptimizer
from offload_plugin.formats.compact import native as compact_adam, optimizer as compact_optimizer
from state_snapshot import assert_unchanged, same, snapshot

LR, WD = 1e-2, 0.1
THROUGH = pytest.mark.parametrize("through", ["CompactAdamW", "CPUOffloadOptimizer"])


def _model():
    """(128, 64) compact; (128,) and (8, 128) exact (under 4096 elements); (8,) exact."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)).to(torch.bfloat16)


def _target(through, model, **kw):
    kw = {"lr": LR, "weight_decay": WD, **kw}
    if through == "CompactAdamW":
        return CompactAdamW(model.parameters(), **kw)
    return CPUOffloadOptimizer(model.parameters(), optimizer_cls=CompactAdamW, **kw)


def _steps(model, opt, start, n):
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _trained(through):
    model = _model()
    opt = _target(through, model)
    _steps(model, opt, 0, 2)
    return model, opt


def _assert_refused(opt, bad, message) -> str:
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message) as err:
        opt.load_state_dict(bad)
    assert_unchanged(before, snapshot(opt))
    return str(err.value)


# ---------------------------------------------------------------- exact shapes

def _reshape(index, key, how):
    return lambda sd: sd["state"][index].update({key: how(sd["state"][index][key])})


SHAPE_CASES = {
    "codes transposed": (_reshape(0, "exp_avg", lambda t: t.t()), "'exp_avg'\\) has shape \\(64, 128\\)"),
    "remainder transposed": (_reshape(0, "remainder", lambda t: t.t()), "'remainder'\\) has shape \\(64, 128\\)"),
    "codes flat": (_reshape(0, "exp_avg_sq", lambda t: t.reshape(-1)), "'exp_avg_sq'\\) has shape \\(8192,\\)"),
    "scales per row": (_reshape(0, "exp_avg_absmax", lambda t: t.reshape(4, 8)), "'exp_avg_absmax'\\) has shape \\(4, 8\\).*\\(32,\\)"),
    "bias moment (2, 64)": (_reshape(1, "exp_avg", lambda t: t.reshape(2, 64)), "'exp_avg'\\) has shape \\(2, 64\\)"),
    "exact moments transposed": (_reshape(2, "exp_avg_sq", lambda t: t.t()), "'exp_avg_sq'\\) has shape \\(128, 8\\)"),
    "exact remainder flat": (_reshape(2, "remainder", lambda t: t.reshape(-1)), "'remainder'\\) has shape \\(1024,\\)"),
}


@THROUGH
@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_an_entry_of_the_right_size_in_another_shape_is_refused(case, through):
    """Accepted before (only element counts were checked): a transposed moment or remainder
    was then read in the wrong order."""
    mutate, message = SHAPE_CASES[case]
    model, opt = _trained(through)
    bad = copy.deepcopy(opt.state_dict())
    mutate(bad)
    said = _assert_refused(opt, bad, message)
    assert "it needs exactly" in said and "reshape it" in said  # (as the exact mode says)


@THROUGH
def test_a_remainder_as_its_bf16_bits_loads_as_sharded_checkpoints_carry_it(through):
    model, opt = _trained(through)
    sd = copy.deepcopy(opt.state_dict())
    as_bits = copy.deepcopy(sd)
    for entry in as_bits["state"].values():
        entry["remainder"] = entry["remainder"].view(torch.bfloat16)
    runs = []
    for saved in (sd, as_bits):
        twin = copy.deepcopy(model)
        twin_opt = _target(through, twin)
        twin_opt.load_state_dict(copy.deepcopy(saved))
        _steps(twin, twin_opt, 2, 2)
        runs.append(([p.detach() for p in twin.parameters()], twin_opt.state_dict()))
    assert same(runs[0], runs[1])


# ---------------------------------------------------------------- group settings

def _empty_torch_state_dict(cls=torch.optim.AdamW, **kw):
    """What torch's optimizer saves before its first step: its groups, no state."""
    return cls(_model().parameters(), lr=LR, **kw).state_dict()


def _with(**settings):
    def mutate(sd):
        sd["param_groups"][0].update(settings)
    return mutate


REFUSED_SETTINGS = {
    "maximize and amsgrad": (lambda: _empty_torch_state_dict(maximize=True, amsgrad=True), "amsgrad=True.*go on without amsgrad"),
    "maximize": (lambda: _empty_torch_state_dict(maximize=True), "maximize=True.*CompactAdamW minimizes"),
    "amsgrad": (lambda: _empty_torch_state_dict(amsgrad=True), "amsgrad=True"),
    "capturable": (lambda: _empty_torch_state_dict(capturable=True), "capturable=True"),
    "differentiable": (lambda: _empty_torch_state_dict(differentiable=True), "differentiable=True"),
    "Adam's L2 decay": (lambda: _empty_torch_state_dict(torch.optim.Adam, weight_decay=0.1),
                        "decoupled_weight_decay=False.*optimizer_cls=torch.optim.Adam"),
}


@THROUGH
@pytest.mark.parametrize("case", list(REFUSED_SETTINGS))
def test_a_group_setting_the_update_would_ignore_is_refused(case, through):
    """Loaded before (with empty state nothing else was checked): the groups then said
    maximize or amsgrad while the update did neither (the constructor refuses both)."""
    make, message = REFUSED_SETTINGS[case]
    _, opt = _trained(through)
    _assert_refused(opt, make(), message)


@THROUGH
@pytest.mark.parametrize("settings", [
    dict(foreach=True), dict(fused=True), dict(fused=False, foreach=False),
    dict(decoupled_weight_decay=False, weight_decay=0.0),  # (Adam without decay: the same update)
], ids=["foreach", "fused", "neither", "Adam without decay"])
def test_settings_that_change_nothing_are_dropped(settings, through):
    """A torch AdamW group with them loads; the groups do not keep them, and the update is
    the one a CompactAdamW built with the same hyperparameters makes."""
    sd = _empty_torch_state_dict()
    sd["param_groups"][0].update(settings, betas=(0.8, 0.95))
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = _target(through, model)
    opt.load_state_dict(sd)
    ref = _target(through, ref_model, betas=(0.8, 0.95), weight_decay=settings.get("weight_decay", 0.01))
    for key in ("foreach", "fused", "amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay"):
        assert key not in opt.param_groups[0], key
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)
    _steps(model, opt, 0, 2)
    _steps(ref_model, ref, 0, 2)
    assert same([p.detach() for p in model.parameters()], [p.detach() for p in ref_model.parameters()])


def test_from_adamw_state_dict_refuses_what_the_update_would_ignore_and_keeps_the_rest():
    """It dropped maximize and amsgrad (and a scheduler's initial_lr) silently."""
    model = _model()
    for bad in (_empty_torch_state_dict(maximize=True), _empty_torch_state_dict(amsgrad=True),
                _empty_torch_state_dict(torch.optim.Adam, weight_decay=0.1)):
        with pytest.raises(ValueError, match="CompactAdamW's update does not do"):
            compact_optimizer.from_adamw_state_dict(bad, list(model.parameters()))
    sd = _empty_torch_state_dict(fused=True)
    sd["param_groups"][0]["initial_lr"] = 0.5
    group = compact_optimizer.from_adamw_state_dict(sd, list(model.parameters()))["param_groups"][0]
    assert group["initial_lr"] == 0.5 and "fused" not in group and group["master"] is True


def test_from_adamw_state_dict_refuses_state_it_would_quantize_into_garbage():
    """A NaN or a transposed moment in a large tensor would have been quantized into codes
    that look valid."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _steps(model, opt, 0, 1)
    for key, value, message in (("exp_avg", lambda t: t * float("nan"), "inf or NaN"),
                                ("exp_avg_sq", lambda t: t.t(), "has shape \\(64, 128\\)"),
                                ("max_exp_avg_sq", lambda t: t, "torch AdamW's layout")):
        bad = copy.deepcopy(opt.state_dict())
        bad["state"][0][key] = value(bad["state"][0]["exp_avg_sq"] if key != "exp_avg" else bad["state"][0][key])
        with pytest.raises(ValueError, match=message):
            compact_optimizer.from_adamw_state_dict(bad, list(model.parameters()))


def test_a_compact_state_dict_loaded_into_torchs_adamw_layout_says_how_to_convert_it():
    """The reverse direction: CPUOffloadOptimizer's default (torch's AdamW) refuses it,
    naming to_adamw_state_dict, with nothing changed."""
    _, compact = _trained("CompactAdamW")
    model = _model()
    opt = CPUOffloadOptimizer(model.parameters(), lr=LR)
    _steps(model, opt, 0, 1)
    _assert_refused(opt, compact.state_dict(), "to_adamw_state_dict")


def test_converted_state_continues_bit_for_bit_in_torchs_fused_adamw():
    """to_adamw_state_dict wrote fused=None, so torch's AdamW(fused=True) loading it fell
    back to its for-loop, whose rounding differs: the exact-layout tensors (CompactAdamW's
    update there is torch's fused AdamW on the fp32 master) no longer continued bit for bit."""
    model = _model()
    opt = CompactAdamW(model.parameters(), lr=LR, weight_decay=WD)
    _steps(model, opt, 0, 3)
    params = list(model.parameters())
    converted, masters = compact_optimizer.to_adamw_state_dict(opt.state_dict(), params)
    assert converted["param_groups"][0]["fused"] is True
    fp32 = [torch.nn.Parameter(m.clone()) for m in masters]
    torch_opt = torch.optim.AdamW(fp32, lr=LR, weight_decay=WD, fused=True)
    torch_opt.load_state_dict(converted)
    for step in range(3, 6):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(params, fp32):
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            q.grad = p.grad.float()
        opt.step()
        torch_opt.step()
    for p, q in zip(params, fp32):
        if p.numel() < compact_optimizer.MIN_8BIT_SIZE:
            master = compact_adam.master_of(p.detach().reshape(-1), opt.state[p]["remainder"].reshape(-1))
            assert torch.equal(master, q.detach().reshape(-1)), tuple(p.shape)
