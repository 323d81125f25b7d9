"""Glue between the single-device recipes and whichever optimizer the config builds.

torchtune's recipes scale the gradients by ``1/num_tokens`` and clip them between
``backward()`` and ``optimizer.step()``. With ``CPUOffloadOptimizer(offload_gradients=True)``
the gradients have already left the model by then, so the scaling and the clipping must
go through the optimizer, which sees them wherever they are. These helpers route the call
so a recipe stays correct with any optimizer.
"""

from typing import Dict

import torch
from torch import nn
from torchtune import training

from offload_plugin.optimizer import CPUOffloadOptimizer

__all__ = ["overlap_last_backward", "scale_grads", "clip_grad_norm", "optimizer_metrics"]


def _is_offload(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, CPUOffloadOptimizer)


def overlap_last_backward(
    optimizer: torch.optim.Optimizer, num_tokens: torch.Tensor, clip_grad_norm
) -> bool:
    """Before the last backward of a step, let the host updates start during it.

    Only for ``CPUOffloadOptimizer(offload_gradients=True)`` and without clipping, which
    needs every gradient before any update. Exact: the optimizer applies ``1/num_tokens``
    inside each update instead of ``scale_grads`` afterwards, which then does nothing.

    Returns:
        bool: whether the updates will overlap backward.
    """
    if not (_is_offload(optimizer) and optimizer.offload_gradients and clip_grad_norm is None):
        return False
    optimizer.overlap_next_step(grad_scale=1.0 / float(num_tokens))
    return True


def scale_grads(
    model: nn.Module, optimizer: torch.optim.Optimizer, factor: torch.Tensor
) -> None:
    """Multiply every trainable gradient by ``factor``, offloaded or not.

    Args:
        model (nn.Module): the model being trained.
        optimizer (torch.optim.Optimizer): the optimizer built from the config.
        factor (torch.Tensor): scalar factor, e.g. ``1 / num_tokens``.
    """
    if _is_offload(optimizer):
        if not optimizer.overlapping:  # else the updates already apply it
            optimizer.scale_grads(factor)
    else:
        training.scale_grads(model, factor)


def clip_grad_norm(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Clip the global 2-norm of all trainable gradients in place.

    Args:
        model (nn.Module): the model being trained.
        optimizer (torch.optim.Optimizer): the optimizer built from the config.
        max_norm (float): largest allowed norm; ``float("inf")`` only measures it.

    Returns:
        torch.Tensor: the total norm before clipping.
    """
    if _is_offload(optimizer):
        return optimizer.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)


def optimizer_metrics(optimizer: torch.optim.Optimizer) -> Dict[str, float]:
    """Metrics the optimizer can report about itself, for the metric logger.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer built from the config.

    Returns:
        Dict[str, float]: ``optimizer_host_memory_gib`` for the offload optimizer, else empty.
    """
    if _is_offload(optimizer):
        return {"optimizer_host_memory_gib": optimizer.host_memory_bytes() / 1024**3}
    return {}
