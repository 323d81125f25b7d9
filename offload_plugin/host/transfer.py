"""Copies between the parameters' device and host memory, ordered by CUDA events.

On CUDA, gradients go to the host on one side stream and weights come back on another,
so both directions overlap compute and each other; within a direction copies run in the
order they were issued. Small tensors whose host buffers lie back to back (as the arena
hands them out) travel packed: one copy per run instead of one per tensor (see
:func:`packed_runs`). Copies to the device are issued through the CUDA runtime that
torch loaded, with the GIL held (see _CudaRuntime). Each copy first waits for the work
already queued on the compute stream, so it sees whatever the recipe did to ``.grad`` or
the weights before it. Host buffers are reused only after the host has waited for the
copies that touch them (see CPUOffloadOptimizer.step). On any other device the copies are
plain synchronous ``copy_`` calls: the same code path, minus the overlap, which is what
CPU-only CI exercises.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Iterable, Optional

import torch

__all__ = ["Transfers", "min_max_into", "packed_runs"]

_H2D = 1  # cudaMemcpyHostToDevice

# Tensors up to this size travel packed with their neighbours. Issuing a copy costs the
# host 5-15 us, as long as the DMA of ~256 KiB; a few hundred LoRA adapters copied one by
# one cost a step more than their update (bench/investigations/step_overhead.py). Larger
# tensors keep a copy of their own, so that each update can start as soon as its gradient
# lands.
PACK_MAX_BYTES = 1 << 20

# The event Transfers.wait last saw complete. Not a class attribute: replacing one frees the
# old event, whose deallocation gives up the GIL before the class's attribute cache is
# invalidated, and another thread reading the attribute then got the freed object (a
# segfault on the GPU machine). A list item is replaced before the old one is released.
_last_completed: list = [None]


def packed_runs(pairs: list, host: int, cache: Optional[dict] = None) -> list[tuple[list, Optional[torch.Tensor]]]:
    """``pairs`` (host tensor at index ``host``, device tensor at the other) split in issue
    order into runs copied packed, each with a 1-D tensor over its host side, and pairs
    copied alone (with None). A run holds two or more small pairs (up to PACK_MAX_BYTES
    each) whose host tensors are contiguous, on the CPU and back to back in one storage.

    The device side of a run is packed and unpacked with one multi-tensor copy into and
    out of views shaped as the host tensors, which lands each element as ``copy_`` would:
    a device tensor of another dtype or layout needs no run of its own, so the split
    depends only on the host tensors. Those are the same buffers step after step, so with
    ``cache`` (a dict its caller keeps as long as the host tensors) it is worked out once
    per sequence of them; a step looks up a key and asks nothing of its device tensors
    (asking each its dtype, size and layout cost 0.2 ms per direction of a step over 192
    LoRA adapters on the H200)."""
    hosts = [pair[host] for pair in pairs]
    key = tuple(map(id, hosts))
    entry = cache.get(key) if cache is not None else None
    if entry is None:
        entry = (hosts, _host_runs(hosts))
        if cache is not None:
            if len(cache) > 64:  # (the batches change with the gradients' arrival order)
                cache.clear()
            cache[key] = entry  # (holding the tensors, so that the ids stay theirs)
    out: list = []
    for start, end, span in entry[1]:
        run = pairs[start:end]
        if span is not None:
            out.append((run, span))
        else:
            out.extend(([pair], None) for pair in run)
    return out


def _host_runs(hosts: list) -> list[tuple[int, int, Optional[torch.Tensor]]]:
    """packed_runs' split of the host tensors: (start, end, span or None) ranges."""
    out: list = []
    first = numel = end = base = 0
    dtype = None

    def close(stop: int) -> None:
        if stop - first > 1:
            out.append((first, stop, hosts[first].as_strided((numel,), (1,))))
        else:
            out.extend((i, i + 1, None) for i in range(first, stop))

    # One pass, each tensor asked each thing once.
    for i, h in enumerate(hosts):
        n, size, ptr = h.numel(), h.element_size(), h.data_ptr()
        if not (0 < n * size <= PACK_MAX_BYTES and h.is_contiguous() and not h.is_cuda):
            close(i)
            out.append((i, i + 1, None))
            first, numel, dtype = i + 1, 0, None
            continue
        start = ptr - h.storage_offset() * size  # the first byte of its storage
        if i == first or ptr != end or h.dtype != dtype or start != base:
            close(i)
            first, numel, dtype, base = i, 0, h.dtype, start
        numel, end = numel + n, ptr + n * size
    close(len(hosts))
    return out


class _CudaRuntime:
    """``cudaMemcpyAsync`` from the CUDA runtime library torch loaded, called with the GIL
    held (ctypes.PyDLL).

    The host update thread sends each batch of updated weights to the device while the
    training thread runs Python to launch kernels. Through torch, each call (the stream
    switch, each copy, the event) gives the GIL up and waits to get it back: a batch of 1-4
    copies cost 34-98 us alone and 59-171 us beside a thread launching kernels, against
    14-57 us and 19-75 us this way (bench/investigations/copy_issue_cost.py on the H200 machine,
    bench/results/investigations/*-copy_issue_cost.json). Over a Llama-3.1-8B 4k step the
    host worker's time issuing copies went from about 0.045 s to 0.02 s (one A/B, traced).
    A separate issuing thread was tried first: steps got no faster and the update ran
    slower beside it (one thread more on the cores that the update's OpenMP team fills).

    Unlike ``copy_``, these writes leave the parameters' version counters alone. Nothing
    autograd saved can see them: a weight is sent only after the backward that read it
    (its gradient hook has fired), and the next forward saves it after its copy.
    """

    @classmethod
    @functools.cache  # (two threads racing on the first call both find the same library)
    def load(cls) -> Optional["_CudaRuntime"]:
        """The runtime, or None where torch's is not a shared library found in this
        process (then copies go through torch)."""
        if torch.version.cuda is None:
            return None
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
        except OSError:
            return None
        if len(paths) != 1:  # none (linked statically), or more than one: do not guess
            return None
        try:
            return cls(ctypes.PyDLL(paths.pop()))
        except (OSError, AttributeError):
            return None

    def __init__(self, lib: ctypes.PyDLL) -> None:
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                 ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: {self._error_string(code).decode()} (CUDA error {code})")

    def copy_to_device(self, pairs: list, device_index: int, stream: int) -> None:
        """Enqueue each ``(host_src, device_dst)`` on ``stream`` (both contiguous, same size)."""
        # The calling thread's current device may be another (a thread starts on device 0).
        # torch's guard switches and back without making a context on a device this
        # process does not use (cudaSetDevice would, since CUDA 12).
        with torch.cuda.device(device_index):
            for src, dst in pairs:
                nbytes = src.numel() * src.element_size()
                self._check(self._memcpy(dst.data_ptr(), src.data_ptr(), nbytes, _H2D, stream),
                            "cudaMemcpyAsync to the device")


def _plain_pair(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``src`` can be copied into ``dst`` byte for byte (else torch's copy_ does it)."""
    return (src.dtype == dst.dtype and src.shape == dst.shape and src.is_contiguous()
            and dst.is_contiguous() and src.device.type == "cpu")


class Transfers:
    """Issues device<->host copies for one device.

    Args:
        device (torch.device): the device the parameters live on.
    """

    def __init__(self, device: torch.device) -> None:
        self.is_async = device.type == "cuda"
        if self.is_async and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.d2h = torch.cuda.Stream(device) if self.is_async else None
        self.h2d = torch.cuda.Stream(device) if self.is_async else None
        self._runtime = _CudaRuntime.load() if self.is_async else None
        self._h2d_waits_for = None  # the `after` event the h2d stream already waits for
        self._device_stage: dict = {}  # dtype -> device buffer that packed runs land in
        self._views: dict = {}  # (span, stage) -> views of the stage (see _stage_views)
        self._pack_buffer: dict = {}  # dtype -> device buffer that packed runs leave from
        self._packed_read_by = None  # the event of the latest copy out of it

    def _compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def to_host(
        self,
        pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
        before: Optional[Callable[[torch.Tensor], None]] = None,
        runs_cache: Optional[dict] = None,
        check: Optional[Callable[[list], None]] = None,
    ) -> Optional[object]:
        """Copy each ``(device_src, host_dst)``; returns an event to wait on (None if synchronous).

        The device tensors may be freed by the caller right away: their memory is not
        reused before the copy has read it.

        ``before(first_src)`` runs first, in the copies' stream order: device work on the
        way out (a check, a scale, a norm) that the host would otherwise do with a pass
        over host memory. ``check(sources)`` likewise, with every device tensor the copies
        read (a packed run as its one packed tensor); whatever it copies to the host is
        there once the returned event has completed. ``runs_cache``: see :func:`packed_runs`.
        """
        pairs = list(pairs)
        if not self.is_async:
            if before is not None:
                before(pairs[0][0])
            if check is not None:
                check([src for src, _ in pairs])
            for src, dst in pairs:
                dst.copy_(src)
            return None
        runs = packed_runs(pairs, 1, runs_cache) if len(pairs) > 1 else [(pairs, None)]
        packed = self._pack(runs)
        self.d2h.wait_stream(self._compute_stream())
        with torch.cuda.stream(self.d2h):
            if before is not None:
                before(pairs[0][0])
            if check is not None:
                check([src for (run, _), flat in zip(runs, packed)
                       for src in ([flat] if flat is not None else [s for s, _ in run])])
            for (run, span), flat in zip(runs, packed):
                if span is not None:
                    span.copy_(flat, non_blocking=True)  # (flat is ours: see _pack)
                    continue
                for src, dst in run:
                    dst.copy_(src, non_blocking=True)
                    # The caching allocator would otherwise hand src's memory to the compute
                    # stream as soon as the caller drops it, while this copy still reads it.
                    src.record_stream(self.d2h)
            event = torch.cuda.Event()
            event.record(self.d2h)
        if any(flat is not None for flat in packed):
            self._packed_read_by = event
        return event

    def _pack(self, runs: list) -> list:
        """Each packed run's device sources copied side by side into the pack buffer (one
        multi-tensor copy per run, on the compute stream, where the sources were written:
        they need no record_stream); None for the others. The buffer is reused by the next
        call, whose packing the compute stream orders after this call's copies out of it.
        (Packing by concatenation made 192 views and a new tensor at every step: 0.3 ms
        of a step over 192 LoRA adapters on the H200.)"""
        need: dict = {}
        for _, span in runs:
            if span is not None:
                need[span.dtype] = need.get(span.dtype, 0) + span.numel()
        if not need:
            return [None] * len(runs)
        compute = self._compute_stream()
        if self._packed_read_by is not None:
            compute.wait_event(self._packed_read_by)
        for dtype, numel in need.items():
            buf = self._pack_buffer.get(dtype)
            if buf is None or buf.numel() < numel:
                if buf is not None:
                    buf.record_stream(self.d2h)  # (a copy out of it may still be reading)
                self._pack_buffer[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
                self._views.clear()  # (they would keep the old buffer alive)
        offset = dict.fromkeys(need, 0)
        out = []
        for run, span in runs:
            if span is None:
                out.append(None)
                continue
            start = offset[span.dtype]
            offset[span.dtype] = start + span.numel()
            flat = self._pack_buffer[span.dtype][start:start + span.numel()]
            torch._foreach_copy_(self._stage_views(flat, span, [dst for _, dst in run]),
                                 [src for src, _ in run])
            out.append(flat)
        return out

    def to_device(
        self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], after: Optional[object] = None,
        runs_cache: Optional[dict] = None,
    ) -> Optional[object]:
        """Copy each ``(host_src, device_dst)``; returns the event of the last copy.
        ``device_dst`` may be a parameter (a leaf that requires grad); its version
        counter does not move.

        Copies in this direction complete in issue order, so waiting for the latest
        event (``order_compute_after``) covers all earlier ones. The copies first wait
        for the work queued on the compute stream so far (the backward that read these
        weights), or only for ``after`` (an event from ``mark_compute``) when the compute
        stream has since received work that does not read them. ``runs_cache``: see
        :func:`packed_runs`.
        """
        if not self.is_async:
            for src, dst in pairs:
                dst.data.copy_(src)  # (.data: see below)
            return None
        if after is None:
            self.h2d.wait_stream(self._compute_stream())
        elif after is not self._h2d_waits_for:  # (later copies on the stream wait anyway)
            self.h2d.wait_event(after)
            self._h2d_waits_for = after
        pairs = list(pairs)
        for run, span in packed_runs(pairs, 0, runs_cache) if len(pairs) > 1 else [(pairs, None)]:
            if span is not None:
                self._to_device_packed(run, span)
            elif self._runtime is not None and all(_plain_pair(src, dst) for src, dst in run):
                self._runtime.copy_to_device(run, self.device.index, self.h2d.cuda_stream)
            else:
                # Through ``.data``, like the runtime's copies: legal on a leaf that requires
                # grad in any thread's grad mode, and the parameter's version counter stays
                # for changes made outside the optimizer (see weight_sync).
                with torch.cuda.stream(self.h2d):
                    for src, dst in run:
                        dst.data.copy_(src, non_blocking=True)
        return self.h2d.record_event()

    def _to_device_packed(self, run: list, span: torch.Tensor) -> None:
        """One copy of ``span`` (the run's host sources, back to back) into a device buffer,
        then one multi-tensor copy from it into each destination, all on the h2d stream:
        the next run's copy into the buffer waits for this one's reads by stream order."""
        stage = self._device_stage.get(span.dtype)
        with torch.cuda.stream(self.h2d):  # (so its memory is the h2d stream's own)
            if stage is None or stage.numel() < span.numel():
                stage = torch.empty(span.numel(), dtype=span.dtype, device=self.device)
                self._device_stage[span.dtype] = stage
                self._views.clear()  # (they would keep the old buffer alive)
            stage = stage[:span.numel()]
            if self._runtime is not None:
                self._runtime.copy_to_device([(span, stage)], self.device.index, self.h2d.cuda_stream)
            else:
                stage.copy_(span, non_blocking=True)
            dsts = [dst.data for _, dst in run]  # (.data: as above)
            torch._foreach_copy_(dsts, self._stage_views(stage, span, [src for src, _ in run]))

    def _stage_views(self, stage: torch.Tensor, span: torch.Tensor, hosts: list) -> list:
        """Views of ``stage`` (the device buffer a packed run lands in, or leaves from: see
        _to_device_packed and _pack) shaped as ``hosts`` (whose span is ``span``), made once
        per span and buffer: the same runs travel at every step, and making the views was
        0.4 ms of a 6 ms step over 192 LoRA adapters (H200). A span is packed_runs' cached
        object for the same host tensors, and the entry holds it, so its id stays its own."""
        key = (id(span), stage.data_ptr())
        entry = self._views.get(key)
        if entry is None or entry[0] is not span:
            if len(self._views) > 64:
                self._views.clear()
            entry = (span, torch._utils._unflatten_dense_tensors(stage, hosts))
            self._views[key] = entry
        return entry[1]

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
    def waited(event: Optional[object]) -> bool:
        """Whether :meth:`wait` would return at once without a call into CUDA."""
        return event is None or event is _last_completed[0]

    @staticmethod
    def wait(event: Optional[object]) -> None:
        """Block the host until ``event`` (from to_host/to_device) has completed."""
        # query() keeps the GIL; synchronize() gives it up and must win it back from a
        # training thread launching kernels, even for a copy that landed long ago. The
        # slots of a batch share one event: once it has completed, skip even the query.
        if Transfers.waited(event):
            return
        if not event.query():
            event.synchronize()
        _last_completed[0] = event  # (events are recorded once: it stays completed)


def min_max_into(device_buf: torch.Tensor, host_buf: torch.Tensor, src: torch.Tensor) -> None:
    """Put ``src``'s minimum and maximum in ``device_buf`` and start their copy to
    ``host_buf`` (two elements each, ``src``'s dtype): inf and NaN propagate to them, so
    the host can tell whether ``src`` is finite without reading it."""
    torch.aminmax(src, out=(device_buf[0], device_buf[1]))  # one read-only pass, no temporaries
    host_buf.copy_(device_buf, non_blocking=device_buf.is_cuda)
