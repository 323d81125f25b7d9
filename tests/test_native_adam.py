"""The one-pass host update (offload_plugin.formats.adamw.native) against torch's fused AdamW.

The kernel is only ever used after matching torch bit for bit at load time; these tests
check that promise from outside, over settings and tensor sizes the load-time check does
not cover, and that every way of not having the kernel falls back cleanly.
"""

import logging
import shutil

import pytest
import torch

from offload_plugin.formats import native_build
from offload_plugin.formats.adamw import native as native_adam
from offload_plugin.host.buffers import HostSlot, allocate_moments
import offload_plugin.host.inner_step as host_update

needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="no C++ compiler: the optimizer falls back to torch's kernels",
)


@pytest.fixture
def fresh_kernel_state(monkeypatch, tmp_path):
    """Forget the loaded kernel (and build into an empty cache) for this test only."""
    monkeypatch.setattr(native_adam, "_state", {})
    monkeypatch.setenv("OFFLOAD_PLUGIN_CACHE", str(tmp_path / "cache"))
    yield


@needs_compiler
def test_kernel_is_built_verified_and_used_here():
    kernel = native_adam.kernel()
    assert kernel is not None, native_adam._state.get("reason")
    assert kernel.dtypes == {torch.float32, torch.bfloat16}, native_adam._state.get("reason")


@needs_compiler
@pytest.mark.slow  # (builds and verifies a kernel anew: left out of the quick lane)
def test_a_dtype_that_fails_verification_is_not_used(fresh_kernel_state, monkeypatch, caplog):
    """If the bf16 variant differed from torch here, only fp32 masters would use the kernel."""
    check = native_adam._matches_torch
    monkeypatch.setattr(native_adam, "_matches_torch",
                        lambda k, dtype: "forced mismatch" if dtype == torch.bfloat16 else check(k, dtype))
    with caplog.at_level(logging.INFO, logger="offload_plugin.formats.adamw.native"):
        kernel = native_adam.kernel()
    assert kernel.dtypes == {torch.float32}
    assert "forced mismatch" in caplog.text
    master, *_ = _run(64, {"lr": 1e-3}, True, 2, 0.5, native=True, master_weights=False)
    ref, *_ = _run(64, {"lr": 1e-3}, True, 2, 0.5, native=False, master_weights=False)
    assert torch.equal(master, ref)


def _run(numel, group_kwargs, adamw, steps, grad_scale, native, seed=0, master_weights=True):
    """`steps` updates of one bf16 parameter through update_slots; returns master, m, v,
    weight (without master weights the bf16 weight is updated in place: master is weight)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen) * 3
    if not master_weights:
        master = master.to(torch.bfloat16)
    slot = HostSlot(param=torch.zeros(1), master=master,
                    grad=torch.empty(numel, dtype=torch.bfloat16),
                    weight_stage=torch.empty(numel, dtype=torch.bfloat16) if master_weights else None)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([master], fused=True, **group_kwargs)
    groups = {id(master): opt.param_groups[0]}
    host_update.USE_NATIVE = native
    try:
        for k in range(steps):
            scale = 10.0 ** torch.randint(-9, 3, (numel,), generator=gen)
            slot.grad.copy_(torch.randn(numel, generator=gen) * scale)
            if k == 1:
                slot.grad[::7] = 0  # zero gradients keep moments decaying
            opt.param_groups[0]["lr"] = group_kwargs.get("lr", 1e-3) * (k + 1)  # a schedule
            host_update.update_slots(opt, groups, [slot], grad_scale)
    finally:
        host_update.USE_NATIVE = True
    st = opt.state[master]
    return master, st["exp_avg"], st["exp_avg_sq"], slot.weight_source()


@needs_compiler
@pytest.mark.parametrize("master_weights", [True, False], ids=["fp32-master", "bf16-no-master"])
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 63, 64, 65, 4096 + 13, 3 * (1 << 21) + 5])
@pytest.mark.parametrize(
    "adamw,group_kwargs,grad_scale",
    [
        (True, {"lr": 1e-3, "weight_decay": 0.01}, None),
        (True, {"lr": 3e-4, "weight_decay": 0.0, "betas": (0.5, 0.95), "maximize": True}, 1 / 4096),
        (True, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.2, 0.99), "eps": 1e-6}, 0.37),
        (False, {"lr": 1e-3, "weight_decay": 0.05}, None),
        (False, {"lr": 1e-3, "betas": (0.0, 0.9)}, 3.0),
    ],
    ids=["adamw", "adamw-maximize-scaled-beta1-half", "adamw-beta1-low", "adam-l2", "adam-beta1-zero"],
)
def test_one_pass_update_is_bitwise_torch_fused(numel, adamw, group_kwargs, grad_scale, master_weights):
    if numel > 1 << 20 and group_kwargs.get("maximize") is not True:
        pytest.skip("one large size is enough: it spans several threads' ranges and a ragged tail")
    if numel in (63, 64, 65) and master_weights:
        pytest.skip("bf16 block edges; fp32 masters have theirs at 15/16/17")
    native = _run(numel, group_kwargs, adamw, 3, grad_scale, native=True, master_weights=master_weights)
    torch_path = _run(numel, group_kwargs, adamw, 3, grad_scale, native=False, master_weights=master_weights)
    for name, a, b in zip(["master", "exp_avg", "exp_avg_sq", "bf16 weight"], native, torch_path):
        assert torch.equal(a, b), f"{name} differs"
    assert native[0].dtype == (torch.float32 if master_weights else torch.bfloat16)
    # And the bf16 weight is exactly the rounded master, as torch's .to(bfloat16) gives.
    assert torch.equal(native[3], native[0].to(torch.bfloat16))


def test_disabled_by_environment(fresh_kernel_state, monkeypatch, caplog):
    monkeypatch.setenv("OFFLOAD_PLUGIN_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="offload_plugin.formats.adamw.native"):
        assert native_adam.kernel() is None
    assert "OFFLOAD_PLUGIN_NATIVE=0" in caplog.text


def test_missing_compiler_falls_back_with_the_same_results(fresh_kernel_state, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with caplog.at_level(logging.INFO, logger="offload_plugin.formats.adamw.native"):
        assert native_adam.kernel() is None
    assert "using torch's fused kernel" in caplog.text
    # The update still runs, through torch's kernel.
    master, *_ = _run(33, {"lr": 1e-3}, True, 2, None, native=True)
    ref, *_ = _run(33, {"lr": 1e-3}, True, 2, None, native=False)
    assert torch.equal(master, ref)


@needs_compiler
def test_refuses_tensors_it_cannot_update():
    kernel = native_adam.kernel()
    n = 32
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, step=1.0,
                adamw=True, maximize=False, grad_scale=None, num_threads=1)
    f32, bf16 = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of"):
        kernel.step(torch.zeros(17), torch.zeros(17, dtype=torch.bfloat16), torch.zeros(17),
                    torch.zeros(17), None, **args)
    with pytest.raises(ValueError, match="multiple of"):  # bf16 weights: 64-element blocks
        kernel.step(bf16.clone(), bf16.clone(), bf16.clone(), bf16.clone(), None, **args)
    with pytest.raises(ValueError, match="bf16 gradient"):
        kernel.step(f32, f32.clone(), f32.clone(), f32.clone(), None, **args)
    with pytest.raises(ValueError, match="bf16 gradient"):  # fp32 moments with a bf16 weight
        b64 = torch.zeros(64, dtype=torch.bfloat16)
        kernel.step(b64, b64.clone(), torch.zeros(64), torch.zeros(64), None, **args)
    with pytest.raises(ValueError, match="bf16 gradient"):  # no weight_out without a master
        b64 = torch.zeros(64, dtype=torch.bfloat16)
        kernel.step(b64, b64.clone(), b64.clone(), b64.clone(), b64.clone(), **args)
    with pytest.raises(ValueError, match="multiple of"):
        kernel.step(torch.zeros(2 * n)[::2], bf16, f32.clone(), f32.clone(), None, **args)


@needs_compiler
@pytest.mark.slow  # (builds and verifies a kernel anew: left out of the quick lane)
def test_builds_when_home_is_not_writable(fresh_kernel_state, monkeypatch, tmp_path):
    """No writable ~/.cache (read-only homes in containers): the kernel builds in a temp folder."""
    monkeypatch.delenv("OFFLOAD_PLUGIN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(native_build, "_writable", lambda path: False)
    monkeypatch.setattr(native_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert native_adam.kernel() is not None, native_adam._state.get("reason")
    assert list((tmp_path / "tmp").glob("offload_plugin-*/adam_master_bf16_*.so"))


# --- bf16 gradient accumulation: native_adam.add_ -------------------------------------------

_SPECIAL = [float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 3e38, -3e38, 1e-40, -1e-40, 1.0]


def _add_operands(numel, seed=0):
    """bf16 dst, src: random bit patterns (every exponent, subnormals, infs, NaNs) in the
    first half, values of wide-ranging but close magnitudes in the second, specials around."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        bits = torch.randint(-(1 << 15), 1 << 15, (numel,), generator=gen, dtype=torch.int16)
        t = bits.view(torch.bfloat16).clone()
        half = numel // 2
        if numel - half:
            scale = torch.logspace(-38, 38, numel - half)
            t[half:] = (torch.randn(numel - half, generator=gen) * scale).to(torch.bfloat16)
        picks = torch.randint(0, len(_SPECIAL), (min(numel, 64),), generator=gen)
        t[torch.randperm(numel, generator=gen)[:len(picks)]] = torch.tensor(_SPECIAL)[picks].to(torch.bfloat16)
        out.append(t)
    return out


def _assert_same_as_torch(got, ref):
    """Every bit equal, except that NaN only has to be NaN: torch writes 0xffff from its
    vector code and 0x7fc0 from its scalar tails (placed by its thread count)."""
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), ref[~nan].view(torch.int16))


@needs_compiler
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 4099, 3 * (1 << 21) + 5])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_add_is_bitwise_torch(numel, threads):
    kernel = native_adam.kernel()
    assert kernel is not None and kernel.can_add, native_adam._state.get("add_reason")
    dst, src = _add_operands(numel)
    ref = dst.clone().add_(src)
    src_before = src.clone()
    kernel.add_(dst, src, threads)
    _assert_same_as_torch(dst, ref)
    assert torch.equal(src.view(torch.int16), src_before.view(torch.int16))
    assert (dst.view(torch.int16)[dst.isnan()] == -1).all()  # 0xffff, as float_to_bf16 writes


@needs_compiler
def test_module_add_uses_the_kernel_for_bf16(monkeypatch):
    assert native_adam.kernel().can_add, native_adam._state.get("add_reason")
    kernel, calls = native_adam.kernel(), []
    original = kernel._add
    monkeypatch.setattr(kernel, "_add", lambda d, s, n, t: (calls.append(t), original(d, s, n, t))[1])
    dst, src = _add_operands(4099, seed=1)
    ref = dst.clone().add_(src)
    native_adam.add_(dst.view(-1, 1), src.view(-1, 1))  # any shape, contiguous
    _assert_same_as_torch(dst, ref)
    assert calls == [torch.get_num_threads()]


@pytest.mark.parametrize("case", ["fp32", "fp16", "strided", "mixed dtypes", "same tensor"])
def test_module_add_falls_back_to_torch_for_other_tensors(case):
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 1000, generator=gen), torch.randn(2, 1000, generator=gen)
    if case == "fp16":
        a, b = a.half(), b.half()
    elif case == "strided":
        a, b = a.to(torch.bfloat16).t(), b.to(torch.bfloat16).t()
    elif case == "mixed dtypes":
        a = a.to(torch.bfloat16)
    elif case == "same tensor":
        a = b = a.to(torch.bfloat16)
    ref = a.clone().add_(b.clone() if case != "same tensor" else a.clone())
    native_adam.add_(a, b)
    assert torch.equal(a, ref)


def test_module_add_without_the_kernel_is_torch(fresh_kernel_state, monkeypatch):
    monkeypatch.setenv("OFFLOAD_PLUGIN_NATIVE", "0")
    dst, src = _add_operands(4099)
    ref = dst.clone().add_(src)
    native_adam.add_(dst, src)
    assert torch.equal(dst.view(torch.int16), ref.view(torch.int16))  # torch itself: NaN bits too
    assert native_adam._state["kernel"] is None


@needs_compiler
@pytest.mark.slow  # (builds and verifies a kernel anew: left out of the quick lane)
def test_add_that_fails_verification_is_not_used(fresh_kernel_state, monkeypatch, caplog):
    """A mismatching add leaves the Adam update in use, and add_ on torch's kernel."""
    monkeypatch.setattr(native_adam, "_add_matches_torch", lambda k: "forced add mismatch")
    with caplog.at_level(logging.INFO, logger="offload_plugin.formats.adamw.native"):
        kernel = native_adam.kernel()
    assert kernel.dtypes == {torch.float32, torch.bfloat16} and not kernel.can_add
    assert "forced add mismatch" in caplog.text and "torch's add_" in caplog.text
    dst, src = _add_operands(4099)
    ref = dst.clone().add_(src)
    native_adam.add_(dst, src)
    assert torch.equal(dst.view(torch.int16), ref.view(torch.int16))
    with pytest.raises(RuntimeError):
        kernel.add_(dst, src, 1)


@needs_compiler
@pytest.mark.slow  # (builds and verifies a kernel anew: left out of the quick lane)
def test_add_alone_can_be_verified(fresh_kernel_state, monkeypatch):
    """The kernel is still returned for add_ when no Adam dtype matched."""
    monkeypatch.setattr(native_adam, "_matches_torch", lambda k, dtype: "forced mismatch")
    kernel = native_adam.kernel()
    assert kernel is not None and kernel.dtypes == set() and kernel.can_add


@needs_compiler
def test_add_refuses_tensors_it_cannot_add():
    kernel = native_adam.kernel()
    b = torch.zeros(100, dtype=torch.bfloat16)
    bad = [
        (torch.zeros(100), torch.zeros(100)),                          # fp32
        (b.clone(), torch.zeros(100)),                                 # mixed dtypes
        (b.clone(), torch.zeros(99, dtype=torch.bfloat16)),            # numel
        (torch.zeros(200, dtype=torch.bfloat16)[::2], b.clone()),      # not contiguous
        (b, b),                                                        # the same memory
        (b[1:], b[:-1]),                                               # overlapping
        (b.half(), b.half()),                                          # fp16
    ]
    for dst, src in bad:
        with pytest.raises(ValueError, match="non-overlapping bf16"):
            kernel.add_(dst, src, 1)
    kernel.add_(torch.zeros(0, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.bfloat16), 1)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numel", [1, 31, 4096, 3 * 32768 + 77])
@pytest.mark.parametrize("threads", [1, 2])
def test_finiteness_check_agrees_with_torch(dtype, numel, threads):
    """native finite() says what torch.isfinite(t).all() says, for an inf or NaN at
    either end or inside, on sizes that split into uneven thread ranges or none."""
    kernel = native_adam.kernel()
    assert kernel is not None and kernel.can_check
    torch.manual_seed(numel)
    t = (torch.randn(numel) * torch.logspace(-30, 30, numel)).to(dtype)
    assert kernel.finite(t, threads) is True
    for where in {0, numel // 2, numel - 1}:
        for bad in (float("inf"), -float("inf"), float("nan")):
            c = t.clone()
            c[where] = bad
            assert kernel.finite(c, threads) is False, (where, bad)
    big = torch.full((numel,), torch.finfo(dtype).max, dtype=dtype)  # the largest finite value
    assert kernel.finite(big, threads) is True


@needs_compiler
def test_all_finite_uses_the_native_check_where_it_applies(monkeypatch):
    from offload_plugin.host.grad_checks import all_finite

    calls = []
    real = native_adam.finite
    monkeypatch.setattr(native_adam, "finite", lambda t: calls.append(t) or real(t))
    bf16 = torch.ones(1000, dtype=torch.bfloat16)
    strided = torch.ones(2000, dtype=torch.bfloat16)[::2]
    half = torch.ones(1000, dtype=torch.float16)
    assert all_finite([bf16, strided, half]) and len(calls) == 3
    assert real(bf16) is True and real(strided) is None and real(half) is None  # torch's check then
    for t in (bf16, strided, half):
        t[7] = float("nan")
        assert not all_finite([t])


def test_all_finite_without_the_kernel_is_torch(fresh_kernel_state, monkeypatch):
    from offload_plugin.host.grad_checks import all_finite

    monkeypatch.setenv("OFFLOAD_PLUGIN_NATIVE", "0")
    t = torch.ones(4099, dtype=torch.bfloat16)
    assert all_finite([t]) and native_adam.finite(t) is None
    t[-1] = float("inf")
    assert not all_finite([t])


@needs_compiler
@pytest.mark.slow  # (builds and verifies a kernel anew: left out of the quick lane)
def test_check_that_fails_verification_is_not_used(fresh_kernel_state, monkeypatch):
    monkeypatch.setattr(native_adam, "_check_matches_torch", lambda k: "forced check mismatch")
    kernel = native_adam.kernel()
    assert kernel is not None and not kernel.can_check
    assert native_adam.finite(torch.ones(10)) is None
    with pytest.raises(RuntimeError):
        kernel.finite(torch.ones(10), 1)


def _run_many(sizes, adamw, grad_scale, native, master_weights, steps=3, seed=0, packed=False,
              late_joiner=True):
    """update_slots over several parameters at once (two param groups, sizes that do and do
    not fit one native call, a parameter that joins a step late); returns every tensor.
    ``packed``: every buffer is a view of one block per kind, back to back, as the arena and
    allocate_moments lay them out."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if master_weights else torch.bfloat16
    masters = [(torch.randn(n, generator=gen) * 3).to(dtype) for n in sizes]

    def buffers(dt):
        if packed:
            return list(torch.empty(sum(sizes), dtype=dt).split(sizes))
        return [torch.empty(n, dtype=dt) for n in sizes]

    if packed:
        masters = [dst.copy_(m) for dst, m in zip(buffers(dtype), masters)]
    grads, stages = buffers(torch.bfloat16), buffers(torch.bfloat16)
    slots = [HostSlot(param=torch.zeros(1), master=m, grad=g, weight_stage=st if master_weights else None)
             for m, g, st in zip(masters, grads, stages)]
    if packed:
        allocate_moments(slots)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    half = len(masters) // 2
    opt = cls([{"params": masters[:half]}, {"params": masters[half:], "lr": 3e-3, "betas": (0.5, 0.9)}],
              lr=1e-3, weight_decay=0.02, fused=True)
    groups = {id(m): g for g in opt.param_groups for m in g["params"]}
    host_update.USE_NATIVE = native
    try:
        for k in range(steps):
            for slot in slots:
                slot.grad.copy_(torch.randn(slot.grad.numel(), generator=gen))
            # The last parameter skips the first step: its step count then differs.
            host_update.update_slots(opt, groups, slots if k or not late_joiner else slots[:-1], grad_scale)
    finally:
        host_update.USE_NATIVE = True
    out = []
    for slot in slots:
        st = opt.state[slot.master]
        out += [slot.master, st["exp_avg"], st["exp_avg_sq"], st["step"], slot.weight_source()]
    return out


@needs_compiler
@pytest.mark.parametrize("master_weights", [True, False], ids=["fp32-master", "bf16-no-master"])
@pytest.mark.parametrize("adamw,grad_scale", [(True, None), (True, 1 / 4096), (False, 0.37)],
                         ids=["adamw", "adamw-scaled", "adam-scaled"])
def test_many_parameters_in_one_native_call_are_bitwise_torch_fused(adamw, grad_scale, master_weights,
                                                                  monkeypatch):
    """Small parameters of a group are updated by one step_many call, bit for bit as torch's
    fused kernel updates each; sizes that are not a multiple of the kernel's block take the
    per-parameter path beside them."""
    calls = []
    kernel = native_adam.kernel()
    assert kernel.can_step_many
    real = type(kernel).step_many
    monkeypatch.setattr(type(kernel), "step_many", lambda self, *a, **k: calls.append(len(a[0])) or real(self, *a, **k))
    sizes = [64, 128, 64 * 1100, 100, 64, 4096, 64 * 3, 64 * 2000 + 7]
    got = _run_many(sizes, adamw, grad_scale, native=True, master_weights=master_weights)
    assert calls and max(calls) >= 2, calls  # several parameters per call
    want = _run_many(sizes, adamw, grad_scale, native=False, master_weights=master_weights)
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"parameter {k // 5}, tensor {k % 5} differs"


@needs_compiler
@pytest.mark.parametrize("master_weights", [True, False], ids=["fp32-master", "bf16-no-master"])
@pytest.mark.parametrize("late_joiner", [False, True], ids=["one-step-count", "step-counts-differ"])
def test_back_to_back_parameters_update_in_one_call_bitwise_torch_fused(master_weights, late_joiner,
                                                                       monkeypatch):
    """Parameters whose buffers lie back to back (the arena's layout) at one step count are
    one tensor to the kernel: one step() call per group, bit for bit torch's fused kernel on
    each parameter. Step counts that differ take step_many, with the same values."""
    calls = []
    kernel = native_adam.kernel()
    for name in ("step", "step_many"):
        real = getattr(type(kernel), name)
        monkeypatch.setattr(type(kernel), name, lambda self, *a, _real=real, _name=name, **k:
                            calls.append(_name) or _real(self, *a, **k))
    sizes = [64, 128, 64 * 1100, 64, 4096, 64 * 3, 64 * 2000]
    got = _run_many(sizes, True, 1 / 64, native=True, master_weights=master_weights, packed=True,
                    late_joiner=late_joiner)
    # Three steps of two groups; with a late joiner, its group's later steps take step_many.
    assert calls.count("step") == (6 if not late_joiner else 4), calls
    assert calls.count("step_many") == (0 if not late_joiner else 2), calls
    want = _run_many(sizes, True, 1 / 64, native=False, master_weights=master_weights, packed=True,
                     late_joiner=late_joiner)
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"parameter {k // 5}, tensor {k % 5} differs"


@needs_compiler
@pytest.mark.slow  # (builds and verifies a kernel anew: left out of the quick lane)
def test_step_many_that_fails_verification_is_not_used(fresh_kernel_state, monkeypatch):
    monkeypatch.setattr(native_adam, "_many_matches_step", lambda k: "forced mismatch")
    kernel = native_adam.kernel()
    assert kernel.dtypes and not kernel.can_step_many
    with pytest.raises(RuntimeError):
        kernel.step_many([], [], [], [], None, [], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0,
                         eps=1e-8, adamw=True, maximize=False, grad_scale=None, num_threads=1)
    got = _run_many([64, 128, 192], True, None, native=True, master_weights=True)
    want = _run_many([64, 128, 192], True, None, native=False, master_weights=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_compiler
def test_step_many_refuses_tensors_it_cannot_update():
    kernel = native_adam.kernel()
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, adamw=True,
              maximize=False, grad_scale=None, num_threads=1)
    f = lambda n: torch.zeros(n)  # noqa: E731
    g = lambda n: torch.zeros(n, dtype=torch.bfloat16)  # noqa: E731
    with pytest.raises(ValueError, match="one length"):
        kernel.step_many([f(64)], [g(64)], [f(64)], [], None, [1.0], **kw)
    with pytest.raises(ValueError, match="per tensor"):
        kernel.step_many([f(65)], [g(65)], [f(65)], [f(65)], None, [1.0], **kw)  # 65 elements: not whole blocks
    with pytest.raises(ValueError, match="per tensor"):
        kernel.step_many([f(128)[::2]], [g(64)], [f(64)], [f(64)], None, [1.0], **kw)  # strided
    with pytest.raises(ValueError, match="fp32 masters"):
        kernel.step_many([g(64)], [g(64)], [g(64)], [g(64)], [g(64)], [1.0], **kw)  # bf16 with weight_out


@needs_compiler
@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_bf16_weights_written_to_any_address_match_and_stay_in_bounds(offset):
    """The kernel writes the new bf16 weights through a staging block with streaming stores
    where the destination is 16-byte aligned, and ordinary stores elsewhere: a destination
    that starts off alignment (offset elements into a buffer), over several staging blocks
    and threads, receives exactly the rounded masters, and the elements around it are untouched."""
    kernel = native_adam.kernel()
    n = kernel.align(torch.float32) * 257  # several 2048-element staging blocks, odd count
    gen = torch.Generator().manual_seed(5)
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    sentinel = torch.tensor(-7.0, dtype=torch.bfloat16)
    buffer = torch.full((n + 16,), sentinel.item(), dtype=torch.bfloat16)
    out = buffer[offset:offset + n]
    kernel.step(master, grad, m, v, out, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
                eps=1e-8, step=1.0, adamw=True, maximize=False, grad_scale=None,
                num_threads=max(2, torch.get_num_threads()))
    assert torch.equal(out, master.to(torch.bfloat16))
    assert torch.equal(buffer[:offset], sentinel.expand(offset))
    assert torch.equal(buffer[offset + n:], sentinel.expand(16 - offset))


@needs_compiler
def test_state_replaced_through_the_optimizer_between_steps_is_what_the_next_step_uses():
    """The batched update keeps each slot's state between steps; a state dict replaced,
    deleted or given a new tensor through ``optimizer.state`` is what the next step uses,
    as with torch's fused AdamW on the same tensors."""
    from offload_plugin import CPUOffloadOptimizer

    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 64), (64, 8), (8, 64), (64, 8)]  # small: one batch, one native call
    weights = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    ref_params = [torch.nn.Parameter(w.clone()) for w in weights]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    opt = CPUOffloadOptimizer(params, lr=1e-2, weight_decay=0.1, fused=True)

    def step(k):
        for rp, p in zip(ref_params, params):
            g = torch.randn(rp.shape, generator=gen).to(torch.bfloat16)
            rp.grad, p.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
        ref.zero_grad()
        opt.zero_grad()

    for k in range(2):
        step(k)
    new_m = torch.randn(shapes[1], generator=gen).to(torch.bfloat16)
    for o in (ref, opt):
        old = o.state[o.param_groups[0]["params"][0]]
        o.state[o.param_groups[0]["params"][0]] = {  # a new dict
            "step": torch.tensor(7.0), "exp_avg": old["exp_avg"].clone() * 2,
            "exp_avg_sq": old["exp_avg_sq"].clone()}
        o.state[o.param_groups[0]["params"][1]]["exp_avg"] = new_m.clone()  # a new tensor
        o.state[o.param_groups[0]["params"][2]]["step"] = torch.tensor(1.0)
        del o.state[o.param_groups[0]["params"][3]]  # starts again from zeros
    step(2)
    for o in (ref, opt):  # a dict holding the same tensors, changed after a step
        p0 = o.param_groups[0]["params"][0]
        o.state[p0] = dict(o.state[p0])
    step(3)
    for o in (ref, opt):
        o.state[o.param_groups[0]["params"][0]]["step"] = torch.tensor(2.0)
    step(4)
    for i, (rp, p) in enumerate(zip(ref_params, params)):
        assert torch.equal(rp.detach(), p.detach()), f"parameter {i}"
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[rp][key], opt.state[p][key]), (i, key)
