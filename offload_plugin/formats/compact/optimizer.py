"""``CompactAdamW``: AdamW on host bf16 tensors with 8-bit moments and an exact fp32 master.

The opt-in compact host state (issue #20), as an ordinary ``torch.optim.Optimizer`` so
that it plugs into ``CPUOffloadOptimizer`` the way any other ``optimizer_cls`` does::

    CPUOffloadOptimizer(model.parameters(), optimizer_cls="offload_plugin.CompactAdamW", lr=2e-5)

or in a torchtune config, ``optimizer.optimizer_cls=offload_plugin.CompactAdamW``. Per
bf16 parameter the host keeps the bf16 weight, a 16-bit remainder that makes it an exact
fp32 master, and block-wise 8-bit moments: about 8 bytes with the gradient, where exact
AdamW with fp32 masters keeps 16 (``compact_adam`` has the scheme and the kernel). On a GPU
``CPUOffloadOptimizer`` streams this state through it instead, without host copies of the
weights and gradients (4 bytes: ``compact_streamed``); this class then only holds the state
and its checks, and the same kernel's bits come from ``compact_gpu``. It is
not exact: the moments are quantized as in bitsandbytes' AdamW8bit, and the weight is the
master rounded to nearest with ties away from zero.

Each parameter's state entry holds ``step``, ``exp_avg`` and ``exp_avg_sq`` (uint8 codes
shaped like the parameter), ``exp_avg_absmax`` and ``exp_avg_sq_absmax`` (fp32, one per
256 elements) and ``remainder`` (int16 shaped like the parameter; absent with
``master=False``). Parameters of fewer than ``min_8bit_size`` elements (4096, as in
bitsandbytes: norms and biases, a negligible share of the memory) keep fp32 state
instead: ``exp_avg`` and ``exp_avg_sq`` in fp32, updated by torch's fused AdamW on the
fp32 master. Compressing them too made the loss curve drift further from exact AdamW's
than bitsandbytes' AdamW8bit's (bench/formats/compact_quality.py). :func:`to_adamw_state_dict` and :func:`from_adamw_state_dict` convert
a whole state dict to and from torch's AdamW layout; a bitsandbytes AdamW8bit (or
PagedAdamW8bit, torchtune's stock full-finetune optimizer) state dict loads as it is, here
or through CPUOffloadOptimizer. Loading checks every group and entry before changing
anything, and refuses settings this update cannot honour (amsgrad, maximize, Adam's L2 decay).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.optim import Optimizer

try:  # (weight_digest's fast path on the host)
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

from offload_plugin.checkpoint import loading
from offload_plugin.formats import bnb_layout as bnb_state
from offload_plugin.formats import group_checks
from offload_plugin.formats.adam_args import Settings, fused
from offload_plugin.formats.block_layout import BlockLayout
from offload_plugin.formats.compact import native as compact_adam
from offload_plugin.formats.inner import InnerOptimizer
from offload_plugin.host.weights import WeightTracker, version

__all__ = ["CompactAdamW", "to_adamw_state_dict", "from_adamw_state_dict", "fp32_update", "check_live_entry",
           "weight_digest"]

_CODES = ("exp_avg", "exp_avg_sq")
_SCALES = ("exp_avg_absmax", "exp_avg_sq_absmax")
MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller parameters keep fp32 state
# How a refused setting is named, as torch's AdamW names them ("Invalid learning rate: -1").
_SETTING_NAMES = {"lr": "learning rate", "eps": "epsilon value", "betas": "beta parameters",
                  "weight_decay": "weight_decay value"}


def _is_fp32_layout(entry: dict) -> bool:
    """Whether a (non-empty) state entry is the fp32 layout: fp32 moments, no block scales."""
    return _SCALES[0] not in entry


class CompactAdamW(Optimizer, InnerOptimizer):
    """AdamW (decoupled weight decay) with compact state, for contiguous bf16 CPU tensors:
    the host copies that ``CPUOffloadOptimizer`` updates (with ``master_weights=False``,
    its default, they are bf16).

    Args:
        params: bf16 CPU tensors or param groups.
        lr, betas, eps, weight_decay: as torch.optim.AdamW.
        master (bool): keep the 16-bit remainder that makes the weight an exact fp32
            master (2 bytes per parameter). ``False``: the weight alone, plain bf16 AdamW
            with 8-bit moments. Default: ``True``.
        min_8bit_size (int): parameters with fewer elements keep fp32 moments, as in
            bitsandbytes' AdamW8bit. Default: 4096.
        fused, foreach: accepted for configs written for torch's AdamW; ignored.
    """

    # Its contract with CPUOffloadOptimizer (offload_plugin.formats.inner.InnerOptimizer says what
    # each means). Its update runs on the bf16 host copies only.
    bf16_host_only = True
    # The streamed update moves this state through the GPU and updates it there
    # (offload_plugin.formats.compact.streamed) where it can.
    state_format = "compact"
    # step(grad_scale=...) applies a gradient scale inside its pass (see step).
    scales_gradients_in_step = True
    # bitsandbytes' AdamW8bit has no "master" (its state entries convert, see check_state_entry).
    optional_group_keys = ("master", "min_8bit_size")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master: bool = True,
                 min_8bit_size: int = MIN_8BIT_SIZE,
                 fused: Optional[bool] = None, foreach: Optional[bool] = None) -> None:
        # fused and foreach are taken (and ignored) so that configs written for torch's
        # AdamW (torchtune's QLoRA configs set fused: True) work unchanged: the update is
        # always one native pass.
        if not isinstance(betas, (str, bytes)) and hasattr(betas, "__iter__"):
            betas = tuple(betas)  # (a config's list)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master=bool(master),
                        min_8bit_size=min_8bit_size)
        # The one check of these settings: step() (check_group) and load_state_dict (which
        # builds a probe with them) refuse what it refuses, with its message.
        problem = group_checks.settings_problem(defaults)
        if problem is not None:
            key, needs = problem
            raise ValueError(f"Invalid {_SETTING_NAMES.get(key, key)}: {defaults[key]!r:.60} ({needs})")
        super().__init__(params, defaults)
        self._setup_tracking()

    def check_group(self, index: int, group: dict) -> None:
        """Refuse settings edited into param_groups[index] that the constructor refuses, or
        that load_state_dict refuses (_FOREIGN_SETTINGS): every path's step() calls it
        before it updates anything."""
        group_checks.check_settings(index, group, flags=("master",))
        key = _foreign_setting(group)
        if key is not None:
            raise ValueError(f"param_groups[{index}] has {key}={group[key]!r:.40}, which CompactAdamW's update does "
                             f"not do: {_REFUSED[key]}. Set it back (or delete the key) before the next step(). "
                             "Nothing was updated.")

    def _setup_tracking(self) -> None:
        """The per-parameter records beside ``state`` (keyed by the tensors, as ``state`` is,
        so that a deep copy keys its own tensors).

        A remainder belongs to the weight it was made with. A weight written by anyone else
        restarts its master from the written weight (remainder zero): the weight is the
        master's upper half, so whether a write kept its values cannot be told without a
        copy, which this state does not keep. CPUOffloadOptimizer reports writes
        (weight_replaced); used directly, a weight's version counter and storage tell (an
        in-place write, a ``.data`` replacement): the kernel's own writes go through a raw
        pointer and leave both alone. Only for tensors that own their
        storage: views (CPUOffloadOptimizer's host copies share blocks) count every write to
        the block. The one exception is a resume: loaded remainders carry the digest of their
        weights (weight_digest), and one is kept when its weight, at its next update, has that
        digest, whichever of model and optimizer was loaded first."""
        self._written = WeightTracker(version)  # (tensors that own their storage)
        self._loaded: dict[torch.Tensor, int] = {}  # p -> digest its loaded remainder needs
        # Which parameters are FSDP2 shards, and their full shapes (see shard_of).
        self._blocks = BlockLayout(compact_adam.BLOCK)

    def __getstate__(self) -> dict:
        # torch's Optimizer pickles defaults, state and groups only; the records above go
        # along (keyed by the same tensors, so a deep copy or pickle keys the copies).
        return dict(super().__getstate__(), _loaded=self._loaded, _full_shapes=self._blocks.full_shapes)

    def __setstate__(self, state: dict) -> None:
        loaded, full_shapes = state.pop("_loaded", {}), state.pop("_full_shapes", {})
        super().__setstate__(state)
        self._setup_tracking()
        self._loaded.update(loaded)
        self._blocks.full_shapes.update(full_shapes)
        for group in self.param_groups:  # (a copy's tensors have counters of their own)
            for p in group["params"]:
                self._remember_version(p)

    def shard_of(self, p: torch.Tensor, full_shape, first_row: int = 0) -> None:
        """``p`` is this rank's rows (a dim-0 shard, as FSDP2 makes) of a parameter of
        ``full_shape``; CPUOffloadOptimizer says so for DTensor parameters. Its state then
        takes the layout every rank agrees on and a checkpoint reshards by rows
        (offload_plugin.formats.block_layout): compact, with block scales per row, or fp32."""
        self._blocks.shard_of(p, full_shape, first_row)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: Optional[float] = None) -> Optional[Any]:
        """One step. ``grad_scale``: multiply each gradient by it first, inside the update's
        pass: the same bits as ``p.grad.mul_(grad_scale)`` (torchtune's scale_grads) before
        the step, without a pass of its own (CPUOffloadOptimizer applies
        ``overlap_next_step``'s scale this way)."""
        loss = group_checks.checked_step(self, closure, _check_tensor, check_live_entry)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                entry = self.init_state(p, group)
                if p.numel() == 0:  # an empty shard: nothing to update, the count goes on
                    entry["step"] += 1
                    continue
                self._decide_remainder(p, p, self._written.changed(p, p))
                if _is_fp32_layout(entry):
                    self._fp32_step(p, group, grad_scale)
                else:
                    state = self._compact(p, group)
                    compact_step(state, p.grad.view(-1), Settings.adamw(group), grad_scale)
                    entry["step"].fill_(float(state.step))
                self._remember_version(p)
        return loss

    def state_dict(self) -> dict:
        """torch's layout; each entry with a remainder also holds ``weight_digest``, the
        digest of the weight it belongs to (see _setup_tracking)."""
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:  # weights written since their last update (CPUOffloadOptimizer's adopts them too)
            if self._written.changed(p, p):
                self._decide_remainder(p, p, written=True)
                self._remember_version(p)
        sd = super().state_dict()
        sd["state"] = {index: self.saved_entry(params[index], entry, params[index])
                       for index, entry in sd["state"].items()}
        return sd

    def saved_entry(self, p: torch.Tensor, entry: dict, weight: torch.Tensor) -> dict:
        """``p``'s state entry as a checkpoint holds it: a new dict (torch's packing hands
        out the live one) with the digest of ``weight``, the weight its remainder belongs
        to. None for a shard's (one rank's digest cannot stand for a resharded load)."""
        entry = dict(entry)
        if entry.get("remainder") is not None and not self._blocks.is_shard(p):
            # (a remainder loaded and not yet matched to its weight still belongs to the one
            # it was saved with)
            digest = self._loaded[p] if p in self._loaded else weight_digest(weight)
            entry["weight_digest"] = torch.tensor(digest, dtype=torch.int64)
        return entry

    def weight_replaced(self, p: torch.Tensor, weight: Optional[torch.Tensor] = None) -> None:
        """``p``'s weight was written outside the optimizer (``weight``: where that weight
        is, when ``p`` is not it, as for the streamed update's placeholders): its master
        restarts from it (remainder zero), unless the remainder was loaded with a digest
        that the written weight has (see _setup_tracking)."""
        self._decide_remainder(p, p if weight is None else weight, written=True)

    def before_update(self, p: torch.Tensor, weight: torch.Tensor) -> None:
        """``p``'s update is about to read ``weight`` (for paths that update without
        step(), the streamed update): a remainder loaded with a digest is kept or dropped
        now, as step() does."""
        if p in self._loaded:
            self._decide_remainder(p, weight, written=False)

    def _decide_remainder(self, p: torch.Tensor, weight: torch.Tensor, written: bool) -> None:
        digest = self._loaded.pop(p, None)
        if digest is not None:  # a resume: is this the weight the remainder was saved with?
            written = weight_digest(weight) != digest
        remainder = self.state[p].get("remainder") if written and p in self.state else None
        if remainder is not None:
            remainder.zero_()

    def _remember_version(self, p: torch.Tensor) -> None:
        if p._base is None:
            self._written.matched(p, p)

    def init_state(self, p: torch.Tensor, group: dict, empty=torch.empty) -> dict:
        """``p``'s state entry, made if it has none: zeros in the layout its size picks
        (compact, or the fp32 layout below ``min_8bit_size``). Made from ``p``'s shape alone, in
        tensors from ``empty(shape, dtype=...)``: the streamed update makes them in
        page-locked memory, for parameters that have no host copy."""
        entry = self.state[p]
        if entry:
            return entry

        def zeros(shape, dtype, fill=0):
            return empty(shape, dtype=dtype).fill_(fill)

        entry["step"] = torch.zeros((), dtype=torch.float32)
        if self._blocks.eight_bit_when_new(p, group.get("min_8bit_size", MIN_8BIT_SIZE)):
            zero_m = compact_adam.zero_code(signed=True)
            entry.update(exp_avg=zeros(p.shape, torch.uint8, zero_m),
                         exp_avg_absmax=zeros(self._blocks.scale_shape(p), torch.float32),
                         exp_avg_sq=zeros(p.shape, torch.uint8),  # code 0 is 0.0 unsigned
                         exp_avg_sq_absmax=zeros(self._blocks.scale_shape(p), torch.float32))
        else:
            entry.update(exp_avg=zeros(p.shape, torch.float32), exp_avg_sq=zeros(p.shape, torch.float32))
        if group["master"]:
            entry["remainder"] = zeros(p.shape, torch.int16)
        self._remember_version(p)
        return entry

    def _fp32_step(self, p: torch.Tensor, group: dict, grad_scale: Optional[float]) -> None:
        """torch's fused AdamW on the fp32 master (weight + remainder), then split back."""
        entry = self.state[p]
        remainder = entry.get("remainder")
        entry["step"] += 1  # (torch's AdamW counts before its fused kernel)
        grad = p.grad if grad_scale is None else p.grad * grad_scale
        fp32_update(p.view(-1), None if remainder is None else remainder.view(-1), grad.reshape(-1),
                     entry["exp_avg"].view(-1), entry["exp_avg_sq"].view(-1), entry["step"],
                     Settings.adamw(group))

    def _compact(self, p: torch.Tensor, group: dict) -> compact_adam.CompactAdamState:
        """``p``'s state entry as a CompactAdamState over the same tensors (no copies)."""
        entry = self.init_state(p, group)
        remainder = entry.get("remainder")
        state = compact_adam.CompactAdamState(
            weight=p.view(-1), remainder=None if remainder is None else remainder.view(-1),
            exp_avg=entry["exp_avg"].view(-1), exp_avg_absmax=entry["exp_avg_absmax"].view(-1),
            exp_avg_sq=entry["exp_avg_sq"].view(-1), exp_avg_sq_absmax=entry["exp_avg_sq_absmax"].view(-1),
            step=int(entry["step"].item()),
        )
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, with everything checked and converted before anything changes: a
        refused load leaves parameters, state and groups as they were. Group settings this
        update cannot honour are refused (amsgrad, maximize, Adam's L2 decay, capturable,
        differentiable; see _group_to_load); foreach and fused, which change nothing here,
        are dropped. Every entry goes through :meth:`check_state_entry`, so a bitsandbytes
        AdamW8bit or PagedAdamW8bit state dict loads as it is. State tensors keep their
        dtypes (torch's own loading casts every state tensor of a floating-point parameter
        to its dtype: the uint8 codes and the int16 remainder would become bf16).

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: it does not match this optimizer's groups and parameters, or a group
                or entry is malformed or asks for what this update does not do; the message
                says which and what to do.
        """
        loading.load_checked(self, state_dict, self._group_to_load, self.check_state_entry,
                             before_post_hooks=self._loaded_remainders)

    def _group_to_load(self, i: int, saved: Mapping, current: dict) -> dict:
        """Group ``i`` of a state dict as this optimizer takes it in place of ``current``:
        without _FOREIGN_SETTINGS (checked first); ``optional_group_keys`` it lacks taken from
        ``current`` (a bitsandbytes group has no "master": this optimizer's setting holds); its
        own settings checked and normalized by the constructor and by what step() checks, and
        finite; other keys kept, as torch keeps them (a scheduler's "initial_lr")."""
        hyper = _without_foreign_settings(i, {k: v for k, v in saved.items() if k != "params"})
        for key in self.optional_group_keys:
            hyper.setdefault(key, current[key])
        missing = sorted(set(self.defaults) - hyper.keys())
        if missing:
            raise ValueError(
                f"parameter group {i} of the state dict lacks {missing}, which CompactAdamW needs "
                f"(it has {sorted(map(str, hyper))}): it was written by another optimizer class. Load "
                "it into the class that wrote it, or start this optimizer fresh."
            )
        try:
            probe = type(self)([torch.zeros(1, dtype=torch.bfloat16)], **{k: hyper[k] for k in self.defaults})
            own = probe.param_groups[0]
            group_checks.check_hyperparameters(i, own)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"parameter group {i} of the state dict does not work with CompactAdamW: "
                             f"{type(err).__name__}: {err}") from None
        hyper.update({k: own[k] for k in self.defaults})
        return hyper

    def _loaded_remainders(self) -> None:
        """After a load: each remainder saved with a digest waits for its weight (kept at its
        next update if the weight then has that digest, see _setup_tracking); one without
        (an older checkpoint, a conversion) belongs to the weight as it is now."""
        self._written, self._loaded = WeightTracker(version), {}
        for group in self.param_groups:
            for p in group["params"]:
                entry = self.state.get(p)
                digest = entry.pop("weight_digest", None) if entry else None
                if digest is not None:
                    self._loaded[p] = int(digest)
                self._remember_version(p)

    def check_state_entry(self, where: str, entry: Mapping, param: torch.Tensor, group: dict) -> dict:
        """A checkpoint's state entry for ``param`` (one of this optimizer's tensors), checked
        and copied into new host tensors; load_state_dict, and CPUOffloadOptimizer's, call it
        for every entry before changing anything. A bitsandbytes entry is converted first
        (_from_bnb_entry). Then each key of the layout (or of _OPTIONAL_ENTRY_KEYS) must have
        its dtype and exact shape: codes, the fp32 layout's moments and the remainder shaped
        like ``param`` (a shard: its rows here), block scales as BlockLayout.scale_shape gives them (the
        remainder may come as its bits in bf16, as a sharded checkpoint carries it). Floats
        must be finite, second moments and scales >= 0, and the count a number >= 0 (whole
        in the compact layout, whose update counts whole steps).

        Raises:
            ValueError: naming ``where`` and the key, saying what is wrong and what to do.
        """
        if bnb_state.is_bnb_entry(entry):
            # (the layout it would get fresh)
            new_compact = self._blocks.eight_bit_when_new(param, group.get("min_8bit_size", MIN_8BIT_SIZE))
            entry = _from_bnb_entry(where, entry, param, group, self._blocks.scale_shape(param) if new_compact else None)
        compact = any(k in entry for k in _SCALES)
        layout = self._layout(where, param, group, compact)
        optional = {k: spec for k, spec in _OPTIONAL_ENTRY_KEYS.items() if spec[2] in layout}
        keys = set(entry)
        if not set(layout) <= keys <= set(layout) | set(optional):
            lacks, extra = sorted(map(str, set(layout) - keys)), sorted(map(str, keys - set(layout) - set(optional)))
            raise ValueError(
                f"{where} has the keys {sorted(map(str, keys))}"
                + (f", lacking {lacks}" if lacks else "") + (f", with {extra} too" if extra else "")
                + f": CompactAdamW(master={group['master']}) keeps {sorted(layout)} for this parameter "
                f"in its {'compact' if compact else 'fp32'} layout. A torch AdamW state dict converts "
                "with offload_plugin.formats.compact.optimizer.from_adamw_state_dict."
            )
        out = {"step": torch.tensor(compact_adam.checked_step(where, entry["step"], whole=compact),
                                    dtype=torch.float32)}
        for key, (dtype, shape, *_) in {**layout, **optional}.items():
            if key in entry and key != "step":
                out[key] = _checked_tensor(where, key, entry[key], dtype, shape)
        return out

    def _layout(self, where: str, p: torch.Tensor, group: dict, compact: bool) -> dict:
        """Each key of ``p``'s state entry in the compact or fp32 layout: (dtype, shape)."""
        shape, scales = tuple(p.shape), self._blocks.scale_shape(p)
        if compact and len(scales) == 2 and math.prod(scales) * compact_adam.BLOCK != p.numel():
            raise ValueError(
                f"{where} is in the compact layout, but this parameter is sharded and its rows are "
                "not whole blocks of 256: it keeps fp32 state (fp32 moments). Convert the checkpoint "
                "with to_adamw_state_dict and from_adamw_state_dict, or start its state fresh."
            )
        layout = {"step": (None, ())}
        if compact:
            layout.update(exp_avg=(torch.uint8, shape), exp_avg_absmax=(torch.float32, scales),
                          exp_avg_sq=(torch.uint8, shape), exp_avg_sq_absmax=(torch.float32, scales))
        else:
            layout.update(exp_avg=(torch.float32, shape), exp_avg_sq=(torch.float32, shape))
        if group["master"]:
            layout["remainder"] = (torch.int16, shape)
        return layout


# Keys an entry may hold beyond its layout's: key -> (dtype, shape, the layout key it needs
# beside it). Shape () takes one element in any shape, kept 0-d (as the count is).
_OPTIONAL_ENTRY_KEYS: dict[str, tuple] = {"weight_digest": (torch.int64, (), "remainder")}  # (see saved_entry)
# Float state that cannot be negative: second moments (their square root is taken) and scales.
_NONNEGATIVE = {"exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"}


def _checked_tensor(where: str, key: str, value: Any, dtype: Optional[torch.dtype], shape: tuple) -> torch.Tensor:
    """``value`` as a new contiguous host tensor of ``dtype`` (None: any floating point,
    converted to fp32) and exactly ``shape``, finite where it is floating point; else
    ValueError naming ``where`` and ``key``."""
    if isinstance(value, torch.Tensor) and (value.layout != torch.strided or value.is_meta or value.is_quantized):
        raise ValueError(f"{where} ({key!r}) is a {value.layout} tensor on {value.device}; it needs a dense tensor with data.")
    if key == "remainder" and isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        value = value.view(torch.int16)  # its bits, as a sharded checkpoint carries them (checkpoint._shard_state)
    needs = "a floating-point tensor" if dtype is None else f"a {dtype} tensor"
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} ({key!r}) is {type(value).__name__} {value!r:.40}; it needs {needs} of shape {shape}.")
    if value.dtype != dtype and not (dtype is None and value.is_floating_point()):
        raise ValueError(f"{where} ({key!r}) has dtype {value.dtype}; it needs {needs} (CompactAdamW's layout).")
    if tuple(value.shape) != shape and not (shape == () and value.numel() == 1):
        if value.numel() == math.prod(shape):
            hint = (f"the same number of elements in another shape (transposed, or another parameter's?); "
                    f"if it holds the values in order, reshape it to {shape}")
        else:
            hint = ("the checkpoint belongs to another model, or its parameters are in another order "
                    "(indices follow the order of the optimizer's parameters)")
        raise ValueError(f"{where} ({key!r}) has shape {tuple(value.shape)} ({value.numel()} elements); "
                         f"it needs exactly {shape}: {hint}.")
    out = value.detach().to("cpu", dtype=torch.float32 if dtype is None else dtype, copy=True,
                            memory_format=torch.contiguous_format).reshape(shape)
    if out.is_floating_point():
        bad = out.numel() - int(torch.isfinite(out).sum())
        if bad:
            raise ValueError(f"{where} ({key!r}) holds {bad} inf or NaN value(s): the next step would "
                             "carry them into the weights. Load a checkpoint from before.")
        if key in _NONNEGATIVE and bool((out < 0).any()):
            raise ValueError(f"{where} ({key!r}) holds {int((out < 0).sum())} negative value(s); it cannot "
                             "be negative (a second moment, whose square root is taken, or a block scale).")
    return out


# Group settings of torch's Adam/AdamW and bitsandbytes' optimizers that CompactAdamW has no
# key for, each with the value under which its update does what the setting says (_ANY: no
# value changes the result; the update is one native pass whatever foreach and fused say).
# A group saying otherwise is refused (_REFUSED says what to do); the keys are then dropped,
# so that a loaded group never says what the update does not do.
_ANY = object()
_FOREIGN_SETTINGS = {
    "foreach": _ANY, "fused": _ANY, "amsgrad": False, "maximize": False, "capturable": False,
    "differentiable": False, "decoupled_weight_decay": True,
    "alpha": 0.0, "t_alpha": None, "t_beta3": None,  # (bitsandbytes' AdEMAMix terms)
}
_TO_TORCH = "load it into torch's AdamW (CPUOffloadOptimizer's default optimizer_cls)"
_ADEMAMIX = "bitsandbytes' AdEMAMix; CompactAdamW is AdamW: load it into bitsandbytes' AdEMAMix8bit"
_REFUSED = {
    "amsgrad": f"CompactAdamW keeps no max_exp_avg_sq: {_TO_TORCH}, or set it to False to go on without amsgrad",
    "maximize": f"CompactAdamW minimizes: {_TO_TORCH}, or set it to False and negate the loss",
    "capturable": "CompactAdamW updates host tensors, outside CUDA graphs: set it to False",
    "differentiable": "CompactAdamW's update is not differentiable: set it to False",
    "decoupled_weight_decay": (
        "Adam's L2 weight decay, where CompactAdamW decays the weights decoupled, as AdamW: load it "
        "into optimizer_cls=torch.optim.Adam, or set it to True to go on as AdamW (as torch's AdamW "
        "does with an Adam checkpoint)"),
    "alpha": _ADEMAMIX, "t_alpha": _ADEMAMIX, "t_beta3": _ADEMAMIX,
}


def _says(value: Any, want: Any) -> bool:
    """Whether a setting's ``value`` means ``want`` (truthiness for flags, as torch reads them)."""
    try:
        if want is _ANY or want is None:
            return want is _ANY or value is None
        return bool(value) == want if isinstance(want, bool) else bool(value == want)
    except (TypeError, ValueError, RuntimeError):  # (a tensor of several values, ...)
        return False


def _foreign_setting(group: Mapping) -> Optional[str]:
    """The first of _FOREIGN_SETTINGS that ``group`` sets to another update than this one,
    or None: load_state_dict refuses such a saved group and step() such an edited one (the
    same check, so that a run never saves a checkpoint it cannot load)."""
    for key, want in _FOREIGN_SETTINGS.items():
        if key not in group:
            continue
        if key == "decoupled_weight_decay" and _says(group.get("weight_decay"), 0.0):
            continue  # without decay, Adam and AdamW are the same update
        if not _says(group[key], want):
            return key
    return None


def _without_foreign_settings(i: int, group: Mapping) -> dict:
    """Group ``i`` of a state dict without _FOREIGN_SETTINGS, each checked first."""
    key = _foreign_setting(group)
    if key is not None:
        raise ValueError(
            f"parameter group {i} of the state dict has {key}={group[key]!r:.40}, which CompactAdamW's "
            f"update does not do: {_REFUSED[key]} (param_groups[{i}][{key!r}] in the state dict). "
            "Nothing was loaded.")
    return {k: v for k, v in group.items() if k not in _FOREIGN_SETTINGS}


def _from_bnb_entry(where: str, entry: Mapping, param: torch.Tensor, group: dict,
                    scale_shape: Optional[tuple]) -> dict:
    """A bitsandbytes Adam entry (bnb_state reads and checks it) in CompactAdamW's layout:
    compact where bitsandbytes kept 8 bits and ``scale_shape`` is given (its moments
    dequantized through its maps and quantized with ours, within a quantization step),
    else the fp32 layout (its moments as it defines them, in fp32: ``scale_shape`` None means the
    parameter keeps fp32 state here). bitsandbytes keeps no master: the weight is the
    master (remainder zero)."""
    moments = bnb_state.read_entry(where, entry, param.shape)
    out = {"step": moments.step}
    if moments.quantized and scale_shape is not None:
        for key, scale_key, value, signed in (("exp_avg", "exp_avg_absmax", moments.exp_avg, True),
                                              ("exp_avg_sq", "exp_avg_sq_absmax", moments.exp_avg_sq, False)):
            codes, absmax = compact_adam.quantize(value.reshape(-1), signed)
            out[key], out[scale_key] = codes.view(param.shape), absmax.view(scale_shape)
    else:
        out.update(exp_avg=moments.exp_avg, exp_avg_sq=moments.exp_avg_sq)
    if group["master"]:
        out["remainder"] = torch.zeros(param.shape, dtype=torch.int16)
    return out


_DIGEST_ROW = 256  # 32-bit words per row of weight_digest


@torch.no_grad()
def weight_digest(weight: torch.Tensor) -> int:
    """A 64-bit digest of ``weight``'s bits, the same on every device: a resumed remainder
    is kept only for the weight it was saved with (see CompactAdamW._setup_tracking).

    The bytes as 32-bit words in rows of 256 (zero-padded); each row's sum of word times
    (2 * column + 1) wraps to 32 bits, and the rows' sum of that times (2 * row + 1) to 64
    bits, plus the element count: any change of one word, and swapping two, change it.
    One pass; on the host through numpy (torch's integer reductions ran 10x slower)."""
    flat = weight.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    pad = -raw.numel() % (4 * _DIGEST_ROW)
    if pad or raw.storage_offset() % 4:  # (whole rows, and words a 32-bit view can read)
        raw = torch.cat([raw, raw.new_zeros(pad)])
    rows = raw.view(torch.int32).view(-1, _DIGEST_ROW)
    total = flat.numel()
    chunk = 1 << 14  # rows at a time: a bounded temporary on a full GPU
    for start in range(0, rows.shape[0], chunk):
        block = rows[start:start + chunk]
        r = torch.arange(start, start + block.shape[0], device=block.device, dtype=torch.int64) * 2 + 1
        if block.device.type == "cpu" and np is not None:
            cols = np.arange(1, 2 * _DIGEST_ROW, 2, dtype=np.int32)
            sums = torch.from_numpy(block.numpy() @ cols).to(torch.int64)  # (wraps at 32 bits)
        else:
            cols = torch.arange(1, 2 * _DIGEST_ROW, 2, device=block.device, dtype=torch.int64)
            sums = (block.to(torch.int64) * cols).sum(1)
            sums = ((sums + 2 ** 31) & 0xFFFFFFFF) - 2 ** 31  # (the same 32-bit wrap)
        total += int((sums * r).sum())
    return (total + 2 ** 63) % 2 ** 64 - 2 ** 63  # (an int64 value: it is saved as a tensor)


def fp32_update(weight: torch.Tensor, remainder: Optional[torch.Tensor], grad: torch.Tensor,
                 exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: torch.Tensor,
                 settings: Settings, found_inf: Optional[torch.Tensor] = None) -> None:
    """The fp32 state's update (parameters under min_8bit_size): torch's fused AdamW on the
    fp32 master (``weight`` plus ``remainder``, flat), split back into them in place; the
    count ``step`` already advanced. A step skipped by ``found_inf`` leaves the master as it
    was, and splitting it gives back the same weight and remainder. The streamed update
    runs it on the GPU (compact_streamed)."""
    master = compact_adam.master_of(weight, remainder)
    fused([master], [grad.float()], [exp_avg], [exp_avg_sq], [step], settings, lr=float(settings.lr),
                found_inf=found_inf)
    if remainder is None:
        weight.copy_(master)  # plain bf16 weight, rounded to nearest
    else:
        rounded, rest = compact_adam.split_master(master)
        weight.copy_(rounded)
        remainder.copy_(rest)


def check_live_entry(p: torch.Tensor, entry: dict, group: dict) -> None:
    """``optimizer.state[p]`` as a step needs it. The kernels walk raw pointers: a state
    tensor of another size assigned by hand read and wrote past its end (heap corruption)."""
    n, blocks = p.numel(), -(-p.numel() // compact_adam.BLOCK)
    if _is_fp32_layout(entry):
        want = {"exp_avg": (torch.float32, n), "exp_avg_sq": (torch.float32, n)}
    else:
        want = {"exp_avg": (torch.uint8, n), "exp_avg_sq": (torch.uint8, n),
                "exp_avg_absmax": (torch.float32, blocks), "exp_avg_sq_absmax": (torch.float32, blocks)}
    if group["master"] or "remainder" in entry:
        want["remainder"] = (torch.int16, n)
    where = f"optimizer.state[p] of a parameter of shape {tuple(p.shape)}"
    step = entry.get("step")
    if not (isinstance(step, torch.Tensor) and step.numel() == 1):
        raise ValueError(f"{where}: 'step' is {step!r:.40}; it must be a one-element tensor. "
                         "Put back the full entry, or `del optimizer.state[p]` to restart its state.")
    count = float(step)
    if not (math.isfinite(count) and count >= 0 and (_is_fp32_layout(entry) or count == int(count))):
        # (the compact update counts whole steps: a fraction would be cut off silently)
        raise ValueError(f"{where}: 'step' is {count!r}; it must be a finite count >= 0"
                         + ("" if _is_fp32_layout(entry) else ", a whole number in the compact layout") + ".")
    for key, (dtype, numel) in want.items():
        value = entry.get(key)
        if not (isinstance(value, torch.Tensor) and value.dtype == dtype and value.numel() == numel
                and value.is_contiguous() and value.device.type == "cpu"):
            got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise ValueError(
                f"{where}: {key!r} is {got}; CompactAdamW needs a contiguous {dtype} CPU tensor "
                f"of {numel} elements there. Put back the full entry, or `del optimizer.state[p]` "
                "to restart its state."
            )


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if t.layout != torch.strided:
        wrong = f"a {t.layout} {what}"
    elif t.dtype != torch.bfloat16 or t.device.type != "cpu":
        wrong = f"a {what} of dtype {t.dtype} on {t.device}"
    elif not t.is_contiguous():
        wrong = (f"a {what} that is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}: "
                 "a transposed or sliced view?); pass the tensor that owns the data, or .contiguous()")
    else:
        return
    raise ValueError(
        f"CompactAdamW updates dense, contiguous bf16 CPU tensors; got {wrong}. Nothing was "
        "updated. On a GPU, or for other dtypes, use it as CPUOffloadOptimizer's optimizer_cls "
        "with bf16 parameters and master_weights=False (the default): its remainder is the master."
    )


def to_adamw_state_dict(state_dict: dict, params: list) -> tuple[dict, list]:
    """A CompactAdamW state dict in torch AdamW's layout: (state dict, fp32 masters in the
    order of ``params``, the parameters the state belongs to, as bf16 weights). Load the
    masters into fp32 parameters for an exact continuation, or round them to bf16. A group
    keeps its ``fused`` if it has one, else says fused=True: the fp32 layout's update
    (parameters under min_8bit_size) is torch's fused AdamW, which such tensors then continue
    bit for bit (torch's for-loop AdamW rounds differently)."""
    out, masters = {"state": {}, "param_groups": []}, []
    for group in state_dict["param_groups"]:
        out["param_groups"].append({k: v for k, v in group.items() if k not in ("master", "min_8bit_size")}
                                   | {"amsgrad": False, "maximize": False, "foreach": None,
                                      "capturable": False, "differentiable": False,
                                      "fused": group.get("fused", True), "decoupled_weight_decay": True})
    for index, p in enumerate(params):
        entry = state_dict["state"].get(index)
        weight = p.detach().reshape(-1).to("cpu", torch.bfloat16).contiguous()
        if not entry:
            masters.append(weight.float().view(p.shape))
            continue
        if not (isinstance(entry, dict) and {"step", "exp_avg", "exp_avg_sq"} <= entry.keys()):
            keys = sorted(map(str, entry)) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(
                f"state entry {index} holds {keys}, not CompactAdamW's state: to_adamw_state_dict "
                "converts CompactAdamW's state dicts. "
                + ("It is bitsandbytes' 8-bit layout: load it with optimizer_cls=offload_plugin.AdamW8bit."
                   if bnb_state.is_bnb_entry(entry) else ""))
        if _is_fp32_layout(entry):
            master = compact_adam.master_of(weight, entry.get("remainder"))
            moments = {k: entry[k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
        else:
            master, moments = compact_adam.to_adamw(_state_of(entry, weight))
        out["state"][index] = {"step": moments["step"], "exp_avg": moments["exp_avg"].view(p.shape),
                               "exp_avg_sq": moments["exp_avg_sq"].view(p.shape)}
        masters.append(master.view(p.shape))
    return out, masters


def from_adamw_state_dict(state_dict: dict, params: list, master: bool = True,
                          min_8bit_size: int = MIN_8BIT_SIZE) -> dict:
    """A torch AdamW state dict (with ``master_weight`` entries, as CPUOffloadOptimizer
    saves them with ``master_weights=True``, or without) in CompactAdamW's layout, for
    ``params`` in the state dict's order. Where an entry has a fp32 master, the remainder
    is the master's; the weight the model needs is then the master rounded, which
    :func:`compact_adam.split_master` gives. Parameters under ``min_8bit_size`` elements
    keep their moments exactly (as CompactAdamW keeps them).

    Raises:
        ValueError: a group asks for what CompactAdamW does not do (amsgrad, maximize,
            Adam's L2 decay, ...), or an entry is not torch AdamW's (keys, exact shapes,
            finite values): quantizing would hide a NaN or a misplaced moment.
    """
    out = {"state": {}, "param_groups": []}
    for i, group in enumerate(state_dict["param_groups"]):
        out["param_groups"].append(_without_foreign_settings(i, group)
                                   | {"master": master, "min_8bit_size": min_8bit_size})
    keys = {"step", "exp_avg", "exp_avg_sq"}
    for index, p in enumerate(params):
        entry = state_dict["state"].get(index)
        if not entry:
            continue
        where, shape, small = f"state entry {index}", tuple(p.shape), p.numel() < min_8bit_size
        if not keys <= entry.keys() <= keys | {"master_weight"}:
            raise ValueError(f"{where} has the keys {sorted(map(str, entry))}: torch AdamW's layout is "
                             f"{sorted(keys)}, and 'master_weight' where CPUOffloadOptimizer saved one.")
        m, v = (_checked_tensor(where, key, entry[key], None, shape) for key in ("exp_avg", "exp_avg_sq"))
        saved_master = entry.get("master_weight")
        if saved_master is not None:
            saved_master = _checked_tensor(where, "master_weight", saved_master, None, shape)
        step = compact_adam.checked_step(where, entry["step"], whole=not small)
        if small:
            source = saved_master if saved_master is not None else p.detach().to("cpu", torch.float32)
            out["state"][index] = {"step": torch.tensor(step), "exp_avg": m, "exp_avg_sq": v}
            if master:
                out["state"][index]["remainder"] = compact_adam.split_master(source.reshape(-1))[1].view(p.shape)
            continue
        state = compact_adam.from_adamw(p, m, v, step=int(step), master=saved_master, master_weights=master)
        sd = state.state_dict()
        out["state"][index] = {k: t.view(p.shape) if t.numel() == p.numel() else t for k, t in sd.items()}
    return out


def _state_of(entry: dict, weight: torch.Tensor) -> compact_adam.CompactAdamState:
    flat = {k: v.reshape(-1) for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return compact_adam.CompactAdamState.from_state_dict(dict(entry, **flat), weight)


def compact_step(state: compact_adam.CompactAdamState, grad: torch.Tensor, settings: Settings,
                 grad_scale: Optional[float] = None) -> None:
    """The compact update for one host tensor's state, advancing ``state.step`` (CompactAdamW.step)."""
    compact_adam.step_(state, grad, lr=float(settings.lr), beta1=settings.beta1, beta2=settings.beta2,
                       eps=float(settings.eps), weight_decay=float(settings.weight_decay),
                       grad_scale=grad_scale)
