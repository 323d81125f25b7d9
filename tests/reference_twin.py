"""Shared pieces of the reference-twin tests: a model, its data, and a torchtune-shaped loop.

A twin test trains one copy of a model with a plain torch optimizer and a deep copy through
CPUOffloadOptimizer, then compares every parameter.
"""

import copy

import pytest
import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: covers the pinned-memory side-stream path",
)
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def make_model(device="cpu", dtype=torch.float32, seed=0) -> nn.Module:
    """A small MLP whose first layer is frozen, like a base model under adapters."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    model[0].requires_grad_(False)
    return model.to(device=device, dtype=dtype)


def batch(step: int, micro: int, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    return x.to(device, dtype), y.to(device, dtype)


def trainable(model: nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def train(model, opt, steps, *, start=0, accum=2, clip=None, sched=None, via_optimizer=False):
    """torchtune's order: backward per micro-batch, scale, clip, step, zero_grad, sched.step.

    ``via_optimizer`` scales and clips through CPUOffloadOptimizer's methods instead of
    torchtune's ``scale_grads`` and ``torch.nn.utils.clip_grad_norm_``. Returns the losses
    and the gradient norms.
    """
    from torchtune.training import scale_grads  # imported late: torchtune takes ~5 s

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    losses, norms = [], []
    for step in range(start, start + steps):
        total, count = 0.0, 0
        for micro in range(accum):
            x, y = batch(step, micro, device, dtype)
            loss = ((model(x) - y) ** 2).sum()
            loss.backward()
            total, count = total + loss.item(), count + x.shape[0]
        scaler = torch.tensor(1.0 / count)
        if via_optimizer:
            opt.scale_grads(scaler)
        else:
            scale_grads(model, scaler)
        if clip is not None:
            norm = (
                opt.clip_grad_norm_(clip)
                if via_optimizer
                else torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            )
            norms.append(float(norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(total / count)
    return losses, norms


def train_overlapped(model, opt, steps, overlap: bool) -> None:
    """Two bf16 micro-batches per step, summed losses scaled by 1/16: with ``overlap`` the
    scale goes to ``overlap_next_step`` before the last backward, else to ``scale_grads``
    after it (the two must give the same bits)."""
    for step in range(steps):
        for micro in range(2):
            if overlap and micro == 1:
                opt.overlap_next_step(grad_scale=1.0 / 16)
            x, y = batch(step, micro, "cpu", torch.bfloat16)
            ((model(x) - y) ** 2).sum().backward()
        if not overlap:
            opt.scale_grads(1.0 / 16)
        opt.step()
        opt.zero_grad()


def reference(cls, params, **kwargs):
    """torch's ``cls`` as the reference for CPUOffloadOptimizer(optimizer_cls=cls, **kwargs):
    Adam and AdamW without a choice of implementation run torch's fused kernel there
    (README, Options), so the reference does too."""
    if issubclass(cls, torch.optim.Adam) and not {"fused", "foreach", "capturable", "differentiable"} & kwargs.keys():
        kwargs = dict(kwargs, fused=True)
    return cls(params, **kwargs)


def twins(device="cpu", dtype=torch.float32):
    """A model and a deep copy of it."""
    model = make_model(device, dtype)
    return model, copy.deepcopy(model)


def assert_same_params(a: nn.Module, b: nn.Module, exact: bool) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        kw = {"rtol": 0, "atol": 0} if exact else {}
        torch.testing.assert_close(pa, pb, msg=lambda m: f"{name}: {m}", **kw)


def offload(model, **kwargs) -> CPUOffloadOptimizer:
    return CPUOffloadOptimizer(model.parameters(), **kwargs)


def trained_in_two_groups(device, dtype, cls, **kwargs):
    """Twins trained 5 steps with torchtune's scaling and clipping and a StepLR, their
    trainable layers in two param groups (the second at its own lr): torch's fused ``cls``
    and CPUOffloadOptimizer(optimizer_cls=cls). Returns (ref_model, ref, model, opt, and
    each side's (losses, norms))."""
    def groups(model):
        layers = [m for m in model if isinstance(m, nn.Linear) and m.weight.requires_grad]
        return [{"params": list(layers[0].parameters())},
                {"params": [p for m in layers[1:] for p in m.parameters()], "lr": 3e-3}]

    ref_model, model = twins(device, dtype)
    ref = cls(groups(ref_model), fused=True, **kwargs)
    opt = CPUOffloadOptimizer(groups(model), optimizer_cls=cls, **kwargs)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (ref, opt)]
    ref_run = train(ref_model, ref, 5, clip=0.5, sched=scheds[0])
    run = train(model, opt, 5, clip=0.5, sched=scheds[1])
    return ref_model, ref, model, opt, ref_run, run
