"""The CUDA path itself: pinned buffers, stream ordering against the recipe, freed device grads.

The reference-twin tests elsewhere also run on CUDA; these check what only a GPU can show.
"""

import copy
import threading

import pytest
import torch
from torch import nn

from offload_plugin.engines import streamed
from offload_plugin.host.transfer import Transfers
from reference_twin import CUDA, offload, trainable

pytestmark = CUDA


def _wide_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).cuda()


def test_host_buffers_are_pinned(monkeypatch):
    """The host update's master weights and gradient buffers are page-locked, so copies run
    asynchronously (the streamed update keeps neither: its moments, test_streamed_gpu.py)."""
    monkeypatch.setattr(streamed.config, "enabled", False)
    opt = offload(_wide_model())
    for slot in opt.engine.slots:
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


def _pinned(*shape, value):
    return torch.full(shape, float(value)).pin_memory()


def test_weight_copies_go_through_the_cuda_runtime_and_wait_for_after():
    """Copies to the device are issued through torch's CUDA runtime (the fast path the
    benchmarks measure) and each waits for its ``after`` event: the compute stream sleeps,
    then overwrites the destination; a copy that did not wait would be overwritten."""
    transfers = Transfers(torch.device("cuda"))
    assert transfers._runtime is not None, "torch's libcudart was not found in this process"
    srcs = [_pinned(1024, 256, value=i + 1) for i in range(3)]
    dsts = [torch.empty(1024, 256, device="cuda") for _ in range(3)]
    events = []
    for src, dst in zip(srcs, dsts):  # each copy after a new `after` (none may be skipped)
        torch.cuda._sleep(50_000_000)
        dst.fill_(-1)
        after = transfers.mark_compute()
        events.append(transfers.to_device([(src, dst)], after=after))
        transfers.to_device([(src, dst)], after=after)  # the same `after` again
    transfers.order_compute_after(events[-1])
    for src, dst in zip(srcs, dsts):
        assert torch.equal(dst.cpu(), src)


def test_a_strided_destination_goes_through_torch():
    transfers = Transfers(torch.device("cuda"))
    src = torch.arange(32.0).reshape(4, 8).pin_memory()
    dst = torch.zeros(8, 4, device="cuda").t()  # not contiguous
    transfers.order_compute_after(transfers.to_device([(src, dst)]))
    assert torch.equal(dst.cpu(), src)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_weight_copies_reach_the_second_gpu_from_any_thread():
    """The host worker starts on device 0; a copy to cuda:1 must still land there."""
    transfers = Transfers(torch.device("cuda", 1))
    src, dst = _pinned(256, value=7), torch.zeros(256, device="cuda:1")
    result = {}
    thread = threading.Thread(target=lambda: result.update(event=transfers.to_device([(src, dst)])))
    thread.start()
    thread.join()
    transfers.order_compute_after(result["event"])
    assert torch.equal(dst.cpu(), src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_gradient_check_on_the_gpu_finds_any_nonfinite_value_and_changes_nothing(dtype, bad):
    """grad_checks.all_finite checks CUDA tensors together: a single inf or NaN in any of
    many tensors, of mixed dtypes and sizes, is found; finite values whose sum of absolute
    values overflows are still finite; the values it reads keep their bits."""
    from offload_plugin.host import grad_checks

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(n, device="cuda", generator=g).to(dtype) for n in (1, 7, 4096, 100_003)]
    tensors.append(torch.randn(33, device="cuda", generator=g))  # another dtype (or the same)
    tensors.append(torch.full((10,), torch.finfo(dtype).max / 2, device="cuda", dtype=dtype))
    tensors[3][5] = torch.finfo(dtype).tiny / 4  # a subnormal
    before = [t.clone() for t in tensors]
    assert grad_checks.all_finite(tensors)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    for i in range(len(tensors)):
        tensors[i][-1] = bad
        assert not grad_checks.all_finite(tensors), i
        tensors[i].copy_(before[i])


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_plain_step_on_the_gpu_checks_gradients_as_they_leave(bad, monkeypatch):
    """A plain step checks the gradients on the device as they are copied (packed small ones
    and a large one alone): one inf or NaN anywhere skips the step with nothing changed;
    finite steps (one whose sum of absolute values overflows among them) match torch's
    fused AdamW on host copies bit for bit."""
    from offload_plugin.host.transfer import PACK_MAX_BYTES

    # The host update's plain step (master weights, amsgrad, other optimizers take it on a
    # GPU); with these settings the streamed update would run (test_streamed_gpu.py).
    monkeypatch.setattr(streamed.config, "enabled", False)
    torch.manual_seed(0)
    shapes = [(8, 64)] * 40 + [(PACK_MAX_BYTES // 2 + 64,)]  # bf16: the last one is copied alone
    params = [nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16)) for s in shapes]
    host = [nn.Parameter(p.detach().cpu().clone()) for p in params]
    opt = offload(nn.ParameterList(params), lr=1e-2, fused=True)
    ref = torch.optim.AdamW(host, lr=1e-2, fused=True)
    for step in range(4):
        grads = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
        poisoned = step in (1, 2)
        if poisoned:  # a small (packed) gradient at step 1, the large one at step 2
            grads[7 if step == 1 else -1].view(-1)[3] = bad
        if step == 3:  # finite, but the sum of absolute values overflows: still taken
            grads[5].fill_(torch.finfo(torch.bfloat16).max / 2)
        for p, g in zip(params, grads):
            p.grad = g.cuda()
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        if poisoned:
            assert all(torch.equal(p, b) for p, b in zip(params, before)), step
            continue
        for p, g in zip(host, grads):
            p.grad = g
        ref.step()
        ref.zero_grad()
        assert all(torch.equal(p.cpu(), h.detach()) for p, h in zip(params, host)), step


def test_stock_lora_recipes_plain_step_checks_on_the_way_from_the_first_step(monkeypatch, device="cuda"):
    """As torchtune's lora_finetune_single_device runs the drop-in: QLoRA adapters (bf16) of
    a model built on the GPU, model.parameters() handed over (NF4 base included), gradients
    accumulated over micro-batches and scaled by torchtune's scale_grads with a tensor on
    the GPU. Adapters that fit one copy batch take the checked path at every step, the first
    included (no separate inf/NaN pass before the copies). (torchtune's own 1B QLoRA config,
    rank 64, has 85 MB of adapter gradients: several batches, checked first by design.)"""
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    from torchtune.training import scale_grads, set_default_dtype

    from offload_plugin import CPUOffloadOptimizer
    from offload_plugin.demo import qlora_tiny_llama
    from offload_plugin.host.scaling import Scaling

    separate = []  # (step, why the checked path was not taken)
    checked = Scaling.step_is_finite

    def separate_check(self, grads, meshes):
        separate.append((step, len(opt.engine.grads.copy_batches(opt.engine.slots.in_order(opt.engine.params()))),
                         self.finite.finite(grads), opt.engine.device_share, opt.engine.slots.sharded))
        return checked(self, grads, meshes)

    monkeypatch.setattr(Scaling, "step_is_finite", separate_check)
    monkeypatch.setattr(streamed.config, "enabled", False)  # (the host update's plain step, as above)
    torch.manual_seed(0)
    with set_default_dtype(torch.bfloat16), torch.device(device):  # as the recipe builds it
        model = qlora_tiny_llama(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                                 lora_rank=8, lora_alpha=16)
    set_trainable_params(model, get_adapter_params(model))
    opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 32), device=device)
    for step in range(3):
        num_tokens = torch.zeros((), device=device, dtype=torch.long)
        for micro in range(2):
            num_tokens += tokens.numel()
            (model(tokens).float().mean() * tokens.numel()).backward()
        scale_grads(model, 1 / num_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert separate == [], separate


@pytest.mark.parametrize("shape", [(), (1,)])
def test_gpu_scale_grads_by_a_host_count_does_not_wait_for_the_gpu(shape):
    """Our recipes count tokens on the host, so ``1 / num_tokens`` is a CPU tensor: scaling by
    it must not be a blocking copy (the host would wait for backward before queueing the
    step), and must give torchtune's scale_grads' bits: the factor rounded to bf16 when it
    is 0-dim, as the GPU kernel converts it, and not when it has a dimension (promoted)."""
    from torchtune import training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8)).cuda().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    opt = offload(model)
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    for m in (model, twin):
        m(x).float().square().sum().backward()
    factor = (1 / torch.tensor(37)).reshape(shape)  # on the host, as our recipes count tokens
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.scale_grads(factor)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    training.scale_grads(twin, factor.cuda())
    for a, b in zip(trainable(model), trainable(twin)):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("how", ["scale_grads", "overlap", "overlap_clipping"])
def test_gpu_offloaded_gradients_are_scaled_with_torchtunes_bits(monkeypatch, how):
    """On a GPU, torchtune's scale_grads multiplies bf16 gradients by 1/num_tokens rounded to
    bf16 (the kernel converts the fp32 factor). Offloaded gradients, scaled on the host by
    scale_grads() or inside the overlapped updates (with and without clipping's norms), get
    the same bits: the same host update then gives the same weights as a twin whose
    gradients torchtune scaled on the GPU before the step copied them."""
    from torchtune import training

    monkeypatch.setattr(streamed.config, "enabled", False)  # both twins: the host update
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8)).cuda().to(torch.bfloat16)
    twin, start = copy.deepcopy(model), copy.deepcopy(model)
    opt = offload(model, offload_gradients=True, lr=1e-3)
    ref = offload(twin, lr=1e-3)  # gradients stay on the GPU until step()
    for step in range(3):
        num_tokens = torch.tensor(37 + step)  # 1/37 and 1/38 need more bits than bf16 has
        x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
        if how != "scale_grads":
            opt.overlap_next_step(grad_scale=1 / num_tokens, clipping=how == "overlap_clipping")
        model(x).float().square().sum().backward()
        twin(x).float().square().sum().backward()
        if how == "scale_grads":
            opt.scale_grads(1 / num_tokens)
        elif how == "overlap_clipping":
            opt.clip_grad_norm_(1e9)  # (a coefficient of exactly 1: only the scaling acts)
        training.scale_grads(twin, (1 / num_tokens).cuda())
        for o in (opt, ref):
            o.step()
            o.zero_grad(set_to_none=True)
    for a, b, s in zip(trainable(model), trainable(twin), trainable(start)):
        assert torch.equal(a, b) and not torch.equal(a, s)


def test_gpu_overlap_with_trainable_parameters_of_two_dtypes_is_refused_with_advice():
    """One overlapped multiplier cannot be both scale_grads' bf16 and fp32 roundings."""
    model = nn.Sequential(nn.Linear(8, 8).cuda().to(torch.bfloat16), nn.Linear(8, 8).cuda())
    opt = offload(model, offload_gradients=True)
    with pytest.raises(ValueError, match="several dtypes.*call scale_grads"):
        opt.overlap_next_step(grad_scale=1 / torch.tensor(37))
