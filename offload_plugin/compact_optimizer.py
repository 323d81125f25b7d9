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
bitsandbytes: norms and biases, a negligible share of the memory) keep exact state
instead: ``exp_avg`` and ``exp_avg_sq`` in fp32, updated by torch's fused AdamW on the
fp32 master. Compressing them too made the loss curve drift further from exact AdamW's
than bitsandbytes' AdamW8bit's (bench/compact_quality.py). :func:`to_adamw_state_dict` and :func:`from_adamw_state_dict` convert
a whole state dict to and from torch's AdamW layout; a bitsandbytes AdamW8bit (or
PagedAdamW8bit, torchtune's stock full-finetune optimizer) state dict loads as it is.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from offload_plugin import compact_adam, host_update

__all__ = ["CompactAdamW", "to_adamw_state_dict", "from_adamw_state_dict", "exact_update"]

_CODES = ("exp_avg", "exp_avg_sq")
_SCALES = ("exp_avg_absmax", "exp_avg_sq_absmax")
MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller parameters keep exact state


def _is_exact(entry: dict) -> bool:
    """Whether a (non-empty) state entry is the exact layout: fp32 moments, no block scales."""
    return _SCALES[0] not in entry


class CompactAdamW(Optimizer):
    """AdamW (decoupled weight decay) with compact state, for contiguous bf16 CPU tensors:
    the host copies that ``CPUOffloadOptimizer`` updates (with ``master_weights=False``,
    its default, they are bf16).

    Args:
        params: bf16 CPU tensors or param groups.
        lr, betas, eps, weight_decay: as torch.optim.AdamW.
        master (bool): keep the 16-bit remainder that makes the weight an exact fp32
            master (2 bytes per parameter). ``False``: the weight alone, plain bf16 AdamW
            with 8-bit moments. Default: ``True``.
        min_8bit_size (int): parameters with fewer elements keep exact fp32 moments, as in
            bitsandbytes' AdamW8bit. Default: 4096.
        fused, foreach: accepted for configs written for torch's AdamW; ignored.
    """

    # CPUOffloadOptimizer refuses it with device_fraction and with other than bf16
    # parameters: its update runs on the bf16 host copies only.
    bf16_host_only = True
    # CPUOffloadOptimizer streams this state through the GPU and updates it there
    # (offload_plugin.compact_streamed) where it can, as it streams torch's AdamW's moments.
    streams_compact = True
    # step(grad_scale=...) applies a gradient scale inside its pass (see step).
    scales_gradients_in_step = True
    # Group keys a checkpoint may lack: bitsandbytes' AdamW8bit has no "master" (its state
    # entries convert, see check_state_entry).
    optional_group_keys = ("master", "min_8bit_size")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master: bool = True,
                 min_8bit_size: int = MIN_8BIT_SIZE,
                 fused: Optional[bool] = None, foreach: Optional[bool] = None) -> None:
        # fused and foreach are taken (and ignored) so that configs written for torch's
        # AdamW (torchtune's QLoRA configs set fused: True) work unchanged: the update is
        # always one native pass.
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            raise ValueError(f"min_8bit_size must be a whole number >= 0; got {min_8bit_size!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, master=bool(master),
                                      min_8bit_size=min_8bit_size))
        # A weight written by anyone else (new weights loaded) must drop its remainder,
        # which belongs to the old one. CPUOffloadOptimizer says so (weight_replaced); used
        # directly, a weight's version counter tells: the kernel's own writes go through a
        # raw pointer and leave it alone. Only for tensors that own their storage: views
        # (CPUOffloadOptimizer's host copies share blocks) count every write to the block.
        self._versions: dict[int, int] = {}
        # Tensors that are one rank's rows of a sharded (FSDP2) parameter: id -> its full
        # shape (see shard_of).
        self._full_shapes: dict[int, torch.Size] = {}

    def shard_of(self, p: torch.Tensor, full_shape) -> None:
        """``p`` is this rank's rows (a dim-0 shard, as FSDP2 makes) of a parameter of
        ``full_shape``; CPUOffloadOptimizer says so for DTensor parameters. Its state is then
        laid out so that every rank agrees and a checkpoint reshards by rows: compact only if
        the full parameter is at least ``min_8bit_size`` elements of 2 or more dims whose
        rows are whole blocks of 256 (then the block scales are kept per row, shaped
        ``(rows, blocks per row)``), else exact."""
        self._full_shapes[id(p)] = torch.Size(full_shape)

    def _compact_when_new(self, p: torch.Tensor, group: dict) -> bool:
        """Whether a parameter without state gets the compact layout (else exact)."""
        floor = group.get("min_8bit_size", MIN_8BIT_SIZE)
        full = self._full_shapes.get(id(p))
        if full is None:
            return p.numel() >= floor
        return len(full) >= 2 and math.prod(full) >= floor and math.prod(full[1:]) % compact_adam.BLOCK == 0

    def _scale_shape(self, p: torch.Tensor) -> tuple:
        """The shape of ``p``'s block scales: per row for a shard, else one flat run."""
        full = self._full_shapes.get(id(p))
        if full is None:
            return (-(-p.numel() // compact_adam.BLOCK),)
        return (p.shape[0], math.prod(full[1:]) // compact_adam.BLOCK)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: Optional[float] = None) -> Optional[Any]:
        """One step. ``grad_scale``: multiply each gradient by it first, inside the update's
        pass: the same bits as ``p.grad.mul_(grad_scale)`` (torchtune's scale_grads) before
        the step, without a pass of its own (CPUOffloadOptimizer applies
        ``overlap_next_step``'s scale this way)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Groups and state entries are the user's to edit between steps: all are checked
        # before any parameter is updated, so a refused step changes nothing.
        for index, group in enumerate(self.param_groups):
            host_update.check_hyperparameters(index, group)
            for p in group["params"]:
                if p.grad is not None and self.state.get(p):
                    _check_live_entry(p, self.state[p], group)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_tensor(p, "parameter")
                _check_tensor(p.grad, "gradient")
                exact = self._exact_entry(p, group) is not None
                if p.numel() == 0:  # an empty shard: nothing to update, the count goes on
                    self._entry(p, group)["step"] += 1
                    continue
                if exact:
                    self._exact_step(p, group, grad_scale)
                    self._remember_version(p)
                    continue
                state = self._compact(p, group)
                compact_adam.step_(
                    state, p.grad.view(-1), lr=float(group["lr"]), beta1=float(beta1),
                    beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), grad_scale=grad_scale,
                )
                self.state[p]["step"].fill_(float(state.step))
                self._remember_version(p)
        return loss

    def weight_replaced(self, p: torch.Tensor) -> None:
        """``p`` now holds new weights: its master restarts from them (remainder zero)."""
        remainder = self.state[p].get("remainder") if p in self.state else None
        if remainder is not None:
            remainder.zero_()

    def _remember_version(self, p: torch.Tensor) -> None:
        if p._base is None:
            self._versions[id(p)] = p._version

    def _entry(self, p: torch.Tensor, group: dict) -> dict:
        """``p``'s state entry, made in its layout if it has none yet."""
        if self._exact_entry(p, group) is None:
            self._compact(p, group)
        return self.state[p]

    def _exact_entry(self, p: torch.Tensor, group: dict) -> Optional[dict]:
        """``p``'s entry if it keeps exact state (made at its first step if it is small)."""
        entry = self.state[p]
        if not entry and not self._compact_when_new(p, group):
            entry = self.init_state(p, group)
        return entry if entry and _is_exact(entry) else None

    def init_state(self, p: torch.Tensor, group: dict, empty=torch.empty) -> dict:
        """``p``'s state entry, made if it has none: zeros in the layout its size picks
        (compact, or exact below ``min_8bit_size``). Made from ``p``'s shape alone, in
        tensors from ``empty(shape, dtype=...)``: the streamed update makes them in
        page-locked memory, for parameters that have no host copy."""
        entry = self.state[p]
        if entry:
            return entry

        def zeros(shape, dtype, fill=0):
            return empty(shape, dtype=dtype).fill_(fill)

        entry["step"] = torch.zeros((), dtype=torch.float32)
        if self._compact_when_new(p, group):
            zero_m = compact_adam.zero_code(signed=True)
            entry.update(exp_avg=zeros(p.shape, torch.uint8, zero_m),
                         exp_avg_absmax=zeros(self._scale_shape(p), torch.float32),
                         exp_avg_sq=zeros(p.shape, torch.uint8),  # code 0 is 0.0 unsigned
                         exp_avg_sq_absmax=zeros(self._scale_shape(p), torch.float32))
        else:
            entry.update(exp_avg=zeros(p.shape, torch.float32), exp_avg_sq=zeros(p.shape, torch.float32))
        if group["master"]:
            entry["remainder"] = zeros(p.shape, torch.int16)
        self._remember_version(p)
        return entry

    def _exact_step(self, p: torch.Tensor, group: dict, grad_scale: Optional[float]) -> None:
        """torch's fused AdamW on the fp32 master (weight + remainder), then split back."""
        entry = self.state[p]
        remainder = entry.get("remainder")
        if p._base is None and self._versions.get(id(p), p._version) != p._version and remainder is not None:
            remainder.zero_()  # the weight was replaced: it is the master now
        entry["step"] += 1  # (torch's AdamW counts before its fused kernel)
        grad = p.grad if grad_scale is None else p.grad * grad_scale
        exact_update(p.view(-1), None if remainder is None else remainder.view(-1), grad.reshape(-1),
                     entry["exp_avg"].view(-1), entry["exp_avg_sq"].view(-1), entry["step"], group)

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
        if p._base is None and self._versions.get(id(p), p._version) != p._version:
            state.reset_master()  # the weight was replaced: it is the master now
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, except that state tensors keep their dtypes: torch's own loading casts
        every state tensor of a floating-point parameter to its dtype, which would turn the
        uint8 codes and the int16 remainder into bf16. Entries are taken as given (no
        checks: CPUOffloadOptimizer.load_state_dict checks them first, check_state_entry)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or "
                             "parameters than this CompactAdamW")
        by_index = {index: p for s, g in zip(saved_groups, self.param_groups)
                    for index, p in zip(s["params"], g["params"])}
        self.state = collections.defaultdict(dict)
        for index, entry in state_dict["state"].items():
            p = by_index[index]
            self.state[p] = {k: v.detach().to("cpu").clone() for k, v in entry.items()}
            for key in _SCALES:  # (a shard keeps them per row)
                if key in self.state[p]:
                    self.state[p][key] = self.state[p][key].reshape(self._scale_shape(p))
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        # Loaded remainders belong to the weights as they are now (saved together).
        self._versions = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._remember_version(p)

    @staticmethod
    def check_state_entry(where: str, entry: dict, param: torch.Tensor, group: dict) -> dict:
        """A checkpoint's state entry for ``param``, checked and copied into new host
        tensors (``CPUOffloadOptimizer.load_state_dict`` calls this before changing
        anything); raises ValueError saying what is wrong."""
        if _BNB_STATE in entry or "state1" in entry:
            entry = _from_bnb_entry(where, entry, param, group)
        n, blocks = param.numel(), -(-param.numel() // compact_adam.BLOCK)
        moment = entry.get("exp_avg")
        if _is_exact(entry) and isinstance(moment, torch.Tensor) and moment.is_floating_point():
            # The exact layout (parameters under min_8bit_size): fp32 moments.
            want = {"step": (None, 1), "exp_avg": (torch.float32, n), "exp_avg_sq": (torch.float32, n)}
        else:
            want = {"step": (None, 1), "exp_avg": (torch.uint8, n), "exp_avg_sq": (torch.uint8, n),
                    "exp_avg_absmax": (torch.float32, blocks), "exp_avg_sq_absmax": (torch.float32, blocks)}
        if group.get("master", True):
            want["remainder"] = (torch.int16, n)
        if set(entry) != set(want):
            raise ValueError(
                f"{where} has the keys {sorted(map(str, entry))}: CompactAdamW"
                f"(master={group.get('master', True)}) keeps {sorted(want)} for this parameter. A "
                "torch AdamW state dict converts with "
                "offload_plugin.compact_optimizer.from_adamw_state_dict."
            )
        out = {}
        for key, (dtype, numel) in want.items():
            value = entry[key]
            if key == "remainder" and isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
                value = value.view(torch.int16)  # its bits, as a sharded checkpoint carries them
            if not isinstance(value, torch.Tensor) or value.numel() != numel or (
                    dtype is not None and value.dtype != dtype):
                got = (f"{value.dtype} with {value.numel()} elements" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                need = "one number" if dtype is None else f"{dtype} with {numel} elements"
                raise ValueError(f"{where} ({key!r}) is {got}; it needs {need}.")
            value = value.detach().to("cpu").clone()
            if dtype is None or dtype == torch.float32:
                value = value.float()
                signed = key == "exp_avg"  # (the exact layout's first moment)
                if not bool(torch.isfinite(value).all()) or (not signed and bool((value < 0).any())):
                    raise ValueError(f"{where} ({key!r}) holds a negative or non-finite value.")
            out[key] = value.reshape(()) if dtype is None else (
                value.reshape(param.shape) if numel == n else value.reshape(-1))
        return out


_BNB_STATE = "__bnb_optimizer_quant_state__"  # where bitsandbytes' state_dict() puts its codes


def _from_bnb_entry(where: str, entry: dict, param: torch.Tensor, group: dict) -> dict:
    """A bitsandbytes (0.50) AdamW8bit state entry as CompactAdamW's: its moments are
    dequantized through its own maps and quantized again with ours; the weight is the
    master (bitsandbytes keeps none). Anything malformed raises ValueError."""
    quant = entry.get(_BNB_STATE, entry)
    if isinstance(quant.get("state1"), torch.Tensor) and quant["state1"].is_floating_point():
        # A parameter it kept in 32 bits (under its min_8bit_size): ours keeps it exact too.
        try:
            out = {"step": torch.as_tensor(float(entry["step"])),
                   "exp_avg": quant["state1"].detach().float().reshape(param.shape),
                   "exp_avg_sq": quant["state2"].detach().float().reshape(param.shape)}
        except (KeyError, RuntimeError, TypeError, ValueError) as err:
            raise ValueError(f"{where} looks like a bitsandbytes AdamW8bit entry but does not "
                             f"convert: {type(err).__name__}: {err}") from None
        if group.get("master", True):  # it keeps no master: the weight is the master
            out["remainder"] = torch.zeros(param.shape, dtype=torch.int16)
        return out
    try:
        state = compact_adam.from_bnb(param.detach().to(torch.bfloat16), entry,
                                      master_weights=group.get("master", True))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{where} looks like a bitsandbytes AdamW8bit entry but does not convert: "
            f"{type(err).__name__}: {err}"
        ) from None
    return {k: v.view(param.shape) if v.numel() == param.numel() else v
            for k, v in state.state_dict().items()}


def exact_update(weight: torch.Tensor, remainder: Optional[torch.Tensor], grad: torch.Tensor,
                 exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: torch.Tensor, group: dict,
                 found_inf: Optional[torch.Tensor] = None) -> None:
    """The exact state's update (parameters under min_8bit_size): torch's fused AdamW on the
    fp32 master (``weight`` plus ``remainder``, flat), split back into them in place; the
    count ``step`` already advanced. A step skipped by ``found_inf`` leaves the master as it
    was, and splitting it gives back the same weight and remainder. The streamed update
    runs it on the GPU (compact_streamed)."""
    master = compact_adam.master_of(weight, remainder)
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(
        [master], [grad.float()], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False,
        lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
        weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), maximize=False,
        grad_scale=None, found_inf=found_inf,
    )
    if remainder is None:
        weight.copy_(master)  # plain bf16 weight, rounded to nearest
    else:
        rounded, rest = compact_adam.split_master(master)
        weight.copy_(rounded)
        remainder.copy_(rest)


def _check_live_entry(p: torch.Tensor, entry: dict, group: dict) -> None:
    """``optimizer.state[p]`` as a step needs it. The kernels walk raw pointers: a state
    tensor of another size assigned by hand read and wrote past its end (heap corruption)."""
    n, blocks = p.numel(), -(-p.numel() // compact_adam.BLOCK)
    if _is_exact(entry):
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
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"CompactAdamW updates contiguous bf16 CPU tensors; got a {what} of dtype {t.dtype} "
            f"on {t.device}. Use it as CPUOffloadOptimizer's optimizer_cls with bf16 parameters "
            "and master_weights=False (the default): its remainder is the master."
        )


def to_adamw_state_dict(state_dict: dict, params: list) -> tuple[dict, list]:
    """A CompactAdamW state dict in torch AdamW's layout: (state dict, fp32 masters in the
    order of ``params``, the parameters the state belongs to, as bf16 weights). Load the
    masters into fp32 parameters for an exact continuation, or round them to bf16."""
    out, masters = {"state": {}, "param_groups": []}, []
    for group in state_dict["param_groups"]:
        out["param_groups"].append({k: v for k, v in group.items() if k != "master"}
                                   | {"amsgrad": False, "maximize": False, "foreach": None,
                                      "capturable": False, "differentiable": False, "fused": None,
                                      "decoupled_weight_decay": True})
    for index, p in enumerate(params):
        entry = state_dict["state"].get(index)
        weight = p.detach().reshape(-1).to("cpu", torch.bfloat16).contiguous()
        if not entry:
            masters.append(weight.float().view(p.shape))
            continue
        if _is_exact(entry):
            master = compact_adam.master_of(weight, entry.get("remainder"))
            exact = {k: entry[k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
        else:
            master, exact = compact_adam.to_exact(_state_of(entry, weight))
        out["state"][index] = {"step": exact["step"], "exp_avg": exact["exp_avg"].view(p.shape),
                               "exp_avg_sq": exact["exp_avg_sq"].view(p.shape)}
        masters.append(master.view(p.shape))
    return out, masters


def from_adamw_state_dict(state_dict: dict, params: list, master: bool = True,
                          min_8bit_size: int = MIN_8BIT_SIZE) -> dict:
    """A torch AdamW state dict (with ``master_weight`` entries, as CPUOffloadOptimizer
    saves them with ``master_weights=True``, or without) in CompactAdamW's layout, for
    ``params`` in the state dict's order. Where an entry has a fp32 master, the remainder
    is the master's; the weight the model needs is then the master rounded, which
    :func:`compact_adam.split_master` gives. Parameters under ``min_8bit_size`` elements
    keep their moments exactly (as CompactAdamW keeps them)."""
    out = {"state": {}, "param_groups": []}
    for group in state_dict["param_groups"]:
        keep = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "params") if k in group}
        out["param_groups"].append(keep | {"master": master, "min_8bit_size": min_8bit_size})
    for index, p in enumerate(params):
        entry = state_dict["state"].get(index)
        if not entry:
            continue
        if p.numel() < min_8bit_size:
            source = entry.get("master_weight", p).detach().reshape(-1).to("cpu", torch.float32)
            small = {"step": torch.as_tensor(float(entry["step"])),
                     "exp_avg": entry["exp_avg"].detach().to("cpu", torch.float32).reshape(p.shape).clone(),
                     "exp_avg_sq": entry["exp_avg_sq"].detach().to("cpu", torch.float32).reshape(p.shape).clone()}
            if master:
                small["remainder"] = compact_adam.split_master(source)[1].view(p.shape)
            out["state"][index] = small
            continue
        state = compact_adam.from_exact(p, entry["exp_avg"], entry["exp_avg_sq"],
                                        step=int(float(entry["step"])),
                                        master=entry.get("master_weight"), master_weights=master)
        sd = state.state_dict()
        out["state"][index] = {k: v.view(p.shape) if v.numel() == p.numel() else v for k, v in sd.items()}
    return out


def _state_of(entry: dict, weight: torch.Tensor) -> compact_adam.CompactAdamState:
    flat = {k: v.reshape(-1) for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return compact_adam.CompactAdamState.from_state_dict(dict(entry, **flat), weight)
