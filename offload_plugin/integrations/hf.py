"""Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``): the optimizer in one argument.

``Trainer`` builds a custom optimizer from ``optimizer_cls_and_kwargs`` with only the
kwargs given there: its own ``learning_rate``, ``adam_beta1``/``adam_beta2`` and
``adam_epsilon`` are not passed on (``weight_decay`` is, on its two param groups). So
``(CPUOffloadOptimizer, {})`` alone would train at torch's default lr of 1e-3.
:func:`trainer_optimizer` fills them in from the ``TrainingArguments``::

    from transformers import Trainer, TrainingArguments
    from offload_plugin.integrations.hf import trainer_optimizer

    args = TrainingArguments(output_dir="out", learning_rate=2e-5, max_grad_norm=1.0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      optimizer_cls_and_kwargs=trainer_optimizer(args, offload_gradients=True))

With these hyperparameters the default mode is bit for bit HF's default optimizer
(``adamw_torch_fused``), and ``optimizer_cls="offload_plugin.AdamW8bit"`` is
``bitsandbytes.optim.AdamW8bit`` (not HF's ``adamw_bnb_8bit``, which keeps embeddings in
32 bits). Checkpoints, resumes, clipping and the logged gradient norm are HF's own
(``tests/frameworks/test_hf.py``). This module imports nothing from transformers: it
reads the arguments' attributes.
"""

from __future__ import annotations

from typing import Any

from offload_plugin.optimizer import CPUOffloadOptimizer
from offload_plugin.optimizer_in_backward import OptimizerInBackward

__all__ = ["trainer_optimizer"]


def trainer_optimizer(args: Any, in_backward: bool = False, **options: Any) -> tuple[type, dict[str, Any]]:
    """``optimizer_cls_and_kwargs`` for ``Trainer``: CPUOffloadOptimizer with ``args``' Adam
    hyperparameters and our ``options``.

    Args:
        args: the ``TrainingArguments`` (or TRL's ``SFTConfig``) the trainer gets.
        in_backward: update each parameter during backward (``OptimizerInBackward``, the
            last backward of each of ``args.gradient_accumulation_steps``): gradients are
            freed as backward goes on and the update overlaps it. Needs
            ``max_grad_norm=0`` (HF still logs the norm).
        **options: CPUOffloadOptimizer's options (``offload_gradients``, ``optimizer_cls``,
            ...); a hyperparameter given here wins over ``args``'.

    Returns:
        tuple: ``(CPUOffloadOptimizer, kwargs)``, or ``(OptimizerInBackward, kwargs)``.

    Raises:
        ValueError: ``in_backward`` with ``args.max_grad_norm`` above 0.
    """
    kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if not in_backward:
        return CPUOffloadOptimizer, {**kwargs, **options}
    if args.max_grad_norm and args.max_grad_norm > 0:
        raise ValueError(
            f"trainer_optimizer(in_backward=True) with max_grad_norm={args.max_grad_norm}: each "
            "parameter is updated during backward, before the global norm a clip needs exists. "
            "Set max_grad_norm=0 in the TrainingArguments (the Trainer still logs the norm), or "
            "leave in_backward off to clip.")
    return OptimizerInBackward, {**kwargs, "accumulation_steps": args.gradient_accumulation_steps, **options}
