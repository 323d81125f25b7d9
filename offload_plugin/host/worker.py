"""One background thread that runs host updates in the order they were submitted (or, for
parameters that live on the CPU, the submitting thread itself).

The training thread only enqueues work (from backward hooks or step()) and keeps launching
GPU kernels; it waits in ``drain()``. Urgent jobs (adding an accumulated gradient, which
the next micro-batch waits for) run before queued non-urgent ones (updates), each class
in submission order. An exception inside a job is kept and raised again,
with the original traceback attached, from the next ``drain()``: nothing fails silently
and nothing hangs. Jobs after a failed one are skipped.

At interpreter exit every worker is stopped and every worker thread joined (``atexit``),
including the thread of a worker already collected, which may still be freeing its
optimizer: a daemon thread still alive when Python finalizes is torn down with
``pthread_exit``, which aborts the process ("terminate called without an active
exception") if it unwinds through C++ frames, e.g. a torch kernel or the OpenMP runtime.

With parameters on the CPU there is nothing to overlap with: the training thread's own
kernels already fill the host's cores. A worker thread there only costs: every thread that
runs a parallel region gets an OpenMP team of its own, and once libgomp manages more
threads than there are cores it stops spinning between regions in every team, so each of
the training thread's many small regions first wakes its threads from sleep. Measured on
the 2-core CI machine, the training thread's forward and backward of the tiny QLoRA demo
model ran 2.5-3x slower for the rest of the process once a second thread had run a single
parallel op. ``inline=True`` runs each job in ``submit`` instead, in the caller's team.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import time
import weakref
from typing import Callable, Optional

import torch

__all__ = ["HostWorker", "HostUpdateError", "JobBatch", "BATCH_NUMEL"]

# Parameters are handed to the worker in batches of at least this many elements (a large
# parameter alone). Each hand-off costs the submitting thread a lock and usually a GIL
# round trip with the worker, up to ~1 ms when the worker is running Python: with
# hundreds of small tensors (LoRA adapters) that dwarfed the update itself. 4 Mi elements
# take about a millisecond to update on 16 cores, so batching delays no update by more.
BATCH_NUMEL = 1 << 22


_LIVE_WORKERS: "weakref.WeakSet[HostWorker]" = weakref.WeakSet()
_LIVE_THREADS: "set[threading.Thread]" = set()  # worker threads not finished yet
_STOP = object()  # queue sentinel: leave the loop
_URGENT, _NORMAL, _LAST = 0, 1, 2  # queue priorities


def _stop_all_workers() -> None:
    for worker in list(_LIVE_WORKERS):
        worker.close()
    # The threads of workers already collected got their stop from the worker's
    # finalizer, but may still be running (freeing that worker's optimizer).
    for thread in list(_LIVE_THREADS):
        thread.join()


atexit.register(_stop_all_workers)


class HostUpdateError(RuntimeError):
    """A host-side update or transfer failed; ``__cause__`` is the original exception."""


class HostWorker:
    """Runs callables on a daemon thread with its own intra-op thread count.

    Args:
        num_threads (int): torch intra-op threads for the jobs. Set per thread (OpenMP),
            so the training thread keeps its own setting. (Inline, native kernels use this
            many threads and torch ops the caller's count.)
        inline (bool): run each job at once in the submitting thread, with the same error
            handling (kept, raised by the next ``drain()``, later jobs skipped).
    """

    def __init__(self, num_threads: int, inline: bool = False) -> None:
        self.num_threads = num_threads
        self.inline = inline
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # FIFO within a priority; jobs are never compared
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._stopper: Optional[weakref.finalize] = None
        self.busy_s = 0.0  # seconds spent in jobs so far (benchmarks compare it to step time)
        self.waited_s = 0.0  # of which update jobs waited for their gradients' copies
        # Benchmarks set a list here to get (start, gradients landed, updated, pushed,
        # elements, first parameter's position) per update job, in perf_counter seconds.
        self.trace: Optional[list] = None

    def start(self) -> None:
        """Start the thread now (else the first ``submit`` does) and return once it has set
        its thread count.

        ``torch.set_num_threads`` also changes process-wide state (MKL's dynamic
        threading among it): the bits of later CPU matrix products change on every
        thread, the training thread's included. Called while the optimizer is built, that
        happens before training, not at whatever point of a backward the first job
        arrives."""
        if self._thread is None and not self.inline:
            ready = threading.Event()
            # The thread holds only a weak reference to this worker: once the worker is
            # garbage (its optimizer was dropped), the finalizer tells the thread to stop.
            # Else every optimizer built in a process would leave its thread, and that
            # thread's OpenMP team, waiting until exit.
            self._thread = threading.Thread(
                target=_serve, args=(weakref.ref(self), self._jobs, self.num_threads, ready),
                name="offload-host-update", daemon=True,
            )
            _LIVE_THREADS.add(self._thread)
            self._thread.start()
            _LIVE_WORKERS.add(self)
            self._stopper = weakref.finalize(
                self, self._jobs.put, (_LAST, next(self._order), _STOP))
            ready.wait()

    def submit(self, job: Callable[[], None], urgent: bool = False) -> None:
        """Queue ``job``; an ``urgent`` one runs before every queued non-urgent job."""
        if self.inline:
            if self._error is None:
                start = time.perf_counter()
                try:
                    job()
                except Exception as error:  # (an interrupt propagates: nothing runs behind it)
                    self._error = error
                self.busy_s += time.perf_counter() - start
            return
        self.start()
        self._jobs.put((_URGENT if urgent else _NORMAL, next(self._order), job))

    @property
    def failed(self) -> bool:
        """Whether a job has failed (drain() raises its error)."""
        return self._error is not None

    def close(self) -> None:
        """Finish the submitted jobs and stop the thread (a later submit starts a new one)."""
        thread, self._thread = self._thread, None
        if self._stopper is not None:
            self._stopper.detach()
            self._stopper = None
        if thread is not None and thread.is_alive():
            self._jobs.put((_LAST, next(self._order), _STOP))
            thread.join()
            self._jobs = queue.PriorityQueue()
        _LIVE_WORKERS.discard(self)

    def drain(self) -> None:
        """Wait for every submitted job; raise HostUpdateError if one failed."""
        if self._thread is not None:
            self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise HostUpdateError(
                f"the host update failed with {type(error).__name__}: {error}. The weights "
                "and optimizer state of the parameters it did not reach are unchanged. (torch's "
                "fused AdamW, CompactAdamW and AdamW8bit check every entry first and change "
                "nothing; another optimizer_cls whose own step() raised part way has advanced "
                "the state of the parameters it reached, as torch's step leaves them: load the "
                "last checkpoint before training on.)"
            ) from error


def _serve(
    worker_ref: "weakref.ref[HostWorker]", jobs: queue.PriorityQueue, num_threads: int,
    ready: threading.Event,
) -> None:
    """A HostWorker's thread: run jobs until told to stop, holding the worker only while a
    job runs."""
    try:
        _serve_jobs(worker_ref, jobs, num_threads, ready)
    finally:
        _LIVE_THREADS.discard(threading.current_thread())


def _serve_jobs(
    worker_ref: "weakref.ref[HostWorker]", jobs: queue.PriorityQueue, num_threads: int,
    ready: threading.Event,
) -> None:
    try:
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
    finally:
        ready.set()
    while True:
        _, _, job = jobs.get()
        if job is _STOP:
            jobs.task_done()
            return
        worker = worker_ref()
        try:
            if worker is not None and worker._error is None:
                start = time.perf_counter()
                job()
                worker.busy_s += time.perf_counter() - start
        except BaseException as error:  # re-raised in the training thread by drain()
            worker._error = error
        finally:
            # Nothing of the job (it holds the optimizer) or the worker stays referenced here
            # while the thread waits for the next one.
            job = worker = None
            jobs.task_done()


class JobBatch:
    """Collects items and submits ``run(items)`` as one job once they hold ``BATCH_NUMEL``
    elements; ``flush()`` submits the rest (call it before waiting on the worker)."""

    def __init__(self, worker: HostWorker, run: Callable[[list], None]) -> None:
        self._worker, self._run = worker, run
        self._min_numel = BATCH_NUMEL
        self._items: list = []
        self._numel = 0

    def add(self, item, numel: int) -> None:
        self._items.append(item)
        self._numel += numel
        if self._numel >= self._min_numel:
            self.flush()

    def flush(self) -> None:
        if self._items:
            items, self._items, self._numel = self._items, [], 0
            self._worker.submit(lambda: self._run(items))
