"""Faults lose nothing: non-finite gradients, failures in background work, bad checkpoints."""

import copy
import logging
import re
import time
import traceback
import weakref

import pytest
import torch

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.host.worker import HostUpdateError
import offload_plugin
import offload_plugin.engines.base as engine_module
import offload_plugin.host.grad_checks as grad_checks
import offload_plugin.host.gradients as gradients
import offload_plugin.host.inner_step as host_update
from reference_twin import assert_same_params, batch, make_model, offload, reference, train, trainable, twins


def _snapshot(opt):
    """Every host tensor the optimizer owns, copied."""
    return copy.deepcopy(opt.state_dict()), [s.master.clone() for s in opt.engine.slots]


def _assert_unchanged(opt, snap):
    sd, masters = snap
    now, now_masters = _snapshot(opt)
    for a, b in zip(masters, now_masters):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for index, st in sd["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(now["state"][index][key], value, rtol=0, atol=0)


def _poison_next_backward(model, value=float("inf")):
    """Make the next backward put ``value`` in the first hidden layer's weight gradient."""
    handle = None

    def hook(grad):
        handle.remove()
        grad = grad.clone()
        grad[0, 0] = value
        return grad

    handle = model[2].weight.register_hook(hook)


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_nonfinite_step_is_skipped_and_training_continues(offload_gradients, clip, caplog):
    """An inf gradient skips the whole step with a warning; later steps match a run without it."""
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    opt = offload(model, lr=1e-2, offload_gradients=offload_gradients)
    train(ref_model, ref, 2, clip=clip)
    train(model, opt, 2, clip=clip, via_optimizer=True)
    snap = _snapshot(opt)
    weights = [p.clone() for p in model.parameters()]
    _poison_next_backward(model)
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        train(model, opt, 1, start=2, clip=clip, via_optimizer=True)
    assert "the step was skipped" in caplog.text
    _assert_unchanged(opt, snap)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    train(ref_model, ref, 2, start=3, clip=clip)
    train(model, opt, 2, start=3, clip=clip, via_optimizer=True)
    assert_same_params(ref_model, model, exact=True)


@pytest.mark.parametrize("copy_batch_bytes", [None, 64])
def test_unchecked_nonfinite_step_is_skipped_whether_checked_on_the_way_or_first(copy_batch_bytes, monkeypatch, caplog):
    """With torchtune's own scale_grads (no verdict from the optimizer), a plain step checks
    the gradients itself: on their way to the host when they go in one copy batch, before
    any copy when in several (so that updates can start as batches land). Either way an
    inf skips the step with nothing changed, and training then matches torch's AdamW."""
    on_the_way = []
    real_on_device = grad_checks.finite_on_device
    monkeypatch.setattr(grad_checks, "finite_on_device", lambda ts: on_the_way.append(len(ts)) or real_on_device(ts))
    if copy_batch_bytes is not None:
        monkeypatch.setattr(gradients, "COPY_BATCH_BYTES", copy_batch_bytes)
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    opt = offload(model, lr=1e-2)
    train(ref_model, ref, 2)
    train(model, opt, 2)
    assert bool(on_the_way) == (copy_batch_bytes is None)
    snap = _snapshot(opt)
    _poison_next_backward(model)
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        train(model, opt, 1, start=2)
    assert "the step was skipped" in caplog.text
    _assert_unchanged(opt, snap)
    train(ref_model, ref, 2, start=3)
    train(model, opt, 2, start=3)
    assert_same_params(ref_model, model, exact=True)


def test_nonfinite_raise_policy_changes_nothing():
    """nonfinite_grads='raise' raises FloatingPointError before any host tensor changes."""
    model = make_model()
    opt = offload(model, lr=1e-2, nonfinite_grads="raise")
    train(model, opt, 1, via_optimizer=True)
    snap = _snapshot(opt)
    _poison_next_backward(model)
    with pytest.raises(FloatingPointError, match="inf or NaN"):
        train(model, opt, 1, start=1, via_optimizer=True)
    _assert_unchanged(opt, snap)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_during_overlapped_updates_spares_that_parameter(value, caplog, monkeypatch):
    """With updates overlapping backward, the parameter with the inf keeps its master and
    state; the verdicts come from the extremes taken on the device, not a host pass."""
    scanned = []
    real = grad_checks.all_finite
    monkeypatch.setattr(grad_checks, "all_finite", lambda ts: scanned.extend(ts) or real(ts))
    model = make_model()
    opt = offload(model, lr=1e-2, offload_gradients=True)
    train(model, opt, 1, via_optimizer=True)
    bad = model[2].weight
    master, state = opt.engine.slots[bad].master.clone(), copy.deepcopy(opt.state[bad])
    _poison_next_backward(model, value)
    opt.overlap_next_step(grad_scale=0.1)
    x, y = batch(5, 0, "cpu")
    scanned.clear()
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        ((model(x) - y) ** 2).sum().backward()
        opt.step()
    assert "1 parameters had an inf or NaN gradient" in caplog.text
    torch.testing.assert_close(opt.engine.slots[bad].master, master, rtol=0, atol=0)
    torch.testing.assert_close(opt.state[bad]["exp_avg"], state["exp_avg"], rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert scanned == []  # no pass over a gradient: its two extremes are read directly


def test_overlapped_update_checks_the_accumulated_sum_not_the_last_micro_batch(caplog):
    """An inf in an earlier micro-batch is in the host sum although the last micro-batch's
    gradient (whose extremes the device took) is finite: that parameter is still spared."""
    model = make_model()
    opt = offload(model, lr=1e-2, offload_gradients=True)
    train(model, opt, 1, via_optimizer=True)
    bad = model[2].weight
    master = opt.engine.slots[bad].master.clone()
    _poison_next_backward(model)
    x, y = batch(5, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()  # first micro-batch: carries the inf
    opt.overlap_next_step(grad_scale=0.1)
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        ((model(x) - y) ** 2).sum().backward()
        opt.step()
    assert "1 parameters had an inf or NaN gradient" in caplog.text
    torch.testing.assert_close(opt.engine.slots[bad].master, master, rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_scaling_detects_nonfinite_without_a_second_pass(offload_gradients, monkeypatch):
    """After scale_grads, step() reuses its verdict; a gradient changed since is scanned
    again (gradients left on the device: by the device, as they are copied to the host)."""
    scans, on_the_way = [], []
    real, real_on_device = grad_checks.all_finite, grad_checks.finite_on_device
    monkeypatch.setattr(grad_checks, "all_finite", lambda ts: scans.append(len(ts)) or real(ts))
    monkeypatch.setattr(grad_checks, "finite_on_device",
                        lambda ts: on_the_way.append(sum(t.numel() for t in ts)) or real_on_device(ts))
    model = make_model()
    opt = offload(model, lr=1e-2, offload_gradients=offload_gradients)
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    opt.scale_grads(0.5)
    opt.step()
    assert scans == [] and on_the_way == []
    ((model(x) - y) ** 2).sum().backward()  # without zero_grad: accumulates onto the grads
    opt.step()
    if offload_gradients:
        assert scans == [4] and on_the_way == []
    else:  # every trainable element, once, as it is copied (on the CPU by all_finite itself)
        assert on_the_way == [sum(p.numel() for p in model.parameters() if p.requires_grad)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_finite_gradients_whose_sum_overflows_are_not_skipped(dtype, caplog):
    """The device's verdict is a sum of absolute values, which overflows for finite values
    near the dtype's largest: such a step is confirmed finite and taken, as torch takes it."""
    g = torch.full((8,), torch.finfo(dtype).max / 2, dtype=dtype)
    ours = torch.nn.Parameter(torch.ones(8, dtype=dtype))
    theirs = torch.nn.Parameter(torch.ones(8, dtype=dtype))
    opt = CPUOffloadOptimizer([ours], lr=1e-2, fused=True)
    ref = torch.optim.AdamW([theirs], lr=1e-2, fused=True)
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        for p, o in ((ours, opt), (theirs, ref)):
            p.grad = g.clone()
            o.step()
    assert "inf or NaN" not in caplog.text
    assert float(opt.state[ours]["step"]) == 1  # taken (the weight may round back to 1)
    assert torch.equal(ours.detach(), theirs.detach())
    assert torch.equal(opt.state[ours]["exp_avg"], ref.state[theirs]["exp_avg"])


def test_failure_in_host_update_surfaces_with_its_traceback(monkeypatch):
    """An exception inside the background update reaches step() with the original cause; no hang."""
    model = make_model()
    opt = offload(model, lr=1e-2)

    def broken(*args, **kwargs):
        raise ValueError("injected host-update failure")

    monkeypatch.setattr(host_update, "update_slots", broken)
    with pytest.raises(HostUpdateError, match="injected host-update failure") as info:
        train(model, opt, 1)
    assert isinstance(info.value.__cause__, ValueError)
    frames = traceback.extract_tb(info.value.__cause__.__traceback__)
    assert frames[-1].name == "broken"
    monkeypatch.undo()
    opt.zero_grad()
    train(model, opt, 1)  # the optimizer keeps working


@pytest.mark.parametrize("overlap", [False, True])
def test_failure_in_transfer_surfaces(overlap, monkeypatch):
    """A failing weight copy, during step() or during backward, is raised by step()."""
    model = make_model()
    opt = offload(model, lr=1e-2, offload_gradients=True)

    def broken(pairs, *args, **kwargs):
        raise RuntimeError("injected transfer failure")

    monkeypatch.setattr(opt.engine.transfers, "to_device", broken)
    if overlap:
        opt.overlap_next_step(grad_scale=1.0)
    x, y = batch(0, 0, "cpu")
    ((model(x) - y) ** 2).sum().backward()
    with pytest.raises(HostUpdateError, match="injected transfer failure"):
        if not overlap:
            opt.scale_grads(1.0)
        opt.step()


def test_state_dict_of_another_optimizer_class_is_refused():
    """An SGD checkpoint loaded into an AdamW-based optimizer: a clear error, nothing changed."""
    model = make_model()
    opt = offload(model, lr=1e-2)
    train(model, opt, 1)
    sgd = torch.optim.SGD(trainable(model), lr=0.1, momentum=0.9)
    train(model, sgd, 1)
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match="another optimizer class.*betas"):
        opt.load_state_dict(sgd.state_dict())
    _assert_unchanged(opt, snap)


def _torchao_state_dict(model, steps, minimal_size):
    """What torchao's CPUOffloadOptimizer saves: one AdamW per large tensor, one for the rest.

    Built from the same torch optimizers torchao builds internally (it cannot run without
    a GPU); returns the state dict and a model trained identically for reference.
    """
    params = trainable(model)
    big = [p for p in params if p.numel() >= minimal_size]
    small = [p for p in params if p.numel() < minimal_size]
    optims = [reference(torch.optim.AdamW, [{"params": p}], lr=1e-2, fused=True) for p in big]
    d_opt = reference(torch.optim.AdamW, [{"params": small}], lr=1e-2, fused=True)

    class Both:
        def step(self):
            for o in (*optims, d_opt):
                o.step()

        def zero_grad(self, set_to_none=True):
            for o in (*optims, d_opt):
                o.zero_grad(set_to_none)

    train(model, Both(), steps)
    return {"offloaded": [o.state_dict() for o in optims], "on-device": d_opt.state_dict()}


def test_torchao_checkpoint_is_converted_and_continues_exactly():
    """A torchao CPUOffloadOptimizer state dict loads, and training continues as AdamW would."""
    ref_model, model = twins()
    sd = _torchao_state_dict(ref_model, 3, minimal_size=512)
    model.load_state_dict(ref_model.state_dict())
    plain = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2, fused=True)
    converted = offload_plugin.convert_torchao_state_dict(sd, model_params := trainable(model),
                                                             minimal_size=512)
    plain.load_state_dict(copy.deepcopy(converted))
    opt = offload(model, lr=1e-2, fused=True)
    opt.load_state_dict(sd, torchao_minimal_size=512)
    train(ref_model, plain, 2, start=3)
    train(model, opt, 2, start=3)
    assert_same_params(ref_model, model, exact=True)
    assert len(model_params) == 4


def test_torchao_checkpoint_for_another_model_is_refused():
    """A torchao state dict whose tensors don't match the parameters: ValueError, nothing changed."""
    model = make_model()
    other = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4))
    sd = _torchao_state_dict(other, 1, minimal_size=512)
    opt = offload(model, lr=1e-2, fused=True)
    train(model, opt, 1)
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match="torchao"):
        opt.load_state_dict(sd, torchao_minimal_size=512)
    _assert_unchanged(opt, snap)


@pytest.mark.parametrize(
    "dtype,master_weights,kwargs",
    [
        (torch.float32, True, {}),
        (torch.bfloat16, True, {}),
        (torch.bfloat16, False, {}),
        (torch.float32, True, {"amsgrad": True}),
    ],
)
def test_host_memory_estimate_matches_what_is_allocated(dtype, master_weights, kwargs):
    """The preflight's estimate equals the host bytes actually held after the first step."""
    from offload_plugin.host import memory as host_memory

    model = make_model(dtype=dtype)
    opt = offload(model, lr=1e-3, master_weights=master_weights, **kwargs)
    train(model, opt, 1, via_optimizer=True)
    state = host_memory.state_tensors_per_param(torch.optim.AdamW, kwargs)
    needed = host_memory.bytes_needed(trainable(model), master_weights, state)
    step_counters = 4 * len(trainable(model))  # AdamW's 0-d `step` tensors
    assert opt.host_memory_bytes() == needed + step_counters


def test_host_memory_preflight_refuses_before_allocating(monkeypatch):
    """Too little host memory: HostMemoryError naming need, limit and options; nothing allocated."""
    from offload_plugin import HostMemoryError
    from offload_plugin.host import memory as host_memory

    monkeypatch.setattr(host_memory, "available_bytes", lambda: (1000, "the cgroup limit in test"))
    allocations = []
    monkeypatch.setattr(engine_module, "build_slots", lambda *a: allocations.append(a) or [])
    model = make_model(dtype=torch.bfloat16)
    with pytest.raises(HostMemoryError) as info:
        CPUOffloadOptimizer(model.parameters(), master_weights=True)
    message = str(info.value)
    needed = host_memory.bytes_needed(trainable(model), True, 2)  # (AdamW: two moments)
    assert f"needs about {needed / 1024:.1f} KiB" in message and "1,188 trainable elements" in message
    # (1000 bytes, less what other optimizers of this process promised: small sizes in small units)
    assert re.search(r"may use only (1\.0 KiB|\d+ bytes) more", message), message
    assert "cgroup limit in test" in message and "master_weights=False" in message
    assert allocations == []
    monkeypatch.undo()
    CPUOffloadOptimizer(model.parameters(), check_host_memory=False)  # the documented bypass


def test_host_memory_preflight_counts_what_the_other_optimizers_will_allocate(monkeypatch):
    """torchtune's optimizer_in_bwd builds one optimizer per parameter, each making its state
    at its first step: each preflight counts the state the others built before it will
    allocate, so the optimizer that would not fit is refused at construction (not killed
    by the OOM killer at the first step); once they have stepped, nothing is counted twice."""
    from offload_plugin import HostMemoryError
    from offload_plugin.host import memory as host_memory

    monkeypatch.setattr(host_memory, "_promised", weakref.WeakKeyDictionary())  # (no other test's)
    layers = torch.nn.Sequential(*(torch.nn.Linear(16, 16, bias=False) for _ in range(4))).to(torch.bfloat16)
    params = list(layers.parameters())
    state = host_memory.state_tensors_per_param(torch.optim.AdamW, {})
    need = host_memory.bytes_needed(params[:1], True, state)  # each alone, all alike
    later = host_memory.bytes_needed(params[:1], True, state, host_copies=False)  # its state
    monkeypatch.setattr(host_memory, "available_bytes", lambda: (need + 2 * later, "the cgroup limit in test"))
    CPUOffloadOptimizer([params[0]], master_weights=True)  # dropped at once: promises nothing any more
    built = [CPUOffloadOptimizer([p], master_weights=True) for p in params[:3]]
    with pytest.raises(HostMemoryError, match=r"3 optimizer\(s\) of this process"):
        CPUOffloadOptimizer([params[3]], master_weights=True)
    layers(torch.randn(2, 16, dtype=torch.bfloat16)).sum().backward()
    for optimizer in built:
        optimizer.step()
    CPUOffloadOptimizer([params[3]], master_weights=True)  # their state is allocated now

    # One optimizer's second group counts the state its first promised.
    monkeypatch.setattr(host_memory, "_promised", weakref.WeakKeyDictionary())
    monkeypatch.setattr(host_memory, "available_bytes", lambda: (need + later - 1, "the cgroup limit in test"))
    with pytest.raises(HostMemoryError, match=r"1 optimizer\(s\) of this process"):
        CPUOffloadOptimizer([{"params": [params[0]]}, {"params": [params[1]]}], master_weights=True)


def test_available_memory_reads_meminfo_and_cgroup():
    """The limit comes from this machine's MemAvailable or cgroup, and is plausible."""
    from offload_plugin.host import memory as host_memory

    free, source = host_memory.available_bytes()
    assert free is not None and 0 < free < 2**50
    assert "MemAvailable" in source or "cgroup" in source


def test_pinning_failure_falls_back_to_pageable_memory(monkeypatch, caplog):
    """If page-locking fails, buffers are ordinary memory and a warning says so."""
    from offload_plugin.host import buffers as host_buffers

    monkeypatch.setattr(host_buffers, "_pin", lambda block: False)
    arena = host_buffers.HostArena(pin=True)
    with caplog.at_level(logging.WARNING, logger="offload_plugin"):
        a, b = arena.allocate([3, 5], torch.float32)
    assert "Could not pin" in caplog.text
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.tolist() == [1.0] * 3 and b.tolist() == [2.0] * 5
    assert b.data_ptr() == a.data_ptr() + 3 * 4  # consecutive in one block


def test_optimizers_share_the_arena_and_count_their_own_bytes(monkeypatch):
    """Small buffers of several optimizers come out of one shared chunk (one page-locking
    call, not one per tensor); each optimizer counts what it asked for; a large request
    gets a block of its own."""
    from offload_plugin.host import buffers as host_buffers

    monkeypatch.setattr(host_buffers.HostArena, "CHUNK_BYTES", 1 << 16)
    arena = host_buffers.HostArena(pin=False)
    first, second = arena.account(), arena.account()
    (a,) = first.allocate([100], torch.float32)
    (b,) = second.allocate([10], torch.float32)
    (big,) = second.allocate([1 << 15], torch.float32)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert big.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert b.data_ptr() % 64 == a.data_ptr() % 64  # each request starts on a cache line
    assert (first.nbytes(), second.nbytes()) == (400, 40 + 4 * (1 << 15))
    a.fill_(1.0)
    b.fill_(2.0)
    assert bool((a == 1).all()) and bool((b == 2).all())  # no overlap


def test_host_worker_runs_urgent_jobs_before_queued_updates():
    """An accumulated gradient's addition (urgent) does not wait behind queued updates."""
    from offload_plugin.host.worker import HostWorker
    import threading

    worker, order, gate = HostWorker(1), [], threading.Event()
    worker.submit(gate.wait)  # holds the thread while the queue fills
    for i in range(3):
        worker.submit(lambda i=i: order.append(f"update{i}"))
    worker.submit(lambda: order.append("add0"), urgent=True)
    worker.submit(lambda: order.append("add1"), urgent=True)
    gate.set()
    worker.drain()
    worker.close()
    assert order == ["add0", "add1", "update0", "update1", "update2"]
    assert worker.busy_s > 0


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_a_dropped_optimizer_is_freed_and_stops_its_host_thread(offload_gradients):
    """Dropping the model and the optimizer frees the optimizer (its host memory) and ends
    its host worker's thread (with its OpenMP team), so a process that builds many (a
    sweep, a notebook) does not keep them all."""
    import gc
    import threading
    import weakref

    def worker_threads():
        return {t for t in threading.enumerate() if t.name == "offload-host-update"}

    gc.collect()
    before = worker_threads()
    model = make_model()
    # A thread count no other optimizer of this process uses: optimizers share a worker
    # per device and thread count (offload_plugin.host.process), which the last one frees.
    opt = offload(model, lr=1e-2, offload_gradients=offload_gradients, host_threads=7)
    train(model, opt, 2, via_optimizer=True)
    started = worker_threads() - before
    assert len(started) == 1
    freed = weakref.ref(opt)
    del model, opt
    gc.collect()
    assert freed() is None
    for thread in started:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_exit_joins_the_thread_of_a_worker_already_collected():
    """At exit (atexit), a worker thread is joined even when its worker is gone: the thread
    may still be freeing that worker's optimizer, and a daemon thread caught in C++ code by
    the interpreter's shutdown aborts the process. Here the thread frees the last
    reference to the worker, whose attribute takes a while to go."""
    import threading
    import time

    from offload_plugin.host import worker as host_worker

    freeing = threading.Event()

    class SlowToFree:
        def __del__(self):
            freeing.set()
            time.sleep(0.5)

    worker = host_worker.HostWorker(1)
    worker.payload = SlowToFree()
    running, gate = threading.Event(), threading.Event()
    worker.submit(lambda: running.set() or gate.wait())
    thread = worker._thread
    assert running.wait(10)
    del worker  # the running job's thread holds the last reference now
    gate.set()
    assert freeing.wait(10)  # the worker is gone; its thread is still freeing it
    host_worker._stop_all_workers()
    assert not thread.is_alive()


@pytest.mark.parametrize("delayed", [False, True], ids=["exact", "delayed"])
def test_accumulated_gradients_are_added_by_the_worker_not_the_training_thread(delayed):
    """With offload_gradients, each micro-batch's gradient is added to the host sum by the
    host worker while backward goes on, not inside the backward hook; training still
    matches torch's AdamW (the delayed mode's own reference is in test_delayed_update)."""
    import threading

    adders = []

    class RecordingLock:  # who holds a slot's lock while an addition is pending does it
        def __init__(self, slot):
            self.slot, self.lock = slot, threading.Lock()

        def __enter__(self):
            self.lock.acquire()
            if self.slot.incoming_pending:
                adders.append(threading.current_thread().name)

        def __exit__(self, *exc):
            self.lock.release()

    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2)
    ours = offload(model, lr=1e-2, offload_gradients=True, delayed_update=delayed)
    for slot in ours.engine.slots:
        slot.complete_lock = RecordingLock(slot)
    train(ref_model, ref, 3, accum=3)
    for step in range(3):
        for micro in range(3):
            x, y = batch(step, micro, "cpu")
            ((model(x) - y) ** 2).sum().backward()
            time.sleep(0.1)  # as if the next micro-batch's forward ran: the worker adds now
        ours.scale_grads(1.0 / 24)
        ours.step()
        ours.zero_grad()
    if not delayed:
        assert_same_params(ref_model, model, exact=True)
    # 3 micro-batches: 2 additions per parameter and step, none on the training thread.
    assert len(adders) == 3 * 2 * len(trainable(model))
    assert set(adders) == {"offload-host-update"}, adders


def test_block_span_covers_views_with_empty_ends():
    """Weights are widened block by block over consecutive views; an empty view (a rank's
    empty FSDP2 shard) first or last must not break the span (its data pointer is null)."""
    from offload_plugin.host.buffers import HostArena, _span

    views = HostArena(pin=False).allocate([0, 3, 0, 5, 0], torch.float32)
    span = _span(views)
    assert span.numel() == 8 and span.data_ptr() == views[1].data_ptr()
    span.copy_(torch.arange(8.0))
    assert views[1].tolist() == [0.0, 1.0, 2.0] and views[3].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize("mode", ["overlap", "clipping", "delayed"])
def test_second_backward_after_announcing_the_last_is_refused(mode):
    """overlap_next_step() announces the LAST backward: updates (or norms, or weight
    returns) start from its gradients, so another backward before step() is an error,
    not a silently doubled update."""
    model = make_model()
    opt = offload(model, lr=1e-2, offload_gradients=True, delayed_update=mode == "delayed")
    train(model, opt, 1, via_optimizer=True)
    x, y = batch(5, 0, "cpu")
    opt.overlap_next_step(grad_scale=0.1, clipping=mode == "clipping")
    ((model(x) - y) ** 2).sum().backward()
    # Let the weights this backward's updates (or, delayed, the last step's) send back land
    # first: one copied in between the next forward and its backward would make autograd
    # refuse that backward itself (a weight modified in place), before our check runs.
    opt.engine.worker.drain()
    with pytest.raises(RuntimeError, match="LAST backward"):
        ((model(x) - y) ** 2).sum().backward()


def test_optimizers_of_a_process_share_one_host_worker_and_stay_exact():
    """torchtune's optimizer_in_bwd builds one optimizer per parameter: all of them share
    one host worker thread and one pair of streams, and each still trains exactly."""
    ref_model, model = twins()
    ref = reference(torch.optim.AdamW, trainable(ref_model), lr=1e-2, fused=True)
    per_param = [CPUOffloadOptimizer([p], lr=1e-2, fused=True, offload_gradients=True)
                 for p in trainable(model)]
    assert len({id(o.engine.worker) for o in per_param}) == 1
    assert len({id(o.engine.transfers) for o in per_param}) == 1
    for step in range(3):
        for m, opts in ((ref_model, [ref]), (model, per_param)):
            x, y = batch(step, 0, "cpu")
            ((m(x) - y) ** 2).sum().backward()
            for o in opts:
                if o is ref:
                    [p.grad.mul_(0.125) for p in trainable(m)]
                else:
                    o.scale_grads(0.125)
                o.step()
                o.zero_grad()
    assert_same_params(ref_model, model, exact=True)
