"""The CUDA path itself: pinned buffers, stream ordering against the recipe, freed device grads.

The reference-twin tests elsewhere also run on CUDA; these check what only a GPU can show.
"""

import copy

import pytest
import torch
from torch import nn

from reference_twin import CUDA, offload, trainable

pytestmark = CUDA


def _wide_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).cuda()


def test_host_buffers_are_pinned():
    """Master weights and gradient buffers are page-locked, so copies run asynchronously."""
    opt = offload(_wide_model())
    for slot in opt._slot_list:
        assert slot.master.is_pinned() and slot.grad.is_pinned()
        assert slot.master.device.type == "cpu"


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_copies_wait_for_recipe_work_on_grads(offload_gradients):
    """Work queued on .grad right before step() (delayed on purpose) is seen by the copy.

    The compute stream sleeps before scaling the gradients; a copy that did not wait for
    it would read unscaled gradients and diverge from the reference.
    """
    model = _wide_model()
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    opt = offload(model, lr=1e-3, offload_gradients=offload_gradients)
    x = torch.randn(64, 2048, device="cuda")
    for m, o in ((ref_model, ref), (model, opt)):
        m(x).square().mean().backward()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the scaling kernel
        if o is opt:
            o.scale_grads(1e-3)
        else:
            for p in m.parameters():
                p.grad *= 1e-3
        o.step()
        o.zero_grad()
        m(x).sum().item()  # the next forward must see the updated weights
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)


def test_offload_gradients_frees_device_memory():
    """With offload_gradients, backward's peak holds far less than all gradients at once."""
    def peak(offload_gradients):
        model = _wide_model()
        opt = offload(model, lr=1e-3, offload_gradients=offload_gradients)
        x = torch.randn(8, 2048, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).sum().backward()
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        opt.step()
        return used, sum(p.numel() * 4 for p in trainable(model))

    kept, grad_bytes = peak(False)
    freed, _ = peak(True)
    assert kept >= grad_bytes
    assert freed < kept - 0.5 * grad_bytes, (freed, kept, grad_bytes)
