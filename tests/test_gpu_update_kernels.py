"""The Triton kernels of the streamed 8-bit formats against their host updates, through the
bench scripts that check and time them: bench/formats/compact_gpu_update.py (CompactAdamW's update,
against compact_adam's CPU update) and bench/formats/adamw8bit_gpu_update.py (AdamW8bit's, against
adamw8bit's host update). The same bits on a GPU, and in Triton's interpreter where Triton
is installed (CI's CPU machines have no Triton; torch's CUDA wheels bring it)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled kernel")
TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                            reason="needs Triton (installed with torch's CUDA wheels)")


def _run(script, *args, env=None):
    return subprocess.run([sys.executable, str(REPO / "bench" / "formats" / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=dict(os.environ, **(env or {})))


def _triton_version() -> tuple:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2])


# ---------------------------------------------------------------------------- CompactAdamW
@TRITON
def test_compact_update_in_tritons_interpreter_has_the_cpu_updates_bits():
    """Three settings (AdamW and Adam, masters or not, scaled, clipped, maximized), three
    steps each, every byte of the state compared with compact_adam.step_'s; and a skipped
    step (the streamed update's verdict on a NaN gradient) writes nothing."""
    proc = _run("compact_gpu_update.py", "--cpu", env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bits: the same as compact_adam's CPU update" in proc.stdout


@CUDA
@TRITON
def test_gpu_compact_update_has_the_cpu_updates_bits():
    """The compiled kernel (no contracted multiply-adds, correctly rounded division and
    square root) against the CPU update, over many blocks; then its timing runs."""
    proc = _run("compact_gpu_update.py", "--check-numel", str(256 * 4099 + 77), "--numel", str(1 << 24),
                "--steps", "5")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bits: the same as compact_adam's CPU update" in proc.stdout


# ---------------------------------------------------------------------------- AdamW8bit
@TRITON
def test_adamw8bit_kernel_in_tritons_interpreter_has_the_host_updates_bits():
    """Tensors of one element, part of a block, whole blocks and a tail: to nearest,
    stochastic rounding, a scaled gradient, a skipped step; every weight, code and scale byte."""
    if _triton_version() < (3, 9):
        # (Seen with Triton 3.6, torch 2.11's: its interpreter gives two block scales of the
        # scaled-gradient case 1 ulp apart from the host update, where the compiled kernel of
        # the same Triton and 3.9's interpreter give the host update's bits.)
        pytest.skip("Triton's interpreter before 3.9 differs from its compiled kernels here: "
                    "the GPU test below checks the compiled kernel")
    proc = _run("adamw8bit_gpu_update.py", "--cpu", env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bits: the same as adamw8bit's host update" in proc.stdout


@CUDA
@TRITON
def test_gpu_adamw8bit_kernel_has_the_host_updates_bits():
    """The compiled kernel (no contracted multiply-adds, correctly rounded division and
    square root) over tensors of up to a million elements; then its timing runs."""
    proc = _run("adamw8bit_gpu_update.py", "--numel", str(1 << 20), "--repeats", "3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bits: the same as adamw8bit's host update" in proc.stdout
