"""A one-pass Adam(W) update for fp32 master weights with bf16 gradients (optional).

torch has no fused CPU kernel that reads a bf16 gradient into an fp32 update and writes
the bf16 weight back, so without this the host runs three passes (upcast, fused AdamW,
downcast). ``csrc/adam_master_bf16.cpp`` does the same arithmetic in one pass. It is
compiled on first use with the system's C++ compiler (about a second; cached under
``$OFFLOAD_PLUGIN_CACHE`` or ``~/.cache/offload_plugin``) and linked to the OpenMP
runtime torch already uses, so both share one thread pool.

It is used only after it has reproduced ``torch._fused_adamw_`` / ``torch._fused_adam_``
bit for bit on this machine (several settings, several steps); otherwise, or without a
compiler, the update stays on torch's kernels with the same results, only slower. Set
``OFFLOAD_PLUGIN_NATIVE=0`` to never build or use it.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

__all__ = ["kernel", "ALIGN"]

log = logging.getLogger(__name__)

# The kernel covers whole 16-element blocks; torch's own kernel handles a tensor's last
# numel % 16 elements differently (scalar code), so those go to torch.
ALIGN = 16

_SOURCE = Path(__file__).parent / "csrc" / "adam_master_bf16.cpp"
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-fopenmp"]
_lock = threading.Lock()
_state: dict = {}


def _torch_openmp() -> Optional[Path]:
    """torch's own libgomp, if it ships one; linking to it avoids a second thread pool."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return Path(found[0]) if found else None


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _cache_dir() -> Path:
    """$OFFLOAD_PLUGIN_CACHE, else ~/.cache/offload_plugin, else a per-user temp folder."""
    explicit = os.environ.get("OFFLOAD_PLUGIN_CACHE")
    if explicit:
        return Path(explicit)
    home = Path(os.path.expanduser("~")) / ".cache" / "offload_plugin"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if _writable(home):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"offload_plugin-{os.getuid()}"


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) found")
    gomp = _torch_openmp()
    link = [f"-L{gomp.parent}", f"-l:{gomp.name}", f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-fopenmp"]
    key = hashlib.sha256(
        _SOURCE.read_bytes()
        + repr((compiler, _FLAGS, link, platform.machine(), torch.__version__)).encode()
        + _cpu_id()
    ).hexdigest()[:16]
    target = _cache_dir() / f"adam_master_bf16_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for cmd in (
            [compiler, *_FLAGS, "-c", str(_SOURCE), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(lib), *link],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: concurrent builds never load a partial file
    return target


def _cpu_id() -> bytes:
    """-march=native code must not be reused on another CPU: key the cache by its flags."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return line
    except OSError:
        pass
    return platform.processor().encode()


def _load(path: Path):
    lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
    fn = lib.adam_master_bf16_step
    p, i64, d, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int, ctypes.c_float
    fn.argtypes = [p, p, p, p, p, i64, d, d, d, d, d, d, i, i, i, f, i]
    fn.restype = i
    return fn


class NativeAdam:
    """The loaded kernel. Call :meth:`step` on flat, contiguous host tensors."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def step(
        self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor, weight_out: Optional[torch.Tensor], *, lr: float,
        beta1: float, beta2: float, weight_decay: float, eps: float, step: float,
        adamw: bool, maximize: bool, grad_scale: Optional[float], num_threads: int,
    ) -> None:
        """Update ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32) from ``grad`` (bf16).

        ``step`` is the count after this update. ``weight_out`` (bf16, or None) receives
        the new weight. All tensors: 1-D, contiguous, same numel, a multiple of ALIGN.
        """
        n = master.numel()
        tensors = (master, grad, exp_avg, exp_avg_sq) + ((weight_out,) if weight_out is not None else ())
        if n % ALIGN or any(t.numel() != n or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
            raise ValueError("NativeAdam.step needs contiguous CPU tensors of one numel, a multiple of 16")
        if master.dtype != torch.float32 or grad.dtype != torch.bfloat16 or (
            weight_out is not None and weight_out.dtype != torch.bfloat16
        ):
            raise ValueError("NativeAdam.step needs an fp32 master and bf16 gradient/weight")
        self._fn(
            master.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
            weight_out.data_ptr() if weight_out is not None else None, n, float(lr),
            float(beta1), float(beta2), float(weight_decay), float(eps), float(step),
            int(adamw), int(maximize), int(grad_scale is not None),
            float(grad_scale if grad_scale is not None else 1.0), int(num_threads),
        )


def _matches_torch(native: NativeAdam) -> Optional[str]:
    """Run native and torch side by side; None if bit-identical, else what differed."""
    gen = torch.Generator().manual_seed(0)
    n = ALIGN * 4099
    settings = [
        dict(adamw=True, weight_decay=0.01, beta1=0.9, maximize=False, grad_scale=None),
        dict(adamw=True, weight_decay=0.0, beta1=0.3, maximize=True, grad_scale=1 / 3),
        dict(adamw=False, weight_decay=0.1, beta1=0.9, maximize=False, grad_scale=0.37),
        dict(adamw=False, weight_decay=0.0, beta1=0.0, maximize=False, grad_scale=None),
    ]
    for s in settings:
        master = torch.randn(n, generator=gen) * torch.logspace(-6, 2, n)
        m, v = torch.zeros(n), torch.zeros(n)
        ref_master, ref_m, ref_v = master.clone(), m.clone(), v.clone()
        step_t = torch.zeros(())
        out = torch.empty(n, dtype=torch.bfloat16)
        for k in range(1, 4):
            grad = (torch.randn(n, generator=gen) * torch.logspace(-8, 1, n)).to(torch.bfloat16)
            g32 = grad.float()
            if s["grad_scale"] is not None:
                g32 = g32 * s["grad_scale"]
            step_t += 1
            kernel = torch._fused_adamw_ if s["adamw"] else torch._fused_adam_
            kernel([ref_master], [g32], [ref_m], [ref_v], [], [step_t], amsgrad=False,
                   lr=1e-3 * k, beta1=s["beta1"], beta2=0.999, weight_decay=s["weight_decay"],
                   eps=1e-8, maximize=s["maximize"], grad_scale=None, found_inf=None)
            native.step(master, grad, m, v, out, lr=1e-3 * k, beta1=s["beta1"], beta2=0.999,
                        weight_decay=s["weight_decay"], eps=1e-8, step=float(k),
                        adamw=s["adamw"], maximize=s["maximize"],
                        grad_scale=s["grad_scale"], num_threads=torch.get_num_threads())
            for name, a, b in (("master", master, ref_master), ("exp_avg", m, ref_m),
                               ("exp_avg_sq", v, ref_v), ("bf16 weight", out, ref_master.to(torch.bfloat16))):
                if not torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.int16),
                                   b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.int16)):
                    return f"{name} differs from torch's kernel at step {k} with {s}"
    return None


def kernel() -> Optional[NativeAdam]:
    """The verified native kernel, or None (no compiler, build failure, mismatch, or disabled)."""
    with _lock:
        if "kernel" in _state:
            return _state["kernel"]
        result = None
        if os.environ.get("OFFLOAD_PLUGIN_NATIVE", "1") == "0":
            reason = "OFFLOAD_PLUGIN_NATIVE=0"
        else:
            try:
                candidate = NativeAdam(_load(_build()))
                reason = _matches_torch(candidate)
                result = candidate if reason is None else None
            except (RuntimeError, OSError) as err:
                reason = str(err)
        if result is None:
            log.info("offload_plugin: one-pass host update unavailable (%s); using torch's "
                     "fused kernel in three passes (same results, slower).", reason)
        _state["kernel"] = result
        _state["reason"] = reason
        return result
