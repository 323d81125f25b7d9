"""The 8-bit formats' defects of issue 55, each pinned against a reference: bitsandbytes 0.50's
``AdamW8bit`` on CPU tensors (its CPU backend), or an untouched twin run.

"Every path" is ``AdamW8bit`` used directly, through ``CPUOffloadOptimizer``'s host update
(with ``offload_gradients=True``) and through the streamed update's code run on the host
(``streamed.config.on_cpu``, as tests/test_adamw8bit.py runs it).
"""

import copy

import pytest
import torch
from torch import nn

from offload_plugin import AdamW8bit, CPUOffloadOptimizer
from offload_plugin.engines import streamed
from offload_plugin.formats.adamw8bit import update as adamw8bit
from state_snapshot import assert_unchanged, snapshot

WRAPPED = "__bnb_optimizer_quant_state__"
LR = 1e-2
SHAPES = [(64, 128), (37, 129), (4099,), (16, 64), (3, 7)]  # 8-bit (with tails) and 32-bit (small)
PATHS = ["direct", "host", "streamed"]


def _bnb():
    return pytest.importorskip("bitsandbytes")


def _params(seed=0):
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in SHAPES]


def _grads(step):
    """Gradients over six decades, so that blocks hold tiny and large moments together."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 1, s, generator=g).float()).to(torch.bfloat16)
            for s in SHAPES]


def _ours(path, params, monkeypatch, **kw):
    """AdamW8bit on ``path`` over ``params`` (a list, or param groups)."""
    monkeypatch.setattr(streamed.config, "enabled", path == "streamed")
    monkeypatch.setattr(streamed.config, "on_cpu", path == "streamed")
    monkeypatch.setattr(streamed.config, "stage_numel", 512)  # (8-bit units of 2048 elements: the large ones in ranges)
    if path == "direct":
        return AdamW8bit(params, lr=LR, **kw)
    opt = CPUOffloadOptimizer(params, optimizer_cls="offload_plugin.AdamW8bit", lr=LR,
                              offload_gradients=path == "host", **kw)
    assert opt.engine.streams == (path == "streamed")
    return opt


def _step(opt, params, step, which=None):
    for i, (p, g) in enumerate(zip(params, _grads(step))):
        p.grad = g.clone() if which is None or i in which else None
    opt.step()
    if hasattr(opt, "finish_step"):
        opt.finish_step()


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_same(ps, qs, theirs_sd, ours_sd):
    """Weights, and state dicts (every entry, empty ones included), bit for bit."""
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert torch.equal(_bits(p), _bits(q)), f"weight {i}"
    assert theirs_sd["state"].keys() == ours_sd["state"].keys()
    for index, x in theirs_sd["state"].items():
        y = ours_sd["state"][index]
        assert x.keys() == y.keys(), index
        if not x:
            continue
        assert x["step"] == y["step"] and type(x["step"]) is type(y["step"]) is int, index
        assert x[WRAPPED].keys() == y[WRAPPED].keys(), index
        for key in x[WRAPPED]:
            assert torch.equal(_bits(x[WRAPPED][key]), _bits(y[WRAPPED][key])), (index, key)


# ---------------------------------------------------------------------------- 1. bitsandbytes' args
def _args(**fields):
    from bitsandbytes.optim.optimizer import MockArgs

    return MockArgs(dict(dict(optim_bits=8, min_8bit_size=4096, max_unorm=0.0, skip_zeros=False), **fields))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fields", [dict(min_8bit_size=100), dict(optim_bits=32)], ids=["min_8bit_size", "32-bit"])
def test_an_args_object_is_followed_as_bitsandbytes_follows_it(monkeypatch, path, fields):
    """bitsandbytes' ``args`` replaces the keyword arguments: its min_8bit_size (small
    tensors in 8 bits), its optim_bits=32 (every tensor's state in fp32, the 32-bit update)."""
    bnb = _bnb()
    ps, qs = _params(), _params()
    theirs = bnb.optim.AdamW8bit(ps, lr=LR, args=_args(**fields))
    ours = _ours(path, qs, monkeypatch, args=_args(**fields))
    for step in range(3):
        _step(theirs, ps, step)
        _step(ours, qs, step)
    _assert_same(ps, qs, theirs.state_dict(), ours.state_dict())


def test_optim_bits_32_is_bitsandbytes_default_and_its_8_bit_update():
    """bitsandbytes' AdamW8bit takes optim_bits=32 alone (its default) and makes the 8-bit
    update whatever it says."""
    bnb = _bnb()
    ps, qs = _params(), _params()
    theirs = bnb.optim.AdamW8bit(ps, lr=LR, optim_bits=32)
    ours = AdamW8bit(qs, lr=LR, optim_bits=32)
    for step in range(3):
        _step(theirs, ps, step)
        _step(ours, qs, step)
    _assert_same(ps, qs, theirs.state_dict(), ours.state_dict())
    assert ours.state[qs[0]]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("fields, message", [
    (dict(max_unorm=1.0), "args.max_unorm"), (dict(skip_zeros=True), "args.skip_zeros"),
    (dict(optim_bits=16), "args.optim_bits"), (dict(percentile_clipping=5), "args.percentile_clipping"),
    (dict(block_wise=False), "args.block_wise"),
])
def test_args_fields_this_update_cannot_follow_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        AdamW8bit(_params(), lr=LR, args=_args(**fields))


def test_an_args_object_without_a_field_bitsandbytes_reads_is_refused():
    """bitsandbytes' first step raises AttributeError without it; refused when built here."""
    from bitsandbytes.optim.optimizer import MockArgs

    with pytest.raises(ValueError, match="args has no 'skip_zeros'"):
        AdamW8bit(_params(), lr=LR, args=MockArgs(dict(optim_bits=8, min_8bit_size=4096, max_unorm=0.0)))


# ---------------------------------------------------------------------------- 2. an empty entry
@pytest.mark.parametrize("path", PATHS)
def test_an_entry_read_before_its_first_step_saves_as_bitsandbytes_and_loads_back(monkeypatch, path):
    """Reading ``opt.state[p]`` of a parameter that never stepped leaves an empty entry;
    the state dict keeps it as bitsandbytes' does, and loads back: the run goes on as
    bitsandbytes' run from its own state dict."""
    bnb = _bnb()
    ps, qs = _params(), _params()
    theirs = bnb.optim.AdamW8bit(ps, lr=LR)
    ours = _ours(path, qs, monkeypatch)
    for step in range(2):
        _step(theirs, ps, step, which={0, 3})
        _step(ours, qs, step, which={0, 3})
    for opt, params in ((theirs, ps), (ours, qs)):
        assert not opt.state[params[1]] and not opt.state[params[4]]
    saved = ours.state_dict()
    _assert_same(ps, qs, theirs.state_dict(), saved)
    resumed_qs = [nn.Parameter(q.detach().clone()) for q in qs]
    resumed = _ours(path, resumed_qs, monkeypatch)
    resumed.load_state_dict(copy.deepcopy(saved))
    for step in range(2, 4):
        _step(theirs, ps, step)
        _step(resumed, resumed_qs, step)
    _assert_same(ps, resumed_qs, theirs.state_dict(), resumed.state_dict())


# ---------------------------------------------------------------------------- 3. hand-edited entries
@pytest.mark.parametrize("edit", [
    lambda e: e.update(absmax1=torch.zeros(3)),
    lambda e: e.update(state1=torch.zeros(1, dtype=torch.uint8)),
], ids=["short absmax1", "one-element state1"])
def test_a_hand_edited_entry_is_refused_by_the_streamed_update_before_any_update(monkeypatch, edit):
    """The second parameter's entry (the first would be updated first) edited by hand: the
    streamed step refuses it with nothing changed, as the direct class and the host update
    do (test_adamw8bit.py), and with the entry put back it steps as an untouched twin."""
    qs, twin_qs = _params(), _params()
    ours, twin = _ours("streamed", qs, monkeypatch), _ours("streamed", twin_qs, monkeypatch)
    for opt, params in ((ours, qs), (twin, twin_qs)):
        _step(opt, params, 0)
    entry = ours.state[qs[1]]
    kept = dict(entry)
    edit(entry)
    before = snapshot(ours)
    with pytest.raises(ValueError, match="optimizer.state\\[p\\] of a parameter of shape \\(37, 129\\)"):
        _step(ours, qs, 1)
    assert_unchanged(before, snapshot(ours))
    ours.state[qs[1]].update(kept)
    for step in (1, 2):
        _step(ours, qs, step)
        _step(twin, twin_qs, step)
    for p, q in zip(twin_qs, qs):
        assert torch.equal(_bits(p), _bits(q))
    sd, twin_sd = ours.state_dict(), twin.state_dict()
    _assert_same(twin_qs, qs, twin_sd, sd)


@pytest.mark.parametrize("path", PATHS)
def test_a_python_int_step_is_taken_as_bitsandbytes_takes_it(monkeypatch, path):
    """bitsandbytes counts in a Python int: a count set so continues as its run does."""
    bnb = _bnb()
    ps, qs = _params(), _params()
    theirs = bnb.optim.AdamW8bit(ps, lr=LR)
    ours = _ours(path, qs, monkeypatch)
    for step in range(4):
        if step == 2:
            for q in qs:
                ours.state[q]["step"] = int(ours.state[q]["step"])
        _step(theirs, ps, step)
        _step(ours, qs, step)
    _assert_same(ps, qs, theirs.state_dict(), ours.state_dict())


# ---------------------------------------------------------------------------- 4. edited groups
_GROUP_EDITS = [(path, edit) for path in PATHS
                for edit in ({"maximize": True}, {"amsgrad": True}, {"decoupled_weight_decay": False}, {"alpha": 5.0})
                if not (path == "streamed" and "amsgrad" in edit)]  # (the streamed engine refused that already)


@pytest.mark.parametrize("path, edit", _GROUP_EDITS, ids=[f"{p}-{next(iter(e))}" for p, e in _GROUP_EDITS])
def test_a_group_edited_to_another_update_is_refused_by_step_as_by_load(monkeypatch, path, edit):
    """Edited into the last group (the others would be updated first): step() refuses what
    load_state_dict refuses, with nothing changed, and the run then goes on as a twin's."""
    qs, twin_qs = _params(), _params()
    make = lambda params: _ours(path, [{"params": params[:3]}, {"params": params[3:]}], monkeypatch)  # noqa: E731
    ours, twin = make(qs), make(twin_qs)
    for opt, params in ((ours, qs), (twin, twin_qs)):
        _step(opt, params, 0)
    saved = copy.deepcopy(ours.state_dict())
    saved["param_groups"][-1].update(edit)
    with pytest.raises(ValueError, match=next(iter(edit))):
        ours.load_state_dict(saved)
    ours.param_groups[-1].update(edit)
    before = snapshot(ours)
    with pytest.raises(ValueError, match=next(iter(edit))):
        _step(ours, qs, 1)
    assert_unchanged(before, snapshot(ours))
    for key in edit:
        del ours.param_groups[-1][key]
    for step in (1, 2):
        _step(ours, qs, step)
        _step(twin, twin_qs, step)
    _assert_same(twin_qs, qs, twin.state_dict(), ours.state_dict())


# ---------------------------------------------------------------------------- 5. non-finite gradients
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_nonfinite_gradient_gives_bitsandbytes_bits(bad):
    """A NaN costs bitsandbytes its one weight, not its block; an inf makes its block's
    scales inf: weights, codes and scales are its bits, then and in the steps after."""
    bnb = _bnb()
    ps, qs = _params(), _params()
    theirs, ours = bnb.optim.AdamW8bit(ps, lr=LR), AdamW8bit(qs, lr=LR)
    for step in range(4):
        for opt, params in ((theirs, ps), (ours, qs)):
            grads = _grads(step)
            if step == 1:
                for g in grads:
                    g.view(-1)[5] = bad
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
    _assert_same(ps, qs, theirs.state_dict(), ours.state_dict())


def test_quantize_treats_nonfinite_values_as_bitsandbytes():
    """Blocks with NaN, inf and -inf at random places, alone and together."""
    F = _bnb().functional
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40 * 256, generator=g)
    for k, bad in enumerate([float("nan"), float("inf"), float("-inf")] * 13):
        x[k * 256 + int(torch.randint(256, (1,), generator=g))] = bad
    x[39 * 256:] = float("nan")  # (a block of NaN alone)
    for signed in (True, False):
        want_codes, want = F.quantize_blockwise(x, code=F.create_dynamic_map(signed=signed), blocksize=256)
        codes, absmax = torch.empty(x.shape, dtype=torch.uint8), torch.empty(want.absmax.shape)
        adamw8bit.quantize_(x, signed, codes, absmax)
        assert torch.equal(codes, want_codes.view(-1)) and torch.equal(_bits(absmax), _bits(want.absmax))


# ---------------------------------------------------------------------------- 6. CompactAdamW
@pytest.mark.parametrize("setting", [dict(lr=float("inf")), dict(eps=float("inf")), dict(weight_decay=float("inf"))],
                         ids=["lr", "eps", "weight_decay"])
def test_compact_constructor_refuses_what_its_loader_refuses_with_the_same_message(setting):
    """One check of the settings: a value its own checkpoint could not load back is refused
    when built, with the message the loader gives."""
    from offload_plugin import CompactAdamW

    opt = CompactAdamW([torch.zeros(8, dtype=torch.bfloat16)])
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0].update(setting)
    with pytest.raises(ValueError) as loading:
        opt.load_state_dict(saved)
    with pytest.raises(ValueError) as building:
        CompactAdamW([torch.zeros(8, dtype=torch.bfloat16)], **setting)
    assert str(building.value) in str(loading.value) and "inf" in str(building.value)
