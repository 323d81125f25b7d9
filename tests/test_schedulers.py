"""Every kind of torch LR scheduler, and torchtune's, drives CPUOffloadOptimizer like a torch optimizer."""

import pytest
import torch
from torch.optim import lr_scheduler as S

from reference_twin import DEVICES, assert_same_params, offload, reference, train, trainable, twins


def _cosine(opt):
    from torchtune.training import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)


SCHEDULERS = {
    "torchtune-cosine-warmup": (torch.optim.AdamW, {"lr": 1e-2}, _cosine),
    "onecycle-betas": (
        torch.optim.AdamW, {"lr": 1e-2},
        lambda o: S.OneCycleLR(o, max_lr=2e-2, total_steps=8, cycle_momentum=True),
    ),
    "cyclic-momentum": (
        torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9},
        lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=2, cycle_momentum=True),
    ),
    "plateau": (
        torch.optim.AdamW, {"lr": 1e-2},
        lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0, threshold=10.0),
    ),
    "sequential": (
        torch.optim.AdamW, {"lr": 1e-2},
        lambda o: S.SequentialLR(
            o, [S.LinearLR(o, start_factor=0.1, total_iters=2), S.ExponentialLR(o, 0.7)],
            milestones=[2],
        ),
    ),
    "chained": (
        torch.optim.AdamW, {"lr": 1e-2},
        lambda o: S.ChainedScheduler([S.StepLR(o, 2, 0.5), S.ExponentialLR(o, 0.9)]),
    ),
}


def _run(model, opt, sched, steps, start=0):
    """Train step by step so that ReduceLROnPlateau gets its metric; returns the lrs seen."""
    from torchtune.training import get_lr

    lrs = []
    for step in range(start, start + steps):
        losses, _ = train(model, opt, 1, start=step, clip=1.0)
        if isinstance(sched, S.ReduceLROnPlateau):
            sched.step(losses[0])
        else:
            sched.step()
        lrs.append(get_lr(opt))
    return lrs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_drives_host_update(device, name):
    """Same lrs (torchtune's get_lr) and same weights as the plain optimizer under the scheduler."""
    cls, kwargs, make_sched = SCHEDULERS[name]
    ref_model, model = twins(device)
    ref = reference(cls, trainable(ref_model), **kwargs)
    opt = offload(model, optimizer_cls=cls, **kwargs)
    ref_lrs = _run(ref_model, ref, make_sched(ref), 6)
    lrs = _run(model, opt, make_sched(opt), 6)
    assert lrs == ref_lrs
    assert len(set(lrs)) > 1, "the schedule must actually change the lr in this test"
    assert_same_params(ref_model, model, exact=device == "cpu")
    if name == "onecycle-betas":
        assert opt.param_groups[0]["betas"] == ref.param_groups[0]["betas"]


@pytest.mark.parametrize("name", ["torchtune-cosine-warmup", "onecycle-betas", "cyclic-momentum"])
def test_scheduler_and_optimizer_state_round_trip(name):
    """Stop after 3 steps, rebuild from both state dicts, continue: same as uninterrupted."""
    cls, kwargs, make_sched = SCHEDULERS[name]
    straight, resumed = twins()
    opt = offload(straight, optimizer_cls=cls, **kwargs)
    straight_lrs = _run(straight, opt, make_sched(opt), 6)

    opt = offload(resumed, optimizer_cls=cls, **kwargs)
    sched = make_sched(opt)
    _run(resumed, opt, sched, 3)
    opt_sd, sched_sd = opt.state_dict(), sched.state_dict()

    # torch's documented order: build the scheduler, then load the optimizer (restoring
    # the lrs the scheduler's constructor overwrote), then the scheduler.
    opt2 = offload(resumed, optimizer_cls=cls, **kwargs)
    sched2 = make_sched(opt2)
    opt2.load_state_dict(opt_sd)
    sched2.load_state_dict(sched_sd)
    lrs = _run(resumed, opt2, sched2, 3, start=3)

    assert lrs == straight_lrs[3:]
    assert_same_params(straight, resumed, exact=True)
