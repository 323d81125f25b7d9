"""DTensor parameters (FSDP2's ``fully_shard``) and the collectives the optimizer needs for them.

Under FSDP2 every trainable parameter is a DTensor whose local shard is all a rank holds;
each rank offloads and updates only that shard. Three things still need the other ranks:
the gradient norm for clipping (a global quantity), the decision to skip a step with a
non-finite gradient (one rank skipping alone would make the replicas diverge for good),
and checkpoints, whose shard-shaped state must be DTensors for torch's distributed
checkpointing to gather or reshard it (a plain per-rank tensor is silently saved as if it
were the whole tensor). Plain tensors pass through every helper unchanged, so the
single-device path runs the same code without collectives.
"""

from __future__ import annotations

import atexit
import collections
import math
import time
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

if dist.is_available():
    from torch.distributed.tensor import DTensor
    # Private, but what torch's own FSDP2 and checkpointing build on (see shard_like and
    # to_local_value); torch offers no public way to do either without moving data.
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
else:  # a torch built without distributed support has no DTensors to handle

    class DTensor:  # type: ignore[no-redef]  # nothing is an instance of it
        pass

__all__ = [
    "local_part",
    "meshes_of",
    "any_rank",
    "global_total_norm",
    "shard_like",
    "check_rows_sharded",
    "first_row",
    "to_local_value",
]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, else ``tensor`` itself.

    The shard is the DTensor's own local tensor (under no_grad ``to_local`` returns it, not
    a differentiable view), so repeated calls give the same object: FiniteRecord matches
    gradients by identity. Writes into it persist; for an FSDP2 parameter the next forward
    all-gathers them.
    """
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def meshes_of(params: Iterable[torch.Tensor]) -> list:
    """The distinct device meshes of the DTensors among ``params`` (empty for plain tensors)."""
    meshes = []
    global _SHARDED_SEEN
    for p in params:
        if isinstance(p, DTensor) and not any(p.device_mesh is m for m in meshes):
            meshes.append(p.device_mesh)
    _SHARDED_SEEN = _SHARDED_SEEN or bool(meshes)
    return meshes


# Handles of our latest collectives, held so that the backend's own thread is never the one
# to drop the last reference to their tensors. gloo's worker thread (NCCL's watchdog
# likewise) releases a finished collective after reporting it done, and in torch 2.13
# releasing a tensor that has a Python object takes the GIL, inside a noexcept destructor.
# Our reductions end each step(), so at a run's end the interpreter may start finalizing
# while that thread waits for the GIL: CPython 3.11/3.12 then end it with pthread_exit, whose
# unwinding through the destructor aborts the process ("terminate called without an active
# exception", exit status -6 after a successful run). Held here, the last reference goes on
# a Python thread holding the GIL (when the handle leaves this queue, long after the
# backend let go) or during finalization, when torch skips the release. 16 handles cover
# several steps; each holds a one-element tensor.
_RECENT_WORK: collections.deque = collections.deque(maxlen=16)
# Whether this process optimized DTensor parameters (see _let_backend_threads_finish).
_SHARDED_SEEN = False


def _let_backend_threads_finish() -> None:
    """At exit, before the interpreter finalizes: release the GIL for a moment.

    The collectives that end a run are not all ours (FSDP2's reduce-scatter and all-gather,
    DTensor.full_tensor), so their works are released on the backend's thread, which takes
    the GIL for it (see _RECENT_WORK). A thread still waiting for the GIL when finalization
    begins is ended with pthread_exit, and the process aborts after a successful run
    (seen in about 1 of 30 FSDP2 rank exits on the 2-core CI machine). Exit handlers run
    while other threads may still take the GIL: sleeping here lets every release pending
    since the last collective complete first. Only in processes that trained DTensor
    parameters; 0.1 s at their exit.
    """
    if _SHARDED_SEEN:
        time.sleep(0.1)


atexit.register(_let_backend_threads_finish)


def _all_reduce(value: torch.Tensor, mesh, dims: Sequence[int], op) -> torch.Tensor:
    """Reduce ``value`` over the given mesh dimensions, on the mesh's device type.

    The mesh's process group has a backend for its own device type for sure (NCCL for a
    CUDA mesh); a host tensor goes over as a one-element device copy rather than relying
    on a ``cpu:gloo`` backend being registered beside it.
    """
    if not dims:
        return value
    work = value.detach().to(mesh.device_type, copy=True)
    for dim in dims:
        handle = dist.all_reduce(work, op=op, group=mesh.get_group(dim), async_op=True)
        handle.wait()  # what the synchronous call does
        _RECENT_WORK.append(handle)  # see _RECENT_WORK
    return work.to(value.device)


def any_rank(flag: bool, meshes: Sequence) -> bool:
    """True if ``flag`` is true on any rank of any mesh; every rank of them must call this."""
    if not meshes:
        return flag
    found = torch.tensor([1.0 if flag else 0.0])
    for mesh in meshes:
        found = _all_reduce(found, mesh, range(mesh.ndim), dist.ReduceOp.MAX)
    return bool(found.item())


def _shard_dims(param: DTensor) -> tuple[int, ...]:
    """Mesh dimensions over which ``param`` is split; along the others ranks hold copies."""
    return tuple(i for i, pl in enumerate(param.placements) if pl.is_shard())


def global_total_norm(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    norm_type: float,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """The norm of all gradients over all ranks, the same tensor value on every rank.

    Args:
        params: the parameters, DTensors or plain, one per gradient (they say how each
            gradient is split).
        grads: the local gradients (shards for DTensor parameters), on one device.
        norm_type: as for ``torch.nn.utils.clip_grad_norm_``; ``inf`` or a positive number.
        error_if_nonfinite: raise on every rank if the global norm is inf or NaN.
        foreach: accepted for torch's signature; the norms are taken per tensor.

    Raises:
        ValueError: ``norm_type`` is not ``inf`` or a positive number.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(
            f"clip_grad_norm_ with sharded (DTensor) parameters supports norm_type=inf or "
            f"a positive number, got {norm_type}."
        )
    # As torch computes it for DTensor gradients (bit for bit): each tensor's norm over
    # all ranks (its shards' norms**p summed, or their max), then the norm of those norms.
    # Never raise before the reduction: a rank raising alone would hang the others.
    norms = [
        torch.linalg.vector_norm(g, norm_type) if g.numel() else g.new_zeros(()) for g in grads
    ]
    by_layout: dict = {}
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            by_layout.setdefault((p.device_mesh, _shard_dims(p)), []).append(i)
    for (mesh, dims), idx in by_layout.items():
        local = torch.stack([norms[i] for i in idx])  # one collective for all of them
        if norm_type == math.inf:
            reduced = _all_reduce(local, mesh, dims, dist.ReduceOp.MAX)
        else:
            reduced = _all_reduce(local**norm_type, mesh, dims, dist.ReduceOp.SUM) ** (1.0 / norm_type)
        for j, i in enumerate(idx):
            norms[i] = reduced[j]
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from all ranks is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set error_if_nonfinite=False."
        )
    return total


def shard_like(host: torch.Tensor, param: torch.Tensor, rows_only: bool = False) -> torch.Tensor:
    """``host`` (shaped like ``param``'s local shard) as a DTensor laid out like ``param``.

    ``rows_only``: ``host`` has the shard's rows (dim 0) but other trailing dims (a state
    kept per row, such as CompactAdamW's block scales); its global shape is ``param``'s
    rows by those dims (``param`` must be sharded along dim 0 only: FSDP2's layout).

    The global shape and stride are given explicitly: with uneven shards ``from_local``
    would otherwise infer a wrong global shape. The data stays where it is: a host tensor
    on a CUDA mesh is wrapped as FSDP2 wraps CPU-offloaded shards, since
    ``DTensor.from_local`` would copy the whole state into GPU memory.
    """
    if not isinstance(param, DTensor):
        return host
    shape, stride = param.shape, param.stride()
    if rows_only:
        check_rows_sharded(param)
        shape = torch.Size((param.shape[0], *host.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
    mesh = param.device_mesh
    if mesh.device_type == host.device.type:
        return DTensor.from_local(host, mesh, param.placements, run_check=False, shape=shape, stride=stride)
    spec = DTensorSpec(mesh, tuple(param.placements), tensor_meta=TensorMeta(shape, stride, host.dtype))
    return DTensor(host, spec, requires_grad=False)


def first_row(param: DTensor) -> int:
    """Where this rank's rows of a dim-0 sharded ``param`` start in the full parameter."""
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0]) if offset else 0


def check_rows_sharded(param: DTensor) -> None:
    """Refuse a DTensor sharded other than along dim 0 (FSDP2 shards dim 0)."""
    if any(p.is_shard() and p.dim != 0 for p in param.placements):
        raise ValueError(
            f"a parameter is sharded as {tuple(param.placements)}: state kept per row (CompactAdamW's "
            "block scales) needs parameters sharded along dim 0 only, as FSDP2's fully_shard "
            "shards them."
        )


def to_local_value(value: torch.Tensor, param: torch.Tensor, rows_only: bool = False) -> torch.Tensor:
    """A state tensor from a checkpoint, as the part ``param``'s rank keeps (not yet copied).

    A DTensor gives its local shard (redistributed first if it is laid out differently);
    for a plain parameter, its full value. A full plain tensor shaped like a DTensor
    parameter gives this rank's slice of it; with ``rows_only``, one with the parameter's
    rows (a state kept per row, see shard_like) gives this rank's rows. Anything else is
    returned as it is.
    """
    if isinstance(value, DTensor):
        if not isinstance(param, DTensor):
            return value.full_tensor()
        if tuple(value.placements) != tuple(param.placements):
            value = value.redistribute(param.device_mesh, param.placements)
        return value.to_local()
    if isinstance(param, DTensor) and value.dim() > 0 and value.shape == param.shape:
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    if isinstance(param, DTensor) and rows_only and value.dim() > 0 and value.shape[0] == param.shape[0]:
        check_rows_sharded(param)  # (then this rank's rows are one range of dim 0)
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return value[offset[0]:offset[0] + shape[0]]
    return value
