"""LoRA and QLoRA fine-tuning on one device, with the optimizer state in host memory if you like.

Same config keys as torchtune's ``lora_finetune_single_device`` recipe, so its configs
carry over; set ``optimizer._component_: offload_plugin.CPUOffloadOptimizer`` to keep
the adapters' AdamW state off the GPU. QLoRA is a model builder with ``quantize_base=True``
(e.g. ``torchtune.models.llama3_2.qlora_llama3_2_1b``). Launch from anywhere::

    tune run offload_plugin/recipes/lora_finetune_single_device.py \\
        --config configs/llama3_2/1B_qlora_offload_single_device.yaml

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
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm  # a torchtune dependency; torchtune's recipes show the same bar

from offload_plugin import demo, recipe_utils

log = utils.get_logger("DEBUG")


class LoRAFinetuneRecipeSingleDevice(FTRecipeInterface):
    """LoRA/QLoRA/DoRA fine-tuning of a decoder on one device (CUDA or CPU).

    Features: bf16/fp32, gradient accumulation with loss normalized by token count,
    gradient clipping, activation checkpointing/offloading, any LR scheduler, and
    end-of-epoch checkpoints (adapter, merged model, optimizer and scheduler state)
    for exact resume, saved so that a kill mid-save keeps the previous one loadable.
    Scaling and clipping go through the optimizer when it is ``CPUOffloadOptimizer``
    (see ``offload_plugin.recipe_utils``).

    Args:
        cfg (Mapping): the parsed config.

    Raises:
        ValueError: for fp16 or ``gradient_accumulation_steps < 1``.
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
        self._save_adapter_weights_only = cfg.get("save_adapter_weights_only", False)

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
        self._model = self._setup_model(cfg.model, ckpt[training.MODEL_KEY], ckpt.get(training.ADAPTER_KEY))
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
            for k in (
                training.ADAPTER_KEY,
                training.OPT_KEY,
                training.SEED_KEY,
                training.EPOCHS_KEY,
                training.MAX_STEPS_KEY,
            )
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

    def _setup_model(
        self,
        cfg_model: Mapping,
        base_state_dict: Dict[str, Any],
        adapter_state_dict: Optional[Dict[str, Any]],
    ) -> torch.nn.Module:
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        self._lora_rank = cfg_model.lora_rank
        self._lora_alpha = cfg_model.lora_alpha
        self._lora_attn_modules = list(cfg_model.lora_attn_modules)
        self._apply_lora_to_mlp = cfg_model.get("apply_lora_to_mlp", False)
        self._apply_lora_to_output = cfg_model.get("apply_lora_to_output", False)
        adapter_params = get_adapter_params(model)
        set_trainable_params(model, adapter_params)
        if self._compile:
            training.compile_model(model)
        if self._act_ckpt:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})

        base_missing, base_unexpected = model.load_state_dict(base_state_dict, strict=False)
        # DoRA magnitudes are computed from the base weights, so only after these are loaded.
        for m in model.modules():
            if hasattr(m, "initialize_dora_magnitude"):
                m.initialize_dora_magnitude()
        lora_missing = lora_unexpected = None
        if adapter_state_dict is not None:
            lora_missing, lora_unexpected = model.load_state_dict(adapter_state_dict, strict=False)
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=self._lora_attn_modules,
            apply_lora_to_mlp=self._apply_lora_to_mlp,
            apply_lora_to_output=self._apply_lora_to_output,
            base_missing=base_missing,
            base_unexpected=base_unexpected,
            lora_missing=lora_missing,
            lora_unexpected=lora_unexpected,
        )
        training.validate_expected_param_dtype(adapter_params.items(), dtype=self._dtype)
        self._act_ctx = training.get_act_offloading_ctx_manager(model, self._act_offload)
        n_train = sum(p.numel() for p in adapter_params.values())
        n_params = sum(p.numel() for p in model.parameters())
        log.info(f"Model has {n_params / 1e6:.1f}M parameters, {n_train / 1e6:.2f}M trainable (adapters).")
        return model

    def _setup_optimizer(self, cfg_optimizer: Mapping, opt_state_dict: Optional[Dict[str, Any]]):
        optimizer = config.instantiate(cfg_optimizer, self._model.parameters())
        if opt_state_dict is not None:
            optimizer.load_state_dict(opt_state_dict)
        log.info(f"Optimizer {type(optimizer).__name__} is initialized.")
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
        return config.instantiate(
            cfg_lr_scheduler,
            self._optimizer,
            num_training_steps=self.total_epochs * self._steps_per_epoch,
            last_epoch=self.global_step - 1,
        )

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
        """Save the adapter and the merged model; before the last epoch also the training state."""
        recipe_utils.finish_step(self._optimizer)  # every weight updated on the device
        # To the CPU: merging on the GPU would need a second copy of the model there. QLoRA's
        # state-dict hook hands over its base weights as new bf16 tensors on the CPU already:
        # not copied again (16 GB more host memory at 8B). On a CPU device the entries are the
        # live weights, which the merge adds to in place: copied there.
        on_cpu = self._device.type == "cpu"
        state_dict = {k: v.to("cpu", copy=on_cpu) for k, v in self._model.state_dict().items()}
        ckpt = {
            training.ADAPTER_KEY: get_adapter_state_dict(state_dict),
            training.ADAPTER_CONFIG: {
                "r": self._lora_rank,
                "lora_alpha": self._lora_alpha,
                "target_modules": get_lora_module_names(
                    self._lora_attn_modules, self._apply_lora_to_mlp, self._apply_lora_to_output
                ),
                "peft_type": "LORA",
            },
        }
        if not self._save_adapter_weights_only:
            ckpt[training.MODEL_KEY] = get_merged_lora_ckpt(state_dict, rank=self._lora_rank, alpha=self._lora_alpha)
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
            self._checkpointer,
            ckpt,
            epoch=epoch,
            intermediate_checkpoint=intermediate,
            adapter_only=self._save_adapter_weights_only,
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
                    if (idx + 1) % self._grad_accum == 0:
                        # Last micro-batch: offloaded updates may start during its backward.
                        recipe_utils.overlap_last_backward(
                            self._optimizer, num_tokens + batch_tokens, self._clip_grad_norm,
                            early_forward=self._early_forward,
                        )
                    loss = self._loss_step(batch) * batch_tokens
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
                            "lr": training.get_lr(self._optimizer),
                            "tokens_per_second_per_gpu": num_tokens.item() / (time.perf_counter() - t0),
                            **{key: float(value) for key, value in step_metrics.items()},
                            **recipe_utils.optimizer_metrics(self._optimizer),
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
    config.log_config(recipe_name="LoRAFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = LoRAFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
