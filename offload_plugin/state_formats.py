"""Optimizer state formats: how one kind of state lives in host memory and is updated.

A format is one module holding one :class:`StateFormat` (named in ``_MODULES``); the
engines ask it everything that depends on the kind of state, and branch on none:

- ``"adamw"`` (:mod:`offload_plugin.adamw_moments`): torch's Adam(W) state, moments in the
  dtype of the tensor updated (the parameter's, or an fp32 master's: ``MASTERS``);
- ``"compact"`` (:mod:`offload_plugin.compact_streamed`): ``CompactAdamW``'s 8-bit moments
  with block scales and the int16 remainder that makes the bf16 weight an exact fp32 master;
- ``"offload_plugin.adamw8bit_streamed"`` (named by its dotted path): ``AdamW8bit``'s, bitsandbytes'
  8-bit moments and block scales.

An inner optimizer names its format with the ``state_format`` trait (offload_plugin.inner):
one of the names above or a module's dotted path; torch's fused Adam(W) has ``"adamw"``. A
new format is a new module whose ``FORMAT`` is a :class:`StateFormat`, named by the optimizer
it serves; nothing else changes (``AdamW8bit``'s came that way).

The streamed update (offload_plugin.streamed) moves a format's state through a ring of
staging buffers on the GPU: per step it cuts the stepping parameters into *units* (a range
of one parameter, or neighbours whose state lies back to back), and per unit it takes room
in a staging buffer, copies the unit's state in, runs the format's kernel, and copies the
state back, the three on their own streams. Its step counts live on the device.
"""

from __future__ import annotations

import importlib
from typing import Optional, Sequence

import torch

__all__ = ["StateFormat", "get", "needs", "for_optimizer", "ALIGN"]

# Staging offsets are multiples of this many elements (the kernels' vectorized loads).
ALIGN = 64

_MODULES = {"adamw": "offload_plugin.adamw_moments", "compact": "offload_plugin.compact_streamed"}


class StateFormat:
    """The protocol. A unit is the format's own object, which the engine only hands back to
    the format's methods; it places the unit in the ring by :meth:`stage_size`."""

    name: str = ""
    # The inner optimizer's hooks (offload_plugin.inner.HOOKS) the format relies on: a class
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


_loaded: dict = {}


def get(name: str) -> StateFormat:
    """The format called ``name``, or the ``FORMAT`` of the module at that dotted path (its
    module imported the first time)."""
    fmt = _loaded.get(name)
    if fmt is None:
        try:
            fmt = importlib.import_module(_MODULES.get(name, name)).FORMAT
        except (ImportError, AttributeError, TypeError, ValueError):
            fmt = None
        if not isinstance(fmt, StateFormat):
            raise TypeError(f"unknown state_format {name!r}: give one of {sorted(_MODULES)} or the dotted "
                            "path of a module whose FORMAT is an offload_plugin.state_formats.StateFormat")
        _loaded[name] = fmt
    return fmt


def needs(name: str) -> tuple:
    """The inner-optimizer hooks format ``name`` calls."""
    return get(name).needs


def for_optimizer(contract, optimizer_cls: type) -> Optional[StateFormat]:
    """The format the streamed update would move for ``optimizer_cls`` (its contract, see
    offload_plugin.inner): the one it names, else "adamw" for torch's Adam(W), else None
    (its state stays with its own step() on the host)."""
    if contract.state_format is not None:
        return get(contract.state_format)
    if issubclass(optimizer_cls, torch.optim.Adam) and not contract.bf16_host_only:
        return get("adamw")
    return None
