"""Builds a format's native host kernel: compiled from its ``csrc/`` source on first use with the
system's C++ compiler (about a second; cached under ``$OFFLOAD_PLUGIN_CACHE`` or
``~/.cache/offload_plugin``, keyed by the source, flags, torch and the CPU), linked to the OpenMP
runtime torch already uses (both share one thread pool), and used only once it reproduced its
torch reference bit for bit on this machine (:func:`load_verified`). ``OFFLOAD_PLUGIN_NATIVE=0``
never builds one.
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
from typing import Callable, Optional

import torch

__all__ = ["build", "load_verified"]

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-fopenmp"]


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


def build(source: Path) -> Path:
    """Compiles ``source`` (a .cpp under csrc/) into a cached shared library and returns its
    path; offload_plugin.formats.compact.native builds its kernel through this too, with the same
    flags, cache and OpenMP runtime."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) found")
    gomp = _torch_openmp()
    link = [f"-L{gomp.parent}", f"-l:{gomp.name}", f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-fopenmp"]
    key = hashlib.sha256(
        source.read_bytes()
        + repr((compiler, _FLAGS, link, platform.machine(), torch.__version__)).encode()
        + _cpu_id()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for cmd in (
            [compiler, *_FLAGS, "-c", str(source), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(lib), *link],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: concurrent builds never load a partial file
    return target


def load_verified(state: dict, lock: threading.Lock, source: Path, make: Callable, check: Callable,
                  what: str):
    """``make(library built from source)`` once ``check`` of it returns None (no difference
    from its torch reference), cached in ``state`` (``"kernel"`` and ``"reason"``) under
    ``lock``; else None, with the reason logged (no compiler, build failure, mismatch, or
    ``OFFLOAD_PLUGIN_NATIVE=0``). For a second kernel that follows this module's pattern."""
    if "kernel" in state:  # (the common case, without the lock)
        return state["kernel"]
    with lock:
        if "kernel" in state:
            return state["kernel"]
        result, reason = None, None
        if os.environ.get("OFFLOAD_PLUGIN_NATIVE", "1") == "0":
            reason = "OFFLOAD_PLUGIN_NATIVE=0"
        else:
            try:
                candidate = make(ctypes.CDLL(str(build(source))))
                reason = check(candidate)
                result = candidate if reason is None else None
            except (RuntimeError, OSError) as err:
                reason = str(err)
        if reason:
            log.info("offload_plugin: %s unavailable (%s); using its torch path (same results, "
                     "much slower).", what, reason)
        state["kernel"], state["reason"] = result, reason
        return result


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
