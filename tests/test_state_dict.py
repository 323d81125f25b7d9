"""State dicts in torch's layout: interchangeable with torch.optim.AdamW, validated, resumable."""

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import offload_plugin

from reference_twin import DEVICES, assert_same_params, make_model, offload, reference, train, trainable, twins


def test_layout_is_torch_standard():
    """{"state": {index: ...}, "param_groups": [...]} with indices in trainable-parameter order."""
    model = make_model()
    opt = offload(model, lr=1e-2)
    ref = reference(torch.optim.AdamW, trainable(model), lr=1e-2)
    train(model, opt, 1)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert sd.keys() == ref_sd.keys() == {"state", "param_groups"}
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert list(sd["state"]) == [0, 1, 2, 3]
    for index, p in enumerate(trainable(model)):
        assert sd["state"][index]["exp_avg"].shape == p.shape
        assert set(sd["state"][index]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("device", DEVICES)
def test_interchangeable_with_plain_adamw(device):
    """A plain AdamW state dict loads into the offload optimizer and back, continuing identically."""
    ref_model, model = twins(device)
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    train(ref_model, ref, 3)
    model.load_state_dict(ref_model.state_dict())

    opt = offload(model, lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    assert all(v.device.type == "cpu" for st in opt.state.values() for v in st.values())
    train(ref_model, ref, 2, start=3)
    train(model, opt, 2, start=3)
    assert_same_params(ref_model, model, exact=device == "cpu")

    back = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))  # as through torch.save/load
    train(ref_model, back, 2, start=5)
    train(model, opt, 2, start=5)
    assert_same_params(ref_model, model, exact=device == "cpu")


def test_a_torch_adamw_over_frozen_parameters_too_loads():
    """torchtune's LoRA recipes build the optimizer over model.parameters(): torch's AdamW then
    lists the frozen tensors (without state). Its state dict loads, dropping them, and
    continues exactly; one with state where a tensor is frozen here is refused unchanged."""
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, list(ref_model.parameters()), lr=1e-2)
    train(ref_model, ref, 3)
    model.load_state_dict(ref_model.state_dict())
    saved = copy.deepcopy(ref.state_dict())
    assert len(saved["param_groups"][0]["params"]) == len(list(model.parameters())) > len(trainable(model))

    opt = offload(model, lr=1e-2)
    opt.load_state_dict(saved)
    train(ref_model, ref, 2, start=3)
    train(model, opt, 2, start=3)
    assert_same_params(ref_model, model, exact=True)

    frozen_index = saved["param_groups"][0]["params"][0]  # (make_model's first layer is frozen)
    saved["state"][frozen_index] = copy.deepcopy(saved["state"][2])
    fresh = offload(make_model(), lr=1e-2)
    with pytest.raises(ValueError, match="frozen here"):
        fresh.load_state_dict(saved)
    assert not fresh.state_dict()["state"]


def _mismatches():
    def more_groups(sd):
        sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))

    def fewer_params(sd):
        sd["param_groups"][0]["params"].pop()

    def wrong_shape(sd):
        sd["state"][0]["exp_avg"] = torch.zeros(3, 3)

    def not_a_state_dict(sd):  # e.g. a model state dict passed by mistake
        sd.clear()
        sd["0.weight"] = torch.zeros(2)

    return {
        "group-count": (more_groups, "2 parameter groups"),
        "param-count": (fewer_params, "3 parameters"),
        "shape": (wrong_shape, "shape \\(3, 3\\)"),
        "layout": (not_a_state_dict, "expected the keys 'state' and 'param_groups'"),
    }


@pytest.mark.parametrize("kind", list(_mismatches()))
def test_mismatched_state_dict_is_refused_and_changes_nothing(kind):
    """Group count, parameter count, shapes or layout that differ: ValueError, state untouched."""
    mutate, message = _mismatches()[kind]
    model = make_model()
    opt = offload(model, lr=1e-2)
    train(model, opt, 2)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    for g in bad["param_groups"]:
        g["lr"] = 123.0
    mutate(bad)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, st in before["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(after["state"][index][key], value, rtol=0, atol=0)


_RESUME = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from reference_twin import make_model, offload, train
    ckpt = torch.load({ckpt!r}, weights_only=True)
    model = make_model({device!r}, getattr(torch, {dtype!r}))
    model.load_state_dict(ckpt["model"])
    opt = offload(model, lr=1e-3, offload_gradients={offload})
    opt.load_state_dict(ckpt["optimizer"])
    train(model, opt, 3, start=3, via_optimizer=True)
    torch.save(model.state_dict(), {out!r})
    """
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.slow  # (starts a process: left out of the quick lane)
def test_resume_in_new_process_matches_uninterrupted(tmp_path, device, dtype, offload_gradients):
    """Save after 3 steps, load in a new process, 3 more steps: the weights of 6 straight steps.

    With bf16 parameters this needs the fp32 master weights from the checkpoint.
    """
    straight, part = twins(device, getattr(torch, dtype))
    train(straight, offload(straight, lr=1e-3, offload_gradients=offload_gradients), 6,
          via_optimizer=True)
    opt = offload(part, lr=1e-3, offload_gradients=offload_gradients)
    train(part, opt, 3, via_optimizer=True)
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "final.pt"
    torch.save({"model": part.state_dict(), "optimizer": opt.state_dict()}, ckpt)

    script = _RESUME.format(
        tests=str(Path(__file__).parent), ckpt=str(ckpt), out=str(out), device=device,
        dtype=dtype, offload=offload_gradients,
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    resumed = torch.load(out, weights_only=True)
    for name, value in straight.state_dict().items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


def test_checkpoint_without_master_weights_starts_from_device_weights():
    """A plain-AdamW checkpoint has no fp32 masters: they start from the loaded bf16 weights."""
    model = make_model(dtype=torch.bfloat16)
    opt = offload(model, lr=1e-3)
    plain = reference(torch.optim.AdamW, trainable(model), lr=1e-3)
    train(model, plain, 2)
    opt.load_state_dict(plain.state_dict())
    for p in trainable(model):
        assert torch.equal(opt.engine.slots[p].master, p.float())


def test_a_load_into_a_trained_optimizer_continues_from_the_loaded_state():
    """Small bf16 tensors update in batches whose layout the optimizer works out once and
    keeps; a load_state_dict into the same, already trained optimizer continues from the
    loaded state, bit for bit as torch's fused AdamW continues from it."""
    ref_model, model = twins("cpu", torch.bfloat16)
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    opt = offload(model, lr=1e-2)
    train(model, opt, 2)  # its batches are worked out
    train(ref_model, ref, 3)  # another history
    model.load_state_dict(ref_model.state_dict())
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(ref_model, ref, 2, start=3)
    train(model, opt, 2, start=3)
    assert_same_params(ref_model, model, exact=True)
    for index, entry in ref.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(opt.state_dict()["state"][index][key], value), (index, key)


def _layers():
    """Two layers of one shape (so a state given to the wrong one of them would show) and others."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 3))


def _step_each(optimizers, model, seed):
    torch.manual_seed(seed)
    model(torch.randn(4, 6)).square().sum().backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("make", [
    lambda params: offload_plugin.CPUOffloadOptimizer(params, lr=1e-2, weight_decay=0.1),
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
], ids=["ours", "torch_adamw"])
def test_recipe_state_converts_between_one_optimizer_and_optimizer_in_bwd(make):
    """optimizer_state_for turns one optimizer's state dict into torchtune's optimizer_in_bwd
    layout (one optimizer per parameter name) and back: training continued from either
    conversion gives the weights of the optimizer that saved, bit for bit."""
    from torchtune import training

    from offload_plugin.recipe_utils import optimizer_state_for

    model = _layers()
    one = make(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(one, lambda step: 0.5)  # (adds initial_lr, as the recipes' schedulers)
    for seed in range(3):
        _step_each([one], model, seed)
    saved = copy.deepcopy(one.state_dict())  # (as from a file: torch's shares its live tensors)

    split_model = copy.deepcopy(model)
    per_param = {p: make([p]) for p in split_model.parameters()}
    wrapper = training.create_optim_in_bwd_wrapper(model=split_model, optim_dict=per_param)
    wrapper.load_state_dict(optimizer_state_for(split_model, saved, optimizer_in_bwd=True))
    assert optimizer_state_for(split_model, saved, optimizer_in_bwd=False) is saved

    joined_model = copy.deepcopy(model)
    joined = make(joined_model.parameters())
    joined.load_state_dict(optimizer_state_for(joined_model, copy.deepcopy(wrapper.state_dict()), optimizer_in_bwd=False))
    for seed in range(3, 6):
        _step_each([one], model, seed)
        _step_each(per_param.values(), split_model, seed)
        _step_each([joined], joined_model, seed)
    for name, param in model.named_parameters():
        assert torch.equal(dict(split_model.named_parameters())[name], param), name
        assert torch.equal(dict(joined_model.named_parameters())[name], param), name


def test_recipe_state_of_another_model_is_refused_with_a_message():
    from offload_plugin.recipe_utils import optimizer_state_for

    model = _layers()
    one = offload_plugin.CPUOffloadOptimizer(model.parameters(), lr=1e-2)
    _step_each([one], model, 0)
    saved = one.state_dict()
    smaller = torch.nn.Sequential(torch.nn.Linear(6, 5))
    with pytest.raises(ValueError, match="covers 8 parameters and the model has 2"):
        optimizer_state_for(smaller, saved, optimizer_in_bwd=True)
    per_name = optimizer_state_for(model, saved, optimizer_in_bwd=True)
    with pytest.raises(ValueError, match=r"missing: \['0.weight'\]"):
        optimizer_state_for(model, {k: v for k, v in per_name.items() if k != "0.weight"}, optimizer_in_bwd=False)
    per_name["1.bias"]["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match="1.bias has other hyperparameters"):
        optimizer_state_for(model, per_name, optimizer_in_bwd=False)
    with pytest.raises(ValueError, match="malformed"):
        optimizer_state_for(model, {"state": {}, "param_groups": [{"lr": 1.0}]}, optimizer_in_bwd=True)
    torchao_layout = {"offloaded": [], "on-device": saved}  # (our load_state_dict converts it)
    assert optimizer_state_for(model, torchao_layout, optimizer_in_bwd=False) is torchao_layout


def test_recipe_state_conversion_takes_torch_optimizers_over_frozen_parameters_and_refuses_several_groups():
    """torch's optimizers (and torchtune's wrapper) keep frozen parameters where ours drops
    them: either count converts. A state of several groups is refused rather than split
    in an order that may not be the model's."""
    from offload_plugin.recipe_utils import optimizer_state_for

    model = _layers()
    model[0].bias.requires_grad_(False)
    torch_adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _step_each([torch_adamw], model, 0)
    saved = copy.deepcopy(torch_adamw.state_dict())
    per_name = optimizer_state_for(model, saved, optimizer_in_bwd=True)
    assert list(per_name) == [name for name, _ in model.named_parameters()]
    assert per_name["0.bias"]["state"] == {}
    back = optimizer_state_for(model, per_name, optimizer_in_bwd=False)
    assert back["param_groups"][0]["params"] == list(range(8))
    for index, entry in saved["state"].items():
        assert all(torch.equal(entry[k], back["state"][index][k]) for k in entry)

    two_groups = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if "bias" in n]},
                                    {"params": [p for n, p in model.named_parameters() if "weight" in n]}])
    with pytest.raises(ValueError, match="2 parameter groups"):
        optimizer_state_for(model, two_groups.state_dict(), optimizer_in_bwd=True)
