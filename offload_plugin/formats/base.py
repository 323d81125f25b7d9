"""What every state format shares: the :class:`StateFormat` protocol the engines ask, the
staging alignment, and :class:`HostState`, which keeps a format's entries in page-locked
blocks for the copies to the GPU.

The streamed update (offload_plugin.engines.streamed) moves a format's state through a ring of
staging buffers on the GPU: per step it cuts the stepping parameters into *units* (a range
of one parameter, or neighbours whose state lies back to back), and per unit it takes room
in a staging buffer, copies the unit's state in, runs the format's kernel, and copies the
state back, the three on their own streams. Its step counts live on the device.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import weakref
from typing import Optional, Sequence

import torch

from offload_plugin.host.buffers import HostSlot, page_locked_block

__all__ = ["Family", "StateFormat", "ALIGN", "HostState", "device_refusal"]

# A carved tensor starts on a cache line (its own and its neighbours' vector loads).
_BYTE_ALIGN = 64

# Staging offsets are multiples of this many elements (the kernels' vectorized loads).
ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Family:
    """What one family of state declares in its folder's ``__init__`` as ``FAMILY``, read
    without importing its kernels: the registry (offload_plugin.formats.registry) answers
    every other module's question about state from these fields and the family's FORMAT."""

    name: str  # the ``state_format`` its inner optimizer names
    format_module: str  # the module whose ``FORMAT`` (a StateFormat) the streamed engine moves
    # Its public inner optimizer as users name it (None: torch's own Adam(W), whose state this is).
    optimizer: Optional[str] = None
    # Keys that only its checkpoints hold, in a state entry or in a param group: a loader that
    # meets them elsewhere names this family and ``load_hint`` (how to load such a checkpoint).
    entry_keys: tuple = ()
    group_keys: tuple = ()
    load_hint: str = ""

    @property
    def class_name(self) -> Optional[str]:
        """Its optimizer's class name, as texts for users name it."""
        return self.optimizer.rsplit(".", 1)[-1] if self.optimizer else None


class StateFormat:
    """The protocol. A unit is the format's own object, which the engine only hands back to
    the format's methods; it places the unit in the ring by :meth:`stage_size`."""

    name: str = ""
    # The inner optimizer's hooks (offload_plugin.formats.inner.HOOKS) the format relies on: a class
    # naming the format without them is refused when it is given. A format whose entries are
    # not torch's layouts needs check_state_entry (and saved_entry) there: checkpoints check
    # and convert entries through the inner optimizer, which owns them.
    needs: tuple = ()
    # Whether the kernel's arguments need each parameter's step count on the host at every
    # step (the host counts then advance by each step's verdict); else the device holds them.
    counts_on_host: bool = False
    # Whether the kernel takes torch.amp.GradScaler's scale to divide by, as torch's fused
    # AdamW's does (else options.check_amp_scaler refuses a scaled step).
    takes_grad_scale: bool = True
    # How the optimizer's log line says the device updates this state.
    kernel_text: str = "on the device"
    # Whether a weight written outside the optimizer touches the state (weights_written).
    watches_weights: bool = False
    # A unit's elements in multiples of streamed.config.stage_numel: a format with fewer staged
    # bytes per element takes larger units, so that the autograd thread queues fewer of them
    # inside a backward (each costs it copies and a launch, while backward's own launches wait).
    stage_scale: int = 1

    # -- which parameters it takes
    def refuses(self, params: Sequence[torch.Tensor], settings: dict, on_cpu: bool) -> Optional[str]:
        """Why the streamed update cannot take ``params`` of a group with ``settings`` (the
        group's keys but "params"), or None. ``on_cpu``: tests run the streamed code on the
        host."""
        raise NotImplementedError

    def leaves(self, inner, index: int, group: dict) -> Optional[str]:
        """Why group ``index`` (the outer optimizer's ``group``), as edited or loaded since it
        was given, no longer asks for what this format's update does (the host update then
        takes over), or None."""
        return None

    # -- the host state
    def state_bytes(self, param: torch.Tensor) -> int:
        """Host bytes of state per element of ``param`` (the preflight's estimate)."""
        raise NotImplementedError

    def entries(self, inner, slots: list, group_of: list, pin: bool) -> list[dict]:
        """Each slot's state entry in ``inner.state`` (keyed by ``slot.master``), made if it
        has none and checked, in page-locked memory if ``pin`` (the copies to the GPU need it)."""
        raise NotImplementedError

    def current(self, entries: list, held: list) -> bool:
        """Whether ``entries`` still hold the tensors ``held`` (:meth:`hold`) that units were
        cut from (``optimizer.state[p][...] = t`` replaces one: cut anew)."""
        return all(all(e.get(k) is t for k, t in h) for e, h in zip(entries, held))

    def hold(self, entries: list) -> list:
        """What :meth:`current` compares: each entry's state tensors."""
        return [[(k, t) for k, t in e.items() if isinstance(t, torch.Tensor) and k != "step"] for e in entries]

    # -- units and the staging ring
    def cut(self, slots: list, entries: list, group_of: list, chunk_numel: int) -> list:
        """The units of ``slots`` (the step's, in order; their entries and group indices),
        none over ``chunk_numel`` elements; each knows its slots' places in the step."""
        raise NotImplementedError

    def reserve(self, ring, unit) -> None:
        """Make sure the ring's buffers hold ``unit`` (``ring.reserve``)."""
        raise NotImplementedError

    def stage_size(self, unit) -> tuple:
        """(ring pool, elements, bytes) the unit takes in a staging pair; the next unit starts
        at the elements rounded up to ALIGN and after the bytes."""
        raise NotImplementedError

    def staged_views(self, unit, ring, index: int, at: int, at_byte: int) -> tuple:
        """The unit's state in the ring's pair ``index`` of its pool, from ``at`` elements and
        ``at_byte`` bytes on (kept on the unit: a step places each unit the same way every
        time; ``ring.generation`` tells when the buffers were replaced)."""
        raise NotImplementedError

    def host_views(self, unit) -> tuple:
        """The views :meth:`update` takes, of the host state itself (tests on the CPU)."""
        raise NotImplementedError

    def stage_in(self, unit, views: tuple) -> None:
        """Queue the copies of the unit's host state into ``views`` on the current stream."""
        raise NotImplementedError

    def stage_out(self, unit, views: tuple) -> None:
        """Queue the copies of ``views`` back into the unit's host state."""
        raise NotImplementedError

    # -- the update

    def step_args(self, inner, slots: list, units: list, groups: list, counts: list, amp_scale) -> list:
        """Each unit's kernel arguments for this step over ``slots``, read from ``groups``
        (the outer optimizer's, as schedulers left them) and, if :attr:`counts_on_host`,
        ``counts`` (each slot's count before the step, by ``slot.order``)."""
        raise NotImplementedError

    def to_device(self, args: list, ring) -> list:
        """``args`` (step_args of the steps queued together, one list) made ready on the ring's
        device, in as few copies as the format can."""
        return args

    def update(self, unit, views: tuple, grads: list, steps: list, found: torch.Tensor, args) -> None:
        """The unit's update on the current stream from ``views``: ``grads`` and ``steps`` (the
        device counts, advanced) are the whole step's, by place; ``found`` the verdict
        (nonzero: write nothing)."""
        raise NotImplementedError

    # -- weights written outside the optimizer
    def weights_written(self, inner, slots: list) -> None:
        """The weights of ``slots`` were written outside the optimizer since its last update
        (the parameter is the truth): drop what the state derived from the old ones."""


def device_refusal(device: torch.device, on_cpu: bool) -> Optional[str]:
    if device.type == "cpu" and on_cpu:
        return None  # (tests: the native CPU kernel on the host state in place)
    if device.type != "cuda":
        return "parameters not on a CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (torch's CUDA wheels bring it)"
    return None


# ---------------------------------------------------------------------------- the host state
class HostState:
    """Where one optimizer's compact state lives: entries made or loaded elsewhere are moved
    into page-locked blocks (the copies to the GPU need it) the first time a plan takes
    them; entries made here are made there."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._homed: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor

    def is_homed(self, t: torch.Tensor) -> bool:
        return not self.pin or self._homed.get(id(t)) is t

    def ensure(self, host_opt, slots: list[HostSlot], host_groups: list[dict]) -> list[dict]:
        """Each slot's state entry, made (zeros) if it has none, all in page-locked memory."""
        state = host_opt.state
        fresh = [(s, g) for s, g in zip(slots, host_groups) if not state.get(s.master)]
        if fresh:
            sizes: dict = {}
            for slot, group in fresh:  # (sized on the meta device first, then made in blocks)
                made = host_opt.init_state(slot.master, group, empty=_on_meta)
                _count(sizes, (t for k, t in made.items() if k != "step"))
                del state[slot.master]
            carve = _Carver(self._blocks(sizes))
            for slot, group in fresh:
                self._remember(host_opt.init_state(slot.master, group, empty=carve.empty))
        moved = [s for s in slots if not all(self.is_homed(t) for k, t in state[s.master].items() if k != "step")]
        if moved:
            sizes = {}
            _count(sizes, (t for s in moved for k, t in state[s.master].items() if k != "step"))
            carve = _Carver(self._blocks(sizes))
            for slot in moved:
                entry = state[slot.master]
                for key, t in list(entry.items()):
                    if key != "step":
                        entry[key] = carve.empty(t.shape, dtype=t.dtype).copy_(t)
                self._remember(entry)
        return [state[s.master] for s in slots]

    def _blocks(self, sizes: dict) -> dict:
        """A block per dtype of ``sizes`` elements, page-locked. (One per dtype, carved by
        plain slices: a view that changes the dtype does not keep its block's tensor alive,
        whose collection unpins the memory, see host_buffers._pin.)"""
        return {dtype: page_locked_block(numel, dtype, self.pin, "the streamed state")
                for dtype, numel in sizes.items()}

    def _remember(self, entry: dict) -> None:
        if self.pin:
            for key, t in entry.items():
                if key != "step":
                    self._homed[id(t)] = t


def _count(sizes: dict, tensors) -> None:
    for t in tensors:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + _aligned(t.numel(), t.dtype)


def _aligned(numel: int, dtype: torch.dtype) -> int:
    """``numel`` rounded up to whole 64-byte lines of ``dtype``."""
    per_line = _BYTE_ALIGN // dtype.itemsize
    return -(-numel // per_line) * per_line


def _on_meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


class _Carver:
    """An ``empty`` that cuts aligned views out of one block per dtype."""

    def __init__(self, blocks: dict) -> None:
        self.blocks, self.at = blocks, dict.fromkeys(blocks, 0)

    def empty(self, shape, dtype) -> torch.Tensor:
        numel, at = math.prod(shape), self.at[dtype]
        self.at[dtype] = at + _aligned(numel, dtype)
        return self.blocks[dtype][at:at + numel].view(shape)
