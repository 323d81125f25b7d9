"""What every CPUOffloadOptimizer in a process shares: the host worker, the host arena and
the transfer streams.

They belong to the process, not to one optimizer: torchtune's ``optimizer_in_bwd`` builds
one optimizer per parameter, and each with a thread of its own (every one with an OpenMP
team over all host cores), its own streams and its own pinned blocks would compete for the
same cores and bandwidth. So optimizers whose parameters are on the same device and that
ask for the same host thread count share one :class:`Resources`. It lives as long as an
optimizer holds it: the last one dropped frees its thread (see host_worker). Each
optimizer counts its own host buffers (``HostArena.account``).

A shared worker runs every instance's jobs in one queue, in submission order; ``drain()``
waits for all of them, and an error raised by any job is raised by the next ``drain()``.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Optional

import torch

from offload_plugin.host.buffers import HostArena
from offload_plugin.host.transfer import Transfers
from offload_plugin.host.worker import HostWorker

__all__ = ["Resources", "resources"]


@dataclasses.dataclass(eq=False)
class Resources:
    """One device's transfer streams, a host worker, host arenas (pinned or not), and the
    device buffers that the streamed update passes moments through."""

    transfers: Transfers
    worker: HostWorker
    arenas: dict = dataclasses.field(default_factory=dict)  # pin -> HostArena
    ring: Optional[object] = None  # streamed.StagingRing, made by the first streamed step

    def arena(self, pin: bool) -> HostArena:
        pin = pin and self.transfers.is_async
        with _lock:
            if pin not in self.arenas:
                self.arenas[pin] = HostArena(pin=pin)
            return self.arenas[pin]


_shared: "weakref.WeakValueDictionary[tuple, Resources]" = weakref.WeakValueDictionary()
_lock = threading.Lock()
# Parameters on the CPU update in the training thread (see host_worker). The tests turn
# this off (tests/conftest.py), so that CI's CPU-only runs go through the host thread and
# its schedules as GPU users do; tests of the inline path turn it back on.
_INLINE_ON_CPU = True


def resources(device: torch.device, host_threads: Optional[int]) -> Resources:
    """The shared resources for parameters on ``device`` (made on first use).

    ``host_threads=None``: with a GPU, all intra-op threads but one, whose core launches
    the GPU work. Parameters on the CPU update in the training thread, with its count
    (see host_worker).
    """
    on_gpu = device.type == "cuda"
    if on_gpu and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    threads = torch.get_num_threads()
    inline = device.type == "cpu" and _INLINE_ON_CPU
    if host_threads is None or inline:
        host_threads = max(1, threads - 1) if on_gpu else threads
    key = (str(device), host_threads, inline)
    with _lock:
        shared = _shared.get(key)
        if shared is None:  # (streams are made once per device, not per optimizer)
            shared = Resources(Transfers(device), HostWorker(host_threads, inline=inline))
            _shared[key] = shared
            if host_threads != threads:  # it will set its own count: do it now (see start)
                shared.worker.start()
    return shared
