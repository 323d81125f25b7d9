"""What CPUOffloadOptimizer keeps of the tensors it is given.

Frozen tensors (``requires_grad=False``: QLoRA's NF4 base weights) are dropped from each
group before anything is allocated or hooked, so ``model.parameters()`` can be passed as
torchtune's recipes pass it. :class:`Kept` does that, counts what was kept and where it is
updated (logged once the optimizer is built), and warns once if a dropped tensor gets a
gradient later, which torch's optimizers would have used.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Hashable, Mapping
from typing import Any, Callable, Optional

import torch

from offload_plugin.distributed import local_part

__all__ = ["Kept"]

log = logging.getLogger("offload_plugin.optimizer")
_ONE_TENSOR_NOTED = False  # (see Kept.log)


class Kept:
    """The counts of kept and frozen tensors, and the frozen ones until one has a gradient."""

    def __init__(self) -> None:
        self.counts = {"kept": 0, "kept_numel": 0, "frozen": 0, "frozen_numel": 0,
                       "on_device": 0, "on_device_numel": 0}
        self._frozen: list[weakref.ref] = []
        self.frozen_at: list[list[int]] = []  # per group: where its frozen tensors were given

    def filter(self, param_group: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """``param_group`` without its frozen tensors (checked as torch's add_param_group
        would check it, where dropping them would change the answer), and the places in it
        of the tensors dropped (for :meth:`drop_frozen`, once the group is added)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        if "params" not in param_group:
            raise ValueError(f"a parameter group needs a 'params' list of tensors; got the keys "
                             f"{sorted(map(str, param_group))[:8]}.")
        group = dict(param_group)
        entries = group["params"]
        if isinstance(entries, set):
            raise TypeError(
                "optimizer parameters need to be an ordered collection (a list), not a set: "
                "state-dict indices follow their order."
            )
        entries = [entries] if isinstance(entries, torch.Tensor) else list(entries)
        named = [e for e in entries if isinstance(e, tuple)]
        tensors = [e[1] if isinstance(e, tuple) else e for e in entries]
        keep = [isinstance(t, torch.Tensor) and t.requires_grad for t in tensors]
        for t, k in zip(tensors, keep):
            if isinstance(t, torch.Tensor) and not k:
                self.counts["frozen"] += 1
                self.counts["frozen_numel"] += local_part(t).numel()  # this rank's, as kept
                self._frozen.append(weakref.ref(t))
        kept_entries = [e for e, k in zip(entries, keep) if k]
        kept = [t for t, k in zip(tensors, keep) if k]
        # Non-tensors are kept so that torch reports them with its own message.
        kept_entries += [e for e, t in zip(entries, tensors) if not isinstance(t, torch.Tensor)]
        if len(set(map(id, kept))) != len(kept):
            raise ValueError("a parameter appears more than once in a parameter group")
        if named and len(named) != len(entries):
            raise ValueError("all optimizer params should be with/without names")
        group["params"] = kept_entries
        return group, [i for i, (t, k) in enumerate(zip(tensors, keep)) if isinstance(t, torch.Tensor) and not k]

    def drop_frozen(self, param_groups: list[dict], state_dict: dict) -> Optional[dict]:
        """A state dict of torch's optimizer built over the same tensors, frozen ones
        included (as torchtune's LoRA recipes build it, over ``model.parameters()``), in
        this optimizer's layout: each group's indices at the places of its frozen tensors
        dropped. They must have no state. None where no group lists its frozen tensors
        (load_state_dict's checks then see the state dict as it is)."""
        saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not (isinstance(saved_groups, (list, tuple)) and isinstance(state, Mapping)
                and len(saved_groups) == len(param_groups) == len(self.frozen_at)):
            return None
        groups, dropped_any = [], False
        for i, (saved, group, frozen) in enumerate(zip(saved_groups, param_groups, self.frozen_at)):
            indices = saved.get("params") if isinstance(saved, Mapping) else None
            if not frozen or not isinstance(indices, (list, tuple)) \
                    or len(indices) != len(group["params"]) + len(frozen):
                groups.append(saved)
                continue
            drop = set(frozen)
            with_state = [index for j, index in enumerate(indices)
                          if j in drop and isinstance(index, Hashable) and index in state]
            if with_state:
                raise ValueError(
                    f"parameter group {i}: the state dict has state for {with_state[:8]}, the places of "
                    "tensors frozen here (requires_grad=False), which this optimizer leaves out. Build "
                    "it with those tensors trainable, as they were when the state dict was saved.")
            saved = dict(saved, params=[index for j, index in enumerate(indices) if j not in drop])
            names = saved.get("param_names")
            if isinstance(names, (list, tuple)) and len(names) == len(indices):
                saved["param_names"] = [name for j, name in enumerate(names) if j not in drop]
            groups.append(saved)
            dropped_any = True
        return dict(state_dict, param_groups=groups) if dropped_any else None

    def add(self, offloaded: list[torch.Tensor], on_device: list[torch.Tensor]) -> None:
        """Count a group's kept tensors: ``offloaded`` (this rank's shards count) and
        ``on_device`` (device_fraction)."""
        c = self.counts
        c["kept"] += len(offloaded) + len(on_device)
        c["kept_numel"] += sum(local_part(p).numel() for p in offloaded) + sum(p.numel() for p in on_device)
        c["on_device"] += len(on_device)
        c["on_device_numel"] += sum(p.numel() for p in on_device)

    def check_any(self) -> None:
        if self.counts["kept"] == 0:
            raise ValueError(
                f"CPUOffloadOptimizer got no trainable parameters: all {self.counts['frozen']} "
                "tensors have requires_grad=False. For LoRA/QLoRA, mark the adapters "
                "trainable first (torchtune.modules.peft.set_trainable_params(model, "
                "get_adapter_params(model))); otherwise check what was passed as params."
            )

    def warn_unfrozen(self, holds: Callable[[torch.Tensor], bool]) -> None:
        """A tensor dropped as frozen (requires_grad=False when the optimizer was built) that
        has a gradient now, and was not added since (``holds`` it), is not updated, where
        torch's optimizers would update it: say so once."""
        if not self._frozen:
            return
        unfrozen = sum(1 for ref in self._frozen
                       if (t := ref()) is not None and t.grad is not None and not holds(t))
        if unfrozen:
            self._frozen = []  # (once)
            warnings.warn(
                f"CPUOffloadOptimizer: {unfrozen} parameter(s) that had requires_grad=False when "
                "it was built (left out as frozen, as QLoRA's base weights) have gradients now; "
                "it does not update them. Add them with optimizer.add_param_group({'params': "
                "[...]}), or set requires_grad before building the optimizer.", stacklevel=3)

    def log(self, optimizer_cls: type, engine) -> None:
        """What was kept and where the update runs, at INFO; at DEBUG for an optimizer of one
        tensor, as torchtune's ``optimizer_in_bwd`` builds one per parameter (a line each
        would flood the recipe's log), after one INFO line per process saying so."""
        global _ONE_TENSOR_NOTED
        c, level = self.counts, logging.INFO
        if c["kept"] == 1:
            level = logging.DEBUG
            if not _ONE_TENSOR_NOTED:
                _ONE_TENSOR_NOTED = True
                log.info("CPUOffloadOptimizer: optimizers over one tensor each (as torchtune's "
                         "optimizer_in_bwd builds them, one per parameter) log what they keep "
                         "at DEBUG level.")
        if engine.transfers is not None and not engine.transfers.is_async:
            log.log(level, "CPUOffloadOptimizer: parameters are on %s, not a CUDA device; the "
                    "update runs in host memory with synchronous copies.", engine.transfers.device)
        log.log(
            level,
            "CPUOffloadOptimizer(%s): optimizing %d tensors (%s elements) %s%s; "
            "skipped %d frozen tensors (%s elements).",
            optimizer_cls.__name__, c["kept"] - c["on_device"],
            f"{c['kept_numel'] - c['on_device_numel']:,}",
            engine.where_text,
            f" and {c['on_device']} ({c['on_device_numel']:,} elements) on the device"
            if c["on_device"] else "",
            c["frozen"], f"{c['frozen_numel']:,}",
        )
