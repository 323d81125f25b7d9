"""offload_plugin.formats.adamw.kernels: one place picks how AdamW runs and turns a group into kernel
arguments; each path gives torch's AdamW(fused=True) bits on the same tensors."""

import pytest
import torch

from offload_plugin.formats.adamw import kernels as adamw, native as native_adam
from offload_plugin.formats.compact import native as compact_adam, optimizer as compact_optimizer, streamed as compact_streamed

BF16, FP32 = torch.bfloat16, torch.float32


def bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def test_settings_are_read_from_the_group_as_the_kernels_take_them():
    group = dict(lr=torch.tensor(0.01), betas=(0.8, torch.tensor(0.95)), weight_decay=0, eps=1e-6,
                 maximize=True, amsgrad=True)
    s = adamw.Settings.of(group, decoupled=False)
    assert (s.beta1, s.beta2) == (0.8, pytest.approx(0.95))
    assert type(s.beta2) is float and s.lr is group["lr"]  # (lr stays as the group holds it)
    assert (s.maximize, s.decoupled, s.amsgrad) == (True, False, True)
    assert adamw.Settings.of(dict(group, decoupled_weight_decay=True), decoupled=False).decoupled
    plain = adamw.Settings.adamw(group)  # CompactAdamW: AdamW alone, whatever the group says
    assert (plain.maximize, plain.decoupled, plain.amsgrad) == (False, True, False)
    assert type(plain.lr) is float and compact_streamed.coefficients_key(plain, 3) == (pytest.approx(0.01), 0.8, pytest.approx(0.95), 0.0, 1e-6, 3)


def test_pick():
    native = native_adam.kernel()
    master, weight = torch.zeros(64), torch.zeros(64, dtype=BF16)
    bf16_grad = torch.zeros(64, dtype=BF16)
    want = adamw.NATIVE if native is not None else adamw.FUSED
    assert adamw.pick(master, bf16_grad) == want
    assert adamw.pick(master, bf16_grad, weight_out=weight) == want
    assert adamw.pick(weight, bf16_grad) == want
    assert adamw.pick(master, bf16_grad, amsgrad=True) == adamw.FUSED
    assert adamw.pick(master, bf16_grad, allow_native=False) == adamw.FUSED
    assert adamw.pick(master, master) == adamw.FUSED  # an fp32 gradient
    assert adamw.pick(master, bf16_grad, weight_out=torch.zeros(64, dtype=torch.float16)) == adamw.FUSED
    assert adamw.pick(weight, bf16_grad, weight_out=weight) == adamw.FUSED
    assert adamw.pick(master.to("meta"), bf16_grad.to("meta")) == adamw.FUSED  # not the host


def _torch_reference(master, grads, settings, grad_scale=None, amsgrad=False):
    """torch's AdamW/Adam(fused=True) on a copy of ``master``, the gradients scaled in bf16
    and widened as the host update does."""
    p = master.clone().requires_grad_()
    cls = torch.optim.AdamW if settings["decoupled"] else torch.optim.Adam
    opt = cls([p], lr=settings["lr"], betas=settings["betas"], weight_decay=settings["weight_decay"],
              eps=1e-8, maximize=settings["maximize"], amsgrad=amsgrad, fused=True)
    for g in grads:
        g = g * grad_scale if grad_scale is not None else g
        p.grad = g.to(p.dtype)
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("case", [
    dict(dtype=FP32, decoupled=True, maximize=False, grad_scale=None, amsgrad=False, native=True),
    dict(dtype=FP32, decoupled=False, maximize=True, grad_scale=0.37, amsgrad=False, native=True),
    dict(dtype=FP32, decoupled=True, maximize=False, grad_scale=None, amsgrad=True, native=True),
    dict(dtype=BF16, decoupled=True, maximize=False, grad_scale=0.5, amsgrad=False, native=True),
    dict(dtype=FP32, decoupled=True, maximize=False, grad_scale=None, amsgrad=False, native=False),
])
def test_host_step_is_torch_fused_adamw(case):
    """A size with a ragged tail (past whole vectors, and several chunks): NATIVE and FUSED
    together give torch's bits, weight out included."""
    gen = torch.Generator().manual_seed(0)
    n = 64 * 37 + 13
    dtype = case["dtype"]
    master = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    grads = [torch.randn(n, generator=gen).to(BF16) for _ in range(3)]
    group = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8, maximize=case["maximize"],
                 amsgrad=case["amsgrad"])
    settings = adamw.Settings.of(group, decoupled=case["decoupled"])
    ref, ref_state = _torch_reference(master, grads, dict(group, decoupled=case["decoupled"]),
                                      case["grad_scale"], case["amsgrad"])
    m, v, vmax = torch.zeros_like(master), torch.zeros_like(master), torch.zeros_like(master)
    out = torch.empty(n, dtype=BF16) if dtype == FP32 else None
    step = torch.zeros(())
    for g in grads:
        step += 1
        adamw.host_step(master, g, m, v, step, settings, max_exp_avg_sq=vmax if case["amsgrad"] else None,
                        weight_out=out, grad_scale=case["grad_scale"], chunk=1000, allow_native=case["native"])
    assert torch.equal(bits(master), bits(ref))
    assert torch.equal(bits(m), bits(ref_state["exp_avg"])) and torch.equal(bits(v), bits(ref_state["exp_avg_sq"]))
    if case["amsgrad"]:
        assert torch.equal(bits(vmax), bits(ref_state["max_exp_avg_sq"]))
    if out is not None:
        assert torch.equal(bits(out), bits(ref.to(BF16)))


@pytest.mark.skipif(native_adam.kernel() is None, reason="no native kernel here")
@pytest.mark.parametrize("one_count", [True, False])
def test_host_step_many_is_host_step_per_tensor(one_count):
    """Tensors back to back: one call where the counts agree, else one per tensor."""
    gen = torch.Generator().manual_seed(1)
    sizes, steps = [64, 640, 128], [3.0, 3.0, 3.0] if one_count else [1.0, 5.0, 2.0]
    block = [torch.randn(sum(sizes), generator=gen) * 0.1 for _ in range(3)] + [torch.empty(sum(sizes), dtype=BF16)]
    grad_block = torch.randn(sum(sizes), generator=gen).to(BF16)
    lists = [list(t.split(sizes)) for t in block]
    grads = list(grad_block.split(sizes))
    twins = [[t.clone() for t in ts] for ts in lists]
    settings = adamw.Settings.of(dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8))
    spans = block[:3] + [grad_block, block[3]]
    spans = [spans[0], spans[3], spans[1], spans[2], spans[4]]  # master, grad, m, v, out
    adamw.host_step_many(lists[0], grads, lists[1], lists[2], lists[3], steps, settings,
                         spans=spans, grad_scale=0.5)
    for k in range(3):
        adamw.host_step(twins[0][k], grads[k], twins[1][k], twins[2][k], torch.tensor(steps[k]), settings,
                        weight_out=twins[3][k], grad_scale=0.5, chunk=1 << 20)
        for got, want in zip(lists, twins):
            assert torch.equal(bits(got[k]), bits(want[k])), k


def test_fused_skips_on_found_inf_and_divides_by_grad_scale():
    gen = torch.Generator().manual_seed(2)
    p, g = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    settings = adamw.Settings.of(dict(lr=0.1, betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8))
    m, v, before = torch.zeros(100), torch.zeros(100), p.clone()
    adamw.fused([p], [g], [m], [v], [torch.ones(())], settings, found_inf=torch.ones(()))
    assert torch.equal(p, before) and not m.any()
    twin, tm, tv = p.clone(), torch.zeros(100), torch.zeros(100)
    adamw.fused([p], [g * 4], [m], [v], [torch.ones(())], settings, grad_scale=torch.tensor(4.0))
    adamw.fused([twin], [g], [tm], [tv], [torch.ones(())], settings)
    assert torch.allclose(p, twin) and not torch.equal(p, before)


@pytest.mark.skipif(compact_adam.kernel() is None, reason="no compact kernel here")
def test_compact_is_compact_adams_step_and_writes_nothing_when_found():
    gen = torch.Generator().manual_seed(3)
    n = 256 * 5 + 7
    weight = torch.randn(n, generator=gen).to(BF16)
    state, twin = compact_adam.CompactAdamState.zeros(weight.clone()), compact_adam.CompactAdamState.zeros(weight.clone())
    grad = torch.randn(n, generator=gen).to(BF16)
    settings = adamw.Settings.adamw(dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8))
    compact_optimizer.compact_step(twin, grad, settings)
    coeffs = compact_adam._coefficients(*compact_streamed.coefficients_key(settings, 1)[:5], 1, True, False, None, None)
    views = (state.weight, state.remainder, grad, state.exp_avg, state.exp_avg_absmax, state.exp_avg_sq,
             state.exp_avg_sq_absmax)
    compact_streamed.update_(*views, coeffs, torch.ones(()))
    assert torch.equal(state.weight, weight) and not state.remainder.any()
    compact_streamed.update_(*views, coeffs, torch.zeros(()))
    for key in ("weight", "remainder", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"):
        assert torch.equal(getattr(state, key), getattr(twin, key)), key
