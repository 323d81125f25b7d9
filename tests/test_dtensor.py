"""CPUOffloadOptimizer on FSDP2 (``fully_shard``) DTensor parameters, 2 processes (issue #5).

Every test runs twice: on 2 CPU processes over gloo (``[cpu]``), and on 2 GPUs over NCCL
(``[cuda]``, skipped without 2 CUDA devices), where the parameters are CUDA DTensors, the
optimizer's host state is wrapped as DTensors on a CUDA mesh, and its collectives (global
norm, non-finite verdict) run on the GPUs. The process group is NCCL alone, as torchtune's
own distributed recipe sets it up without fsdp_cpu_offload (ours adds cpu:gloo): nothing
may depend on a host backend.

Each rank offloads its own shard. The model's layers have odd sizes, so shards are
uneven and one rank holds an empty shard of the last layer. The references: torch's
AdamW on the unsharded model in a single CPU process, fed the global batch (the FSDP2
model sees half of it on each rank); an identically sharded twin, which sees exactly the
same gradients, for bitwise checks; and an uninterrupted run for resuming.

The twin's optimizer: on CPU, torch's fused AdamW on the twin's shards. On CUDA, torch's
fused GPU kernel need not round like the CPU kernel our host update uses, so the twin
runs torch's fused CPU AdamW on host copies of its shards' weights and gradients and
copies the result back (``_HostTwinAdamW``): the same arithmetic as ours, through plain
torch, so the comparison stays bitwise. Two checks are looser on CUDA: with clipping, our
global norm (per-tensor norms, on the host for offloaded gradients) and torch's (foreach
norms on the GPU) may differ in the last bit, so clipped runs are compared to the twin
within 1e-6; and the single-process CPU reference computes its gradients on the CPU,
so it is matched within 1e-5 instead of 1e-6.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from offload_plugin import CPUOffloadOptimizer

WORLD = 2
LR, WD = 1e-2, 0.01
pytestmark = [pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
              pytest.mark.slow]  # (starts processes: left out of the quick lane)
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices (NCCL)")),
]
DEVICE = torch.device("cpu")  # this rank's device; set in each spawned process


def _spawn(fn, tmp_path: Path, device: str, *args) -> None:
    """Run ``fn(rank, *args)`` on 2 ranks (gloo on CPU, NCCL on 2 GPUs); a failure on either rank fails the test."""
    mp.spawn(_init_and_run, args=(fn, device, str(tmp_path / "rendezvous"), args), nprocs=WORLD, join=True)


def _init_and_run(rank, fn, device, store, args):
    global DEVICE
    from offload_plugin.host import process

    process._INLINE_ON_CPU = False  # CPU ranks stand in for GPU ones: the host thread's path
    torch.set_num_threads(1)  # 2 cores for 2 ranks
    if device == "cuda":
        torch.cuda.set_device(rank)
        DEVICE = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD
    )
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
    # The rank then leaves through the interpreter's normal shutdown (mp.spawn fails the
    # test on a non-zero exit): tests/test_exit.py checks that exit on its own.


def _model(dtype=torch.float32) -> torch.nn.Module:
    """Odd sizes: 5 and 3 rows split 3/2 and 2/1; the last layer's single row leaves rank 1 nothing."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)
    ).to(dtype)


def _sharded(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model).to(DEVICE)
    mesh = init_device_mesh(DEVICE.type, (WORLD,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch(step: int, rank=None, dtype=torch.float32):
    """The global batch of ``step`` (8 examples), or ``rank``'s half of it."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    if rank is not None:
        x, y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
    return x.to(dtype), y.to(dtype)


def _backward(model, step, rank=None, dtype=torch.float32):
    # Mean over the examples: FSDP2 averages gradients over ranks, so half-batch means on
    # 2 ranks give the gradient of the global-batch mean.
    x, y = _batch(step, rank, dtype)
    device = next(model.parameters()).device  # the sharded model's, or the reference's
    ((model(x.to(device)) - y.to(device)) ** 2).mean().backward()


def _train(model, opt, steps, rank=None, clip=None, first_step=0, dtype=torch.float32, overlap=False):
    norms = []
    for step in range(first_step, first_step + steps):
        if overlap:
            opt.overlap_next_step(grad_scale=1.0)
        _backward(model, step, rank, dtype)
        if clip is not None:
            norm = opt.clip_grad_norm_(clip) if isinstance(opt, CPUOffloadOptimizer) else (
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            )
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        opt.step()
        opt.zero_grad()
    return norms


def _full(model) -> list:
    """The full parameters, on the host."""
    return [(p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu() for p in model.parameters()]


def _gather(state: DTensor) -> torch.Tensor:
    """The full value of a state DTensor, on the host. Host-backed state on a CUDA mesh goes to
    the GPU first, as torch's get_optimizer_state_dict(full_state_dict=True) moves it: NCCL
    cannot gather host tensors."""
    if state.device.type != state.device_mesh.device_type:
        state = state.to(state.device_mesh.device_type)
    return state.full_tensor().cpu()


class _HostTwinAdamW:
    """The CUDA twin's optimizer: torch's fused AdamW run on the host, on copies of each
    rank's shards (weights and gradients), the result copied back into the shards."""

    def __init__(self, params):
        self.params = list(params)
        self.host = [p.to_local().detach().to("cpu", copy=True) for p in self.params]
        self.opt = torch.optim.AdamW(self.host, lr=LR, weight_decay=WD, fused=True)

    def step(self):
        for p, h in zip(self.params, self.host):
            h.grad = p.grad.to_local().cpu() if p.grad is not None else None
        self.opt.step()
        with torch.no_grad():
            for p, h in zip(self.params, self.host):
                p.to_local().copy_(h)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _twin_optimizer(model):
    if DEVICE.type == "cuda":
        return _HostTwinAdamW(model.parameters())
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)


def _offload(model, **kwargs):
    return CPUOffloadOptimizer(model.parameters(), lr=LR, weight_decay=WD, fused=True, **kwargs)


def _check_matches_adamw(rank, clip):
    base = _model()
    reference = copy.deepcopy(base)  # one process, global batch
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    ref_norms = _train(reference, ref_opt, 3, clip=clip)
    twin = _sharded(base)  # same shards, same gradients: torch's fused AdamW must agree bit for bit
    twin_norms = _train(twin, _twin_optimizer(twin), 3, rank, clip)
    cuda = DEVICE.type == "cuda"
    ref_tol = dict(rtol=1e-5, atol=1e-6) if cuda else dict(rtol=1e-6, atol=1e-7)
    # Gradients copied at step(), offloaded during backward, and with overlap_next_step
    # (which, sharded, overlaps only the transfers so that ranks agree on inf/NaN first).
    for offload_gradients, overlap in ((False, False), (True, False), (True, True)):
        model = _sharded(base)
        opt = _offload(model, offload_gradients=offload_gradients)
        # Each rank holds its own shard on the host: 3+2 rows on rank 0 of the 5-row layer.
        assert [tuple(s.master.shape) for s in opt.engine.slots.in_order(opt.engine.params())][:2] == ([(3, 4), (3,)] if rank == 0 else [(2, 4), (2,)])
        norms = _train(model, opt, 3, rank, clip, overlap=overlap)
        for got, twin_p, ref_p in zip(_full(model), _full(twin), _full(reference)):
            if cuda and clip is not None:
                torch.testing.assert_close(got, twin_p, rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(got, twin_p)
            torch.testing.assert_close(got, ref_p, **ref_tol)
        for norm, twin_norm, ref_norm in zip(norms, twin_norms, ref_norms):
            assert not isinstance(norm, DTensor)
            torch.testing.assert_close(norm.cpu(), twin_norm.cpu(), rtol=1e-6, atol=0)
            torch.testing.assert_close(norm.cpu(), ref_norm, rtol=ref_tol["rtol"], atol=0)
            norm = norm.to(DEVICE)  # NCCL gathers device tensors only
            same = [torch.zeros_like(norm) for _ in range(WORLD)]
            dist.all_gather(same, norm)
            assert all(torch.equal(n, norm) for n in same)  # every rank clips by the same coefficient
    # The single process's full (unsharded) state loads too: each rank keeps its slice, and
    # hands it back as DTensors that gather to the original.
    opt = _offload(_sharded(base))
    opt.load_state_dict(ref_opt.state_dict())
    for got, want in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        assert torch.equal(got["step"], want["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(got[key], DTensor) and torch.equal(_gather(got[key]), want[key]), key


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_training_matches_adamw(tmp_path, device):
    """3 steps on uneven shards (one empty), gradients offloaded or not, overlapped or not: bitwise equal to
    torch's fused (CPU) AdamW on the same shards, and to single-process AdamW within float noise."""
    _spawn(_check_matches_adamw, tmp_path, device, None)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_uses_the_global_norm(tmp_path, device):
    """clip_grad_norm_ returns the norm over both ranks' shards (as the single-process clip and
    torch's clip over FSDP2 gradients do), the same on both ranks, and clips both alike."""
    _spawn(_check_matches_adamw, tmp_path, device, 0.05)  # clips every step (norms ~0.5-2)


def _check_nonfinite(rank, offload_gradients, clip):
    model = _sharded(_model())
    if rank == 1:  # only rank 1's shard of the first weight gets a NaN, after the reduce-scatter
        first = next(model.parameters())
        first.register_post_accumulate_grad_hook(lambda p: p.grad.to_local()[0].fill_(float("nan")))
    opt = _offload(model, offload_gradients=offload_gradients)
    before = [t.clone() for t in _full(model)]
    _backward(model, 0, rank)
    if clip:
        assert torch.isnan(opt.clip_grad_norm_(1.0))  # the global norm, on both ranks
    else:
        opt.scale_grads(0.5)  # flags the NaN on rank 1 only; step() must tell rank 0
    opt.step()
    opt.zero_grad()
    for got, want in zip(_full(model), before):
        assert torch.equal(got, want)
    assert len(opt.state) == 0  # nothing was updated, not even the step count
    # The next, finite step is taken on both ranks.
    if rank == 1:
        first._post_accumulate_grad_hooks.clear()
    _backward(model, 1, rank)
    opt.step()
    assert all(not torch.equal(g, w) for g, w in zip(_full(model), before))


@pytest.mark.parametrize(
    "offload_gradients, clip", [(False, False), (True, False), (False, True)], ids=["scale", "offload-scale", "clip"]
)
@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_gradient_on_one_rank_skips_the_step_on_all(tmp_path, device, offload_gradients, clip):
    """A NaN in rank 1's shard only: both ranks skip the step (weights and state untouched),
    then both take the next finite one, so the replicas stay in step."""
    _spawn(_check_nonfinite, tmp_path, device, offload_gradients, clip)


def _check_dcp_resume(rank, ckpt_dir):
    dtype, kwargs = torch.bfloat16, {"master_weights": True}
    base = _model(dtype)
    straight = _sharded(base)
    straight_opt = _offload(straight, **kwargs)
    _train(straight, straight_opt, 4, rank, dtype=dtype)

    model = _sharded(base)
    opt = _offload(model, **kwargs)
    _train(model, opt, 2, rank, dtype=dtype)
    optim_sd = get_optimizer_state_dict(model, opt)
    for name, entry in optim_sd["state"].items():  # saved by shard, fp32 masters included
        assert isinstance(entry["exp_avg"], DTensor) and isinstance(entry["master_weight"], DTensor), name
        assert entry["master_weight"].dtype == torch.float32
    dcp.save({"model": get_model_state_dict(model), "optim": optim_sd}, checkpoint_id=ckpt_dir)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert full["state"]["0.weight"]["exp_avg"].shape == (5, 4)  # gathered, not rank 0's 3 rows

    resumed = _sharded(base)
    opt = _offload(resumed, **kwargs)
    # A fresh optimizer: DSD initializes its state with a step at lr=0, which must leave
    # the weights alone and the lr as it was.
    before = [t.clone() for t in _full(resumed)]
    template = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, opt)}
    assert all(torch.equal(a, b) for a, b in zip(_full(resumed), before))
    assert opt.param_groups[0]["lr"] == LR
    dcp.load(template, checkpoint_id=ckpt_dir)
    set_model_state_dict(resumed, template["model"])
    set_optimizer_state_dict(resumed, opt, template["optim"])
    _train(resumed, opt, 2, rank, first_step=2, dtype=dtype)
    for got, want in zip(_full(resumed), _full(straight)):
        assert torch.equal(got, want)
    for got, want in zip(opt.state_dict()["state"].values(), straight_opt.state_dict()["state"].values()):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key].to_local() if key != "step" else got[key],
                               want[key].to_local() if key != "step" else want[key]), key


@pytest.mark.parametrize("device", DEVICES)
def test_dcp_save_load_resumes_exactly(tmp_path, device):
    """bf16 model, fp32 masters: get_optimizer_state_dict + dcp.save after 2 steps, then a fresh
    sharded model and optimizer restored by dcp.load + set_optimizer_state_dict continue for
    2 steps bit for bit like the uninterrupted run."""
    _spawn(_check_dcp_resume, tmp_path, device, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("inner", ["torch.optim.AdamW", "offload_plugin.AdamW8bit"])
def test_a_state_dict_one_rank_refuses_is_refused_on_every_rank(tmp_path, inner):
    """Each rank checks its own part: a NaN in rank 1's rows alone (and, in another entry,
    state laid out unlike its parameter, which each rank redistributes) must refuse the
    load on both ranks with their states unchanged, not load on rank 0 (the ranks' states
    would differ) or leave rank 1 waiting alone in a collective."""
    _spawn(_check_refused_everywhere, tmp_path, "cpu", inner)


def _check_refused_everywhere(rank, inner):
    from torch.distributed.tensor import Replicate

    dtype = torch.float32 if inner == "torch.optim.AdamW" else torch.bfloat16
    kwargs = {} if inner == "torch.optim.AdamW" else {"min_8bit_size": 0}  # (fp32 moments 'state1': small)
    model = _sharded(_model(dtype))
    opt = CPUOffloadOptimizer(model.parameters(), optimizer_cls=inner, lr=LR, **kwargs)
    _train(model, opt, 1, rank, dtype=dtype)
    saved = opt.state_dict()
    _train(model, opt, 1, rank, first_step=1, dtype=dtype)
    flat = lambda e: {**e, **e.get("__bnb_optimizer_quant_state__", {})}
    locals_of = lambda sd: {(i, k): v.to_local().clone() for i, e in sd["state"].items()
                            for k, v in flat(e).items() if isinstance(v, DTensor)}
    before = locals_of(opt.state_dict())
    key = "exp_avg_sq" if inner == "torch.optim.AdamW" else "state1"
    entry = dict(saved["state"][0])
    value = entry[key] if key in entry else entry["__bnb_optimizer_quant_state__"][key]
    local = value.to_local().clone()
    if rank == 1:
        local[-1, 0] = float("nan")  # (the 5-row weight: rank 1 holds rows 3 and 4)
    bad = DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
    if key in entry:
        entry[key] = bad
    else:
        entry["__bnb_optimizer_quant_state__"] = dict(entry["__bnb_optimizer_quant_state__"], **{key: bad})
    saved["state"][0] = entry
    if inner == "torch.optim.AdamW":  # (a later entry whose collective every rank must reach)
        later = dict(saved["state"][2])
        later["exp_avg"] = later["exp_avg"].redistribute(later["exp_avg"].device_mesh, [Replicate()])
        saved["state"][2] = later
    with pytest.raises(ValueError, match="inf or NaN" if rank == 1 else "another rank refused"):
        opt.load_state_dict(saved)
    after = locals_of(opt.state_dict())
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _check_qlora(rank, clip):
    """NF4 base weights sharded by FSDP2 (torchao's NF4Tensor all-gathers its shards) with
    trainable LoRA adapters: the optimizer drops the frozen NF4 shards and trains the
    adapters like single-process AdamW over the whole batch."""
    from torchtune.modules.peft import LoRALinear, get_adapter_params, set_trainable_params

    torch.manual_seed(0)
    # 256 wide: an NF4 weight shards in whole 16384-element scaler blocks per rank.
    model = torch.nn.Sequential(
        LoRALinear(256, 256, rank=4, alpha=8, quantize_base=True), torch.nn.Tanh(),
        LoRALinear(256, 256, rank=4, alpha=8, quantize_base=True))
    for layer in (model[0], model[2]):
        torch.nn.init.normal_(layer.lora_b.weight, std=0.02)  # adapters that do something
    set_trainable_params(model, get_adapter_params(model))
    ref = copy.deepcopy(model)
    sharded = copy.deepcopy(model).to(DEVICE)
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer)
    fully_shard(sharded)
    opt = CPUOffloadOptimizer(sharded.parameters(), lr=LR, weight_decay=WD, offload_gradients=True)
    assert len(opt.engine.slots) == 4  # the adapters; the NF4 weights were dropped
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)
        half = slice(4 * rank, 4 * rank + 4)
        if clip is None:
            opt.overlap_next_step(grad_scale=1.0)
        ((sharded(x[half].to(DEVICE)) - y[half].to(DEVICE)) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        if clip is not None:
            torch.testing.assert_close(
                opt.clip_grad_norm_(clip), torch.nn.utils.clip_grad_norm_(
                    [p for p in ref.parameters() if p.requires_grad], clip), rtol=1e-5, atol=1e-7)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for (name, p), q in zip(sharded.named_parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.full_tensor().cpu(), q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["overlap", "clip"])
def test_qlora_nf4_base_sharded_trains_adapters_like_one_process(tmp_path, clip):
    _spawn(_check_qlora, tmp_path, "cpu", clip)


def _compact_model() -> torch.nn.Module:
    """bf16. Rows of 256 elements are whole blocks (compact, block scales per row, the 7
    rows split 4/3); rows of 7 are not (fp32 state); the last layer's single row of 256
    leaves rank 1 an empty shard of a compact parameter."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 7), torch.nn.Tanh(), torch.nn.Linear(7, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)
    ).to(torch.bfloat16)


def _compact_train(model, opt, steps, rank, first_step=0):
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 256, generator=g), torch.randn(8, 1, generator=g)
        half = slice(4 * rank, 4 * rank + 4)
        out = model(x[half].to(DEVICE, torch.bfloat16))
        ((out - y[half].to(DEVICE, torch.bfloat16)) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


class _HostTwinCompact(_HostTwinAdamW):
    """CompactAdamW itself on host copies of each rank's shards, told what they are shards of."""

    def __init__(self, params):
        from offload_plugin import CompactAdamW

        self.params = list(params)
        self.host = [p.to_local().detach().to("cpu", copy=True) for p in self.params]
        self.opt = CompactAdamW(self.host, lr=LR, weight_decay=WD, min_8bit_size=0)
        for p, h in zip(self.params, self.host):
            self.opt.shard_of(h, p.shape)


def _check_compact(rank, ckpt_dir):
    from offload_plugin import CompactAdamW

    base = _compact_model()

    def offload(model, **kwargs):
        return CPUOffloadOptimizer(model.parameters(), optimizer_cls=CompactAdamW, lr=LR, weight_decay=WD,
                                   min_8bit_size=0, **kwargs)

    twin = _sharded(base)
    _compact_train(twin, _HostTwinCompact(twin.parameters()), 3, rank)
    for offload_gradients in (False, True):
        model = _sharded(base)
        opt = offload(model, offload_gradients=offload_gradients)
        _compact_train(model, opt, 3, rank)
        for got, want in zip(model.parameters(), twin.parameters()):
            assert torch.equal(got.to_local().cpu(), want.to_local().cpu())
    state = opt.state_dict()["state"]
    rows = {0: 4 if rank == 0 else 3, 4: 1 if rank == 0 else 0}
    for index, local_rows in rows.items():  # compact: codes by element, block scales per row
        assert state[index]["exp_avg"].dtype == torch.uint8
        assert state[index]["exp_avg_absmax"].to_local().shape == (local_rows, 1), index
    assert state[2]["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in state[2]  # rows of 7

    # Saved by shard, resumed bit for bit; the full state dict gathers the scales by row.
    straight = _sharded(base)
    straight_opt = offload(straight)
    _compact_train(straight, straight_opt, 4, rank)
    model = _sharded(base)
    opt = offload(model)
    _compact_train(model, opt, 2, rank)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt_dir)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert full["state"]["0.weight"]["exp_avg_absmax"].shape == (7, 1)
    assert full["state"]["4.weight"]["exp_avg_absmax"].shape == (1, 1)
    # ... and the gathered state loads back into fresh shards (torch's DSD distributes it).
    again = _sharded(base)
    again.load_state_dict(model.state_dict())
    again_opt = offload(again)
    set_optimizer_state_dict(again, again_opt, full, options=StateDictOptions(full_state_dict=True))
    for got, want in zip(again_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        for key in want:
            bits = (lambda t: (t.to_local() if isinstance(t, DTensor) else t).reshape(-1).view(torch.uint8))
            assert torch.equal(bits(got[key]), bits(want[key])), key
    resumed = _sharded(base)
    opt = offload(resumed)
    template = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, opt)}
    dcp.load(template, checkpoint_id=ckpt_dir)
    set_model_state_dict(resumed, template["model"])
    set_optimizer_state_dict(resumed, opt, template["optim"])
    _compact_train(resumed, opt, 2, rank, first_step=2)
    for got, want in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(got.to_local().cpu(), want.to_local().cpu())
    for got, want in zip(opt.state_dict()["state"].values(), straight_opt.state_dict()["state"].values()):
        assert got.keys() == want.keys()
        for key in want:  # bit for bit (the remainders travel as bf16 bits, NaN patterns too)
            bits = (lambda t: (t.to_local() if isinstance(t, DTensor) else t).reshape(-1).view(torch.uint8))
            assert torch.equal(bits(got[key]), bits(want[key])), key
            assert got[key].dtype == want[key].dtype, key


@pytest.mark.parametrize("device", DEVICES)
def test_compact_state_on_fsdp2_shards_trains_and_resumes_exactly(tmp_path, device):
    """optimizer_cls=CompactAdamW on FSDP2 shards: each rank's update is CompactAdamW on its
    own rows, bit for bit; a compact parameter's block scales are kept per row, so the state
    saves by shard (DCP) and resumes bit for bit, and gathers whole (full_state_dict)."""
    _spawn(_check_compact, tmp_path, device, str(tmp_path / "ckpt"))
