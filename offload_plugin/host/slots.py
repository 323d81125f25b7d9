"""The table of trainable slots: which parameters an optimizer updates on the host, in order.

Each offloaded parameter has one :class:`~offload_plugin.host.buffers.HostSlot` (its master
weight, gradient and staging buffers in host memory). The table is the one place that
maps parameters to slots; the order of the slots is the order the parameters were given
(for torchtune's models, the order in which the forward uses them).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from offload_plugin import distributed
from offload_plugin.host.buffers import HostSlot

__all__ = ["SlotTable"]


class SlotTable:
    """Slots of the offloaded parameters, by parameter and in the order they were added."""

    def __init__(self) -> None:
        self._slots: list[HostSlot] = []
        # By id: a tensor's __hash__ is Python code, and the table is asked about every
        # parameter at every step. The slot holds its parameter, so the id stays its own.
        self._of: dict[int, HostSlot] = {}
        # Device meshes of DTensor (FSDP2) parameters: the ranks whose gradients count in
        # the clipping norm and in the decision to skip a non-finite step. Empty otherwise.
        self.meshes: list = []

    def add(self, slots: Iterable[HostSlot]) -> None:
        for slot in slots:
            slot.order = len(self._slots)
            self._slots.append(slot)
            self._of[id(slot.param)] = slot
        self.meshes = distributed.meshes_of(s.param for s in self._slots)

    def __iter__(self) -> Iterator[HostSlot]:
        return iter(self._slots)

    @property
    def ordered(self) -> list[HostSlot]:
        """The slots in the order they were added (read-only: do not change the list)."""
        return self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, param) -> bool:
        return self.get(param) is not None

    def __getitem__(self, param: torch.Tensor) -> HostSlot:
        slot = self.get(param)
        if slot is None:
            raise KeyError("not a parameter of this optimizer's slots")
        return slot

    def get(self, param: torch.Tensor) -> Optional[HostSlot]:
        slot = self._of.get(id(param))
        return slot if slot is not None and slot.param is param else None

    def in_order(self, params: Iterable[torch.Tensor]) -> Iterator[HostSlot]:
        """The slots of ``params`` that have one, in the order of ``params``."""
        of = self._of
        return (s for p in params if (s := of.get(id(p))) is not None and s.param is p)

    @property
    def sharded(self) -> bool:
        """Whether the parameters are DTensors (FSDP2), whose ranks must agree on verdicts."""
        return bool(self.meshes)
