"""The streamed update (offload_plugin.engines.streamed): the state in host memory, the update made
by torch's fused kernel where the parameters are. On a GPU it is the default wherever it
applies; here the same code runs with CPU parameters (``streamed.config.on_cpu``, no streams),
so the reference is torch's fused AdamW on the CPU, bit for bit. test_streamed_gpu.py
holds what only a GPU shows (streams, events, the staging ring)."""

import copy
import dataclasses
import logging

import pytest
import torch

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.engines import streamed
from reference_twin import assert_same_params, batch, make_model, train, trainable, trained_in_two_groups, twins

KW = dict(lr=1e-2, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _streamed_on_cpu(monkeypatch):
    monkeypatch.setattr(streamed.config, "on_cpu", True)
    # The 32x32 weights go in ranges. (A multiple of the CPU kernel's vector width: its
    # scalar tail rounds differently, CUDA's kernel does not.)
    monkeypatch.setattr(streamed.config, "stage_numel", 640)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_matches_torch_fused_adam_bit_for_bit(dtype, cls):
    """Two groups, accumulation, torchtune's scaling and clipping, a scheduler: the same
    weights, losses and state as torch's fused kernel; some parameters go in ranges, the
    small ones packed."""
    ref_model, ref, model, opt, ref_run, run = trained_in_two_groups("cpu", dtype, cls, **KW)
    assert opt.engine.streams
    assert_same_params(ref_model, model, exact=True)
    assert run == ref_run
    ours, theirs = opt.state_dict(), ref.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for index, entry in theirs["state"].items():
        assert entry.keys() == ours["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(ours["state"][index][key], value), (index, key)
    units = next(iter(opt.engine._plans.values())).units
    assert any(len(u.items) > 1 for u in units), "small neighbours share one unit"
    assert any(u.items[0][1] > 0 for u in units), "a larger parameter goes in ranges"


def test_state_reads_and_resume_continue_exactly():
    """optimizer.state between steps is the current state; a resume from state_dict()
    continues bit for bit as the uninterrupted run."""
    ref_model, model = twins()
    ref = torch.optim.AdamW(trainable(ref_model), fused=True, **KW)
    opt = CPUOffloadOptimizer(model.parameters(), **KW)
    train(ref_model, ref, 3)
    train(model, opt, 3)
    p, rp = trainable(model)[1], trainable(ref_model)[1]
    assert torch.equal(opt.state[p]["exp_avg"], ref.state[rp]["exp_avg"])
    assert float(opt.state[p]["step"]) == 3.0

    saved = copy.deepcopy(opt.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = CPUOffloadOptimizer(resumed_model.parameters(), **KW)
    resumed.load_state_dict(saved)
    train(ref_model, ref, 3, start=3)
    train(resumed_model, resumed, 3, start=3)
    assert_same_params(ref_model, resumed_model, exact=True)
    assert float(resumed.state[trainable(resumed_model)[0]]["step"]) == 6.0


def test_nonfinite_step_is_skipped_and_reported(caplog):
    """A NaN gradient skips the whole step (no weight, moment or count changes), reported
    at the next step or state read; "raise" raises from the step itself."""
    model = make_model()
    opt = CPUOffloadOptimizer(model.parameters(), **KW)
    train(model, opt, 1)
    before = [p.clone() for p in trainable(model)]
    state_before = copy.deepcopy(opt.state_dict())
    x, y = batch(9, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    trainable(model)[2].grad[0] = float("nan")
    with caplog.at_level(logging.WARNING):
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(before, trainable(model)))
        after = opt.state_dict()
    assert "the step was skipped for all 4 parameters" in caplog.text
    for index, entry in state_before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][index][key], value), (index, key)

    raising = CPUOffloadOptimizer(make_model().parameters(), nonfinite_grads="raise", **KW)
    for p in raising.param_groups[0]["params"]:
        p.grad = torch.full_like(p, float("inf"))
    with pytest.raises(FloatingPointError, match="inf or NaN"):
        raising.step()


@pytest.mark.parametrize("flush_numel", [1, 1000, streamed.config.flush_numel])
def test_optimizer_in_backward_matches_torch_stepped_the_same_way(monkeypatch, flush_numel):
    """torchtune's optimizer_in_bwd (one optimizer per parameter, stepped in its gradient
    hook): bit for bit torch's fused AdamW stepped the same way, one verdict per parameter,
    whether the queued steps go to the device one by one, a few together, or all when the
    backward ends."""
    from torchtune import training

    monkeypatch.setattr(streamed.config, "flush_numel", flush_numel)

    ref_model, model = twins()
    for m, make in ((ref_model, lambda ps: torch.optim.AdamW(ps, fused=True, **KW)),
                    (model, lambda ps: CPUOffloadOptimizer(ps, **KW))):
        optims = {p: make([p]) for p in trainable(m)}
        training.register_optim_in_bwd_hooks(m, optims)
        if m is model:
            ours = optims
    for step in range(3):
        for m in (ref_model, model):
            x, y = batch(step, 0, "cpu")
            ((m(x) - y) ** 2).sum().backward()
    assert all(o.engine.streams for o in ours.values())
    assert_same_params(ref_model, model, exact=True)


def test_weights_changed_outside_are_what_the_next_step_updates():
    """The device weights are what the streamed update reads: a pretrained load_state_dict
    after building the optimizer, or an in-place edit, is never overwritten."""
    ref_model, model = twins()
    ref = torch.optim.AdamW(trainable(ref_model), fused=True, **KW)
    opt = CPUOffloadOptimizer(model.parameters(), **KW)
    pretrained = make_model(seed=7).state_dict()
    for m, o in ((ref_model, ref), (model, opt)):
        train(m, o, 1)
        m.load_state_dict(pretrained)
        with torch.no_grad():
            m[2].weight.mul_(0.5)
        train(m, o, 2, start=1)
    assert_same_params(ref_model, model, exact=True)


def test_settings_torch_has_no_device_kernel_for_use_the_host_update():
    """amsgrad, master weights, offloaded gradients, other optimizers: the host update
    (bit for bit as before); a group added later without streaming turns it off for all."""
    model = make_model()
    assert not CPUOffloadOptimizer(model.parameters(), amsgrad=True).engine.streams
    assert not CPUOffloadOptimizer(model.parameters(), master_weights=True).engine.streams
    assert not CPUOffloadOptimizer(model.parameters(), offload_gradients=True).engine.streams
    assert not CPUOffloadOptimizer(model.parameters(), fused=False).engine.streams
    assert not CPUOffloadOptimizer(model.parameters(), optimizer_cls=torch.optim.SGD, lr=0.1).engine.streams

    ref_model, model = twins()
    layers = [ref_model[2], ref_model[4]], [model[2], model[4]]
    ref = torch.optim.AdamW(layers[0][0].parameters(), fused=True, **KW)
    opt = CPUOffloadOptimizer(layers[1][0].parameters(), **KW)
    train(ref_model, ref, 2)
    train(model, opt, 2)
    assert opt.engine.streams
    ref.add_param_group({"params": list(layers[0][1].parameters()), "amsgrad": True})
    opt.add_param_group({"params": list(layers[1][1].parameters()), "amsgrad": True})
    assert not opt.engine.streams
    train(ref_model, ref, 2, start=2)
    train(model, opt, 2, start=2)
    assert_same_params(ref_model, model, exact=True)


def test_host_memory_is_the_state_alone():
    """No host copy of a weight or a gradient: 4 bytes per bf16 parameter (the two moments)
    and a step count per tensor, against 8 with the host update; the preflight counts the
    same."""
    from offload_plugin.host import memory as host_memory

    model = make_model(dtype=torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), **KW)
    train(model, opt, 1)
    params = trainable(model)
    moments = sum(2 * p.numel() * p.element_size() for p in params)
    assert opt.host_memory_bytes() == moments + 4 * len(params)
    assert host_memory.bytes_needed(params, False, 2, host_copies=False) == moments
    assert host_memory.bytes_needed(params, False, 2) == 2 * moments


def test_checkpoints_move_between_the_streamed_and_the_host_update(monkeypatch):
    """The same state dict either way: a run resumed from the host update's checkpoint into
    the streamed update (and back) continues bit for bit as the uninterrupted run (on the
    CPU both are torch's fused kernel)."""
    def build(model, streaming):
        monkeypatch.setattr(streamed.config, "enabled", streaming)
        opt = CPUOffloadOptimizer(model.parameters(), **KW)
        assert opt.engine.streams == streaming
        return opt

    whole = make_model(dtype=torch.bfloat16)
    start = copy.deepcopy(whole)
    opt = build(whole, True)
    train(whole, opt, 6)

    model = start
    saved = None
    for part, streaming in enumerate((False, True, False)):
        opt = build(model, streaming)
        if saved is not None:
            opt.load_state_dict(saved)
        train(model, opt, 2, start=2 * part)
        saved = copy.deepcopy(opt.state_dict())
    assert_same_params(whole, model, exact=True)


@pytest.mark.parametrize("flush_numel", [1, streamed.config.flush_numel])
def test_a_nonfinite_gradient_in_backward_spares_that_parameter(caplog, monkeypatch, flush_numel):
    """torchtune's optimizer_in_bwd: each parameter judges its own gradient, as torch's
    per-parameter optimizers would, also when its step went to the device with others';
    the report comes with the next step."""
    from torchtune import training

    monkeypatch.setattr(streamed.config, "flush_numel", flush_numel)

    model = make_model()
    optims = {p: CPUOffloadOptimizer([p], **KW) for p in trainable(model)}
    training.register_optim_in_bwd_hooks(model, optims)
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    bad = model[4].weight
    before = [p.detach().clone() for p in trainable(model)]
    handle = bad.register_hook(lambda g: torch.full_like(g, float("nan")))
    ((model(x) - y) ** 2).sum().backward()
    handle.remove()
    changed = [not torch.equal(a, p) for a, p in zip(before, trainable(model))]
    assert changed == [p is not bad for p in trainable(model)]
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        ((model(x) - y) ** 2).sum().backward()
    assert "1 parameters had an inf or NaN gradient" in caplog.text


@pytest.mark.parametrize("settle", ["state_dict", "finish_step"])
def test_steps_queued_by_a_backward_that_failed_are_made_as_torch_made_them(settle):
    """A backward that raises after some gradient hooks ran: torch's per-parameter
    optimizers have updated those parameters. The steps those hooks queued are made when
    any of their optimizers' state is read or finish_step() is called (the end of that
    backward, which would have sent them, never comes)."""
    from torchtune import training

    ref_model, model = twins()
    made = {}
    for m, make in ((ref_model, lambda ps: torch.optim.AdamW(ps, fused=True, **KW)),
                    (model, lambda ps: CPUOffloadOptimizer(ps, **KW))):
        made[m] = optims = {p: make([p]) for p in trainable(m)}
        training.register_optim_in_bwd_hooks(m, optims)
    for m in (ref_model, model):
        x, y = batch(0, 0, "cpu")
        hidden = m[:3](x)  # the last layer's hooks run before the failure reaches here
        hidden.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("failed in backward")))
        with pytest.raises(RuntimeError, match="failed in backward"):
            ((m[3:](hidden) - y) ** 2).sum().backward()
    last = made[model][model[4].weight]
    last.state_dict() if settle == "state_dict" else last.finish_step()
    assert_same_params(ref_model, model, exact=True)
    for ref, ours in zip(made[ref_model].values(), made[model].values()):
        theirs, mine = ref.state_dict()["state"], ours.state_dict()["state"]
        assert mine.keys() == theirs.keys()
        for index, entry in theirs.items():
            for key, value in entry.items():
                assert torch.equal(mine[index][key], value), key
    for m in (ref_model, model):
        x, y = batch(1, 0, "cpu")
        ((m(x) - y) ** 2).sum().backward()
    assert_same_params(ref_model, model, exact=True)


def test_replaced_moments_and_mismatched_gradients():
    """A moment replaced inside a state dict is what the next step reads and writes, as in
    torch; a gradient unlike its parameter is refused before anything changes."""
    ref_model, model = twins()
    ref = torch.optim.AdamW(trainable(ref_model), fused=True, **KW)
    opt = CPUOffloadOptimizer(model.parameters(), **KW)
    for m, o in ((ref_model, ref), (model, opt)):
        train(m, o, 2)
        p = trainable(m)[0]
        o.state[p]["exp_avg"] = o.state[p]["exp_avg"] * 0.5
        train(m, o, 2, start=2)
    assert_same_params(ref_model, model, exact=True)
    assert torch.equal(opt.state[trainable(model)[0]]["exp_avg"], ref.state[trainable(ref_model)[0]]["exp_avg"])

    before = [p.clone() for p in trainable(model)]
    for p in trainable(model):
        p.grad = torch.ones_like(p)
    trainable(model)[1].grad.data = torch.ones(3)  # (torch refuses it as .grad itself)
    with pytest.raises(ValueError, match="set .grad to a tensor like the parameter"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, trainable(model)))


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True), (None, True)])
@pytest.mark.slow  # (starts a process: left out of the quick lane)
def test_environment_switches_the_streamed_update_off(value, enabled):
    """OFFLOAD_PLUGIN_STREAMED=0 (what bench/bench_stock.py's host-update run sets for a
    recipe's process) leaves the update on the host; unset or 1, the streamed update runs."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_PLUGIN_STREAMED"}
    if value is not None:
        env["OFFLOAD_PLUGIN_STREAMED"] = value
    out = subprocess.run([sys.executable, "-c", "from offload_plugin.engines import streamed; print(streamed.config.enabled)"],
                         capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert out == str(enabled)


def test_wrongly_shaped_moment_assigned_by_hand_is_refused_changing_nothing():
    """The streamed update cuts its copies from the state's moments: one of another size
    assigned by hand to ``optimizer.state[p]`` is refused with a message when the step
    re-plans, the weights and step counts as they were (adamw_moments.adam_state)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-2)
    assert opt.engine.streams
    for _ in range(2):
        model(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        opt.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    steps = [opt.state[p]["step"].clone() for p in model.parameters()]
    opt.state[model.weight]["exp_avg"] = torch.zeros(3, dtype=torch.bfloat16)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(ValueError, match="'exp_avg' is a torch.bfloat16 tensor of shape"):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(model.parameters(), steps))


@pytest.mark.parametrize("edit", ["in place", "replaced"])
def test_step_count_edited_by_hand_is_what_the_next_step_uses(edit):
    """The step counts live on the device between steps; ``optimizer.state[p]["step"]``
    edited by hand (in place, or a new tensor) must be what the next step's bias correction
    uses, as with torch's AdamW, also after the state was read before."""
    ref_model, model = twins()
    ref = torch.optim.AdamW(trainable(ref_model), fused=True, **KW)
    opt = CPUOffloadOptimizer(model.parameters(), **KW)
    train(ref_model, ref, 2)
    train(model, opt, 2)
    for o, params in ((ref, trainable(ref_model)), (opt, trainable(model))):
        float(o.state[params[0]]["step"])  # (a read first: the host counts were brought up to date)
        if edit == "in place":
            o.state[params[0]]["step"].fill_(10.0)
        else:
            o.state[params[0]]["step"] = torch.tensor(10.0)
    train(ref_model, ref, 2)
    train(model, opt, 2)
    assert_same_params(ref_model, model, exact=True)
    assert float(opt.state[trainable(model)[0]]["step"]) == 12.0


def test_step_count_edited_after_a_group_was_added():
    """A group added after steps, then a step count edited by hand: both the new group's
    counts and the edited one are what the next steps use, bit for bit torch's AdamW."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    opt = CPUOffloadOptimizer(first.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_first.parameters(), lr=1e-2, fused=True)
    assert opt.engine.streams

    def step(a, b, o, i):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
        b(a(x)).sum().backward()
        o.step()
        o.zero_grad()

    step(first, second, opt, 0)
    step(ref_first, ref_second, ref, 0)
    opt.add_param_group({"params": list(second.parameters())})
    ref.add_param_group({"params": list(ref_second.parameters())})
    opt.state[first.weight]["step"].fill_(5.0)
    ref.state[ref_first.weight]["step"].fill_(5.0)
    for i in (1, 2):
        step(first, second, opt, i)
        step(ref_first, ref_second, ref, i)
    for p, q in zip([*first.parameters(), *second.parameters()], [*ref_first.parameters(), *ref_second.parameters()]):
        assert torch.equal(p, q)
    assert float(opt.state[first.weight]["step"]) == 7.0 and float(opt.state[second.weight]["step"]) == 2.0


@pytest.mark.slow  # (starts processes: left out of the quick lane)
def test_benchmark_settings_are_read_from_the_environment():
    """The streamed update's benchmark knobs reach a recipe through its environment (bench/
    run_h200.sh sets them per run)."""
    import os
    import subprocess
    import sys

    code = "from offload_plugin.engines import streamed as s; print(s.config.flush_numel, s.config.in_flight_bytes >> 20)"
    env = dict(os.environ, OFFLOAD_PLUGIN_FLUSH_NUMEL="4096", OFFLOAD_PLUGIN_IN_FLIGHT_MIB="2048")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["4096", "2048"], out.stderr[-2000:]


def test_configured_sets_the_streamed_config_for_a_block_and_restores_it():
    """streamed.configured(): the engine's tunables changed for a block, put back after it
    (also when the block raises); a field it does not have is refused with the fields."""
    before = dataclasses.asdict(streamed.config)
    with pytest.raises(KeyError):
        with streamed.configured(stage_numel=640, on_cpu=True) as config:
            assert (streamed.config.stage_numel, streamed.config.on_cpu) == (640, True) and config is streamed.config
            raise KeyError("inside")
    assert dataclasses.asdict(streamed.config) == before
    with pytest.raises(TypeError, match="no stage_size.*stage_numel"):
        with streamed.configured(stage_size=1):
            pass
    assert dataclasses.asdict(streamed.config) == before
