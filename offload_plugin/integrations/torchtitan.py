"""torchtitan 0.3.0: its optimizers as CPUOffloadOptimizer, with their state in host memory.

torchtitan builds ``config.optimizer.build(model_parts=...)``: the class that declares the
config's type. Swap the config in a config function of your own (``--module`` takes a path)::

    # my_configs.py                                    (others: optimizer_factory_kwargs_by_name)
    from torchtitan.models.llama3.config_registry import llama3_8b
    from offload_plugin.integrations.torchtitan import offload_optimizers
    def llama3_8b_offload():
        config = llama3_8b()
        config.optimizer = offload_optimizers(config.optimizer, offload_gradients=True)
        config.training.disable_cuda_graphs = True  # with offload_gradients on a GPU
        return config
    # torchrun --nproc_per_node=1 -m torchtitan.train --module my_configs --config llama3_8b_offload
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Callable

from torch import nn
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer

from offload_plugin.optimizer import CPUOffloadOptimizer

__all__ = ["OffloadOptimizersContainer", "offload_optimizers", "OPTIMIZER_CLASSES"]

# torchtitan's optimizer names (ParamGroupConfig.optimizer_name) and what runs on the host;
# a dotted path names any other class CPUOffloadOptimizer takes as optimizer_cls.
OPTIMIZER_CLASSES = {
    "AdamW": "torch.optim.AdamW",
    "Adam": "torch.optim.Adam",
    "AdamW8bit": "offload_plugin.AdamW8bit",
}


class OffloadOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` building a CPUOffloadOptimizer wherever it builds
    an optimizer: the same param groups (``param_names``, ``fused``/``foreach`` from
    ``implementation``, each ``ParamGroupConfig``'s kwargs), the same flat FQN-keyed state
    dict, the same results (torch's fused AdamW on the host, or streamed on a GPU).

    CPUOffloadOptimizer options other than ``offload_gradients`` go in torchtitan's
    ``optimizer_factory_kwargs_by_name`` (e.g. ``{"AdamW": {"master_weights": True}}``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        offload_gradients: bool = False
        """Move each gradient to host memory during backward (CPUOffloadOptimizer's option).
        On a GPU it needs ``training.disable_cuda_graphs``: a CUDA graph's replay of the
        backward would not run the hooks that move them."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError(
                "optimizer.implementation='fused_opt_states_bf16' makes torch's Adam keep bf16 "
                "state through a hook that CPUOffloadOptimizer does not run: use 'fused' (the "
                "state in host memory, in the parameters' dtype), or "
                "optimizer_cls='offload_plugin.AdamW8bit' (name 'AdamW8bit') for 8-bit state.")
        self._offload_gradients = config.offload_gradients
        super().__init__(config, model_parts=model_parts)

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., Optimizer]:
        optimizer_cls = OPTIMIZER_CLASSES.get(name, name if "." in name else None)
        if optimizer_cls is None:
            raise NotImplementedError(
                f"OffloadOptimizersContainer runs {sorted(OPTIMIZER_CLASSES)} or a dotted class "
                f"path (e.g. 'torch.optim.SGD') in host memory, not {name!r}.")
        return partial(CPUOffloadOptimizer, optimizer_cls=optimizer_cls,
                       offload_gradients=self._offload_gradients)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # torchtitan's train step calls zero_grad(set_to_none=training.disable_cuda_graphs):
        # False on a GPU means its forward and backward replay a CUDA graph.
        if not set_to_none and self._offload_gradients and any(
                p.is_cuda for model in self.model_parts for p in model.parameters()):
            raise RuntimeError(
                "offload_gradients=True under torchtitan's CUDA graphs: the graph's replay of "
                "the backward skips the hooks that move gradients to host memory. Set "
                "--training.disable_cuda_graphs (config.training.disable_cuda_graphs = True).")
        super().zero_grad(set_to_none)


def offload_optimizers(config: OptimizersContainer.Config, **options: Any) -> OffloadOptimizersContainer.Config:
    """``config`` (e.g. a config function's ``config.optimizer``, or ``default_adamw(lr=...)``)
    as an ``OffloadOptimizersContainer.Config``: the same fields, plus ``options``
    (``offload_gradients``)."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return OffloadOptimizersContainer.Config(**{**values, **options})
