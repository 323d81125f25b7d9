"""``CPUOffloadOptimizer.state``: keyed by the user's parameters, backed by the engine's
inner optimizers' state (host, and the device share's), as torch's optimizers' ``state``."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Iterator

import torch

from offload_plugin.engines.base import Engine

__all__ = ["HostEntry", "StateView"]


class HostEntry(MutableMapping):
    """One parameter's state as ``optimizer.state[p]`` hands it out: the entry itself, except
    that a tensor assigned on another device over a host tensor of its shape and dtype is
    copied into that host tensor. Lightning moves every state tensor to the GPU after
    loading a checkpoint (``v[key] = val.to(device)``, key by key): the state stays in host
    memory, and the GPU holds one moved tensor at a time, never the whole state."""

    __slots__ = ("_entry",)

    def __init__(self, entry: dict) -> None:
        self._entry = entry

    def __getitem__(self, key):
        return self._entry[key]

    def __setitem__(self, key, value) -> None:
        held = self._entry.get(key)
        if (isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and value.device != held.device
                and held.device.type == "cpu" and value.shape == held.shape and value.dtype == held.dtype):
            held.copy_(value)
            return
        self._entry[key] = value

    def __delitem__(self, key) -> None:
        del self._entry[key]

    def __iter__(self):
        return iter(self._entry)

    def __len__(self) -> int:
        return len(self._entry)

    def __repr__(self) -> str:
        return repr(self._entry)


class StateView(MutableMapping):
    """``optimizer.state`` over the engine ``engine()`` returns (it changes when the host
    engine takes over from the streamed one)."""

    def __init__(self, engine: Callable[[], Engine]) -> None:
        self._engine = engine

    def _where(self, param: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The state mapping that holds ``param``'s state, and its key there."""
        where = self._engine().state_of(param)
        if where is not None:
            return where
        # (torch's state is a defaultdict that would make an empty entry here; one made for a
        # tensor this optimizer never updates would be dropped silently, so say why instead)
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else type(param).__name__
        raise KeyError(
            f"optimizer.state has no entry for this tensor ({shape}): it is not among the "
            "parameters this CPUOffloadOptimizer updates (frozen parameters, requires_grad=False "
            "when it was built, are left out). Use `p in optimizer.state` to test first.")

    def __getitem__(self, param):
        # Both optimizers' state is a defaultdict, as torch's optimizers' state is.
        state, key = self._where(param)
        return HostEntry(state[key])

    def __setitem__(self, param, value):
        state, key = self._where(param)
        state[key] = value
        self._replaced(state)

    def __delitem__(self, param):
        state, key = self._where(param)
        del state[key]
        self._replaced(state)

    def _replaced(self, state: dict) -> None:
        """A parameter's state dict was replaced: the update's batches and plans held it."""
        engine = self._engine()
        if state is engine.inner.state:
            engine.forget_state()

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p in self._engine().params() if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, param) -> bool:
        try:
            state, key = self._where(param)
        except (KeyError, TypeError):
            return False
        return key in state

    def __repr__(self) -> str:
        return repr(dict(self.items()))
