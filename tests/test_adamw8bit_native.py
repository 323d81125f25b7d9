"""AdamW8bit's one-pass host kernel (offload_plugin.formats.adamw8bit.native) against its torch path.

The kernel is used only after it matched ``update_8bit_``'s torch path bit for bit at load
time; these tests check that promise from outside (sizes with tails, zero blocks, several
steps, decay, gradient scaling, non-finite values, bitsandbytes itself), and that every way
of not having the kernel leaves the torch path with the same bits.
"""

import logging
import shutil

import pytest
import torch

from offload_plugin import AdamW8bit
from offload_plugin.formats.adamw8bit import native as adamw8bit_native, update as reference

needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="no C++ compiler: AdamW8bit's host update stays on its torch path",
)
CHUNK, BLOCK = reference.CHUNK, reference.BLOCK
FIELDS = ("weight", "state1", "absmax1", "state2", "absmax2")
GROUP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)


@pytest.fixture
def fresh_kernel_state(monkeypatch, tmp_path):
    """Forget the loaded kernel (and build into an empty cache) for this test only."""
    monkeypatch.setattr(adamw8bit_native, "_state", {})
    monkeypatch.setenv("OFFLOAD_PLUGIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def torch_chunks(monkeypatch):
    """The first elements of the chunks that take the torch path, as they are updated."""
    seen, update = [], reference.update_chunk_8bit_

    def spy(*args):
        seen.append(args[-1])
        update(*args)
    monkeypatch.setattr(reference, "update_chunk_8bit_", spy)
    return seen


def _fresh_state(n, seed=0):
    """A bf16 weight over many magnitudes and zero 8-bit state, as a first step finds it."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)).to(torch.bfloat16)
    blocks = -(-n // BLOCK)
    return [weight, torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks),
            torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks)]


def _grad(n, step, seed=0):
    """Gradients over eight decades, with the second block all zeros (its codes and scales
    stay 0), the third tiny values and zeros, and, from the third step on, the first block
    all zeros too (its moments only decay)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    g = (torch.randn(n, generator=gen) * 10.0 ** torch.randint(-7, 1, (n,), generator=gen).float()).to(torch.bfloat16)
    g[BLOCK:2 * BLOCK] = 0
    g[2 * BLOCK:3 * BLOCK:2] *= 1e-19  # (the second moment's largest value subnormal: inf reciprocal)
    g[2 * BLOCK + 1:3 * BLOCK:2] = 0
    if step >= 3:
        g[:BLOCK] = 0
    return g


def _run(n, steps, native, weight_decay=0.01, grad_scale=None, grads=_grad, stochastic_rounding=False):
    """``steps`` updates of fresh state through update_8bit_; returns the five tensors."""
    state = _fresh_state(n)
    group = dict(GROUP, weight_decay=weight_decay, stochastic_rounding=stochastic_rounding)
    for step in range(1, steps + 1):
        coeffs = reference.coefficients(group, step, grad_scale)
        adamw8bit_native.update_8bit_(state[0], grads(n, step), *state[1:], coeffs, native=native)
    return state


def _assert_same_bits(ours, ref):
    for name, a, b in zip(FIELDS, ours, ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@needs_compiler
def test_the_kernel_is_built_verified_and_used_here():
    """On a machine with a compiler, the kernel passes its load-time check."""
    assert adamw8bit_native.kernel() is not None, adamw8bit_native._state.get("reason")


@needs_compiler
@pytest.mark.parametrize("n", [4096, 7 * BLOCK + 13, CHUNK + 5, 2 * CHUNK + 1077, BLOCK + 1])
@pytest.mark.parametrize("weight_decay,grad_scale", [(0.01, None), (0.0, 0.37), (0.1, 3.0)])
def test_native_is_the_torch_path_bit_for_bit(n, weight_decay, grad_scale, torch_chunks):
    """Sizes with tails (a last chunk of a few elements too), zero blocks, five steps, decay
    and gradient scaling: the kernel alone gives the torch path's weights, codes and scales."""
    ours = _run(n, 5, True, weight_decay, grad_scale)
    assert torch_chunks == []
    _assert_same_bits(ours, _run(n, 5, False, weight_decay, grad_scale))


def _with_nonfinite(n, step, seed=0):
    """_grad with a NaN in the second chunk at step 2, an inf in the third at step 3, and a
    finite gradient whose square overflows (the second moment's scale becomes inf) in the
    first chunk at step 4."""
    g = _grad(n, step, seed)
    if step == 2:
        g[CHUNK + 300] = float("nan")
    if step == 3:
        g[2 * CHUNK + 7] = float("-inf")
    if step == 4:
        g[5 * BLOCK + 1] = 1e30
    return g


@needs_compiler
def test_chunks_with_nonfinite_values_take_the_torch_path_whole(torch_chunks):
    """A chunk where an inf or a NaN appears (from the gradient, or overflowing from finite
    values) is left untouched by the kernel and redone by the torch path, so that NaN rules
    and NaN bits are the torch path's; the other chunks stay native."""
    n = 3 * CHUNK - 99
    ours = _run(n, 5, True, grads=_with_nonfinite)
    # (step 2: chunk 1; step 3: chunks 1 and 2, whose scales are inf since; step 4 on: all)
    assert torch_chunks[:3] == [CHUNK, CHUNK, 2 * CHUNK] and set(torch_chunks[3:6]) == {0, CHUNK, 2 * CHUNK}
    ref = _run(n, 5, False, grads=_with_nonfinite)
    assert ours[0].isnan().any() and torch.isinf(ours[4]).any()
    _assert_same_bits(ours, ref)


@needs_compiler
def test_stochastic_rounding_takes_the_torch_path(torch_chunks):
    """The kernel rounds to nearest only: with stochastic_rounding every chunk is torch's."""
    ours = _run(CHUNK + 5, 2, True, stochastic_rounding=True)
    assert torch_chunks == [0, CHUNK] * 2
    _assert_same_bits(ours, _run(CHUNK + 5, 2, False, stochastic_rounding=True))


@needs_compiler
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_through_adamw8bit_it_is_bitsandbytes_bit_for_bit(weight_decay, torch_chunks):
    """AdamW8bit.step on the kernel against bitsandbytes' AdamW8bit on the CPU, six steps."""
    bnb = pytest.importorskip("bitsandbytes")
    shapes = [(64, 129), (CHUNK + 300,), (4099,)]
    torch.manual_seed(0)
    ps = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    qs = [p.clone() for p in ps]
    theirs = bnb.optim.AdamW8bit(ps, lr=1e-2, weight_decay=weight_decay)
    ours = AdamW8bit(qs, lr=1e-2, weight_decay=weight_decay)
    for step in range(1, 7):
        for p, q in zip(ps, qs):
            p.grad = _grad(p.numel(), step).view(p.shape)
            q.grad = p.grad.clone()
        theirs.step()
        ours.step()
    assert torch_chunks == []
    for p, q in zip(ps, qs):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        mine, bnbs = ours.state[q], theirs.state[p]
        for key in ("state1", "state2", "absmax1", "absmax2"):
            assert torch.equal(mine[key].view(torch.uint8), bnbs[key].view(torch.uint8)), key


def test_off_when_disabled_with_the_same_bits(fresh_kernel_state, monkeypatch, torch_chunks, caplog):
    """OFFLOAD_PLUGIN_NATIVE=0: no kernel, every chunk on the torch path, the same result."""
    monkeypatch.setenv("OFFLOAD_PLUGIN_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="offload_plugin.formats.native_build"):
        assert adamw8bit_native.kernel() is None
    assert "OFFLOAD_PLUGIN_NATIVE=0" in caplog.text
    ours = _run(CHUNK + 5, 2, True)
    assert torch_chunks == [0, CHUNK] * 2
    _assert_same_bits(ours, _run(CHUNK + 5, 2, False))


def test_no_compiler_leaves_the_torch_path(fresh_kernel_state, monkeypatch, torch_chunks):
    """A failing build (here: a compiler that does not exist) is no kernel, not an error."""
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert adamw8bit_native.kernel() is None and adamw8bit_native._state["reason"]
    _run(BLOCK + 1, 1, True)
    assert torch_chunks == [0]


@needs_compiler
@pytest.mark.slow  # (builds and verifies a kernel anew: left out of the quick lane)
def test_a_kernel_that_fails_verification_is_not_used(fresh_kernel_state, monkeypatch, torch_chunks, caplog):
    """If the kernel differed from the torch path here, the torch path would run instead."""
    monkeypatch.setattr(adamw8bit_native, "_matches_reference", lambda k: "forced mismatch")
    with caplog.at_level(logging.INFO, logger="offload_plugin.formats.native_build"):
        assert adamw8bit_native.kernel() is None
    assert "forced mismatch" in caplog.text
    _run(BLOCK + 1, 1, True)
    assert torch_chunks == [0]


@needs_compiler
@pytest.mark.slow  # (builds and verifies a kernel anew: left out of the quick lane)
def test_the_load_time_check_catches_a_changed_kernel(fresh_kernel_state, monkeypatch, tmp_path):
    """(The load-time check can fail: the kernel without its fused multiply-add for the
    first moment differs, and is not used.)"""
    source = tmp_path / "adamw8bit_host.cpp"
    text = adamw8bit_native._SOURCE.read_text()
    changed = text.replace("std::fma(g, omb1, map1[state1[i]] * absmax1 * b1)",
                           "g * omb1 + map1[state1[i]] * absmax1 * b1")
    assert changed != text
    source.write_text(changed)
    monkeypatch.setattr(adamw8bit_native, "_SOURCE", source)
    assert adamw8bit_native.kernel() is None
    assert "differs from the reference" in adamw8bit_native._state["reason"]


@needs_compiler
def test_tensors_the_kernel_cannot_read_take_the_torch_path(torch_chunks):
    """A strided gradient (or any tensor not as update_8bit_ documents it) is never handed to
    the kernel: the torch path updates it, with its bits."""
    n = BLOCK + 1
    ours, ref = _fresh_state(n), _fresh_state(n)
    wide = torch.stack([_grad(n, 1), _grad(n, 1)], 1)
    coeffs = reference.coefficients(dict(GROUP, weight_decay=0.01), 1)
    adamw8bit_native.update_8bit_(ours[0], wide[:, 0], *ours[1:], coeffs)
    assert torch_chunks == [0]
    adamw8bit_native.update_8bit_(ref[0], _grad(n, 1), *ref[1:], coeffs, native=False)
    _assert_same_bits(ours, ref)
