"""AdamW8bit (offload_plugin.formats.adamw8bit.optimizer): bitsandbytes' AdamW8bit update and state layout.

The reference is bitsandbytes 0.50 itself on CPU tensors (its CPU backend): from the same
weights and gradients, the bf16 weights, the 8-bit codes, the block scales and the 32-bit
state of small tensors are its bits, used directly and through CPUOffloadOptimizer (the host
update, and the streamed update's code run on the host, ``streamed.config.on_cpu``). Each side's
state dict continues on the other as the uninterrupted run does. Every malformed field is
refused with nothing changed. The GPU kernel's bits are checked in the last tests.
"""

import copy
import pickle

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


def _bnb():
    return pytest.importorskip("bitsandbytes")


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.randn(s).to(torch.bfloat16) for s in SHAPES]


def _grads(step, shapes=SHAPES):
    """Gradients over six decades, so that blocks hold tiny and large moments together."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 1, s, generator=g).float()).to(torch.bfloat16)
            for s in shapes]


def _step(opt, params, step):
    for p, g in zip(params, _grads(step)):
        p.grad = g.clone()
    opt.step()


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_same_state_dicts(a, b):
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        x, y = a["state"][index], b["state"][index]
        assert x["step"] == y["step"] and type(x["step"]) is type(y["step"]) is int, index
        assert x[WRAPPED].keys() == y[WRAPPED].keys(), index
        for key in x[WRAPPED]:
            assert torch.equal(_bits(x[WRAPPED][key]), _bits(y[WRAPPED][key])), (index, key)


def _assert_same_weights(ps, qs):
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16)), i


# ---------------------------------------------------------------------------- the maps and quantizer
def test_the_maps_are_bitsandbytes_maps():
    F = _bnb().functional
    for signed in (True, False):
        assert torch.equal(adamw8bit.dynamic_map(signed).view(torch.int32),
                           F.create_dynamic_map(signed=signed).view(torch.int32))


def test_quantize_gives_bitsandbytes_codes_at_every_table_boundary():
    """Values one ulp either side of each of the table's 65,535 decision points, blocks with
    tails and zeros: codes and scales are bitsandbytes' CPU quantizer's."""
    F = _bnb().functional
    k = torch.arange(1, 65535, dtype=torch.float64)
    y = ((k - 0.5) / 65535 * 2 - 1).float()
    values = torch.cat([y, torch.nextafter(y, torch.tensor(2.0)), torch.nextafter(y, torch.tensor(-2.0))])
    blocks = -(-values.numel() // 255)
    values = torch.nn.functional.pad(values, (0, blocks * 255 - values.numel())).view(blocks, 255)
    values = torch.cat([values, torch.ones(blocks, 1)], 1).view(-1)
    values = torch.cat([values, torch.zeros(256), torch.randn(300) * 1e-3])  # (a zero block, a tail)
    for signed in (True, False):
        x = values if signed else values.abs()
        want_codes, want = F.quantize_blockwise(x, code=F.create_dynamic_map(signed=signed), blocksize=256)
        codes, absmax = torch.empty(x.shape, dtype=torch.uint8), torch.empty(want.absmax.shape)
        adamw8bit.quantize_(x, signed, codes, absmax)
        assert torch.equal(codes, want_codes.view(-1)) and torch.equal(absmax, want.absmax)


# ---------------------------------------------------------------------------- bitsandbytes' bits
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_update_is_bitsandbytes_bit_for_bit(weight_decay):
    bnb = _bnb()
    ps, qs = _params(), _params()
    theirs = bnb.optim.AdamW8bit(ps, lr=LR, weight_decay=weight_decay)
    ours = AdamW8bit(qs, lr=LR, weight_decay=weight_decay)
    for step in range(6):
        _step(theirs, ps, step)
        _step(ours, qs, step)
    _assert_same_weights(ps, qs)
    _assert_same_state_dicts(theirs.state_dict(), ours.state_dict())
    assert ours.state[qs[0]]["state1"].dtype == torch.uint8 and ours.state[qs[3]]["state1"].dtype == torch.float32


def test_a_changed_update_is_caught():
    """(The comparison above can fail: one ulp more of beta2 changes the bits.)"""
    bnb = _bnb()
    ps, qs = _params(), _params()
    theirs = bnb.optim.AdamW8bit(ps, lr=LR)
    ours = AdamW8bit(qs, lr=LR, betas=(0.9, float(torch.nextafter(torch.tensor(0.999), torch.tensor(1.0)))))
    for step in range(3):
        _step(theirs, ps, step)
        _step(ours, qs, step)
    with pytest.raises(AssertionError):
        _assert_same_weights(ps, qs)
        _assert_same_state_dicts(theirs.state_dict(), ours.state_dict())


def _offloaded(params, **kw):
    return CPUOffloadOptimizer(params, optimizer_cls="offload_plugin.AdamW8bit", lr=LR, **kw)


@pytest.mark.parametrize("streaming", [False, True])
def test_through_the_offload_optimizer_it_is_bitsandbytes(monkeypatch, streaming):
    """The host update of the host copies, and the streamed update's code run on the host
    (units of 2048 elements: the large weights in ranges), against bitsandbytes; the state
    dict is its layout."""
    bnb = _bnb()
    monkeypatch.setattr(streamed.config, "enabled", streaming)
    monkeypatch.setattr(streamed.config, "on_cpu", streaming)
    monkeypatch.setattr(streamed.config, "stage_numel", 512)  # (8-bit units of 2048 elements: stage_scale)
    ps, qs = _params(), [nn.Parameter(p) for p in _params()]
    theirs = bnb.optim.AdamW8bit(ps, lr=LR)
    ours = _offloaded(qs)
    assert ours.engine.streams == streaming
    for step in range(5):
        _step(theirs, ps, step)
        _step(ours, qs, step)
    ours.finish_step()
    _assert_same_weights(ps, qs)
    _assert_same_state_dicts(theirs.state_dict(), ours.state_dict())


def test_a_unit_of_a_whole_parameter_is_staged_in_two_copies_each_way(monkeypatch):
    """The host state of a unit holding a whole parameter lies side by side (the two scales,
    the two codes, for a parameter of whole 4096-element lines of scales): two copies each
    way, each landing where the kernel reads each part; a unit of a range of a larger
    parameter takes four."""
    from offload_plugin.formats.adamw8bit import streamed as adamw8bit_streamed

    monkeypatch.setattr(streamed.config, "enabled", True)
    monkeypatch.setattr(streamed.config, "on_cpu", True)
    monkeypatch.setattr(streamed.config, "stage_numel", 1024)  # (8-bit units of 4096 elements)
    torch.manual_seed(0)
    qs = [nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in ((32, 128), (64, 128))]
    opt = _offloaded(qs)
    for p in qs:
        p.grad = torch.randn_like(p)
    opt.step()
    units = [u for plan in opt.engine._plans.values() for u in plan.units if u.eight_bit]
    counts = {}
    for unit in units:
        raw = torch.zeros(adamw8bit_streamed.stage_layout(8192)[1][0], dtype=torch.uint8)
        staged = adamw8bit_streamed._stage_views(unit, raw, 64)
        copies = adamw8bit_streamed._copies(staged, unit.host)
        for to, source in copies:
            to.copy_(source)
        assert all(torch.equal(s, h) for s, h in zip(staged, unit.host))
        whole = unit.numel == unit.slot.param.numel()
        counts.setdefault(whole, set()).add(len(copies))
    assert counts == {True: {2}, False: {4}}, counts


def test_a_nonfinite_step_is_skipped_by_the_streamed_update_as_by_the_host_update(monkeypatch):
    results = []
    for streaming in (False, True):
        monkeypatch.setattr(streamed.config, "enabled", streaming)
        monkeypatch.setattr(streamed.config, "on_cpu", streaming)
        qs = [nn.Parameter(p) for p in _params()]
        opt = _offloaded(qs)
        for step in range(4):
            for p, g in zip(qs, _grads(step)):
                p.grad = g
            if step == 2:
                qs[1].grad[0, 0] = float("inf")
            opt.step()
        opt.finish_step()
        results.append((qs, opt.state_dict()))
    (host, host_sd), (ours, sd) = results
    _assert_same_weights(host, ours)
    _assert_same_state_dicts(host_sd, sd)
    assert sd["state"][0]["step"] == 3


# ---------------------------------------------------------------------------- stochastic rounding
def test_stochastic_rounding_is_unbiased_and_keeps_updates_rounding_to_nearest_loses():
    """Values an eighth of a bf16 step above 1.0 round up an eighth of the time; steps of a
    tenth of a bf16 step move the weights by about as much on average, where rounding to
    nearest (bitsandbytes' update) leaves them where they were."""
    x = torch.full((1 << 20,), 1.0 + 2.0 ** -10)
    up = float((adamw8bit.round_weight(x, 5.0, 0, x.numel()).float() > 1.0).float().mean())
    assert abs(up - 0.125) < 0.002, up
    assert torch.equal(adamw8bit.round_weight(x, -1.0, 0, x.numel()), x.to(torch.bfloat16))
    moved = {}
    for sr in (False, True):
        w = torch.ones(1 << 16, dtype=torch.bfloat16)
        opt = AdamW8bit([w], lr=2.0 ** -8 / 10, weight_decay=0.0, stochastic_rounding=sr)
        for _ in range(20):  # (Adam's steps are about lr each: 20 steps of a tenth of 2**-8)
            w.grad = -torch.ones_like(w)
            opt.step()
        moved[sr] = float(w.float().mean()) - 1.0
    assert moved[False] == 0.0
    assert abs(moved[True] - 20 * 2.0 ** -8 / 10) < 0.1 * 20 * 2.0 ** -8 / 10, moved


@pytest.mark.parametrize("shape", [(9, 512), (5, 16)], ids=["8-bit", "32-bit"])
def test_stochastic_rounding_of_row_shards_is_the_whole_parameters(shape):
    """FSDP2 shards (told their place by shard_of) round as the whole parameter does: the
    rounding hashes each element's place in its parameter, not in its shard."""
    torch.manual_seed(0)
    whole = torch.randn(shape).to(torch.bfloat16)
    rows = [whole[:shape[0] // 2 + 1].clone(), whole[shape[0] // 2 + 1:].clone()]
    kw = dict(lr=LR, stochastic_rounding=True, min_8bit_size=0 if shape[1] % 256 == 0 else 4096)
    opt = AdamW8bit([whole], **kw)
    shards = [AdamW8bit([part], **kw) for part in rows]
    for shard, part, first in zip(shards, rows, (0, rows[0].shape[0])):
        shard.shard_of(part, shape, first)
    for step in range(3):
        grad = _grads(step, [shape])[0]
        whole.grad = grad
        opt.step()
        for shard, part, g in zip(shards, rows, grad.split([r.shape[0] for r in rows])):
            part.grad = g.clone()
            shard.step()
    _assert_same_weights([whole], [torch.cat(rows)])


def test_stochastic_rounding_streamed_is_the_host_update_bit_for_bit(monkeypatch):
    """The streamed code (run on the host, in ranges) rounds each element as the host update
    does: the random bits follow the element's place in its parameter, not the unit's."""
    results = []
    for streaming in (False, True):
        monkeypatch.setattr(streamed.config, "enabled", streaming)
        monkeypatch.setattr(streamed.config, "on_cpu", streaming)
        monkeypatch.setattr(streamed.config, "stage_numel", 512)  # (8-bit units of 2048 elements: stage_scale)
        qs = [nn.Parameter(p) for p in _params()]
        opt = _offloaded(qs, stochastic_rounding=True, min_8bit_size=1024)
        for step in range(4):
            _step(opt, qs, step)
        opt.finish_step()
        results.append((qs, opt.state_dict()))
    (host, host_sd), (ours, sd) = results
    _assert_same_weights(host, ours)
    _assert_same_state_dicts(host_sd, sd)
    plain = [nn.Parameter(p) for p in _params()]
    _run(lambda ps: _offloaded(ps, min_8bit_size=1024), 4, params=plain)
    with pytest.raises(AssertionError):  # (it is not bitsandbytes' rounding)
        _assert_same_weights(plain, ours)


# ---------------------------------------------------------------------------- checkpoints
def test_a_one_block_tensors_checkpoint_loads_whatever_block_its_one_scale_could_mean():
    """8-bit state of tensors of at most 256 elements (min_8bit_size=0) has one scale, which
    fits blocks of 64, 128 or 256 alike: bitsandbytes' checkpoint and ours load, and the run
    goes on as bitsandbytes' does (they were refused as blocks of 64 or 128)."""
    bnb = _bnb()
    shapes = [(32,), (100,), (16, 16), (300,)]
    torch.manual_seed(0)
    start = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    ps, qs = [nn.Parameter(t.clone()) for t in start], [nn.Parameter(t.clone()) for t in start]
    theirs = bnb.optim.AdamW8bit(ps, lr=LR, min_8bit_size=0)
    for step in range(4):
        if step == 2:  # (ours takes over bitsandbytes' run here, then reloads its own state)
            with torch.no_grad():
                for p, q in zip(ps, qs):
                    q.copy_(p)
            ours = AdamW8bit(qs, lr=LR, min_8bit_size=0)
            ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
            again = AdamW8bit(qs, lr=LR, min_8bit_size=0)
            again.load_state_dict(copy.deepcopy(ours.state_dict()))
        for opt, params in ((theirs, ps),) + (((again, qs),) if step >= 2 else ()):
            for p, g in zip(params, _grads(step, shapes)):
                p.grad = g.clone()
            opt.step()
    _assert_same_weights(ps, qs)
    _assert_same_state_dicts(theirs.state_dict(), again.state_dict())


def _run(make, steps, start=0, params=None):
    opt = make(params if params is not None else _params())
    params = [p for g in opt.param_groups for p in g["params"]]  # (the offload optimizer's own)
    for step in range(start, start + steps):
        _step(opt, params, step)
    return params, opt


@pytest.mark.parametrize("through", ["direct", "offload"])
@pytest.mark.parametrize("other", ["AdamW8bit", "PagedAdamW8bit"])
def test_each_side_continues_the_others_run_exactly(through, other):
    """Ours continues a bitsandbytes run, and bitsandbytes continues ours, each as the
    uninterrupted run of the other goes on."""
    bnb = _bnb()
    theirs_cls = getattr(bnb.optim, other)

    def ours_cls(ps):
        return AdamW8bit(ps, lr=LR) if through == "direct" else _offloaded([nn.Parameter(p) for p in ps])

    def weights(opt):
        return [p for g in opt.param_groups for p in g["params"]]

    with pytest.warns(UserWarning, match="Paged") if other == "PagedAdamW8bit" else _nothing():
        for first, second in ((theirs_cls, ours_cls), (ours_cls, lambda ps: theirs_cls(ps, lr=LR))):
            make_first = (lambda ps: theirs_cls(ps, lr=LR)) if first is theirs_cls else first
            _, whole = _run(make_first, 6)
            _, half = _run(make_first, 3)
            resumed_params = [p.detach().clone() for p in weights(half)]
            resumed = second(resumed_params)
            resumed.load_state_dict(copy.deepcopy(half.state_dict()))
            params = weights(resumed)
            for step in range(3, 6):
                _step(resumed, params, step)
            if hasattr(resumed, "finish_step"):
                resumed.finish_step()
            _assert_same_weights(weights(whole), params)
            _assert_same_state_dicts(whole.state_dict(), resumed.state_dict())


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_resume_of_our_own_checkpoint_is_exact(monkeypatch):
    monkeypatch.setattr(streamed.config, "enabled", False)
    whole_params = [nn.Parameter(p) for p in _params()]
    _, whole = _run(_offloaded, 6, params=whole_params)
    half_params = [nn.Parameter(p) for p in _params()]
    _, half = _run(_offloaded, 3, params=half_params)
    sd = copy.deepcopy(half.state_dict())
    again = [nn.Parameter(p.detach().clone()) for p in half_params]
    resumed = _offloaded(again)
    resumed.load_state_dict(sd)
    for step in range(3, 6):
        _step(resumed, again, step)
    _assert_same_weights(whole_params, again)
    _assert_same_state_dicts(whole.state_dict(), resumed.state_dict())


def _corruptions():
    BIG, SMALL = 0, 3

    def quant(i, **changes):
        return lambda sd: sd["state"][i][WRAPPED].update({k: f(sd["state"][i][WRAPPED]) for k, f in changes.items()})

    def ulp(q):
        q = q.clone()
        q[200] = torch.nextafter(q[200], torch.tensor(2.0))
        return q

    return {
        "a map one ulp off": (quant(BIG, qmap1=lambda q: ulp(q["qmap1"])), r"'qmap1'\) is not bitsandbytes' signed dynamic map"),
        "2048-element blocks": (quant(BIG, absmax1=lambda q: q["absmax1"][:4], absmax2=lambda q: q["absmax2"][:4]),
                                "one absmax per 2048 elements"),
        "block sizes mixed": (quant(BIG, absmax1=lambda q: q["absmax1"][:4]), "two block sizes"),
        "NaN absmax": (quant(BIG, absmax2=lambda q: q["absmax2"] * float("nan")), r"'absmax2'\) holds 32 inf or NaN"),
        "transposed codes": (quant(BIG, state1=lambda q: q["state1"].t().contiguous()), r"'state1'\) has shape \(128, 64\)"),
        "negative 32-bit second moment": (quant(SMALL, state2=lambda q: -q["state2"] - 1), r"'state2'\) holds negative"),
        "fp16 small state": (quant(SMALL, state1=lambda q: q["state1"].half()), r"'state1'\) has dtype torch.float16"),
        "fractional step": (lambda sd: sd["state"][BIG].update(step=2.5), r"'step'\) is 2.5"),
        "unwrapped with an extra key": (lambda sd: sd["state"][BIG].update(extra=1), "has the keys"),
        "AdEMAMix group": (lambda sd: sd["param_groups"][0].update(alpha=5.0), "alpha=5.0.*AdEMAMix"),
        "amsgrad group": (lambda sd: sd["param_groups"][0].update(amsgrad=True), "amsgrad=True"),
        "maximize group (torch's key)": (lambda sd: sd["param_groups"][0].update(maximize=True), "maximize=True"),
        "Adam's L2 decay (torch's key)": (lambda sd: sd["param_groups"][0].update(decoupled_weight_decay=False),
                                          "decoupled_weight_decay=False"),
        "an unknown parameter index": (lambda sd: sd["state"].update({99: sd["state"][BIG]}), "99"),
    }


@pytest.mark.parametrize("through", ["direct", "offload"])
@pytest.mark.parametrize("case", list(_corruptions()))
def test_a_malformed_checkpoint_is_refused_with_nothing_changed(case, through):
    corrupt, message = _corruptions()[case]
    _, saved = _run(lambda ps: AdamW8bit(ps, lr=LR), 2)
    bad = copy.deepcopy(saved.state_dict())
    corrupt(bad)
    params = [nn.Parameter(p) for p in _params(1)]
    opt = AdamW8bit(params, lr=LR) if through == "direct" else _offloaded(params)
    _step(opt, params, 0)  # (state to keep)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(bad)
    assert_unchanged(before, snapshot(opt))


# ---------------------------------------------------------------------------- refusals and copies
@pytest.mark.parametrize("kw, message", [
    (dict(amsgrad=True), "amsgrad=False"), (dict(optim_bits=4), "optim_bits=32 or 8"),
    (dict(percentile_clipping=5), "percentile_clipping=100"), (dict(block_wise=False), "block_wise=True"),
    (dict(lr=float("inf")), "lr"), (dict(eps=-1.0), "eps"), (dict(betas=(0.9, 1.0)), "beta"),
    (dict(min_8bit_size=-1), "min_8bit_size"), (dict(no_such=1), "unexpected keyword"),
])
def test_settings_of_another_update_are_refused(kw, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AdamW8bit(_params(), **kw)


def test_bitsandbytes_config_arguments_that_change_nothing_are_taken():
    AdamW8bit(_params(), lr=LR, is_paged=True, optim_bits=8, percentile_clipping=100, block_wise=True, fused=True)


@pytest.mark.parametrize("edit, message", [
    (lambda p: setattr(p, "data", p.data.float()), "bf16"),  # (fp32, its gradient too)
    (lambda p: setattr(p, "data", torch.zeros(4, 7, dtype=torch.bfloat16)), "shaped like its parameter"),
], ids=["dtype", "shape"])
def test_a_refused_step_changes_nothing(edit, message):
    """The last parameter's (the others would be updated first) made unusable after its
    gradient was set: torch refuses such a .grad itself, a .data replacement gets past it."""
    params = _params()
    opt = AdamW8bit(params, lr=LR)
    _step(opt, params, 0)
    before = [p.clone() for p in params], copy.deepcopy(opt.state_dict())
    for p, g in zip(params, _grads(1)):
        p.grad = g
    edit(params[-1])
    if params[-1].dtype == torch.float32:
        params[-1].grad = None
        params[-1].grad = _grads(1)[-1].float()
    with pytest.raises(ValueError, match=message):
        opt.step()
    _assert_same_weights(before[0][:-1], params[:-1])
    _assert_same_state_dicts(before[1], opt.state_dict())


@pytest.mark.parametrize("through", ["direct", "host", "streamed"])
@pytest.mark.parametrize("edit, message", [
    (dict(betas=(1.0, 0.999)), "betas"),  # (beta1 = 1: the bias correction divides by zero)
    (dict(lr=float("nan")), "lr"),
    (dict(stochastic_rounding="False"), "stochastic_rounding"),  # (a string is not False)
])
def test_a_group_edited_to_settings_the_constructor_refuses_is_refused_before_any_update(
        monkeypatch, through, edit, message):
    """Edited into the last group, so that the other groups would be updated first."""
    monkeypatch.setattr(streamed.config, "enabled", through == "streamed")
    monkeypatch.setattr(streamed.config, "on_cpu", through == "streamed")
    params = [nn.Parameter(p) for p in _params()]
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": LR / 2}]
    opt = (AdamW8bit(groups, lr=LR) if through == "direct"
           else CPUOffloadOptimizer(groups, optimizer_cls="offload_plugin.AdamW8bit", lr=LR))
    _step(opt, params, 0)
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    opt.param_groups[-1].update(edit)
    with pytest.raises(ValueError, match=message):
        _step(opt, params, 1)
    _assert_same_weights(before[0], params)
    opt.param_groups[-1].update({k: before[1]["param_groups"][-1][k] for k in edit})
    _assert_same_state_dicts(before[1], opt.state_dict())


def test_a_group_added_with_settings_the_constructor_refuses_is_refused():
    params = _params()
    opt = AdamW8bit(params[:2], lr=LR)
    with pytest.raises(ValueError, match="betas"):
        opt.add_param_group({"params": params[2:], "betas": (1.0, 0.999)})
    assert len(opt.param_groups) == 1


def test_a_state_dict_is_the_callers_to_change():
    """The maps in a state dict are its own: a loader that writes into it in place (as
    torch.distributed.checkpoint does) changes neither other checkpoints nor the update."""
    params = _params()
    opt = AdamW8bit(params, lr=LR)
    _step(opt, params, 0)
    sd = opt.state_dict()
    saved = copy.deepcopy(sd)
    sd["state"][0][WRAPPED]["qmap1"].add_(1.0)
    _assert_same_state_dicts(saved, opt.state_dict())


@pytest.mark.parametrize("through", ["direct", "offload"])
def test_a_step_count_an_fp32_count_cannot_hold_is_refused(through):
    """bitsandbytes counts in a Python int; ours in fp32, as torch does: 2**24 + 1 would
    load as 2**24 and stop advancing."""
    params = _params()
    opt = AdamW8bit(params, lr=LR)
    _step(opt, params, 0)
    sd = opt.state_dict()
    sd["state"][0]["step"] = 2**24 + 1
    target = AdamW8bit(_params(), lr=LR) if through == "direct" else _offloaded([nn.Parameter(p) for p in _params()])
    with pytest.raises(ValueError, match="cannot be kept exactly"):
        target.load_state_dict(sd)
    assert not target.state_dict()["state"]


def test_a_hand_edited_entry_is_refused_before_any_update():
    params = _params()
    opt = AdamW8bit(params, lr=LR)
    _step(opt, params, 0)
    opt.state[params[-1]]["absmax1"] = torch.zeros(1)  # (a 32-bit entry given a scale: fine) ...
    opt.state[params[0]]["absmax1"] = torch.zeros(3)  # ... but a short scale would be read past its end
    before = [p.clone() for p in params]
    with pytest.raises(ValueError, match="'absmax1' is a torch.float32 tensor of shape \\(3,\\)"):
        _step(opt, params, 1)
    _assert_same_weights(before, params)


@pytest.mark.parametrize("copy_with", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_a_copy_steps_as_the_original(copy_with):
    params = _params()
    opt = AdamW8bit(params, lr=LR)
    _step(opt, params, 0)
    twin = copy_with(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for step in (1, 2):
        _step(opt, params, step)
        _step(twin, twin_params, step)
    _assert_same_weights(params, twin_params)
    _assert_same_state_dicts(opt.state_dict(), twin.state_dict())


def test_the_host_memory_preflight_counts_its_two_bytes_of_state(monkeypatch):
    """With room for 7 bytes per parameter, AdamW8bit's host update (weight, gradient and 2
    bytes of state: 6) is built, the default's (weight, gradient and bf16 moments: 8) refused."""
    from offload_plugin import HostMemoryError
    from offload_plugin.host import memory as host_memory

    monkeypatch.setattr(streamed.config, "enabled", False)
    params = [nn.Parameter(torch.zeros(64, 1024, dtype=torch.bfloat16))]
    monkeypatch.setattr(host_memory, "available_bytes", lambda: (7 * params[0].numel(), "a test limit"))
    _offloaded(params)
    with pytest.raises(HostMemoryError):
        CPUOffloadOptimizer(params, lr=LR)


def test_a_scheduler_drives_it_through_the_offload_optimizer(monkeypatch):
    monkeypatch.setattr(streamed.config, "enabled", False)
    params = [nn.Parameter(p) for p in _params()]
    opt = _offloaded(params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    for step in range(3):
        _step(opt, params, step)
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LR / 8)


# ---------------------------------------------------------------------------- on a GPU
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the Triton kernels and the streams")


@CUDA
@pytest.mark.parametrize("stochastic_rounding", [False, True])
@pytest.mark.parametrize("min_8bit_size", [4096, 0, 10**6])
def test_gpu_streamed_adamw8bit_has_the_host_updates_bits(monkeypatch, min_8bit_size, stochastic_rounding):
    """The Triton kernels with the state streamed through small staging buffers, against the
    host update on the same gradients (an inf in one at step 2: skipped): every weight and
    state byte, the 32-bit kernel too (min_8bit_size=4096; 10**6: every tensor in 32 bits,
    the large ones in ranges a staging pair holds)."""
    monkeypatch.setattr(streamed.config, "stage_numel", 512)  # (8-bit units of 2048 elements: stage_scale)
    results = []
    for device in ("cpu", "cuda"):
        monkeypatch.setattr(streamed.config, "on_cpu", device == "cpu")
        params = [nn.Parameter(p.to(device)) for p in _params()]
        opt = _offloaded(params, min_8bit_size=min_8bit_size, stochastic_rounding=stochastic_rounding)
        assert opt.engine.streams and opt.engine.format.name == "adamw8bit"
        for step in range(5):
            for p, g in zip(params, _grads(step)):
                p.grad = g.to(device)
            if step == 2:
                params[1].grad[0, 0] = float("inf")
            opt.step()
            opt.zero_grad()
        opt.finish_step()
        results.append(([p.detach().cpu() for p in params], opt.state_dict()))
    (host, host_sd), (gpu, gpu_sd) = results
    _assert_same_weights(host, gpu)
    _assert_same_state_dicts(host_sd, gpu_sd)
    assert gpu_sd["state"][0]["step"] == 4


# ---------------------------------------------------------------------------- torchtune's stock recipe
@pytest.mark.slow  # (runs a recipe twice: left out of the quick lane)
@pytest.mark.parametrize("in_bwd", [True, False], ids=["optimizer_in_bwd", "step-after-backward"])
def test_torchtune_stock_full_recipe_with_adamw8bit_is_bitsandbytes(tmp_path, in_bwd):
    """torchtune's own full_finetune_single_device on the bf16 demo model, once with
    bitsandbytes' AdamW8bit and once with only the optimizer overridden to ours: the same
    losses and the same final weights, bit for bit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    from disk_log import read_log

    _bnb()
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), PYTHONUNBUFFERED="1")
    subprocess.run([sys.executable, "-m", "offload_plugin.demo", "prepare", "--output-dir", str(tmp_path / "demo")],
                   env=env, check=True, capture_output=True)
    settings = {"lr": 2e-3, "weight_decay": 0.01}
    runs = {}
    for name, optimizer in {
        "bitsandbytes": {"_component_": "bitsandbytes.optim.AdamW8bit", **settings},
        "ours": {"_component_": "offload_plugin.CPUOffloadOptimizer", "optimizer_cls": "offload_plugin.AdamW8bit",
                 **settings},
    }.items():
        cfg = OmegaConf.load(repo / "configs" / "demo" / "tiny_full_offload.yaml")
        cfg.optimizer = optimizer
        config, out = tmp_path / f"{name}.yaml", tmp_path / name
        OmegaConf.save(cfg, config)
        cmd = [sys.executable, "-m", "torchtune._cli.tune", "run", "full_finetune_single_device",
               "--config", str(config), f"demo_dir={tmp_path / 'demo'}", f"output_dir={out}", "dtype=bf16",
               "batch_size=4", "max_steps_per_epoch=8", f"optimizer_in_bwd={in_bwd}", "clip_grad_norm=null",
               "metric_logger.filename=log.txt"]
        proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses = [m["loss"] for _, m in sorted(read_log(out).items())]
        (checkpoint,) = [f for f in out.rglob("*") if f.suffix in (".pt", ".bin", ".safetensors")
                         and "optim" not in f.name and "recipe" not in f.name]
        runs[name] = losses, torch.load(checkpoint, map_location="cpu", weights_only=True)
    (their_losses, theirs), (our_losses, ours) = runs["bitsandbytes"], runs["ours"]
    assert len(our_losses) == 8 and our_losses == their_losses
    assert sum(our_losses[-3:]) < sum(our_losses[:3])  # (it trains: the weights compared moved)
    assert theirs.keys() == ours.keys()
    for key in theirs:
        assert torch.equal(_bits(theirs[key]), _bits(ours[key])), key
