"""Full fine-tuning on one device, with the optimizer state in host memory if you like.

Same config keys as torchtune's ``full_finetune_single_device`` recipe, so its configs
carry over; set ``optimizer._component_: offload_plugin.CPUOffloadOptimizer`` to keep
the AdamW state (and, with ``offload_gradients: True``, the gradients) off the GPU.
Launch from anywhere::

    tune run offload_plugin/recipes/full_finetune_single_device.py \\
        --config configs/llama3_2/1B_full_offload_single_device.yaml

This file imports only torch, torchtune and offload_plugin: copy it and edit freely.
"""

import sys
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Dict, Optional
from warnings import warn

import torch
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm  # a torchtune dependency; torchtune's recipes show the same bar

from offload_plugin import demo, recipe_utils

log = utils.get_logger("DEBUG")


class FullFinetuneRecipeSingleDevice(FTRecipeInterface):
    """Full fine-tuning of a decoder on one device (CUDA or CPU).

    Features: bf16/fp32, gradient accumulation with loss normalized by token count,
    gradient clipping, activation checkpointing/offloading, any LR scheduler,
    ``optimizer_in_bwd`` (as torchtune's: one optimizer per parameter, stepped in its
    gradient's hook, each gradient freed there), and end-of-epoch checkpoints with
    optimizer and scheduler state for exact resume, saved so that a kill mid-save keeps
    the previous one loadable.
    Scaling and clipping go through the optimizer when it is ``CPUOffloadOptimizer``
    (see ``offload_plugin.recipe_utils``).

    Args:
        cfg (Mapping): the parsed config.

    Raises:
        ValueError: for fp16, ``gradient_accumulation_steps < 1``, or ``optimizer_in_bwd``
            with gradient accumulation, clipping or ``early_forward``.
        RuntimeError: for activation offloading without CUDA or without checkpointing.
    """

    def __init__(self, cfg: Mapping) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        if self._dtype == torch.float16:
            raise ValueError("fp16 is not supported (no loss scaling): set dtype=bf16 or dtype=fp32.")
        self._grad_accum = cfg.gradient_accumulation_steps
        if self._grad_accum < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {self._grad_accum}.")
        self._optimizer_in_bwd = cfg.get("optimizer_in_bwd", False)
        if self._optimizer_in_bwd and (
            self._grad_accum > 1 or cfg.get("clip_grad_norm") is not None or cfg.get("early_forward", False)
        ):
            raise ValueError(
                "optimizer_in_bwd=True updates each parameter as soon as its gradient is made, so it "
                "needs gradient_accumulation_steps=1, clip_grad_norm=null and early_forward=False; "
                "set optimizer_in_bwd=False for those (optimizer.offload_gradients=True then keeps "
                "the gradients off the GPU)."
            )
        self._act_ckpt = cfg.get("enable_activation_checkpointing", False)
        self._act_offload = cfg.get("enable_activation_offloading", False)
        if self._act_offload and (self._device.type != "cuda" or not self._act_ckpt):
            raise RuntimeError(
                "enable_activation_offloading needs device=cuda and enable_activation_checkpointing=True."
            )
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._log_every_n_steps = cfg.get("log_every_n_steps", 1)
        self._log_peak_memory = self._device.type == "cuda" and cfg.get("log_peak_memory_stats", True)
        self._resume = cfg.get("resume_from_checkpoint", False)

        # Public: updated from the checkpoint on resume.
        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0

    def setup(self, cfg: Mapping) -> None:
        """Build every component; on resume, restore model, optimizer and recipe state."""
        # A demo config without its files: name the command that writes them, before
        # torchtune's checkpointer fails with only `... is not a valid directory`.
        demo.check_prepared(cfg)
        self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)
        ckpt = self._setup_checkpointer(cfg.checkpointer)
        self._compile = cfg.get("compile", False)
        # Opt-in: step() returns before the offloaded update ends, the next forward waiting
        # per module for its weights. Not with compiled modules, whose graphs the forward
        # pre-hook would break: refused rather than ignored.
        self._early_forward = cfg.get("early_forward", False)
        if self._early_forward and self._compile:
            raise ValueError("early_forward=True does not combine with compile=True; set one to False.")
        self._model = self._setup_model(cfg.model, ckpt[training.MODEL_KEY])
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg.optimizer, ckpt.get(training.OPT_KEY))
        self._loss_fn = self._setup_loss(cfg.loss)
        self._dataloader = self._setup_data(
            cfg.dataset, cfg.shuffle, cfg.batch_size, cfg.get("collate_fn", "torchtune.data.padded_collate_sft")
        )
        self._steps_per_epoch = len(self._dataloader) // self._grad_accum
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        self.global_step = self.epochs_run * self._steps_per_epoch
        # After the optimizer state is loaded: the scheduler resumes from the step count.
        self._lr_scheduler = self._setup_lr_scheduler(cfg.get("lr_scheduler", None))
        self._profiler = self._setup_profiler(cfg.get("profiler", None))

    def _setup_checkpointer(self, cfg_checkpointer: Mapping) -> Dict[str, Any]:
        # A run killed while saving leaves a staged save behind: finish it if it was
        # complete, else drop it, so what we load below is one consistent epoch.
        recovered = recipe_utils.recover_checkpoints(cfg_checkpointer.output_dir)
        if recovered:
            log.info(f"Finished publishing the interrupted checkpoint save of epoch(s) {recovered}.")
        self._checkpointer = config.instantiate(cfg_checkpointer, should_load_recipe_state=self._resume)
        ckpt = self._checkpointer.load_checkpoint()
        if self._resume:
            self._update_recipe_state(ckpt)
        return ckpt

    def _update_recipe_state(self, ckpt: Dict[str, Any]) -> None:
        missing = [
            k
            for k in (training.OPT_KEY, training.SEED_KEY, training.EPOCHS_KEY, training.MAX_STEPS_KEY)
            if k not in ckpt
        ]
        if missing:
            raise KeyError(
                f"Checkpoint lacks {missing}: resume needs the recipe_state.pt of an intermediate "
                "checkpoint written by this recipe; set resume_from_checkpoint=False to start over."
            )
        for key, attr in ((training.SEED_KEY, "seed"), (training.MAX_STEPS_KEY, "max_steps_per_epoch")):
            if getattr(self, attr) != ckpt[key]:
                warn(f"Config {attr}={getattr(self, attr)} differs from the checkpoint; using {ckpt[key]}.")
                setattr(self, attr, ckpt[key])
        if self.total_epochs != ckpt.get(training.TOTAL_EPOCHS_KEY, self.total_epochs):
            warn(f"Config epochs={self.total_epochs} differs from the checkpoint; using the config.")
        self.epochs_run = ckpt[training.EPOCHS_KEY]

    def _setup_model(self, cfg_model: Mapping, model_state_dict: Dict[str, Any]) -> torch.nn.Module:
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        if self._compile:
            training.compile_model(model)
        if self._act_ckpt:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        model.load_state_dict(model_state_dict)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        self._act_ctx = training.get_act_offloading_ctx_manager(model, self._act_offload)
        n_params = sum(p.numel() for p in model.parameters())
        log.info(f"Model has {n_params / 1e6:.1f}M parameters, all trainable, in {self._dtype}.")
        return model

    def _setup_optimizer(self, cfg_optimizer: Mapping, opt_state_dict: Optional[Dict[str, Any]]):
        """The optimizer, or with ``optimizer_in_bwd`` torchtune's wrapper over one optimizer
        per parameter, each stepped in that parameter's gradient hook (torchtune's helpers;
        CPUOffloadOptimizer's instances share one set of streams and staging buffers)."""
        if self._optimizer_in_bwd:
            optim_dict = {p: config.instantiate(cfg_optimizer, [p]) for p in self._model.parameters()}
            training.register_optim_in_bwd_hooks(model=self._model, optim_dict=optim_dict)
            optimizer = training.create_optim_in_bwd_wrapper(model=self._model, optim_dict=optim_dict)
            self._optimizers = list(optim_dict.values())
        else:
            optimizer = config.instantiate(cfg_optimizer, self._model.parameters())
            self._optimizers = [optimizer]
        if opt_state_dict is not None:  # (saved with optimizer_in_bwd either way)
            optimizer.load_state_dict(
                recipe_utils.optimizer_state_for(self._model, opt_state_dict, self._optimizer_in_bwd)
            )
        log.info(f"Optimizer {type(self._optimizers[0]).__name__} is initialized"
                 + (", one per parameter, stepped in backward." if self._optimizer_in_bwd else "."))
        return optimizer

    def _setup_loss(self, cfg_loss: Mapping) -> torch.nn.Module:
        loss_fn = config.instantiate(cfg_loss)
        if self._compile:
            training.compile_loss(loss_fn)
        if hasattr(loss_fn, "num_output_chunks"):
            self._model.set_num_output_chunks(loss_fn.num_output_chunks)
        return loss_fn

    def _setup_lr_scheduler(self, cfg_lr_scheduler: Optional[Mapping]):
        if cfg_lr_scheduler is None:
            return None
        scheduler = config.instantiate(
            cfg_lr_scheduler,
            self._optimizers[0],
            num_training_steps=self.total_epochs * self._steps_per_epoch,
            last_epoch=self.global_step - 1,
        )
        if self._optimizer_in_bwd:
            # The wrapper's scheduler steps set every optimizer's lr to the first one's; so
            # does a resumed scheduler's first lr here.
            self._optimizer.set_lr_scheduler(scheduler)
            for optimizer in self._optimizers[1:]:
                for group in optimizer.param_groups:
                    group["lr"] = self._optimizers[0].param_groups[0]["lr"]
        return scheduler

    def _setup_profiler(self, cfg_profiler: Optional[Mapping]):
        if cfg_profiler is None or not cfg_profiler.get("enabled", False):
            return training.DummyProfiler()
        profiler, _ = config.instantiate(cfg_profiler)
        return profiler

    def _setup_data(self, cfg_dataset, shuffle: bool, batch_size: int, collate_fn: str) -> DataLoader:
        if isinstance(cfg_dataset, Sequence):
            ds = ConcatDataset([config.instantiate(c, self._tokenizer) for c in cfg_dataset])
            packed = getattr(ds, "packed", False)
        else:
            ds = config.instantiate(cfg_dataset, self._tokenizer)
            packed = cfg_dataset.get("packed", False)
        if "left_pad_sequence" in collate_fn:
            raise ValueError("left_pad_sequence is for inference: set collate_fn=torchtune.data.padded_collate_sft.")
        collate = _get_component_from_path(collate_fn)
        # set_epoch(epoch) before each epoch makes the order a function of (seed, epoch),
        # so a resumed run sees the same batches as an uninterrupted one.
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=shuffle, seed=self.seed)
        return DataLoader(
            ds,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=(
                padded_collate_packed
                if packed
                else partial(collate, padding_idx=self._tokenizer.pad_id, ignore_idx=self._loss_fn.ignore_index)
            ),
        )

    def save_checkpoint(self, epoch: int) -> None:
        """Save the model; before the last epoch also optimizer, scheduler and recipe state."""
        for optimizer in self._optimizers:  # every weight updated on the device
            recipe_utils.finish_step(optimizer)
        ckpt = {training.MODEL_KEY: self._model.state_dict()}
        intermediate = epoch + 1 < self.total_epochs
        if intermediate:
            ckpt.update(
                {
                    training.OPT_KEY: self._optimizer.state_dict(),
                    training.SEED_KEY: self.seed,
                    training.EPOCHS_KEY: self.epochs_run,
                    training.TOTAL_EPOCHS_KEY: self.total_epochs,
                    training.MAX_STEPS_KEY: self.max_steps_per_epoch,
                }
            )
        # Staged and published atomically: a kill mid-save keeps the previous checkpoint loadable.
        recipe_utils.save_checkpoint_atomically(
            self._checkpointer, ckpt, epoch=epoch, intermediate_checkpoint=intermediate
        )

    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.pop("labels")
        with self._act_ctx:
            logits = self._model(**batch)
        # Predict token t+1 at position t: shift labels left, pad the end with ignore_index.
        labels = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=self._loss_fn.ignore_index)
        if not isinstance(logits, list):
            labels, logits = labels.reshape(-1), logits.reshape(-1, logits.size(-1))
        return self._loss_fn(logits, labels)

    def _optimizer_step(self, num_tokens: torch.Tensor) -> Dict[str, float]:
        if self._optimizer_in_bwd:  # (the hooks stepped during backward)
            if self._lr_scheduler is not None:
                self._lr_scheduler.step()
            return {}
        # The loss was summed over tokens; normalize once for the whole accumulated step.
        recipe_utils.scale_grads(self._model, self._optimizer, 1 / num_tokens)
        metrics = {}
        if self._clip_grad_norm is not None:
            grad_norm = recipe_utils.clip_grad_norm(self._model, self._optimizer, float(self._clip_grad_norm))
            # Read when logged: an .item() here would hold the step until backward ends.
            metrics["grad_norm"] = grad_norm
        t0 = time.perf_counter()
        self._optimizer.step()
        metrics["optimizer_step_s"] = time.perf_counter() - t0
        self._optimizer.zero_grad(set_to_none=True)
        if self._lr_scheduler is not None:
            self._lr_scheduler.step()
        return metrics

    def _optimizer_metrics(self) -> Dict[str, float]:
        """What the optimizers report about themselves, summed (one per parameter with
        ``optimizer_in_bwd``)."""
        each = [recipe_utils.optimizer_metrics(optimizer) for optimizer in self._optimizers]
        return {key: sum(m[key] for m in each) for key in each[0]}

    def train(self) -> None:
        """Run the remaining epochs; checkpoint at the end of each."""
        t0, running_loss, num_tokens = time.perf_counter(), 0.0, 0
        with self._profiler as prof:
            for curr_epoch in range(self.epochs_run, self.total_epochs):
                self._dataloader.sampler.set_epoch(curr_epoch)
                pbar = tqdm(total=self._steps_per_epoch)
                for idx, batch in enumerate(self._dataloader):
                    if idx // self._grad_accum >= self._steps_per_epoch:
                        break
                    # Counted before the batch moves: a count on the host needs no wait for
                    # the GPU (overlap_last_backward reads it before the last backward).
                    batch_tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
                    utils.batch_to_device(batch, self._device)
                    if (idx + 1) % self._grad_accum == 0 and not self._optimizer_in_bwd:
                        # Last micro-batch: offloaded updates may start during its backward.
                        recipe_utils.overlap_last_backward(
                            self._optimizer, num_tokens + batch_tokens, self._clip_grad_norm,
                            early_forward=self._early_forward,
                        )
                    loss = self._loss_step(batch)
                    if self._optimizer_in_bwd:  # (no accumulation: the mean is the step's loss)
                        loss.backward()
                        loss = loss.detach() * batch_tokens
                    else:
                        loss = loss * batch_tokens
                        loss.backward()
                    running_loss, num_tokens = running_loss + loss.detach(), num_tokens + batch_tokens
                    prof.step()
                    if (idx + 1) % self._grad_accum != 0:
                        continue

                    step_metrics = self._optimizer_step(num_tokens)
                    self.global_step += 1
                    loss_to_log = (running_loss / num_tokens).item()
                    pbar.update(1)
                    pbar.set_description(f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_to_log}")
                    if self.global_step % self._log_every_n_steps == 0:
                        log_dict = {
                            "loss": loss_to_log,
                            "lr": training.get_lr(self._optimizers[0]),
                            "tokens_per_second_per_gpu": num_tokens.item() / (time.perf_counter() - t0),
                            **{key: float(value) for key, value in step_metrics.items()},
                            **self._optimizer_metrics(),
                        }
                        if self._log_peak_memory:
                            log_dict.update(training.get_memory_stats(device=self._device))
                        self._metric_logger.log_dict(log_dict, step=self.global_step)
                    t0, running_loss, num_tokens = time.perf_counter(), 0.0, 0
                pbar.close()
                self.epochs_run += 1
                self.save_checkpoint(epoch=curr_epoch)

    def cleanup(self) -> None:
        """Flush and close the metric logger."""
        self._metric_logger.close()


@config.parse
def recipe_main(cfg: Mapping) -> None:
    """Entry point: config from ``--config`` plus ``key=value`` overrides."""
    config.log_config(recipe_name="FullFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
