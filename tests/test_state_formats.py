"""offload_plugin.formats.registry: each format, driven through its protocol alone as the
streamed engine drives it (on the CPU: its host views, or staged through buffers and back),
updates as the optimizer it serves does on the host: torch's AdamW(fused=True) for
"adamw", CompactAdamW.step for "compact"."""

import pytest
import torch

from offload_plugin import CompactAdamW
from offload_plugin.formats import inner, registry as state_formats
from offload_plugin.formats.base import ALIGN
from offload_plugin.formats.compact import native as compact_adam
from offload_plugin.host.buffers import HostSlot, allocate_moments

BF16 = torch.bfloat16


class CpuRing:
    """The staging ring's interface over host buffers (one pair per pool, large enough)."""

    is_async, generation, device = False, 0, torch.device("cpu")

    def __init__(self):
        self.numel, self._pairs = {}, {}

    def reserve(self, pool, numel, layout=None):
        numel = max(numel, 1 << 14)
        if self.numel.get(pool, 0) < numel:
            shapes = layout(numel) if layout is not None else [(numel, pool)] * 2
            self._pairs[pool] = tuple(torch.full((size,), 77, dtype=kind) for size, kind in shapes)
            self.numel[pool] = numel
            self.generation += 1

    def buffers(self, pool, index):
        return self._pairs[pool]


def slots_of(params):
    slots = []
    for order, p in enumerate(params):
        placeholder = torch.zeros((), dtype=p.dtype)
        slots.append(HostSlot(param=p, master=placeholder.expand(p.shape), grad=placeholder.expand(p.shape),
                              weight_stage=None, param_device=p.device, order=order))
    return slots


def drive(fmt, opt, slots, group_of, grads, chunk, staged):
    """One step of ``slots`` through ``fmt``'s protocol, as the streamed engine makes it."""
    entries = fmt.entries(opt, slots, group_of, pin=False)
    units = fmt.cut(slots, entries, group_of, chunk)
    ring = CpuRing()
    for unit in units:
        fmt.reserve(ring, unit)
    steps = [entry["step"] for entry in entries]
    counts = [float(s) for s in steps]
    args = fmt.to_device(fmt.step_args(opt, slots, units, opt.param_groups, counts, None), ring)
    torch._foreach_add_(steps, 1)
    found = torch.zeros(())
    if not staged:
        for unit, arg in zip(units, args):
            fmt.update(unit, fmt.host_views(unit), grads, steps, found, arg)
        return units
    # Every unit in its place of one buffer pair; all copies in before the kernels and the
    # copies out after them, as the streams may run them: units must not overlap.
    filled, views = {}, []
    for unit in units:
        pool, numel, nbytes = fmt.stage_size(unit)
        at, at_byte = filled.get(pool, (0, 0))
        filled[pool] = (at + -(-numel // ALIGN) * ALIGN, at_byte + nbytes)
        views.append(fmt.staged_views(unit, ring, 0, at, at_byte))
        fmt.stage_in(unit, views[-1])
    for unit, view, arg in zip(units, views, args):
        fmt.update(unit, view, grads, steps, found, arg)
    for unit, view in zip(units, views):
        fmt.stage_out(unit, view)
    return units


def models(dtype, sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [(torch.randn(*s, generator=gen) * 0.1).to(dtype) for s in sizes]
    return params, [p.clone() for p in params]


# (ranges of a large one, small neighbours packed, two groups)
SIZES = [(64, 96), (64,), (3, 5), (128,), (40, 40)]
GROUP_OF = [0, 0, 0, 1, 1]


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_adamw_format_is_torch_fused_adamw(dtype, staged):
    params, ref_params = models(dtype, SIZES)
    ref_params = [p.requires_grad_() for p in ref_params]
    kw = dict(betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8, fused=True)
    ref = torch.optim.AdamW([{"params": ref_params[:3], "lr": 1e-2}, {"params": ref_params[3:], "lr": 3e-3}], **kw)
    slots = slots_of(params)
    allocate_moments(slots)
    opt = torch.optim.AdamW([{"params": [s.master for s in slots[:3]], "lr": 1e-2},
                             {"params": [s.master for s in slots[3:]], "lr": 3e-3}], **kw)
    fmt = state_formats.for_optimizer(inner.contract(torch.optim.AdamW), torch.optim.AdamW)
    assert fmt is state_formats.get("adamw")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
        units = drive(fmt, opt, slots, GROUP_OF, grads, chunk=1024, staged=staged)
        for rp, g in zip(ref_params, grads):
            rp.grad = g
        ref.step()
    assert any(len(u.items) > 1 for u in units) and any(u.items[0][1] > 0 for u in units)
    for slot, rp in zip(slots, ref_params):
        assert torch.equal(slot.param, rp.detach())
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[slot.master][key], ref.state[rp][key]), key


@pytest.mark.skipif(compact_adam.kernel() is None, reason="no compact kernel here")
@pytest.mark.parametrize("staged", [False, True])
def test_compact_format_is_compact_adamws_step(staged):
    sizes = [(64, 96), (64,), (100, 50), (70,)]  # two compact (one in ranges), two in the fp32 layout
    params, ref_params = models(BF16, sizes)
    group_of = [0, 0, 1, 1]
    kw = dict(betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8)
    ref = CompactAdamW([{"params": ref_params[:2], "lr": 1e-2}, {"params": ref_params[2:], "lr": 3e-3}], **kw)
    slots = slots_of(params)
    opt = CompactAdamW([{"params": [s.master for s in slots[:2]], "lr": 1e-2},
                        {"params": [s.master for s in slots[2:]], "lr": 3e-3}], **kw)
    fmt = state_formats.for_optimizer(inner.contract(CompactAdamW), CompactAdamW)
    assert fmt is state_formats.get("compact") and fmt.counts_on_host and fmt.watches_weights
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen).to(BF16) for p in params]
        units = drive(fmt, opt, slots, group_of, grads, chunk=1024, staged=staged)
        for rp, g in zip(ref_params, grads):
            rp.grad = g
        ref.step()
    assert any(u.start > 0 for u in units) and any(u.fp32 for u in units)
    for slot, rp in zip(slots, ref_params):
        assert torch.equal(slot.param, rp)
        ours, theirs = opt.state[slot.master], ref.state[rp]
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert torch.equal(ours[key], theirs[key]), key


def test_a_skipped_step_writes_nothing():
    params, _ = models(torch.float32, [(300,)])
    slots = slots_of(params)
    allocate_moments(slots)
    opt = torch.optim.AdamW([s.master for s in slots], lr=0.1, fused=True)
    fmt = state_formats.get("adamw")
    entries = fmt.entries(opt, slots, [0], pin=False)
    (unit,) = fmt.cut(slots, entries, [0], 1 << 20)
    (arg,) = fmt.step_args(opt, slots, [unit], opt.param_groups, [0.0], None)
    before = params[0].clone()
    fmt.update(unit, fmt.host_views(unit), [torch.ones(300)], [torch.ones(())], torch.ones(()), arg)
    assert torch.equal(params[0], before) and not entries[0]["exp_avg"].any()


def test_units_are_cut_anew_when_state_tensors_are_replaced():
    fmt = state_formats.get("adamw")
    entries = [{"step": torch.zeros(()), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}]
    held = fmt.hold(entries)
    assert fmt.current(entries, held)
    entries[0]["step"] = torch.ones(())  # (the count is read from the device's)
    assert fmt.current(entries, held)
    entries[0]["exp_avg"] = torch.zeros(3)
    assert not fmt.current(entries, held)


def test_a_weight_written_outside_restarts_the_compact_master():
    params, _ = models(BF16, [(64, 96)])
    slots = slots_of(params)
    opt = CompactAdamW([s.master for s in slots], lr=1e-2)
    fmt = state_formats.get("compact")
    entries = fmt.entries(opt, slots, [0], pin=False)
    entries[0]["remainder"].fill_(3)
    state_formats.get("adamw").weights_written(opt, slots)  # (no derived state: nothing)
    assert entries[0]["remainder"].eq(3).all()
    fmt.weights_written(opt, slots)
    assert not entries[0]["remainder"].any()


def test_which_parameters_each_format_takes():
    adamw, compact = state_formats.get("adamw"), state_formats.get("compact")
    bf16, fp64 = [torch.zeros(4, dtype=BF16)], [torch.zeros(4, dtype=torch.float64)]
    assert adamw.refuses(bf16, {"fused": True}, on_cpu=True) is None
    assert "fused" in adamw.refuses(bf16, {"fused": False}, on_cpu=True)
    assert "fused" in adamw.refuses(bf16, {"fused": True, "amsgrad": True}, on_cpu=True)
    assert "dtype" in adamw.refuses(fp64, {"fused": True}, on_cpu=True)
    assert compact.refuses(bf16, {}, on_cpu=True) is None
    assert "CUDA" in compact.refuses(bf16, {}, on_cpu=False)
    assert "bf16" in compact.refuses([torch.zeros(4)], {}, on_cpu=True)
    from offload_plugin.formats.adamw.streamed import MASTERS

    assert MASTERS.refuses(bf16, {"fused": True}, on_cpu=True) is not None
    assert (adamw.state_bytes(bf16[0]), MASTERS.state_bytes(bf16[0]), compact.state_bytes(bf16[0])) == (4, 12, 4)
    assert state_formats.for_optimizer(inner.contract(torch.optim.SGD), torch.optim.SGD) is None
    with pytest.raises(TypeError, match="unknown state_format"):
        state_formats.get("bnb")
    with pytest.raises(TypeError, match="unknown state_format"):
        state_formats.get("offload_plugin.formats.adamw.kernels")  # (a module without a FORMAT)
    # A format named by its module's path: a new format is its module alone.
    assert state_formats.get("offload_plugin.formats.compact.streamed") is compact


def test_compact_refuses_a_gradscaler_scale_before_anything_changes():
    """The compact kernel takes no GradScaler scale (the step refuses it through
    options.check_amp_scaler, tested in test_options_table); torch's fused kernel does."""
    assert not state_formats.get("compact").takes_grad_scale
    assert state_formats.get("adamw").takes_grad_scale
