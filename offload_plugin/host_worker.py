"""One background thread that runs host updates in the order they were submitted.

The training thread only enqueues work (from backward hooks or step()) and keeps launching
GPU kernels; it waits in ``drain()``. An exception inside a job is kept and raised again,
with the original traceback attached, from the next ``drain()``: nothing fails silently
and nothing hangs. Jobs after a failed one are skipped.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

import torch

__all__ = ["HostWorker", "HostUpdateError"]


class HostUpdateError(RuntimeError):
    """A host-side update or transfer failed; ``__cause__`` is the original exception."""


class HostWorker:
    """Runs callables on a daemon thread with its own intra-op thread count.

    Args:
        num_threads (int): torch intra-op threads for the jobs. Set per thread (OpenMP),
            so the training thread keeps its own setting.
    """

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._jobs: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="offload-host-update", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def drain(self) -> None:
        """Wait for every submitted job; raise HostUpdateError if one failed."""
        if self._thread is not None:
            self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise HostUpdateError(
                f"the host update failed with {type(error).__name__}: {error}. The weights "
                "and optimizer state of the parameters it did not reach are unchanged."
            ) from error

    def _run(self) -> None:
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        while True:
            job = self._jobs.get()
            try:
                if self._error is None:
                    job()
            except BaseException as error:  # re-raised in the training thread by drain()
                self._error = error
            finally:
                self._jobs.task_done()
