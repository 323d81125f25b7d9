"""Host-memory copies of the trainable parameters: master weights, gradients, staging.

Every trainable parameter gets a :class:`HostSlot`. The buffers of all slots are carved
out of a few large flat blocks per dtype (one allocation, one pin per block) instead of
one pinned allocation per tensor: pinning is slow per call, and torch's caching host
allocator rounds every request up to a power of two. Only the blocks that copies to or
from the GPU touch are pinned (gradients, outgoing weights); fp32 master weights that
only the host reads stay pageable, which halves the memory to lock at setup.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from offload_plugin.distributed import DTensor, local_part

__all__ = ["HostSlot", "HostArena", "ArenaAccount", "allocate_landing", "allocate_moments", "back_to_back",
           "build_slots", "give_host_copies", "master_dtype_for"]

log = logging.getLogger(__name__)

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def master_dtype_for(param: torch.Tensor, master_weights: bool) -> torch.dtype:
    """The dtype the host keeps and updates for ``param``: fp32 for bf16/fp16 with master weights."""
    if master_weights and param.dtype in _LOW_PRECISION:
        return torch.float32
    return param.dtype


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _advise_huge_pages(block: torch.Tensor) -> bool:
    """Ask Linux to back ``block`` with 2 MiB pages where it can (transparent huge pages in
    "madvise" mode, a common default): 512 times fewer pages to fault in and to pin.
    Best effort: elsewhere, or if refused, the block keeps normal pages. Returns whether
    the advice was taken."""
    if not sys.platform.startswith("linux"):
        return False
    begin = block.data_ptr()
    start = -(-begin // _HUGE_PAGE) * _HUGE_PAGE
    end = (begin + block.numel() * block.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


def _huge_page_block(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized flat host block, advised to use huge pages (nothing touched yet)."""
    block = torch.empty(numel, dtype=dtype)
    _advise_huge_pages(block)
    return block


def page_locked_block(numel: int, dtype: torch.dtype, pin: bool, what: str = "") -> torch.Tensor:
    """A flat host block of ``numel`` elements, advised to use huge pages and, with ``pin``,
    page-locked for copies to and from the GPU. If locking fails the block stays pageable
    (the copies then run slower) and a warning names ``what`` it holds."""
    block = _huge_page_block(numel, dtype)
    if pin and numel and not _pin(block):
        log.warning("Could not pin %.2f GiB of host memory%s; using pageable memory (slower copies to and "
                    "from the GPU). Check `ulimit -l` and free RAM.",
                    numel * block.element_size() / 2**30, f" for {what}" if what else "")
    return block


def _pin(block: torch.Tensor) -> bool:
    """Page-lock ``block`` in place (cudaHostRegister); unpinned again when it is freed."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = block.data_ptr(), block.numel() * block.element_size()
    # Fault the pages in first, on all of this thread's intra-op threads (a parallel
    # fill): cudaHostRegister would fault them in on one thread. With huge pages too,
    # 16 GiB took 1.2 s instead of 8.5 s on the H200 machine (bench/pinning.py).
    block.zero_()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        return False
    # Unregister when the block is collected (it lives as long as its views). Should views
    # outlive it, they stay valid as pageable memory: copies get slower, never wrong.
    weakref.finalize(block, cudart.cudaHostUnregister, ptr)
    return True


class HostArena:
    """Flat host blocks from which per-parameter views are taken, shared by the optimizers
    of a process (see process.py).

    A request of at least ``CHUNK_BYTES`` gets a block of its own. Smaller ones are carved
    from a shared chunk per dtype and pinning: torchtune's ``optimizer_in_bwd`` builds one
    optimizer per parameter, and a pinned block per small tensor would cost a page-locking
    call each. Each optimizer counts what it asked for through its own
    :meth:`account`. Memory lives as long as any view of its block (a dropped optimizer's
    carve of a chunk is returned with the chunk).

    Args:
        pin (bool): page-lock the blocks that GPU copies touch, so that they run
            asynchronously at full bandwidth. Falls back to pageable memory with a warning
            if pinning fails.
    """

    CHUNK_BYTES = 64 << 20

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._chunks: dict[tuple, list] = {}  # (dtype, pinned) -> [chunk, elements used]
        self._lock = threading.Lock()

    def account(self) -> "ArenaAccount":
        return ArenaAccount(self)

    def allocate(
        self, numels: list[int], dtype: torch.dtype, for_transfers: bool = True
    ) -> list[torch.Tensor]:
        """``len(numels)`` consecutive buffers; returns a 1-D view per buffer. Pinned if the
        arena pins and ``for_transfers`` (the GPU copies from or into them)."""
        pinned = self.pin and for_transfers
        total = sum(numels)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if total * itemsize >= self.CHUNK_BYTES:
            return list(self._block(total, dtype, pinned).split(numels))
        align = max(1, 64 // itemsize)  # each request starts on a cache line
        with self._lock:
            chunk, used = self._chunks.get((dtype, pinned), (None, 0))
            start = -(-used // align) * align
            if chunk is None or start + total > chunk.numel():
                chunk, start = self._block(self.CHUNK_BYTES // itemsize, dtype, pinned), 0
            self._chunks[(dtype, pinned)] = [chunk, start + total]
        return list(chunk[start:start + total].split(numels))

    @staticmethod
    def _block(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return page_locked_block(numel, dtype, pinned)


class ArenaAccount:
    """One optimizer's allocations from a shared :class:`HostArena`, and their bytes."""

    def __init__(self, arena: HostArena) -> None:
        self._arena = arena
        self.pin = arena.pin
        self._bytes = 0

    def allocate(self, numels: list[int], dtype: torch.dtype, for_transfers: bool = True) -> list[torch.Tensor]:
        views = self._arena.allocate(numels, dtype, for_transfers)
        self._bytes += sum(v.numel() * v.element_size() for v in views)
        return views

    def nbytes(self) -> int:
        return self._bytes


@dataclass
class HostSlot:
    """The host side of one trainable parameter.

    ``master`` is what the inner optimizer updates (fp32 for bf16/fp16 parameters with
    master weights, else the parameter's dtype). ``grad`` holds the gradient in the
    parameter's dtype, accumulated on the host when gradients are offloaded.
    ``weight_stage`` holds the updated weight in the parameter's dtype on its way back to
    the device; it is ``None`` when ``master`` already has that dtype. Between steps it is
    free, so accumulated gradients land there (``incoming``) before being added to ``grad``;
    without it, they land in a buffer from :func:`allocate_landing`.
    """

    param: torch.Tensor
    master: torch.Tensor
    grad: torch.Tensor
    weight_stage: Optional[torch.Tensor]
    # Offloaded-gradient bookkeeping (see CPUOffloadOptimizer._offload_grad).
    has_grad: bool = False
    # delayed_update: the second gradient buffer (the other one feeds the running update),
    # and whether the updated weight may go to the device (ready, and no longer in use).
    grad_spare: Optional[torch.Tensor] = None
    push_ready: bool = False
    free_to_push: bool = False
    push_event: object = None
    grad_event: object = None
    incoming: Optional[torch.Tensor] = None
    incoming_event: object = None
    incoming_pending: bool = False
    # accumulate_on_device: a weak reference to the gradient autograd is summing on the
    # device, to be added to the host gradient when it leaves (see HostEngine.follow_grad).
    device_part: object = None
    # The gradient's 2-norm taken on the device as it left, while the host gradient is
    # unchanged since (see HostEngine.device_norm).
    device_norm: Optional[torch.Tensor] = None
    # The gradient's minimum and maximum, taken on the device as it left (see
    # CPUOffloadOptimizer._offload_grad): buffers on the device and the host, and whether
    # the host copy describes what ``grad`` holds now.
    extremes: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    extremes_current: bool = False
    # Adam's exp_avg and exp_avg_sq for ``master`` (views of a block per dtype in huge
    # pages, see allocate_moments); the update's state takes them when it is created.
    moments: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # Position among the optimizer's offloaded parameters (their order: for torchtune's
    # models, the order in which the forward uses them).
    order: int = -1
    # The device the parameter was on (a weight moved since is refused: weight_sync).
    param_device: Optional[torch.device] = None
    # Told of ``master`` when a changed weight replaced it: the inner optimizer's
    # ``weight_replaced`` if it has one (CompactAdamW drops the old weight's remainder).
    on_replaced: Optional[Callable[[torch.Tensor], None]] = None
    # (weight_source(), param) for a plain tensor, whose buffers and parameter never change:
    # the pair each update sends, made once (None for a DTensor, whose shard is asked anew).
    push_pair: Optional[tuple] = None
    # Whether the one-pass kernel takes all of this slot in a batch (host_update's
    # _one_native_call without amsgrad); worked out at the first update (None before).
    native_whole: Optional[bool] = None
    # Held while adding ``incoming`` into ``grad``, which the host worker does during
    # backward and the training thread may do too (whichever comes first).
    complete_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def weight_source(self) -> torch.Tensor:
        """The host tensor whose values are copied into the device parameter."""
        return self.master if self.weight_stage is None else self.weight_stage

    def device_weight(self) -> torch.Tensor:
        """Where updated weights go: the parameter, or its local shard if it is a DTensor.

        A ``.data`` alias: writing into it is legal from any thread (grad mode is per
        thread, and the host worker's is on), and it has a version counter of its own, so
        the optimizer's writes leave the parameter's counter to mark changes made outside
        it (see weight_sync).
        """
        return local_part(self.param).data


def weight_mark(param: torch.Tensor) -> tuple[int, int, int]:
    """What identifies ``param``'s current contents without reading them: its version
    counter, its local shard's (the same tensor unless a DTensor) and the shard's storage
    (see weight_sync)."""
    local = param._local_tensor if isinstance(param, DTensor) else param
    return param._version, local._version, local.data_ptr()


def build_slots(
    params: list[torch.Tensor], master_weights: bool, arena: "ArenaAccount", spare_grads: bool = False,
    host_copies: bool = True,
) -> list[HostSlot]:
    """Allocate host buffers for ``params`` and copy their current values into the masters.

    A DTensor parameter (FSDP2) gets buffers for its local shard only, which may be
    empty when the shards are uneven.

    From a GPU the weights come over in their own dtype into the (pinned) gradient
    buffers, asynchronously, and are widened to fp32 on the host in one pass per block:
    much faster than a synchronous, pageable copy per tensor.

    ``host_copies=False`` (the streamed update, which keeps only the state on the host):
    ``master`` and ``grad`` are placeholders shaped like the parameter over one element,
    there to key and shape the state; :func:`give_host_copies` replaces them.
    """
    if not host_copies:
        slots = []
        for p in params:
            placeholder = torch.zeros((), dtype=p.dtype)
            slots.append(HostSlot(param=p, master=placeholder.expand(p.shape),
                                  grad=placeholder.expand(p.shape), weight_stage=None,
                                  param_device=p.device))
        return slots  # (mark () : nothing on the host matches a weight yet)
    shards = [local_part(p).detach() for p in params]
    numels = [s.numel() for s in shards]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)

    masters: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}
    stages: dict[int, torch.Tensor] = {}
    spares: dict[int, torch.Tensor] = {}
    for dtype, idx in by_dtype.items():
        mdtype = master_dtype_for(params[idx[0]], master_weights)
        sizes = [numels[i] for i in idx]
        # The master is the weight the GPU copies back from only without a stage.
        master_views = arena.allocate(sizes, mdtype, for_transfers=mdtype == dtype)
        grad_views = arena.allocate(sizes, dtype)
        for i, m, g in zip(idx, master_views, grad_views):
            masters[i], grads[i] = m, g
        if mdtype != dtype:
            for i, buf in zip(idx, arena.allocate(sizes, dtype)):
                stages[i] = buf
        if spare_grads:
            for i, buf in zip(idx, arena.allocate(sizes, dtype)):
                spares[i] = buf
        _copy_weights_in([shards[i] for i in idx], master_views, grad_views)

    slots = []
    for i, (p, shard) in enumerate(zip(params, shards)):
        shape = shard.shape
        slots.append(
            HostSlot(
                param=p,
                master=masters[i].view(shape),
                grad=grads[i].view(shape),
                weight_stage=stages[i].view(shape) if i in stages else None,
                grad_spare=spares[i].view(shape) if i in spares else None,
                param_device=shard.device,
            )
        )
        if not isinstance(p, DTensor):
            slots[-1].push_pair = (slots[-1].weight_source(), p)
    return slots


def give_host_copies(slots: list[HostSlot], master_weights: bool, arena: "ArenaAccount") -> None:
    """Host buffers for slots built without them (``build_slots(host_copies=False)``), when
    the host update takes over: each slot's master, gradient and stage are replaced in place
    (the host engine then records them unknown, so the next step adopts the weight)."""
    for slot, built in zip(slots, build_slots([s.param for s in slots], master_weights, arena)):
        slot.master, slot.grad, slot.weight_stage = built.master, built.grad, built.weight_stage
        slot.push_pair, slot.native_whole = built.push_pair, None


def allocate_landing(slots: list[HostSlot], arena: "ArenaAccount") -> None:
    """Give each slot an ``incoming`` buffer (its gradient's dtype and shape) from one block
    per dtype: accumulated gradients land there while ``grad`` holds the running sum."""
    by_dtype: dict[torch.dtype, list[HostSlot]] = {}
    for slot in slots:
        by_dtype.setdefault(slot.grad.dtype, []).append(slot)
    for dtype, group in by_dtype.items():
        views = arena.allocate([s.grad.numel() for s in group], dtype)
        for slot, view in zip(group, views):
            slot.incoming = view.view(slot.grad.shape)


def allocate_moments(slots: list[HostSlot], pin: bool = False) -> None:
    """Give each slot ``moments``: two views shaped like its master, from two blocks per
    dtype asked to be backed by huge pages (see _advise_huge_pages). The update streams
    through the moments every step beside the transfers' DMA, and per-tensor allocations
    get few huge pages or none (a bf16 Llama k projection's moment is 2 MiB). With all host
    memory in huge pages, 1B training steps on the H200 machine took 6-8% less time than
    with default pages (bench/results/investigations/*-x2-s7-ab-*). Nothing is touched here:
    pages are faulted in when the state is created (zero-filled) at the first update.
    ``pin``: the streamed update copies them to and from the GPU (page-locked now)."""
    by_dtype: dict[torch.dtype, list[HostSlot]] = {}
    for slot in slots:
        by_dtype.setdefault(slot.master.dtype, []).append(slot)
    for dtype, group in by_dtype.items():
        sizes = [slot.master.numel() for slot in group]
        blocks = []
        for _ in range(2):
            blocks.append(page_locked_block(sum(sizes), dtype, pin, "optimizer state").split(sizes))
        for slot, m, v in zip(group, *blocks):
            slot.moments = (m.view(slot.master.shape), v.view(slot.master.shape))


def _copy_weights_in(
    params: list[torch.Tensor], masters: list[torch.Tensor], scratch: list[torch.Tensor]
) -> None:
    """masters[i] <- params[i]; ``scratch`` (params' dtype, pinned) receives GPU copies."""
    if not params:
        return
    if params[0].device.type != "cuda":
        for p, m in zip(params, masters):
            m.copy_(p.detach().reshape(-1))
        return
    widen = masters[0].dtype != params[0].dtype
    for p, dst in zip(params, scratch if widen else masters):
        dst.copy_(p.detach().reshape(-1), non_blocking=True)
    torch.cuda.synchronize(params[0].device)
    if widen:
        _span(masters).copy_(_span(scratch))


def back_to_back(tensors: list) -> Optional[torch.Tensor]:
    """One 1-D tensor over ``tensors`` if they are contiguous, of one dtype, and follow each
    other in one storage in this order (as ``HostArena.allocate`` hands out its views);
    else None. Empty tensors occupy nothing (and may report a null pointer)."""
    dtype = tensors[0].dtype
    first, numel, end, base = None, 0, 0, 0
    for t in tensors:  # (each tensor asked each thing once: this runs at every step)
        n = t.numel()
        if t.dtype != dtype:
            return None
        if n == 0:
            continue
        size, ptr = t.element_size(), t.data_ptr()
        start = ptr - t.storage_offset() * size  # the first byte of its storage
        if first is None:
            first, end, base = t, ptr, start
        if ptr != end or start != base or not t.is_contiguous():
            return None
        numel, end = numel + n, ptr + n * size
    return first.as_strided((numel,), (1,)) if first is not None else None


def _span(views: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor over consecutive views of a block (as ``HostArena.allocate`` returns).

    By storage offsets, not data pointers: an empty view (an FSDP2 rank's empty shard)
    reports a null data pointer.
    """
    start = views[0].storage_offset()
    end = max(v.storage_offset() + v.numel() for v in views)
    return views[0].as_strided((end - start,), (1,), start)
