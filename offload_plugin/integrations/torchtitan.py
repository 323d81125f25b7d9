"""torchtitan 0.3.0: its optimizers as CPUOffloadOptimizer, with their state in host memory.

torchtitan builds ``config.optimizer.build(model_parts=...)``, an instance of the class that
declares the config's type. Put our config there in a config function of your own module
(``--module`` takes a dotted path); the optimizer names and param groups stay as they were::

    # my_configs.py
    from torchtitan.models.llama3.config_registry import llama3_8b
    from offload_plugin.integrations.torchtitan import offload_optimizers

    def llama3_8b_offload():
        config = llama3_8b()
        config.optimizer = offload_optimizers(config.optimizer, offload_gradients=True)
        config.training.disable_cuda_graphs = True  # offload_gradients needs it on a GPU
        return config

    # torchrun --nproc_per_node=1 -m torchtitan.train --module my_configs --config llama3_8b_offload
    # (the command line takes --optimizer.offload-gradients / --optimizer.no-offload-gradients)
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the flat, FQN-keyed dict ``state_dict()`` returns (after DCP filled it in place).

        torchtitan's own unflattening keeps only the state names the live optimizer holds,
        which drops bitsandbytes' nested 8-bit state (AdamW8bit saves it under
        ``__bnb_optimizer_quant_state__``); this rebuilds each entry from the saved keys.
        """
        for optimizer in self.optimizers:
            optimizer.load_state_dict(_unflatten(optimizer, state_dict))


def _unflatten(optimizer: Optimizer, flat: dict[str, Any]) -> dict[str, Any]:
    """The inverse of torchtitan's ``get_flat_optim_state_dict`` for ``optimizer``: keys
    ``state.{fqn}.{name}[.{name}...]`` and ``param_groups.{fqn}.{key}``, FQNs from each
    group's ``param_names``. Keys of other optimizers' parameters are left alone."""
    index = {fqn: i for i, fqn in enumerate(f for g in optimizer.param_groups for f in g["param_names"])}
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        parts = key.split(".")
        if parts[0] != "state":
            continue
        # The longest prefix that is one of ours (no parameter's FQN prefixes another's).
        for cut in range(len(parts) - 1, 1, -1):
            i = index.get(".".join(parts[1:cut]))
            if i is not None:
                node = state.setdefault(i, {})
                for part in parts[cut:-1]:
                    node = node.setdefault(part, {})
                node[parts[-1]] = value
                break
    groups, first = [], 0
    for group in optimizer.param_groups:
        fqns, ids = group["param_names"], list(range(first, first + len(group["param_names"])))
        first += len(ids)
        values = {}
        for key in group.keys() - {"params", "param_names"}:
            flat_key = f"param_groups.{fqns[0]}.{key}" if fqns else None
            if flat_key not in flat:
                raise KeyError(f"the checkpoint has no {flat_key!r} (optimizer param group key {key!r})")
            values[key] = flat[flat_key]
        groups.append({**values, "params": ids})
    return {"state": state, "param_groups": groups}


def offload_optimizers(config: OptimizersContainer.Config, **options: Any) -> OffloadOptimizersContainer.Config:
    """``config`` (e.g. a config function's ``config.optimizer``, or ``default_adamw(lr=...)``)
    as an ``OffloadOptimizersContainer.Config``: the same fields, plus ``options``
    (``offload_gradients``)."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return OffloadOptimizersContainer.Config(**{**values, **options})
