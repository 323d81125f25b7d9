"""bitsandbytes' AdamW8bit and PagedAdamW8bit state dicts in CompactAdamW (issue 40).

A real bitsandbytes run on CPU tensors (bitsandbytes 0.50 runs there; the paged optimizer
falls back to plain buffers) loads as it is, into CompactAdamW used directly and through
CPUOffloadOptimizer, and continues as bitsandbytes continues itself: 32-bit state (tensors
under its min_8bit_size) the same, 8-bit moments within their quantization. Every field
bitsandbytes would not write is refused, naming the entry and key, with nothing changed.
"""

import copy

import pytest
import torch

from offload_plugin import CompactAdamW, CPUOffloadOptimizer
from offload_plugin.formats.compact import native as compact_adam
from state_snapshot import assert_unchanged, snapshot

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")

LR = 1e-3
CLASSES = {"AdamW8bit": bnb.optim.AdamW8bit, "PagedAdamW8bit": bnb.optim.PagedAdamW8bit}
WRAPPED = "__bnb_optimizer_quant_state__"
BIG, SMALL = 0, 2  # (64, 128): 8-bit in bitsandbytes; (16, 64): 32-bit (under 4096 elements)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16)).to(torch.bfloat16)


def _set_grads(params, step):
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)


def _bnb_run(name, steps=4):
    model = _model()
    opt = CLASSES[name](model.parameters(), lr=LR)
    for step in range(steps):
        _set_grads(model.parameters(), step)
        opt.step()
    return model, opt


def _target(through, model):
    if through == "CompactAdamW":
        return CompactAdamW(model.parameters(), lr=LR)
    return CPUOffloadOptimizer(model.parameters(), optimizer_cls=CompactAdamW, lr=LR)


def _bnb_moments(entry, n):
    """bitsandbytes' moments as it defines them: a code's value in its map times the block's
    absmax (256 per block), or the fp32 state it keeps for small tensors."""
    q = entry[WRAPPED]
    if q["state1"].dtype != torch.uint8:
        return q["state1"].reshape(-1), q["state2"].reshape(-1)
    return tuple(q[f"qmap{k}"][q[f"state{k}"].reshape(-1).long()] * q[f"absmax{k}"].repeat_interleave(256)[:n]
                 for k in (1, 2))


def _our_moments(entry):
    if "exp_avg_absmax" not in entry:
        return entry["exp_avg"].reshape(-1), entry["exp_avg_sq"].reshape(-1)
    return tuple(compact_adam.dequantize(entry[k].reshape(-1), entry[f"{k}_absmax"].reshape(-1), signed)
                 for k, signed in (("exp_avg", True), ("exp_avg_sq", False)))


def _assert_same_moments(theirs: dict, ours: dict, params) -> None:
    for index, p in enumerate(params):
        for mine, want in zip(_our_moments(ours[index]), _bnb_moments(theirs[index], p.numel())):
            if p.numel() < 4096:  # kept in fp32 by both: the same update, in another operation order
                torch.testing.assert_close(mine, want, rtol=1e-4, atol=0)
            else:  # requantized with our map: within a few quantization steps
                assert (mine - want).abs().max() <= 0.04 * want.abs().max(), index
        assert float(ours[index]["step"]) == theirs[index]["step"]


@pytest.mark.parametrize("through", ["CompactAdamW", "CPUOffloadOptimizer"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_a_bitsandbytes_state_dict_loads_as_it_is_and_continues_as_bitsandbytes(name, through):
    """Used directly, CompactAdamW crashed on it after wiping its state (issue 40)."""
    model, theirs = _bnb_run(name)
    ours_model = copy.deepcopy(model)
    ours = _target(through, ours_model)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    _assert_same_moments(theirs.state_dict()["state"], ours.state_dict()["state"], list(model.parameters()))
    for step in range(4, 8):
        for m, o in ((model, theirs), (ours_model, ours)):
            _set_grads(m.parameters(), step)
            o.step()
    _assert_same_moments(theirs.state_dict()["state"], ours.state_dict()["state"], list(model.parameters()))
    for p, q in zip(model.parameters(), ours_model.parameters()):
        # (bitsandbytes rounds each update into the bf16 weight; ours keeps the fp32 master)
        assert (p.float() - q.float()).abs().max() <= 3 * LR


def _corruptions():
    def quant(i, **changes):
        return lambda sd: sd["state"][i][WRAPPED].update(
            {k: v(sd["state"][i][WRAPPED]) for k, v in changes.items()})

    def set_value(key, index, value):
        def apply(sd):
            t = sd["state"][BIG][WRAPPED][key].clone()
            t.reshape(-1)[index] = value
            sd["state"][BIG][WRAPPED][key] = t
        return apply

    def dequantized_fp16(q):
        return (q["qmap1"][q["state1"].long()].reshape(-1)
                * q["absmax1"].repeat_interleave(256)).reshape(q["state1"].shape).half()

    def without_maps(sd):
        q = sd["state"][BIG][WRAPPED]
        q["state1"] = dequantized_fp16(q)
        for key in ("qmap1", "qmap2", "absmax1", "absmax2"):
            del q[key]

    def step(value):
        return lambda sd: sd["state"][BIG].update(step=value)

    # (each message names the entry and the key)
    BIG_AT, SMALL_AT = f"state entry {BIG} \\(", f"state entry {SMALL} \\("

    return {
        "int64 codes": (quant(BIG, state1=lambda q: q["state1"].long()), BIG_AT + "'state1'\\) has dtype torch.int64"),
        "fp16 state1 beside uint8 state2": (quant(BIG, state1=dequantized_fp16), BIG_AT + "'state1'\\) has dtype torch.float16"),
        "fp16 state1, uint8 state2, no maps": (without_maps, BIG_AT + "'state1'\\) has dtype torch.float16"),
        "int32 state1 on a small tensor": (quant(SMALL, state1=lambda q: q["state1"].int()), SMALL_AT + "'state1'\\) has dtype torch.int32"),
        "transposed codes": (quant(BIG, state1=lambda q: q["state1"].t().contiguous(),
                                   state2=lambda q: q["state2"].t().contiguous()), BIG_AT + "'state1'\\) has shape \\(128, 64\\)"),
        "transposed 32-bit state": (quant(SMALL, state2=lambda q: q["state2"].t().contiguous()), SMALL_AT + "'state2'\\) has shape \\(64, 16\\)"),
        "flat codes": (quant(BIG, state2=lambda q: q["state2"].reshape(-1)), BIG_AT + "'state2'\\) has shape \\(8192,\\)"),
        "short absmax": (quant(BIG, absmax1=lambda q: q["absmax1"][:-1]), BIG_AT + "'absmax1'\\) has shape \\(31,\\)"),
        "NaN absmax": (set_value("absmax1", 3, float("nan")), BIG_AT + "'absmax1'\\) holds 1 inf or NaN"),
        "negative absmax": (set_value("absmax1", 3, -1.0), BIG_AT + "'absmax1'\\) holds negative"),
        "inf absmax2": (set_value("absmax2", 0, float("inf")), BIG_AT + "'absmax2'\\) holds 1 inf or NaN"),
        "NaN qmap1": (set_value("qmap1", 200, float("nan")), BIG_AT + "'qmap1'\\) holds 1 inf or NaN"),
        "negated qmap2": (quant(BIG, qmap2=lambda q: -q["qmap2"]), BIG_AT + "'qmap2'\\) is not an unsigned dynamic map"),
        "maps swapped": (quant(BIG, qmap1=lambda q: q["qmap2"], qmap2=lambda q: q["qmap1"]), BIG_AT + "'qmap1'\\) is not a signed"),
        "map not up to 1": (quant(BIG, qmap1=lambda q: q["qmap1"] * 0.5), BIG_AT + "'qmap1'\\) is not a signed"),
        "fp64 map": (quant(BIG, qmap2=lambda q: q["qmap2"].double()), BIG_AT + "'qmap2'\\) has dtype torch.float64"),
        "negative 32-bit second moment": (quant(SMALL, state2=lambda q: -q["state2"] - 1), SMALL_AT + "'state2'\\) holds negative"),
        "NaN 32-bit first moment": (quant(SMALL, state1=lambda q: q["state1"] * float("nan")), SMALL_AT + "'state1'\\) holds 1024 inf or NaN"),
        "update-norm state (max_unorm)": (quant(BIG, unorm_vec=lambda q: torch.zeros(1)), f"state entry {BIG} holds .*'unorm_vec'"),
        "no qmap2": (lambda sd: sd["state"][BIG][WRAPPED].pop("qmap2"), f"state entry {BIG} holds \\['absmax1', 'absmax2', 'qmap1', 'state1', 'state2'\\]"),
        "NaN step": (step(float("nan")), BIG_AT + "'step'\\) is nan"),
        "negative step": (step(-1), BIG_AT + "'step'\\) is -1"),
        "fractional step": (step(2.5), BIG_AT + "'step'\\) is 2.5"),
        "step as text": (step("4"), BIG_AT + "'step'\\) is '4'"),
        "AdEMAMix group": (lambda sd: sd["param_groups"][0].update(alpha=5.0), "alpha=5.0.*AdEMAMix"),
    }


@pytest.mark.parametrize("through", ["CompactAdamW", "CPUOffloadOptimizer"])
@pytest.mark.parametrize("case", list(_corruptions()))
def test_a_malformed_bitsandbytes_entry_is_refused_with_nothing_changed(case, through):
    """Each was read as something else before (codes as moment values, raw codes as the
    second moment, a frozen or zeroed block, ...) or crashed after changing the state."""
    corrupt, message = _corruptions()[case]
    _, theirs = _bnb_run("AdamW8bit", steps=2)
    bad = copy.deepcopy(theirs.state_dict())
    corrupt(bad)
    model = _model()
    opt = _target(through, model)
    _set_grads(model.parameters(), 0)
    opt.step()  # (state to keep)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(bad)
    assert_unchanged(before, snapshot(opt))


def test_from_bnb_refuses_what_bitsandbytes_does_not_write():
    """compact_adam.from_bnb reads through the same checks."""
    model, theirs = _bnb_run("AdamW8bit", steps=1)
    entry = copy.deepcopy(theirs.state_dict()["state"][BIG])
    p = next(model.parameters()).detach()
    assert compact_adam.from_bnb(p, entry).step == 1
    entry[WRAPPED]["state1"] = entry[WRAPPED]["state1"].long()
    with pytest.raises(ValueError, match="'state1'\\) has dtype torch.int64"):
        compact_adam.from_bnb(p, entry)


def test_this_optimizers_master_setting_holds_where_bitsandbytes_has_none():
    """A bitsandbytes group has no "master": CPUOffloadOptimizer took CompactAdamW's default
    (True) for it, so master=False became True and every entry got a remainder."""
    model, theirs = _bnb_run("AdamW8bit", steps=1)
    for opt in (CPUOffloadOptimizer(copy.deepcopy(model).parameters(), optimizer_cls=CompactAdamW, lr=LR, master=False),
                CompactAdamW(copy.deepcopy(model).parameters(), lr=LR, master=False)):
        opt.load_state_dict(copy.deepcopy(theirs.state_dict()))
        assert opt.param_groups[0]["master"] is False
        assert not any("remainder" in entry for entry in opt.state_dict()["state"].values())


@pytest.mark.parametrize("writer, says", [
    ("offload_plugin.AdamW8bit", "optimizer_cls=offload_plugin.AdamW8bit"),
    ("offload_plugin.CompactAdamW", "optimizer_cls=offload_plugin.CompactAdamW"),
])
def test_an_eight_bit_checkpoint_in_the_default_mode_is_refused_naming_its_writer(writer, says):
    """The refusal says which class loads it, and the conversion it may suggest refuses a
    layout it does not convert instead of crashing."""
    from offload_plugin.formats.compact.optimizer import to_adamw_state_dict

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 80).to(torch.bfloat16))]
    opt = CPUOffloadOptimizer(params, optimizer_cls=writer, lr=1e-3)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    saved = opt.state_dict()
    default = CPUOffloadOptimizer([torch.nn.Parameter(params[0].detach().clone())], lr=1e-3)
    before = snapshot(default)
    with pytest.raises(ValueError, match=f"another optimizer class.*{says}"):
        default.load_state_dict(saved)
    assert_unchanged(before, snapshot(default))
    if writer.endswith("AdamW8bit"):
        with pytest.raises(ValueError, match="not CompactAdamW's state.*offload_plugin.AdamW8bit"):
            to_adamw_state_dict(saved, params)
