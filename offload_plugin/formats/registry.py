"""The registry of state formats: one line per family, and the answers other modules ask.

A family is a folder under ``offload_plugin/formats/`` whose ``__init__`` declares ``FAMILY``
(:class:`~offload_plugin.formats.base.Family`): its name, the module whose ``FORMAT`` (a
:class:`~offload_plugin.formats.base.StateFormat`) the streamed engine moves, its public
optimizer, and the keys that tell its checkpoints apart. Nothing outside a family's folder
names its modules; the engines, the preflight, the checkpoint loader and the options table
ask here. Families import no other family.

- ``"adamw"``: torch's Adam(W) state, moments in the dtype of the tensor updated (the
  parameter's, or an fp32 master's);
- ``"adamw8bit"``: ``AdamW8bit``'s, bitsandbytes' 8-bit moments and block scales;
- ``"compact"``: ``CompactAdamW``'s 8-bit moments with block scales and the int16 remainder
  that makes the bf16 weight an exact fp32 master.

An inner optimizer names its family with the ``state_format`` trait (offload_plugin.formats.inner);
torch's fused Adam(W) has ``"adamw"``. A format outside the package is named by the dotted
path of a module whose ``FORMAT`` is a StateFormat. A new family is its folder, one line in
:data:`FAMILIES` and one entry in the conformance suite's formats (tests/test_conformance.py).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from offload_plugin.formats.base import Family, StateFormat

__all__ = ["FAMILIES", "family", "families", "get", "needs", "for_optimizer", "whose_checkpoint", "optimizer_names"]

# The families, each a folder of offload_plugin/formats/.
FAMILIES = ("adamw", "adamw8bit", "compact")

_loaded: dict = {}


def family(name: str) -> Family:
    """The family called ``name`` (its folder's ``__init__`` only: no kernel is imported)."""
    if name not in FAMILIES:
        raise KeyError(name)
    return importlib.import_module(f"{__package__}.{name}").FAMILY


def families() -> list[Family]:
    return [family(name) for name in FAMILIES]


def get(name: str) -> StateFormat:
    """The format of family ``name``, or the ``FORMAT`` of the module at that dotted path (its
    module imported the first time)."""
    fmt = _loaded.get(name)
    if fmt is None:
        try:
            module = family(name).format_module if name in FAMILIES else name
            fmt = importlib.import_module(module).FORMAT
        except (ImportError, AttributeError, TypeError, ValueError):
            fmt = None
        if not isinstance(fmt, StateFormat):
            raise TypeError(f"unknown state_format {name!r}: give one of {list(FAMILIES)} or the dotted "
                            "path of a module whose FORMAT is an offload_plugin.formats.base.StateFormat")
        _loaded[name] = fmt
    return fmt


def needs(name: str) -> tuple:
    """The inner-optimizer hooks format ``name`` calls."""
    return get(name).needs


def for_optimizer(contract, optimizer_cls: type) -> Optional[StateFormat]:
    """The format the streamed update would move for ``optimizer_cls`` (its contract, see
    offload_plugin.formats.inner): the one it names, else "adamw" for torch's Adam(W), else None
    (its state stays with its own step() on the host)."""
    if contract.state_format is not None:
        return get(contract.state_format)
    if issubclass(optimizer_cls, torch.optim.Adam) and not contract.bf16_host_only:
        return get("adamw")
    return None


def whose_checkpoint(entry_keys=(), group_keys=()) -> str:
    """How to load a checkpoint whose state entries or param groups hold these keys: the
    ``load_hint`` of the family whose keys they are, or "" (none's)."""
    for fam in families():
        if set(fam.group_keys) & set(group_keys) or set(fam.entry_keys) & set(entry_keys):
            return fam.load_hint
    return ""


def optimizer_names(joined: str = " or ") -> str:
    """The families' public optimizers as texts name them: "`AdamW8bit` or `CompactAdamW`"."""
    return joined.join(f"`{f.class_name}`" for f in families() if f.class_name)
