"""Parameters on the CPU update in the training thread (the default outside the tests, see
tests/conftest.py): no host thread starts, and every schedule gives torch's AdamW bits."""

import threading

import pytest
import torch

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.host.worker import HostUpdateError, HostWorker
from reference_twin import assert_same_params, batch, make_model, offload, reference, train, trainable, twins


def _host_threads():
    return {t for t in threading.enumerate() if t.name == "offload-host-update"}


def _overlapped(model, opt, steps, clipping=False, early=False):
    """Two micro-batches per step, the scale announced before the last backward."""
    for step in range(steps):
        for micro in range(2):
            if micro == 1:
                opt.overlap_next_step(grad_scale=0.25, clipping=clipping, early_forward=early)
            x, y = batch(step, micro, "cpu")
            ((model(x) - y) ** 2).sum().backward()
        if clipping:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _overlapped_reference(model, opt, steps, clipping=False):
    for step in range(steps):
        for micro in range(2):
            x, y = batch(step, micro, "cpu")
            ((model(x) - y) ** 2).sum().backward()
        for p in trainable(model):
            p.grad.mul_(0.25)
        if clipping:
            torch.nn.utils.clip_grad_norm_(trainable(model), 1.0)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("options", [
    {},
    {"offload_gradients": True},
    {"master_weights": True},
], ids=["plain", "offload_gradients", "master_weights"])
def test_cpu_parameters_update_in_the_training_thread_exactly(cpu_inline, options):
    before = _host_threads()
    ours_model, ref_model = twins()
    ours = offload(ours_model, lr=1e-2, **options)
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    train(ref_model, ref, 3, clip=1.0)
    train(ours_model, ours, 3, clip=1.0, via_optimizer=options.get("offload_gradients", False))
    assert_same_params(ours_model, ref_model, exact=not options.get("master_weights"))
    assert _host_threads() == before
    assert ours.engine.worker.inline and ours.engine.worker.busy_s > 0


@pytest.mark.parametrize("clipping,early", [(False, False), (True, False), (False, True)],
                         ids=["scale", "scale_and_clip", "early_forward"])
def test_cpu_parameters_overlapped_schedules_inline_match_torch(cpu_inline, clipping, early):
    """overlap_next_step: each update runs in its gradient's hook, inside backward."""
    ours_model, ref_model = twins()
    ours = offload(ours_model, lr=1e-2, offload_gradients=True)
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    _overlapped_reference(ref_model, ref, 3, clipping)
    _overlapped(ours_model, ours, 3, clipping, early)
    ours.finish_step()
    assert_same_params(ours_model, ref_model, exact=True)


def test_cpu_parameters_in_backward_inline_match_torch(cpu_inline):
    """torchtune's optimizer_in_bwd: one optimizer per parameter, stepped in its hook."""
    from torchtune import training  # imported late: torchtune takes ~5 s

    ref_model, model = twins()
    training.register_optim_in_bwd_hooks(
        ref_model, {p: torch.optim.AdamW([p], lr=1e-2, fused=True) for p in trainable(ref_model)})
    ours = {p: CPUOffloadOptimizer([p], lr=1e-2) for p in trainable(model)}
    training.register_optim_in_bwd_hooks(model, ours)
    for step in range(3):
        for m in (ref_model, model):
            x, y = batch(step, 0, "cpu")
            ((m(x) - y) ** 2).sum().backward()
    assert_same_params(model, ref_model, exact=True)
    assert all(o.engine.worker.inline for o in ours.values())



def test_cpu_parameters_delayed_update_inline_is_the_threaded_result(cpu_inline, monkeypatch):
    """delayed_update applies each gradient one step late whichever thread runs it: the
    same bits inline as through the host thread."""
    from offload_plugin.host import process

    inline_model, threaded_model = twins()
    inline = offload(inline_model, lr=1e-2, offload_gradients=True, delayed_update=True)
    _overlapped(inline_model, inline, 4)
    inline.finish_step()
    monkeypatch.setattr(process, "_INLINE_ON_CPU", False)
    threaded = offload(threaded_model, lr=1e-2, offload_gradients=True, delayed_update=True)
    assert not threaded.engine.worker.inline
    _overlapped(threaded_model, threaded, 4)
    threaded.finish_step()
    assert_same_params(inline_model, threaded_model, exact=True)
    assert not torch.equal(inline_model[2].weight, make_model()[2].weight)  # it trained


def test_an_inline_job_that_fails_is_raised_by_drain_and_later_jobs_skip():
    worker, ran = HostWorker(1, inline=True), []

    def fail():
        raise ValueError("boom")

    worker.submit(fail)
    worker.submit(lambda: ran.append(1))
    assert worker.failed and ran == []
    with pytest.raises(HostUpdateError, match="ValueError: boom") as info:
        worker.drain()
    assert isinstance(info.value.__cause__, ValueError)
    worker.submit(lambda: ran.append(2))  # the error was reported: jobs run again
    worker.drain()
    assert ran == [2]
