"""bench/compact_gpu_update.py, the prototype of CompactAdamW's update on the GPU (issue
#20): the same bits as compact_adam's CPU update, on a GPU, and in Triton's interpreter
where Triton is installed (CI's CPU machines have no Triton; torch's CUDA wheels bring it)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "compact_gpu_update.py"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled kernel")
TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                            reason="needs Triton (installed with torch's CUDA wheels)")


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=dict(os.environ, **(env or {})))


@TRITON
def test_compact_update_in_tritons_interpreter_has_the_cpu_updates_bits():
    """Three settings (AdamW and Adam, masters or not, scaled, clipped, maximized), three
    steps each, every byte of the state compared with compact_adam.step_'s; and a skipped
    step (the streamed update's verdict on a NaN gradient) writes nothing."""
    proc = _run("--cpu", env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bits: the same as compact_adam's CPU update" in proc.stdout


@CUDA
@TRITON
def test_gpu_compact_update_has_the_cpu_updates_bits():
    """The compiled kernel (no contracted multiply-adds, correctly rounded division and
    square root) against the CPU update, over many blocks; then its timing runs."""
    proc = _run("--check-numel", str(256 * 4099 + 77), "--numel", str(1 << 24), "--steps", "5")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bits: the same as compact_adam's CPU update" in proc.stdout
