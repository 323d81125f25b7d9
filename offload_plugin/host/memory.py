"""Host-memory preflight: refuse to start what cannot fit, before allocating anything.

An offload optimizer that runs out of host memory hours into training is killed by the
kernel's OOM killer with no message. The need is known at construction (buffers plus the
optimizer state allocated at the first step), and so is what this process may still use
(``MemAvailable`` and the cgroup limit of a container or job scheduler).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Optional

import torch

from offload_plugin.host.buffers import master_dtype_for

__all__ = ["HostMemoryError", "state_tensors_per_param", "bytes_needed", "available_bytes", "check",
           "promise", "allocated"]

GIB = 2**30


class HostMemoryError(MemoryError):
    """The optimizer's host buffers and state would not fit in the memory this process may use."""


def state_tensors_per_param(optimizer_cls: type, kwargs: dict) -> int:
    """How many parameter-sized state tensors ``optimizer_cls`` keeps (2 when unknown)."""
    if issubclass(optimizer_cls, torch.optim.Adam) or optimizer_cls.__name__ in ("Adamax", "NAdam", "RAdam"):
        return 3 if kwargs.get("amsgrad") else 2
    if issubclass(optimizer_cls, torch.optim.SGD):
        return 1 if kwargs.get("momentum", 0) else 0
    if issubclass(optimizer_cls, torch.optim.RMSprop):
        return 1 + bool(kwargs.get("momentum", 0)) + bool(kwargs.get("centered", False))
    if issubclass(optimizer_cls, torch.optim.Adagrad):
        return 1
    return 2


def bytes_needed(
    params, master_weights: bool, state_tensors: int, extra_grad_buffers: int = 0,
    host_copies: bool = True, state_bytes=None,
) -> int:
    """Host bytes for master weights, gradient and staging buffers, and optimizer state.

    ``extra_grad_buffers``: further gradient-sized buffers per parameter (the delayed
    update's second gradient buffer and landing buffer). ``host_copies=False``: the
    streamed update, which keeps only the state on the host. ``state_bytes(p)``: the state's
    bytes per element of ``p`` where its state format says (CompactAdamW's, AdamW8bit's),
    in place of ``state_tensors`` tensors of the master's dtype.
    """
    total = 0
    for p in params:
        master = torch.empty((), dtype=master_dtype_for(p, master_weights)).element_size()
        own = p.element_size()
        stage = own if master != own else 0
        copies = master + own * (1 + extra_grad_buffers) + stage if host_copies else 0
        state = state_bytes(p) if state_bytes is not None else state_tensors * master
        total += p.numel() * (copies + state)
    return total


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_bytes() -> tuple[Optional[int], str]:
    """What this process may still allocate, and where that number comes from."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except OSError:
        pass
    cg = Path("/sys/fs/cgroup")
    for limit_file, usage_file in (
        (cg / "memory.max", cg / "memory.current"),  # cgroup v2
        (cg / "memory" / "memory.limit_in_bytes", cg / "memory" / "memory.usage_in_bytes"),  # v1
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:
            limits.append((limit - usage, f"the cgroup limit in {limit_file}"))
    if not limits:
        return None, "unknown"
    return min(limits)


# Host bytes that optimizers of this process were checked for but have not touched yet
# (optimizer state is zero-filled at the first step, so MemAvailable does not show it
# before). torchtune's optimizer_in_bwd builds one optimizer per parameter, each checking
# its own need: each check counts what the others still will take.
_promised: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


def promise(owner: object, nbytes: int) -> None:
    """``owner`` will allocate ``nbytes`` more at its first step (see check)."""
    if nbytes:
        _promised[owner] = _promised.get(owner, 0) + nbytes


def allocated(owner: object) -> None:
    """``owner`` has stepped or loaded its state: what it promised is allocated now."""
    if _promised:  # (every step calls this: nothing to do after the first)
        _promised.pop(owner, None)


def _size(nbytes: float) -> str:
    """A byte count for a message: GiB, or MiB / KiB where GiB would read 0.0."""
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= 0.1 * scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} bytes"


def check(needed: int, num_params: int, master_weights: bool) -> None:
    """Raise HostMemoryError if ``needed`` bytes, and what optimizers of this process
    promised to allocate at their first step (see promise), exceed what the process may use."""
    free, source = available_bytes()
    if free is not None and _promised and needed + sum(_promised.values()) > free:
        gc.collect()  # (a dropped optimizer in a reference cycle would still hold its promise)
    promised = list(_promised.values())
    if free is None or needed + sum(promised) <= free:
        return
    if promised:
        source += (f", less {_size(sum(promised))} that {len(promised)} optimizer(s) of this process "
                   "(torchtune's optimizer_in_bwd builds one per parameter) allocate at their first step")
        free = max(free - sum(promised), 0)
    options = [
        "a smaller model, or LoRA/QLoRA instead of full fine-tuning",
        "more host RAM (or a higher container memory limit)",
    ]
    if master_weights:
        options.insert(0, "master_weights=False (bf16/fp16 parameters then keep their "
                          "optimizer state in their own dtype: about half the memory)")
    raise HostMemoryError(
        f"CPUOffloadOptimizer needs about {_size(needed)} of host memory for "
        f"{num_params:,} trainable elements (buffers plus optimizer state), but this process "
        f"may use only {_size(free)} more ({source}). Options: "
        + "; ".join(options)
        + ". If that figure is wrong (some VMs report memory late), pass "
        "check_host_memory=False."
    )
