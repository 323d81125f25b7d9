"""The table of valid combinations (``offload_plugin.options.COMBINATIONS``): docs/options.md
shows it as generated, and the public API refuses or accepts each combination, on the
engine, that its row says. Each row has a case here whose outcome (refused, accepted, which
engine) is written out, not read from the table, so that a rule changed in the table alone
fails; a refusal's message must be its row's, word for word; a row without a case fails."""

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer, CompactAdamW, options
from offload_plugin.engines import streamed
from offload_plugin.formats.compact import streamed as compact_streamed
from offload_plugin.options import COMBINATIONS, HOST, REFUSED, STREAMED

DOCS = Path(__file__).resolve().parent.parent / "docs" / "options.md"
BEGIN = "<!-- Generated from offload_plugin/options.py (COMBINATIONS)"
END = "<!-- end of the generated table -->"


def _rule(combination: str) -> options.Rule:
    (rule,) = [r for r in COMBINATIONS if r.combination == combination]
    return rule


def _docs_table(text: str) -> str:
    start = text.index(BEGIN)
    return text[text.index("\n", start) + 1:text.index(END)]


def test_docs_table_is_the_generated_one():
    assert _docs_table(DOCS.read_text()) == options.combinations_markdown(), (
        "docs/options.md's table of combinations differs from COMBINATIONS: paste "
        "offload_plugin.options.combinations_markdown()'s output between its markers")


def test_a_changed_rule_changes_the_generated_table(monkeypatch):
    """(What the test above catches: a rule changed without the docs.)"""
    rule = _rule("`master_weights`")
    changed = tuple(r if r is not rule else options.Rule(r.check, r.combination, STREAMED, r.when, r.text)
                    for r in COMBINATIONS)
    monkeypatch.setattr(options, "COMBINATIONS", changed)
    assert _docs_table(DOCS.read_text()) != options.combinations_markdown()


def test_rows_are_well_formed():
    for rule in COMBINATIONS:
        assert rule.update in (REFUSED, HOST, STREAMED), rule
        assert rule.check in options._WHEN, rule
        assert callable(getattr(options, rule.check)), rule
    assert len({r.combination for r in COMBINATIONS}) == len(COMBINATIONS)
    engines = [r for r in COMBINATIONS if r.check == "engine_for"]
    assert engines[-1].update == STREAMED and engines[-1].when(None)  # the fall-through


# ------------------------------------------------------------------ the cases

def _mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def _engine(caplog, params, **kwargs) -> str:
    """Which engine the optimizer reports it built: its INFO line says where it updates."""
    with caplog.at_level(logging.INFO, logger="offload_plugin.optimizer"):
        caplog.clear()
        CPUOffloadOptimizer(params, **kwargs)
    said = " ".join(r.getMessage() for r in caplog.records if "optimizing" in r.getMessage())
    on_device, on_host = "updated on the device" in said, "on the host" in said
    assert on_device != on_host, said
    return STREAMED if on_device else HOST


@pytest.fixture
def on_cpu(monkeypatch):
    """The streamed engine on CPU parameters (tests/test_streamed.py), so that CPU runs
    choose between the engines as a GPU run would."""
    monkeypatch.setattr(streamed.config, "on_cpu", True)


def _dtensors(mesh, dim: int, dtype=torch.float32) -> list:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    return [nn.Parameter(distribute_tensor(torch.randn(8, 16, dtype=dtype), mesh, [Shard(dim)]))
            for _ in range(2)]


def _refused(combination: str, call, **facts):
    """``call()`` raises ValueError with the row's message (``facts`` fill it in)."""
    rule = _rule(combination)
    assert rule.update == REFUSED
    with pytest.raises(ValueError) as caught:
        call()
    assert str(caught.value) == rule.text.format(**facts)


REFUSALS = {}  # combination -> test of its refusal (and of the nearest accepted combination)


def refusal(combination: str):
    def register(test):
        REFUSALS[combination] = test
        return test
    return register


@refusal("`accumulate_on_device` without `offload_gradients`")
def test_accumulate_on_device_needs_offloaded_gradients():
    _refused("`accumulate_on_device` without `offload_gradients`",
             lambda: CPUOffloadOptimizer(_mlp().parameters(), accumulate_on_device=True))
    CPUOffloadOptimizer(_mlp().parameters(), accumulate_on_device=True, offload_gradients=True)


@refusal("`device_fraction` with `AdamW8bit` or `CompactAdamW`")
def test_device_fraction_with_compact_adamw():
    bf16 = _mlp(torch.bfloat16)
    _refused("`device_fraction` with `AdamW8bit` or `CompactAdamW`", lambda: CPUOffloadOptimizer(
        bf16.parameters(), optimizer_cls=CompactAdamW, device_fraction=0.5), cls="CompactAdamW")
    CPUOffloadOptimizer(bf16.parameters(), optimizer_cls=CompactAdamW)
    CPUOffloadOptimizer(_mlp().parameters(), device_fraction=0.5)


@refusal("`device_fraction` with FSDP2 (DTensor) parameters")
def test_device_fraction_with_dtensors(one_rank):
    _refused("`device_fraction` with FSDP2 (DTensor) parameters",
             lambda: CPUOffloadOptimizer(_dtensors(one_rank, 0), device_fraction=0.5))
    CPUOffloadOptimizer(_dtensors(one_rank, 0))


@refusal("`AdamW8bit` or `CompactAdamW` with DTensor parameters sharded other than by rows")
def test_compact_adamw_needs_row_shards(one_rank):
    from torch.distributed.tensor import Shard

    _refused("`AdamW8bit` or `CompactAdamW` with DTensor parameters sharded other than by rows",
             lambda: CPUOffloadOptimizer(_dtensors(one_rank, 1, torch.bfloat16), optimizer_cls=CompactAdamW),
             placements=(Shard(dim=1),))
    CPUOffloadOptimizer(_dtensors(one_rank, 0, torch.bfloat16), optimizer_cls=CompactAdamW)
    CPUOffloadOptimizer(_dtensors(one_rank, 1))  # (other classes keep no state per row)


@refusal("`torch.optim.Adafactor` (factored state) with FSDP2 (DTensor) parameters")
def test_adafactor_with_dtensors(one_rank):
    _refused("`torch.optim.Adafactor` (factored state) with FSDP2 (DTensor) parameters",
             lambda: CPUOffloadOptimizer(_dtensors(one_rank, 0), optimizer_cls=torch.optim.Adafactor),
             cls="Adafactor")
    CPUOffloadOptimizer(_mlp().parameters(), optimizer_cls=torch.optim.Adafactor)
    CPUOffloadOptimizer(_dtensors(one_rank, 0), optimizer_cls=torch.optim.SGD, lr=0.1)


@refusal("`AdamW8bit` or `CompactAdamW` with parameters not bf16, or `master_weights`")
def test_compact_adamw_needs_bf16_without_masters():
    combination = "`AdamW8bit` or `CompactAdamW` with parameters not bf16, or `master_weights`"
    _refused(combination, lambda: CPUOffloadOptimizer(_mlp().parameters(), optimizer_cls=CompactAdamW),
             cls="CompactAdamW", dtypes_list="torch.float32", master_weights=False)
    _refused(combination, lambda: CPUOffloadOptimizer(
        _mlp(torch.bfloat16).parameters(), optimizer_cls=CompactAdamW, master_weights=True),
        cls="CompactAdamW", dtypes_list="torch.bfloat16", master_weights=True)
    mixed = [nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(4, dtype=torch.float16))]
    _refused(combination, lambda: CPUOffloadOptimizer(mixed, optimizer_cls=CompactAdamW),
             cls="CompactAdamW", dtypes_list="torch.bfloat16, torch.float16", master_weights=False)
    CPUOffloadOptimizer(_mlp(torch.bfloat16).parameters(), optimizer_cls=CompactAdamW)
    CPUOffloadOptimizer(_mlp().parameters(), master_weights=True)


@refusal("`overlap_next_step()` without `offload_gradients`")
def test_overlap_needs_offloaded_gradients():
    _refused("`overlap_next_step()` without `offload_gradients`",
             lambda: CPUOffloadOptimizer(_mlp().parameters()).overlap_next_step())
    CPUOffloadOptimizer(_mlp().parameters(), offload_gradients=True).overlap_next_step()


@refusal("`overlap_next_step(early_forward=True)` with `delayed_update`")
def test_early_forward_with_delayed_update():
    opt = CPUOffloadOptimizer(_mlp().parameters(), offload_gradients=True, delayed_update=True)
    _refused("`overlap_next_step(early_forward=True)` with `delayed_update`",
             lambda: opt.overlap_next_step(grad_scale=0.5, early_forward=True))
    assert not opt.overlapping
    opt.overlap_next_step(grad_scale=0.5)
    assert opt.overlapping
    CPUOffloadOptimizer(_mlp().parameters(), offload_gradients=True).overlap_next_step(early_forward=True)


@refusal("`overlap_next_step(early_forward=True)` with FSDP2 (DTensor) parameters")
def test_early_forward_with_dtensors(one_rank):
    opt = CPUOffloadOptimizer(_dtensors(one_rank, 0), offload_gradients=True)
    _refused("`overlap_next_step(early_forward=True)` with FSDP2 (DTensor) parameters",
             lambda: opt.overlap_next_step(early_forward=True))
    assert not opt.overlapping
    opt.overlap_next_step()
    assert opt.overlapping


def _scaled_step(opt, params) -> list:
    """GradScaler's way in: its scale on the optimizer, then step(); the weights before."""
    for p in params:
        p.grad = torch.ones_like(p)
    opt.grad_scale = torch.tensor(256.0)
    return [p.detach().clone() for p in params]


@refusal("torch.amp `GradScaler` with `offload_gradients` and DTensor (FSDP2) parameters")
def test_grad_scaler_with_offloaded_dtensor_gradients(one_rank):
    params = _dtensors(one_rank, 0)
    opt = CPUOffloadOptimizer(params, offload_gradients=True)
    before = _scaled_step(opt, params)
    _refused("torch.amp `GradScaler` with `offload_gradients` and DTensor (FSDP2) parameters", opt.step)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    params = _dtensors(one_rank, 0)
    opt = CPUOffloadOptimizer(params)
    before = _scaled_step(opt, params)
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, params))


@refusal("torch.amp `GradScaler` on the streamed engine with a state format whose kernel takes no scale (`AdamW8bit` or `CompactAdamW`)")
def test_grad_scaler_with_streamed_compact_adamw(on_cpu, monkeypatch):
    params = list(_mlp(torch.bfloat16).parameters())
    opt = CPUOffloadOptimizer(params, optimizer_cls=CompactAdamW)
    before = _scaled_step(opt, params)
    _refused("torch.amp `GradScaler` on the streamed engine with a state format whose kernel takes no scale (`AdamW8bit` or `CompactAdamW`)", opt.step, cls="CompactAdamW")
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    monkeypatch.setattr(streamed.config, "on_cpu", False)  # the host engine takes the scale
    opt = CPUOffloadOptimizer(params, optimizer_cls=CompactAdamW)
    _scaled_step(opt, params)
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, params))


def test_every_refusal_has_a_case():
    assert set(REFUSALS) == {r.combination for r in COMBINATIONS if r.update == REFUSED}


# ------------------------------------------------------------------ the engines

def _noncontiguous(dtype) -> list:
    return [nn.Parameter(torch.randn(16, 8, dtype=dtype).t()) for _ in range(2)]


def _frozen_group_first():
    frozen = nn.Parameter(torch.zeros(4), requires_grad=False)
    return [{"params": [frozen]}, {"params": list(_mlp().parameters())}]


# combination -> (parameters, options, the engine expected), all with the streamed engine
# able to run on these CPU parameters (the on_cpu fixture) unless the case says otherwise.
ENGINES = {
    "`OFFLOAD_PLUGIN_STREAMED=0` in the environment": (_mlp, {}, HOST),
    "a group without parameters for the engines (all frozen, or kept on the device)":
        (_frozen_group_first, {}, STREAMED),
    "parameters not on a CUDA device": (_mlp, {}, HOST),
    "`offload_gradients`": (_mlp, dict(offload_gradients=True), HOST),
    "`master_weights`": (lambda: _mlp(torch.bfloat16), dict(master_weights=True), HOST),
    "`delayed_update`": (_mlp, dict(delayed_update=True), HOST),
    "`device_fraction` keeping parameters on the device": (_mlp, dict(device_fraction=0.9), HOST),
    "an `optimizer_cls` with no streamed state format (torch's Adam and AdamW move the `adamw` "
    "format, `CompactAdamW` its `compact` one; SGD and others have none)":  # (fused: not Adam's kernel)
        (_mlp, dict(optimizer_cls=torch.optim.SGD, lr=0.1, fused=True), HOST),
    "a parameter not a plain contiguous tensor (DTensor, NF4, a transposed view, ...)":
        (lambda: _noncontiguous(torch.float32), {}, HOST),
    "what the state format refuses (its `refuses()`: Adam(W) without `fused` (the default sets "
    "it), or with `amsgrad`, `capturable` or `differentiable`, or not fp32, bf16 or fp16; "
    "`CompactAdamW` without Triton)": (_mlp, dict(fused=False), HOST),
    "any other combination (a state format on a GPU)": (_mlp, {}, STREAMED),
}


def test_every_engine_row_has_a_case():
    assert set(ENGINES) == {r.combination for r in COMBINATIONS if r.check == "engine_for"}


@pytest.mark.parametrize("combination", list(ENGINES))
def test_engine(combination, monkeypatch, caplog):
    make, kwargs, expected = ENGINES[combination]
    assert _rule(combination).update == expected, "the table says otherwise"
    if combination != "parameters not on a CUDA device":
        monkeypatch.setattr(streamed.config, "on_cpu", True)
    if combination == "`OFFLOAD_PLUGIN_STREAMED=0` in the environment":
        monkeypatch.setattr(streamed.config, "enabled", False)
    params = make()
    params = params.parameters() if isinstance(params, nn.Module) else params
    assert _engine(caplog, params, **kwargs) == expected


@pytest.mark.parametrize("kwargs", [dict(amsgrad=True), dict(fused=False), dict(foreach=True)])
def test_adam_settings_other_than_plain_fused_take_the_host(kwargs, on_cpu, caplog):
    assert _engine(caplog, _mlp().parameters(), **kwargs) == HOST
    assert _engine(caplog, _mlp().parameters(), optimizer_cls=torch.optim.Adam, **kwargs) == HOST


def test_what_a_state_format_refuses_takes_the_host(on_cpu, caplog, monkeypatch):
    """The formats' own refusals (their modules'), and a parameter not plain for any format."""
    assert _engine(caplog, _mlp(torch.float64).parameters()) == HOST  # (the adamw format's dtypes)
    assert _engine(caplog, _noncontiguous(torch.bfloat16), optimizer_cls=CompactAdamW) == HOST
    monkeypatch.setattr(compact_streamed, "device_refusal", lambda device, on_cpu: "Triton is not installed")
    assert _engine(caplog, _mlp(torch.bfloat16).parameters(), optimizer_cls=CompactAdamW) == HOST


def test_the_streamed_engine_takes_what_it_can(on_cpu, caplog):
    """The nearest combinations to each host row that still stream."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _engine(caplog, _mlp(dtype).parameters()) == STREAMED
    assert _engine(caplog, _mlp().parameters(), optimizer_cls=torch.optim.Adam) == STREAMED
    assert _engine(caplog, _mlp(torch.bfloat16).parameters(), optimizer_cls=CompactAdamW) == STREAMED
    # A device_fraction too small to keep a whole tensor keeps none: nothing stays on the device.
    assert _engine(caplog, _mlp().parameters(), device_fraction=0.01) == STREAMED
    # One group the streamed engine cannot take puts the whole optimizer on the host.
    groups = [{"params": list(_mlp().parameters())}, {"params": list(_mlp().parameters()), "amsgrad": True}]
    assert _engine(caplog, groups) == HOST


def test_engine_for_takes_plain_values():
    """engine_for on values alone: the device's facts are arguments."""
    opts = options.Options(torch.optim.AdamW, {})
    params = [torch.zeros(4)]
    settings = dict(opts.defaults())
    facts = dict(kept_on_device=False, streaming_on=True, device_streams=True)
    assert options.engine_for(opts, settings, params, **facts) == STREAMED
    assert options.engine_for(opts, settings, params, **dict(facts, device_streams=False)) == HOST
    assert options.engine_for(opts, settings, params, **dict(facts, kept_on_device=True)) == HOST
    assert options.engine_for(opts, settings, [], **dict(facts, device_streams=False)) == STREAMED
    assert options.engine_for(opts, dict(settings, fused=None), params, **facts) == HOST
