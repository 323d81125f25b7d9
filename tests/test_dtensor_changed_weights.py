"""FSDP2 shards changed outside the optimizer between steps are what the next step updates:
an in-place edit of a DTensor parameter, of its local shard, and ``model.load_state_dict``
of another sharded model, on 2 ranks (gloo on CPU, NCCL on 2 GPUs), against the sharded
twin of test_dtensor (torch's fused AdamW on the same shards, bit for bit)."""

import copy

import pytest
import torch

from test_dtensor import DEVICES, _full, _offload, _model, _sharded, _spawn, _train, _twin_optimizer
from test_dtensor import pytestmark  # noqa: F401  (skipped without gloo)


def _edit(model, other, step):
    with torch.no_grad():
        if step == 1:
            model[2].weight.mul_(0.5)  # the DTensor itself
        elif step == 2:
            model[0].weight.to_local().add_(1.0)  # this rank's shard
        elif step == 3:
            model.load_state_dict(other.state_dict())


def _check(rank, offload_gradients, overlap):
    base = _model()
    changed = copy.deepcopy(base)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(-2.0)
    results = []
    for ours in (False, True):
        model, other = _sharded(base), _sharded(changed)
        opt = _offload(model, offload_gradients=offload_gradients) if ours else _twin_optimizer(model)
        for step in range(5):
            _edit(model, other, step)
            _train(model, opt, 1, rank, first_step=step, overlap=overlap and ours)
        results.append(_full(model))
    for want, got in zip(*results):
        assert torch.equal(want, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload_gradients,overlap", [(False, False), (True, False), (True, True)],
                         ids=["grads-at-step", "offloaded-grads", "overlapped"])
def test_sharded_weights_changed_between_steps_are_updated_as_torch_does(tmp_path, device,
                                                                         offload_gradients, overlap):
    _spawn(_check, tmp_path, device, offload_gradients, overlap)
