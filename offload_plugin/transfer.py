"""Copies between the parameters' device and host memory, ordered by CUDA events.

On CUDA, gradients go to the host on one side stream and weights come back on another,
so both directions overlap compute and each other; within a direction copies run in the
order they were issued. Each copy first waits for the work already queued on the compute
stream, so it sees whatever the recipe did to ``.grad`` or the weights before it. Host
buffers are reused only after the host has waited for the copies that touch them (see
CPUOffloadOptimizer.step). On any other device the copies are plain synchronous ``copy_`` calls: the
same code path, minus the overlap, which is what CPU-only CI exercises.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

__all__ = ["Transfers", "min_max_into"]


class Transfers:
    """Issues device<->host copies for one device.

    Args:
        device (torch.device): the device the parameters live on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_async = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.is_async else None
        self.h2d = torch.cuda.Stream(device) if self.is_async else None

    def _compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def to_host(
        self,
        pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
        before: Optional[Callable[[torch.Tensor], None]] = None,
    ) -> Optional[object]:
        """Copy each ``(device_src, host_dst)``; returns an event to wait on (None if synchronous).

        The device tensors may be freed by the caller right away: their memory is not
        reused before the copy has read it.

        ``before(first_src)`` runs first, in the copies' stream order: device work on the
        way out (a check, a scale, a norm) that the host would otherwise do with a pass
        over host memory.
        """
        pairs = list(pairs)
        if not self.is_async:
            if before is not None:
                before(pairs[0][0])
            for src, dst in pairs:
                dst.copy_(src)
            return None
        self.d2h.wait_stream(self._compute_stream())
        with torch.cuda.stream(self.d2h):
            if before is not None:
                before(pairs[0][0])
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                # The caching allocator would otherwise hand src's memory to the compute
                # stream as soon as the caller drops it, while this copy still reads it.
                src.record_stream(self.d2h)
            event = torch.cuda.Event()
            event.record(self.d2h)
        return event

    def to_device(
        self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], after: Optional[object] = None
    ) -> Optional[object]:
        """Copy each ``(host_src, device_dst)``; returns the event of the last copy.

        Copies in this direction complete in issue order, so waiting for the latest
        event (``order_compute_after``) covers all earlier ones. The copies first wait
        for the work queued on the compute stream so far (the backward that read these
        weights), or only for ``after`` (an event from ``mark_compute``) when the compute
        stream has since received work that does not read them.
        """
        if not self.is_async:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        if after is not None:
            self.h2d.wait_event(after)
        else:
            self.h2d.wait_stream(self._compute_stream())
        with torch.cuda.stream(self.h2d):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        return event

    def mark_compute(self) -> Optional[object]:
        """An event after the work queued on the compute stream so far (None if synchronous)."""
        if not self.is_async:
            return None
        event = torch.cuda.Event()
        event.record(self._compute_stream())
        return event

    @staticmethod
    def landed(event: Optional[object]) -> bool:
        """Whether ``event`` (from to_host) has completed, without waiting."""
        return event is None or event.query()

    def order_compute_after(self, event: Optional[object]) -> None:
        """Make work queued on the compute stream from now on wait for ``event``."""
        if event is not None:
            self._compute_stream().wait_event(event)

    @staticmethod
    def wait(event: Optional[object]) -> None:
        """Block the host until ``event`` (from to_host/to_device) has completed."""
        if event is not None:
            event.synchronize()


def min_max_into(device_buf: torch.Tensor, host_buf: torch.Tensor, src: torch.Tensor) -> None:
    """Put ``src``'s minimum and maximum in ``device_buf`` and start their copy to
    ``host_buf`` (two elements each, ``src``'s dtype): inf and NaN propagate to them, so
    the host can tell whether ``src`` is finite without reading it."""
    torch.aminmax(src, out=(device_buf[0], device_buf[1]))  # one read-only pass, no temporaries
    host_buf.copy_(device_buf, non_blocking=device_buf.is_cuda)
