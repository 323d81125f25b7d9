"""Copies between the parameters' device and host memory, ordered by CUDA events.

On CUDA every copy runs on one side stream, so copies overlap compute and run in the
order they were issued (a device-to-host copy into a buffer never overtakes an earlier
host-to-device copy out of it). Each copy first waits for the work already queued on
the compute stream, so it sees whatever the recipe did to ``.grad`` or the weights
before it. On any other device the copies are plain synchronous ``copy_`` calls: the
same code path, minus the overlap, which is what CPU-only CI exercises.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

__all__ = ["Transfers"]


class Transfers:
    """Issues device<->host copies for one device.

    Args:
        device (torch.device): the device the parameters live on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_async = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_async else None

    def _compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def to_host(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Optional[object]:
        """Copy each ``(device_src, host_dst)``; returns an event to wait on (None if synchronous).

        The device tensors may be freed by the caller right away: their memory is not
        reused before the copy has read it.
        """
        if not self.is_async:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        self.stream.wait_stream(self._compute_stream())
        with torch.cuda.stream(self.stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                # The caching allocator would otherwise hand src's memory to the compute
                # stream as soon as the caller drops it, while this copy still reads it.
                src.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def to_device(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Optional[object]:
        """Copy each ``(host_src, device_dst)``; later compute-stream work waits for them."""
        if not self.is_async:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        compute = self._compute_stream()
        self.stream.wait_stream(compute)  # nothing queued before may still read the old values
        with torch.cuda.stream(self.stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)
        return event

    @staticmethod
    def wait(event: Optional[object]) -> None:
        """Block the host until ``event`` (from to_host/to_device) has completed."""
        if event is not None:
            event.synchronize()
