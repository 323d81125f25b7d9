"""Gradient scaling, clipping and the inf/NaN verdict, wherever the gradients are.

torchtune's ``training.scale_grads(model, ...)`` and ``clip_grad_norm_(model.parameters())``
cannot reach offloaded gradients (``.grad`` is ``None`` on the model), so the optimizer
does both on whatever holds them: device ``.grad``, or host copies. The scan for inf/NaN
reuses what scaling and clipping read anyway (see grad_checks.FiniteRecord).

Overlapped clipping (``overlap_next_step(clipping=True)``): each gradient is scaled and its
norm taken on its way out of the device (or by the host worker for a sum accumulated on
the host), so ``clip_grad_norm_`` only adds the norms up and leaves the multiply to each
update (:class:`ClipNorms`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Union

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from offload_plugin import distributed
from offload_plugin.host import grad_checks
from offload_plugin.host.buffers import HostSlot
from offload_plugin.host.grad_checks import FiniteRecord
from offload_plugin.host.gradients import GradientPath
from offload_plugin.host.worker import HostWorker, JobBatch

__all__ = ["ClipNorms", "Scaling"]

log = logging.getLogger("offload_plugin.optimizer")


@dataclasses.dataclass
class ClipNorms:
    """Overlapped clipping: the scale to apply during backward, and the norms taken."""

    grad_scale: Optional[float]  # a multiplier() value (overlap_next_step makes it one)
    batch: JobBatch  # host-accumulated sums, scaled and normed by the worker
    scale: torch.Tensor = None  # [grad_scale or 1.0], fp32
    found: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1))
    norms: dict = dataclasses.field(default_factory=dict)  # gradient (host or device) -> its norm

    def __post_init__(self) -> None:
        self.scale = torch.tensor([self.grad_scale if self.grad_scale is not None else 1.0])

    def on_device(self, slot: HostSlot, grad: torch.Tensor) -> None:
        """Scale a gradient on its way to the host as Scaling.scale would on its device,
        and take its norm there (kept under the host copy's key)."""
        if self.grad_scale is not None:
            grad.mul_(self.grad_scale)  # fp32 multiply, one rounding (a number: no copy to wait on)
        self.norms[slot.grad] = torch._foreach_norm([grad], 2.0)[0]

    def on_host(self, grad: torch.Tensor) -> None:
        if self.grad_scale is not None:  # as Scaling.scale multiplies, bit for bit
            torch._amp_foreach_non_finite_check_and_unscale_([grad], self.found, self.scale)
        self.norms[grad] = torch._foreach_norm([grad], 2.0)[0]


def multiplier(factor: Union[float, torch.Tensor], grad_dtype: torch.dtype,
               on_accelerator: bool) -> float:
    """The number torchtune's ``scale_grads(model, factor)`` multiplies a ``grad_dtype``
    gradient by: ``p.grad *= factor.to(p.device)``. On the CPU that multiply reads the
    factor as fp32; on a GPU the kernel first converts a 0-dim factor to the gradient's
    dtype (bf16 keeps 8 bits of 1/num_tokens; a factor with a dimension takes part in type
    promotion instead, and stays fp32). So a host copy of a GPU gradient is scaled by that
    value to get the same bits. Every scaled gradient here is ``g * multiplier(...)``
    computed in fp32 and rounded once, which is what both devices do with it. (A number is
    taken as torch.tensor(number). Reading a factor that lives on a GPU waits for it;
    recipes that count tokens on the host pass a CPU tensor, read at no cost.)"""
    value = torch.as_tensor(factor)
    if on_accelerator and value.dim() == 0:
        value = value.to(grad_dtype)
    return float(value.to(torch.float32))


class Scaling:
    """One optimizer's gradient scale, clip and inf/NaN verdict."""

    def __init__(self, nonfinite_grads: str) -> None:
        self.nonfinite_grads = nonfinite_grads
        # Gradients offloaded without a handle left on .grad (DTensor parameters: see
        # grad_handle), which torch's scale and clip over model.parameters() cannot see.
        self.hidden_grads = False
        self.finite = FiniteRecord()
        self.clip_norms: Optional[ClipNorms] = None  # overlap_next_step(clipping=True), until step()
        self.clip_coef: Optional[torch.Tensor] = None  # clip's multiply, left to the updates
        self.scaled_since_zero_grad = False
        self._warned_unscaled = False
        self.on_accelerator = False  # the parameters live on a GPU (set with their device)

    def prepare_clipping(self, worker: HostWorker, grads: GradientPath,
                          grad_scale: Optional[float]) -> None:
        def scale_and_norm(slots: list[HostSlot]) -> None:  # worker job
            for slot in slots:
                grads.complete(slot)
                norms.on_host(slot.grad)

        norms = ClipNorms(grad_scale, JobBatch(worker, scale_and_norm))
        self.clip_norms = norms

    def reset(self) -> None:
        """After a step or zero_grad: no clipping prepared, nothing left to multiply."""
        self.clip_norms, self.clip_coef = None, None

    # ------------------------------------------------------------------ scaling
    def scale(self, grads: list[torch.Tensor], factor: Union[float, torch.Tensor]) -> None:
        found, known = torch.zeros(1), True
        for (device, dtype), ([group], _) in _group_tensors_by_device_and_dtype([grads]).items():
            if device.type == "cpu":
                value = multiplier(factor, dtype, self.on_accelerator)
                # Multiplies like `g *= factor` (bit for bit) and flags inf/NaN in one pass.
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.tensor([value]))
                continue
            # CUDA's AMP kernel has no bf16 variant; step() scans on the GPU instead.
            known = False
            if isinstance(factor, torch.Tensor) and factor.device.type != "cpu":
                scale = factor.to(device)  # torchtune's own multiply
            else:  # a number or a CPU tensor: read here, no copy for the host to wait on
                scale = multiplier(factor, dtype, self.on_accelerator)
            for g in group:
                g.mul_(scale)
        if known:
            self.finite.record(found, grads)
        else:
            self.finite.clear()
        self.scaled_since_zero_grad = True
        # Norms taken during backward (overlap_next_step(clipping=True)) are of the gradients
        # before this multiply: a clip now takes them anew, as torch's would.
        self.clip_norms = None

    # ------------------------------------------------------------------ clipping
    def clip(self, params: list[torch.Tensor], grads: list[torch.Tensor], meshes: list,
             max_norm: float, norm_type: float, error_if_nonfinite: bool,
             foreach: Optional[bool]) -> torch.Tensor:
        """clip_grad_norm_ over ``grads`` (the gradients of ``params``, in order)."""
        if self.clip_norms is not None and float(norm_type) == 2.0 and foreach is None:
            total = self._total_of_clip_norms(grads, error_if_nonfinite)
            # Each update job multiplies its gradient by this, as the loop below would
            # here: the same values, without a pass over all gradients in between.
            self.clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).cpu()
            total = total.cpu()
            self.finite.record((~torch.isfinite(total)).float(), grads)
            self.scaled_since_zero_grad = True
            return total
        if meshes:
            total = distributed.global_total_norm(params, grads, norm_type, error_if_nonfinite, foreach)
        else:
            total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula
        for g in grads:
            g.mul_(coef.to(g.device))
        self.finite.record((~torch.isfinite(total)).float(), grads)
        self.scaled_since_zero_grad = True
        return total

    def _total_of_clip_norms(self, grads: list[torch.Tensor], error_if_nonfinite: bool) -> torch.Tensor:
        """torch.nn.utils.get_total_norm(grads) from the norms taken during backward: torch
        stacks the per-tensor norms grouped by device and dtype, in that order, so the same
        grouping gives the same bits."""
        norms = self.clip_norms
        ordered = []
        for (device, _), ([device_grads], _) in _group_tensors_by_device_and_dtype([grads]).items():
            for g in device_grads:
                if g not in norms.norms:  # not seen by a worker job: scale and norm it now
                    norms.on_host(g)
                ordered.append(norms.norms[g])
        # Where torch would add them up: the parameters' device, if the norms were taken there.
        where = next((n.device for n in ordered if n.device.type != "cpu"), grads[0].device)
        total = torch.linalg.vector_norm(torch.stack([n.to(where) for n in ordered]), 2.0)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
                "it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        return total

    def apply_clip_now(self, grads: list[torch.Tensor]) -> None:
        """Something other than step() reads or changes the gradients after a clip whose
        multiply was left to the update jobs: do the multiply now, as clip_grad_norm_
        would have, and forget the norms it made stale."""
        if self.clip_coef is not None:
            for g in grads:
                g.mul_(self.clip_coef.to(g.device))
            self.clip_coef, self.clip_norms = None, None

    # ------------------------------------------------------------------ inf/NaN
    def step_is_finite(self, grads: list[torch.Tensor], meshes: list) -> bool:
        """The whole step's verdict (every rank's, when sharded)."""
        known = self.finite.finite(grads)  # from scale/clip, if still current
        finite = grad_checks.all_finite(grads) if known is None else known
        # Sharded: a rank skipping a step the others take would desynchronize the replicas
        # for good, so one rank's inf/NaN skips the step everywhere.
        return not distributed.any_rank(not finite, meshes)

    def report_skipped_step(self, grads: Optional[list[torch.Tensor]] = None, *,
                            count: Optional[int] = None) -> None:
        """Report a step skipped as a whole: counting the non-finite ``grads`` (a pass over
        each, on this rare path only), or, where the gradients are gone (the streamed update
        learns its verdict after the step), naming only the ``count`` of parameters."""
        if grads is None:
            what = (f"a gradient held an inf or NaN, so the step was skipped for all {count} "
                    "parameters: no weight or optimizer state changed")
        elif not (bad := sum(1 for g in grads if not grad_checks.all_finite([g]))):
            # (sharded: the verdict is every rank's)
            what = (f"another rank had an inf or NaN gradient, so the step was skipped for all "
                    f"{len(grads)} parameters here too (their master weights and optimizer "
                    "state are unchanged)")
        else:
            what = (f"{bad} of {len(grads)} parameters had an inf or NaN gradient, so the step "
                    "was skipped: no master weight or optimizer state changed")
        self._report(what)

    def report_spared(self, updated: int, skipped: int) -> None:
        """Report updates spared one by one (each checked its own gradient)."""
        if not skipped:
            return
        what = (
            f"{skipped} parameters had an inf or NaN gradient; their master weights and "
            "optimizer state are unchanged"
            + (f", while the other {updated} parameters were updated (with "
               "overlap_next_step or delayed_update each update checks its own gradient)"
               if updated else ": the step was skipped")
        )
        self._report(what)

    def _report(self, what: str) -> None:
        if self.nonfinite_grads == "raise":
            raise FloatingPointError(
                f"CPUOffloadOptimizer: {what}. Lower the lr, clip gradients, or check the "
                "data; nonfinite_grads='skip' skips such steps instead."
            )
        log.warning("CPUOffloadOptimizer: %s.", what)

    def warn_if_unscaled(self, param_groups: list[dict]) -> None:
        if self.hidden_grads and not self.scaled_since_zero_grad and not self._warned_unscaled:
            # torch.distributed.checkpoint's get/set_optimizer_state_dict create the state
            # with a step on zero gradients at lr=0, which must not use up the warning.
            if all(float(g["lr"]) == 0 for g in param_groups):
                return
            self._warned_unscaled = True
            # The leading newline: torchtune's recipes draw a tqdm bar on the same stream
            # without ending its line, and the warning would otherwise run on from it.
            log.warning(
                "\nCPUOffloadOptimizer(offload_gradients=True): step() ran without "
                "optimizer.scale_grads() or optimizer.clip_grad_norm_() since zero_grad(), so "
                "the gradients were applied unscaled and unclipped. Offloaded gradients of "
                "sharded (FSDP2) parameters leave .grad as None, where "
                "training.scale_grads(model, ...) and "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) cannot see them "
                "(the grad_norm such a loop logs is then 0.0): call the optimizer's "
                "scale_grads() and clip_grad_norm_() (our recipes do), or set "
                "offload_gradients=False. (Shown once.)"
            )
