"""Glue between the single-device recipes and whichever optimizer the config builds.

Gradient scaling and clipping:
torchtune's recipes scale the gradients by ``1/num_tokens`` and clip them between
``backward()`` and ``optimizer.step()``. With ``CPUOffloadOptimizer(offload_gradients=True)``
the gradients have already left the model by then, so the scaling and the clipping must
go through the optimizer, which sees them wherever they are. These helpers route the call
so a recipe stays correct with any optimizer.

Crash-safe checkpoints:
torchtune 0.6.1's checkpointers ``torch.save`` straight into ``output_dir/epoch_N/`` and
overwrite ``output_dir/recipe_state/recipe_state.pt`` in place, so a kill while saving
can truncate the only recipe state or leave a half-written ``epoch_N`` that a LoRA resume
picks as the latest adapter. ``save_checkpoint_atomically`` and ``recover_checkpoints``
make a save all-or-nothing while keeping torchtune's on-disk layout.
"""

import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Union

import torch
from torch import nn
from torchtune import training, utils

from offload_plugin.optimizer import CPUOffloadOptimizer

__all__ = [
    "overlap_last_backward",
    "finish_step",
    "scale_grads",
    "clip_grad_norm",
    "optimizer_metrics",
    "optimizer_state_for",
    "save_checkpoint_atomically",
    "recover_checkpoints",
]


def _is_offload(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, CPUOffloadOptimizer)


def overlap_last_backward(
    optimizer: torch.optim.Optimizer, num_tokens: torch.Tensor, clip_grad_norm,
    early_forward: bool = False,
) -> bool:
    """Before the last backward of a step, let the host work start during it.

    Only for ``CPUOffloadOptimizer(offload_gradients=True)``. Without clipping each
    parameter's update starts as soon as its gradient reaches the host. With clipping no
    update may start before the global norm is known, so the gradients are scaled and
    their norms taken as they arrive, and ``clip_grad_norm`` only adds the norms up
    (with ``delayed_update`` the update starts after step() anyway: here it learns when
    each updated weight may return early). Exact: the optimizer applies ``1/num_tokens``
    itself instead of ``scale_grads`` afterwards, which then does nothing.

    ``early_forward``: ``step()`` returns before the host update ends, and the next
    forward waits per module for its weights (see ``CPUOffloadOptimizer.overlap_next_step``);
    call :func:`finish_step` before reading the weights otherwise, e.g. to save them.

    Returns:
        bool: whether the optimizer takes over the ``1/num_tokens`` scaling.
    """
    if not (_is_offload(optimizer) and optimizer.offload_gradients):
        return False
    if len({p.dtype for g in optimizer.param_groups for p in g["params"]}) > 1:
        return False  # scale_grads rounds 1/num_tokens per gradient dtype: let it do so
    optimizer.overlap_next_step(
        grad_scale=1 / torch.as_tensor(num_tokens), clipping=clip_grad_norm is not None,
        early_forward=early_forward,
    )
    return True


def finish_step(optimizer: torch.optim.Optimizer) -> None:
    """Wait until the last optimizer step has put every weight on the device (a step that
    returned early, see :func:`overlap_last_backward`); a no-op for other optimizers."""
    if _is_offload(optimizer):
        optimizer.finish_step()


def scale_grads(
    model: nn.Module, optimizer: torch.optim.Optimizer, factor: torch.Tensor
) -> None:
    """Multiply every trainable gradient by ``factor``, offloaded or not.

    Args:
        model (nn.Module): the model being trained.
        optimizer (torch.optim.Optimizer): the optimizer built from the config.
        factor (torch.Tensor): scalar factor, e.g. ``1 / num_tokens``.
    """
    if _is_offload(optimizer):
        if not optimizer.overlapping:  # else the updates already apply it
            optimizer.scale_grads(factor)
    else:
        training.scale_grads(model, factor)


def clip_grad_norm(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Clip the global 2-norm of all trainable gradients in place.

    Args:
        model (nn.Module): the model being trained.
        optimizer (torch.optim.Optimizer): the optimizer built from the config.
        max_norm (float): largest allowed norm; ``float("inf")`` only measures it.

    Returns:
        torch.Tensor: the total norm before clipping.
    """
    if _is_offload(optimizer):
        return optimizer.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)


def optimizer_metrics(optimizer: torch.optim.Optimizer) -> Dict[str, float]:
    """Metrics the optimizer can report about itself, for the metric logger.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer built from the config.

    Returns:
        Dict[str, float]: ``optimizer_host_memory_gib`` for the offload optimizer, else empty.
    """
    if _is_offload(optimizer):
        return {"optimizer_host_memory_gib": optimizer.host_memory_bytes() / 1024**3}
    return {}


def optimizer_state_for(
    model: nn.Module, opt_state_dict: Dict[str, Any], optimizer_in_bwd: bool
) -> Dict[str, Any]:
    """A recipe checkpoint's optimizer state in the layout this run's optimizer loads, so a
    run can resume with ``optimizer_in_bwd`` switched (the state of each parameter is the
    same either way; torchtune refuses the other layout with "unexpected param state").

    The layouts: torch's ``{"state": {i: ...}, "param_groups": [...]}`` over the trainable
    parameters in model order (one optimizer), and torchtune's ``optimizer_in_bwd`` wrapper's
    ``{parameter name: that layout for one parameter}``.

    Args:
        model (nn.Module): the model being trained.
        opt_state_dict (Dict[str, Any]): the optimizer state a recipe checkpoint holds.
        optimizer_in_bwd (bool): whether this run builds one optimizer per parameter.

    Returns:
        Dict[str, Any]: ``opt_state_dict`` itself if it has the wanted layout, else a new
        dict of the same tensors in it.

    Raises:
        ValueError: if the state does not cover exactly the model's trainable parameters
            (or all of them), has several groups (to split), or (to join) the parameters'
            hyperparameters differ.
    """
    is_dict = isinstance(opt_state_dict, dict)
    flat = is_dict and opt_state_dict.keys() == {"state", "param_groups"}
    per_parameter = is_dict and bool(opt_state_dict) and "state" not in opt_state_dict and all(
        isinstance(entry, dict) and {"state", "param_groups"} <= entry.keys() for entry in opt_state_dict.values()
    )
    if not (per_parameter or flat) or per_parameter == optimizer_in_bwd:
        # (another layout, e.g. torchao's, or a malformed one: the optimizer's own
        # load_state_dict converts or refuses it, saying what is wrong)
        return opt_state_dict
    # Ours keeps the trainable parameters, torch's optimizers and torchtune's wrapper all.
    candidates = ([name for name, param in model.named_parameters() if param.requires_grad],
                  [name for name, _ in model.named_parameters()])
    try:
        if optimizer_in_bwd:
            return _split_by_parameter(opt_state_dict, candidates)
        return _join_parameters(opt_state_dict, candidates)
    except (KeyError, TypeError, AttributeError, IndexError) as err:
        raise ValueError(
            f"The checkpoint's optimizer state is malformed ({type(err).__name__}: {err}); "
            "resume from another checkpoint or set resume_from_checkpoint=False."
        ) from err


# Group keys that are not hyperparameters: the parameters, the LR scheduler's initial_lr
# (torchtune builds the scheduler on the first per-parameter optimizer only) and the names
# torch keeps when given named parameters.
_NOT_SHARED = ("params", "initial_lr", "param_names")


def _split_by_parameter(flat: Dict[str, Any], candidates: tuple) -> Dict[str, Any]:
    """torch's layout (one group) to one single-parameter state dict per parameter name."""
    groups = flat["param_groups"]
    if len(groups) != 1:  # (ours writes one; several could follow another order than the model's)
        raise ValueError(
            f"The checkpoint's optimizer has {len(groups)} parameter groups; only a one-group state "
            "splits by parameter: resume with optimizer_in_bwd=False."
        )
    indices = list(groups[0]["params"])
    names = next((c for c in candidates if len(c) == len(indices)), None)
    if names is None:
        raise ValueError(
            f"The checkpoint's optimizer state covers {len(indices)} parameters and the model has "
            f"{len(candidates[0])} trainable ones ({len(candidates[1])} in all): it is from another "
            "model; resume from a checkpoint of this one."
        )
    strays = set(flat["state"]) - set(indices)
    if strays:
        raise ValueError(f"The checkpoint's optimizer has state for parameters {sorted(map(str, strays))[:3]} "
                         "that no group lists; resume from a checkpoint of this recipe.")
    hyperparameters = {key: value for key, value in groups[0].items() if key not in ("params", "param_names")}
    return {
        name: {"state": {0: flat["state"][index]} if index in flat["state"] else {},
               "param_groups": [{**hyperparameters, "params": [0]}]}
        for name, index in zip(names, indices)
    }


def _join_parameters(per_name: Dict[str, Any], candidates: tuple) -> Dict[str, Any]:
    """One single-parameter state dict per name to torch's layout over the names (one group)."""
    names = next((c for c in candidates if set(c) == set(per_name)), None)
    if names is None:
        strays = sorted(set(per_name) - set(candidates[1]))[:3]
        missing = sorted(set(candidates[0]) - set(per_name))[:3]
        raise ValueError(
            "The checkpoint's optimizer state is for other parameters than the model's "
            f"(not in the model: {strays}; trainable but missing: {missing}); resume from a checkpoint of this model."
        )
    state, hyperparameters, initial_lr = {}, None, None
    for index, name in enumerate(names):
        groups = per_name[name]["param_groups"]
        if len(groups) != 1:
            raise ValueError(
                f"The checkpoint's optimizer for {name} has {len(groups)} parameter groups where "
                "torchtune's optimizer_in_bwd saves one; resume from a checkpoint of this recipe."
            )
        mine = {key: value for key, value in groups[0].items() if key not in _NOT_SHARED}
        if initial_lr is None:
            initial_lr = groups[0].get("initial_lr")
        if hyperparameters is None:
            hyperparameters = mine
        elif not _same_values(mine, hyperparameters):
            raise ValueError(
                f"The checkpoint's optimizer for {name} has other hyperparameters than for {names[0]}; "
                "one optimizer needs them equal: resume with optimizer_in_bwd=True."
            )
        entries = list(per_name[name]["state"].values())
        if len(entries) > 1:
            raise ValueError(
                f"The checkpoint's optimizer for {name} holds {len(entries)} states for one parameter; "
                "resume from a checkpoint of this recipe."
            )
        if entries:
            state[index] = entries[0]
    group = {**(hyperparameters or {}), "params": list(range(len(names)))}
    if initial_lr is not None:
        group["initial_lr"] = initial_lr
    return {"state": state, "param_groups": [group]}


def _same_values(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


# A save is staged in ``output_dir/.epoch_N.partial`` and renamed to ``.epoch_N.complete``
# once every file is on disk: that rename is the commit point. Staging inside output_dir
# keeps every rename on one filesystem, where os.replace is atomic (across filesystems it
# would be a copy). Both names start with "." so torchtune's ``^epoch_(\d+)`` search for
# the latest epoch (LoRA resume) never sees them.
_PARTIAL = ".epoch_{epoch}.partial"
_COMPLETE = ".epoch_{epoch}.complete"
_COMPLETE_RE = re.compile(r"^\.epoch_(\d+)\.complete$")
_PARTIAL_RE = re.compile(r"^\.epoch_(\d+)\.partial$")
# Relative path of the file whose presence tells a resume "epoch N finished"; torchtune
# reads it from this fixed place (``RECIPE_STATE_DIRNAME``), so it is published last.
_RECIPE_STATE = os.path.join("recipe_state", "recipe_state.pt")


def _fsync_path(path: Union[str, Path]) -> None:
    # torch.save and os.replace only reach the page cache: a SIGKILL keeps them, but a
    # power loss may not, nor keep them in order. fsync makes each step durable before
    # the next one depends on it. Directories too, so the new names survive.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def _publish(staged: Path, output_dir: Path) -> None:
    """Move every file of a committed save into ``output_dir``; idempotent, so a kill midway is finished by the next call."""
    files = sorted(
        os.path.relpath(os.path.join(dirpath, name), staged)
        for dirpath, _, names in os.walk(staged)
        for name in names
    )
    # Weights, adapter and configs first, the recipe state last: until it is replaced the
    # previous recipe_state.pt still describes a complete earlier epoch, which is what a
    # full fine-tune resume (model files named in the config) needs.
    files.sort(key=lambda rel: rel == _RECIPE_STATE)
    touched = set()
    for rel in files:
        dst = output_dir / rel
        if rel == _RECIPE_STATE:
            for d in touched:  # the weights' new names must be durable before the marker's
                _fsync_path(d)
            touched.clear()
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged / rel, dst)  # atomic: a reader sees the old file or the new one
        touched.update({dst.parent, output_dir})
    for d in touched:
        _fsync_path(d)
    shutil.rmtree(staged)
    _fsync_path(output_dir)


def recover_checkpoints(output_dir: Union[str, Path]) -> List[int]:
    """Finish or discard the saves a killed run left in ``output_dir``; call before loading a checkpoint.

    A save that reached its commit point (every file staged and synced) is published, so
    the weights, adapter and recipe state on disk are all from the same epoch; one that
    did not is deleted, leaving the previous checkpoint as it was.

    Args:
        output_dir (Union[str, Path]): the checkpointer's ``output_dir``.

    Returns:
        List[int]: the epochs whose interrupted saves were published.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    published = []
    for name in sorted(os.listdir(output_dir)):
        if _PARTIAL_RE.match(name):
            shutil.rmtree(output_dir / name)
    complete = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _COMPLETE_RE.match(name))]
    for epoch, name in sorted(complete):
        _publish(output_dir / name, output_dir)
        published.append(epoch)
    return published


def save_checkpoint_atomically(checkpointer, state_dict: Dict[str, object], epoch: int, **kwargs) -> None:
    """Run ``checkpointer.save_checkpoint`` so that a kill at any moment leaves a loadable checkpoint.

    The checkpointer writes into a staging directory inside its ``output_dir``, in the
    usual layout (``epoch_N/...``, ``recipe_state/recipe_state.pt``). The files are synced,
    the staging directory is renamed to mark the save complete, then each file is moved
    into place with an atomic ``os.replace``, the recipe state last. A kill before the
    mark leaves the previous checkpoint untouched (``recover_checkpoints`` deletes the
    staging directory); a kill after it is rolled forward by ``recover_checkpoints``.

    Args:
        checkpointer: a torchtune single-device checkpointer, e.g. ``FullModelTorchTuneCheckpointer``.
        state_dict (Dict[str, object]): what the recipe would pass to ``save_checkpoint``.
        epoch (int): the epoch being saved.
        **kwargs: passed on, e.g. ``intermediate_checkpoint`` and ``adapter_only``.

    Raises:
        TypeError: if the checkpointer has no ``_output_dir`` to redirect (not a torchtune
            single-device checkpointer); call its ``save_checkpoint`` directly instead.
    """
    output_dir = getattr(checkpointer, "_output_dir", None)
    if output_dir is None:
        raise TypeError(
            f"{type(checkpointer).__name__} has no _output_dir to stage into: use a torchtune "
            "FullModel*Checkpointer or call its save_checkpoint directly (not crash-safe)."
        )
    output_dir = Path(output_dir)
    partial = output_dir / _PARTIAL.format(epoch=epoch)
    complete = output_dir / _COMPLETE.format(epoch=epoch)
    shutil.rmtree(partial, ignore_errors=True)  # from a save killed before its commit
    partial.mkdir(parents=True)
    # torchtune 0.6.1's checkpointers build every output path from self._output_dir at
    # save time, so pointing it at the staging directory reproduces their exact layout
    # without copying their code.
    checkpointer._output_dir = partial
    try:
        checkpointer.save_checkpoint(state_dict, epoch=epoch, **kwargs)
    finally:
        checkpointer._output_dir = output_dir
    _fsync_tree(partial)
    os.replace(partial, complete)  # the commit point
    _fsync_path(output_dir)
    _publish(complete, output_dir)
    # torchtune's own lines name the staging folder; say where the files are now.
    utils.get_logger().info(
        f"Checkpoint of epoch {epoch} moved into place in {output_dir} (written first to "
        f"{partial.name}, named above, so that a kill mid-save keeps the previous one)."
    )
