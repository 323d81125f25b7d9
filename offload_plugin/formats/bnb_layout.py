"""Reading one parameter's state from a bitsandbytes Adam checkpoint, every field checked.

bitsandbytes' own ``load_state_dict`` checks nothing beyond group sizes: codes of another
dtype or shape, a non-finite block scale or a map that is not its map load, and its kernel
then reads them as they are. CompactAdamW converts such an entry into its own layout
(``CompactAdamW.check_state_entry``, :func:`compact_adam.from_bnb`) and AdamW8bit keeps it as
it is (``AdamW8bit.check_state_entry``), so what they read here must be what bitsandbytes 0.50
writes, or garbage would reach the moments:

* ``step``: the number of steps, a Python int;
* an 8-bit entry (AdamW8bit, PagedAdamW8bit; parameters of at least its ``min_8bit_size``
  elements): ``state1`` and ``state2`` uint8 codes shaped like the parameter, ``qmap1``
  (signed) and ``qmap2`` (unsigned) the 256 sorted fp32 values of its dynamic maps
  (``bitsandbytes.functional.create_dynamic_map``: the largest is 1.0, the signed map's
  smallest about -0.99, the unsigned map's 0), ``absmax1`` and ``absmax2`` one fp32 scale
  per block of 256 elements (2048 in older releases), never negative;
* a 32-bit entry (smaller parameters, or its 32-bit AdamW): fp32 ``state1`` and ``state2``
  shaped like the parameter.

Its ``state_dict()`` puts all but ``step`` under ``"__bnb_optimizer_quant_state__"``;
its live ``optimizer.state[p]`` holds them beside ``step``. Both are read.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["WRAPPED", "BnbMoments", "BnbState", "is_bnb_entry", "read_entry", "read_state"]

WRAPPED = "__bnb_optimizer_quant_state__"  # where bitsandbytes' state_dict() puts its tensors
_8BIT_KEYS = {"state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2"}
_32BIT_KEYS = {"state1", "state2"}
# Block sizes bitsandbytes' block-wise optimizers have used (256 since 0.43, 2048 before), the
# two it wrote first: a tensor of one block has one scale whatever the block size, and is then
# read as written with 256, which every update here takes (the meaning is the same).
_BLOCKS = (256, 2048, 64, 128, 512, 1024, 4096)
_FIX = ("Load the checkpoint bitsandbytes wrote as it wrote it, or start this optimizer's "
        "state fresh.")


@dataclass
class BnbMoments:
    """One entry's content: fp32 moments shaped like the parameter, as bitsandbytes defines
    them (a code's value in its map times its block's absmax; fp32 state as it is)."""

    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    quantized: bool  # an 8-bit entry (else bitsandbytes kept it in 32 bits)


def is_bnb_entry(entry) -> bool:
    """Whether a state entry is bitsandbytes' (wrapped by its state_dict(), or its live state)."""
    return isinstance(entry, Mapping) and (WRAPPED in entry or "state1" in entry)


@dataclass
class BnbState:
    """One entry's tensors as bitsandbytes wrote them, each checked and copied to the host:
    ``state1``/``state2`` (uint8 codes shaped like the parameter, or fp32 state), and for an
    8-bit entry ``qmap1``/``qmap2`` and ``absmax1``/``absmax2`` (one fp32 scale per ``block``
    elements)."""

    step: int
    tensors: dict
    quantized: bool  # an 8-bit entry (else bitsandbytes kept it in 32 bits)
    block: int = 0


def read_entry(where: str, entry: Mapping, shape: torch.Size) -> BnbMoments:
    """The moments of a bitsandbytes Adam state entry for a parameter of ``shape``.

    Raises:
        ValueError: a key, dtype, shape or value that bitsandbytes 0.50 does not write,
            naming the entry and the key.
    """
    state = read_state(where, entry, shape)
    t = state.tensors
    if not state.quantized:
        return BnbMoments(state.step, t["state1"], t["state2"], quantized=False)
    n = math.prod(shape)
    moments = [(t[f"qmap{k}"][t[f"state{k}"].reshape(-1).long()]
                * t[f"absmax{k}"].repeat_interleave(state.block)[:n]).reshape(shape) for k in (1, 2)]
    return BnbMoments(state.step, moments[0], moments[1], quantized=True)


def read_state(where: str, entry: Mapping, shape: torch.Size) -> BnbState:
    """A bitsandbytes Adam state entry for a parameter of ``shape``, every field checked
    (see the module's docstring) and copied to the host.

    Raises:
        ValueError: a key, dtype, shape or value that bitsandbytes 0.50 does not write,
            naming the entry and the key.
    """
    tensors = entry.get(WRAPPED, entry)
    outer = {"step", WRAPPED} if WRAPPED in entry else {"step"} | _8BIT_KEYS
    if not isinstance(tensors, Mapping) or not entry.keys() <= outer or "step" not in entry:
        raise ValueError(
            f"{where} has the keys {sorted(map(str, entry))}: a bitsandbytes Adam entry holds "
            f"'step' and {WRAPPED!r} (a dict of its tensors), or its tensors beside 'step'. {_FIX}"
        )
    step = read_step(where, entry["step"])
    state1, state2 = (tensors.get(k) for k in ("state1", "state2"))
    if not (isinstance(state1, torch.Tensor) and isinstance(state2, torch.Tensor)):
        raise ValueError(f"{where} lacks the tensors 'state1' and 'state2' of a bitsandbytes Adam entry. {_FIX}")
    held = set(tensors) - ({"step"} if tensors is entry else set())
    # An 8-bit entry has maps and block scales, and its codes are uint8: either tells.
    quantized = state1.dtype == torch.uint8 or bool(held & (_8BIT_KEYS - _32BIT_KEYS))
    want = _8BIT_KEYS if quantized else _32BIT_KEYS
    if held != want:
        raise ValueError(
            f"{where} holds {sorted(map(str, held))}: bitsandbytes' "
            f"{'8-bit' if quantized else '32-bit'} Adam state is {sorted(want)} (bitsandbytes "
            f"keeps more, such as 'unorm_vec' for max_unorm > 0, for updates this optimizer does "
            f"not make). {_FIX}"
        )
    dtype = torch.uint8 if quantized else torch.float32
    for key in ("state1", "state2"):
        _check(where, key, tensors[key], dtype, tuple(shape),
               "'state1' and 'state2' as uint8 codes in an 8-bit entry (one with maps and block "
               "scales), as fp32 in a 32-bit one")
    out = {k: tensors[k].detach().to("cpu", copy=True).contiguous() for k in ("state1", "state2")}
    if not quantized:
        for key in ("state1", "state2"):
            _finite(where, key, out[key])
        if bool((out["state2"] < 0).any()):
            raise ValueError(f"{where} ('state2') holds negative values; a second moment cannot. {_FIX}")
        return BnbState(step, out, quantized=False)
    n, blocks = math.prod(shape), set()
    for k, signed in ((1, True), (2, False)):
        out[f"qmap{k}"] = _qmap(where, f"qmap{k}", tensors[f"qmap{k}"], signed).clone()
        absmax = tensors[f"absmax{k}"]
        block = next((b for b in _BLOCKS if isinstance(absmax, torch.Tensor) and absmax.dim() == 1
                      and absmax.numel() == -(-n // b)), None)
        _check(where, f"absmax{k}", absmax, torch.float32,
               tuple(absmax.shape) if block else (-(-n // 256),), "one fp32 scale per block of 256")
        absmax = out[f"absmax{k}"] = _finite(where, f"absmax{k}", absmax.detach().to("cpu", copy=True))
        if bool((absmax < 0).any()):
            raise ValueError(f"{where} ('absmax{k}') holds negative block scales. {_FIX}")
        blocks.add(block)
    if len(blocks) != 1:
        raise ValueError(f"{where} has block scales of two block sizes ({sorted(blocks)} elements): "
                         f"bitsandbytes uses one. {_FIX}")
    return BnbState(step, out, quantized=True, block=blocks.pop())


# The largest step count an fp32 count holds exactly.
MAX_STEPS = 2**24


def read_step(where: str, value) -> int:
    """bitsandbytes counts steps in a Python int; a one-element tensor is taken too."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.layout == torch.strided \
            and not value.is_meta and not value.is_complex() and value.dtype != torch.bool:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or value < 0 or value != int(value):
        raise ValueError(f"{where} ('step') is {value!r:.40}; it needs a whole number of steps >= 0. {_FIX}")
    if value > MAX_STEPS:
        # (the count lives in fp32, as torch keeps optimizer step counts: above 2**24 it
        # would load rounded and stop advancing)
        raise ValueError(f"{where} ('step') is {value!r:.40}; counts above {MAX_STEPS:,} steps cannot be "
                         f"kept exactly. {_FIX}")
    return int(value)


def _check(where: str, key: str, value, dtype: torch.dtype, shape: tuple, needs: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} ({key!r}) is {type(value).__name__}; it needs a tensor. {_FIX}")
    if value.layout != torch.strided or value.is_meta or value.is_quantized:
        raise ValueError(f"{where} ({key!r}) is a {value.layout} tensor on {value.device}; it needs a dense tensor with data.")
    if value.dtype != dtype:
        raise ValueError(f"{where} ({key!r}) has dtype {value.dtype}; bitsandbytes writes {needs} "
                         f"({dtype} here). {_FIX}")
    if tuple(value.shape) != shape:
        same = value.numel() == math.prod(shape)
        raise ValueError(
            f"{where} ({key!r}) has shape {tuple(value.shape)}; bitsandbytes writes it shaped "
            f"{shape}" + (" (the same number of elements in another shape: a transposed or "
                          "reshaped entry, or another parameter's)" if same else
                          " (the checkpoint belongs to another model, or its parameters are in "
                          "another order)") + f". {_FIX}"
        )


def _finite(where: str, key: str, t: torch.Tensor) -> torch.Tensor:
    bad = t.numel() - int(torch.isfinite(t).sum())
    if bad:
        raise ValueError(f"{where} ({key!r}) holds {bad} inf or NaN value(s). {_FIX}")
    return t


def _qmap(where: str, key: str, value, signed: bool) -> torch.Tensor:
    """A map as bitsandbytes' create_dynamic_map makes it: 256 sorted values up to 1.0,
    signed (negative values) for the first moment, unsigned (none) for the second."""
    _check(where, key, value, torch.float32, (256,), "256 fp32 map values")
    q = _finite(where, key, value.detach().to("cpu"))
    kind = "a signed" if signed else "an unsigned"
    if not (bool((q[1:] >= q[:-1]).all()) and float(q[-1]) == 1.0 and (float(q[0]) < 0) == signed):
        raise ValueError(
            f"{where} ({key!r}) is not {kind} dynamic map of bitsandbytes (256 values sorted "
            f"ascending up to 1.0, {'some' if signed else 'none'} negative): it runs from "
            f"{float(q[0]):.4g} to {float(q[-1]):.4g}. {_FIX}"
        )
    return q
