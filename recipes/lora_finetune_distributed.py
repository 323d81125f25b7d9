"""LoRA fine-tuning on several devices with FSDP2, with the adapters' optimizer state in host memory if you like.

Same config keys as torchtune's ``lora_finetune_distributed`` recipe, so its configs carry
over; set ``optimizer._component_: offload_plugin.CPUOffloadOptimizer`` to keep each rank's
AdamW state (for its shard of the adapters) off the GPU. Launch from anywhere::

    tune run --nproc_per_node 2 offload_plugin/recipes/lora_finetune_distributed.py \\
        --config configs/llama3_1/8B_lora_offload_distributed.yaml

``device=cpu`` trains on CPU processes over gloo. Launched without torchrun (plain
``tune run`` or ``python``) the recipe runs as a world of one process.

This file imports only torch, torchtune and offload_plugin: copy it and edit freely.
"""

import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Dict, Optional
from warnings import warn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.modules.peft import (
    DoRALinear,
    LoRALinear,
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)
from torchtune.recipe_interfaces import FTRecipeInterface
from torchao.dtypes.nf4tensor import NF4Tensor
from tqdm import tqdm  # a torchtune dependency; torchtune's recipes show the same bar

from offload_plugin import demo, recipe_utils

log = utils.get_logger("DEBUG")


class LoRAFinetuneRecipeDistributed(FTRecipeInterface):
    """LoRA/QLoRA/DoRA fine-tuning of a decoder sharded with FSDP2 over all ranks (CUDA/nccl or CPU/gloo).

    Features: bf16/fp32, FSDP2 sharding per transformer layer (``custom_sharded_layers``,
    ``fsdp_reshard_after_forward``, ``fsdp_cpu_offload``), gradient accumulation with the
    loss normalized by the token count of all ranks, gradient clipping, activation
    checkpointing/offloading, any LR scheduler, and end-of-epoch checkpoints (adapter,
    merged model, optimizer and scheduler state) for exact resume, written by rank 0 so that
    a kill mid-save keeps the previous one loadable. New adapters are initialized from the
    seed alone, so a run starts alike on any number of ranks. Scaling and clipping go
    through the optimizer when it is ``CPUOffloadOptimizer`` (see ``offload_plugin.recipe_utils``).

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
        self._fsdp_cpu_offload = cfg.get("fsdp_cpu_offload", False)
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._log_every_n_steps = cfg.get("log_every_n_steps", 1)
        self._log_peak_memory = self._device.type == "cuda" and cfg.get("log_peak_memory_stats", True)
        self._resume = cfg.get("resume_from_checkpoint", False)
        self._save_adapter_weights_only = cfg.get("save_adapter_weights_only", False)

        _init_process_group(self._device)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0

        # Public: updated from the checkpoint on resume. set_seed seeds each rank with
        # seed + rank (dropout differs per rank) and returns the shared seed, which the
        # sampler and the adapter initialization use so that all ranks agree.
        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0

    def setup(self, cfg: Mapping) -> None:
        """Build every component; on resume, restore adapters, optimizer and recipe state."""
        # A demo config without its files: name the command that writes them, before
        # torchtune's checkpointer fails with only `... is not a valid directory`.
        demo.check_prepared(cfg)
        if self._is_rank_zero:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)
        ckpt = self._setup_checkpointer(cfg.checkpointer)
        self._compile = cfg.get("compile", False)
        self._model = self._setup_model(
            cfg.model,
            ckpt[training.MODEL_KEY],
            ckpt.get(training.ADAPTER_KEY),
            custom_sharded_layers=cfg.get("custom_sharded_layers", None),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
        )
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
        # A run killed while saving leaves a staged save behind: rank 0 (the only writer)
        # finishes it if it was complete, else drops it, before any rank reads output_dir.
        if self._is_rank_zero:
            recovered = recipe_utils.recover_checkpoints(cfg_checkpointer.output_dir)
            if recovered:
                log.info(f"Finished publishing the interrupted checkpoint save of epoch(s) {recovered}.")
        dist.barrier()
        # Every rank reads the full checkpoint (torchtune's checkpointers memory-map what they
        # can) and keeps only its own shards of it below.
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
        custom_sharded_layers: Optional[Sequence[str]],
        reshard_after_forward: bool,
    ) -> torch.nn.Module:
        # On the meta device no rank allocates the full model; each gets real memory only
        # for its own shards when the weights are loaded.
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg_model)
        self._lora_rank = cfg_model.lora_rank
        self._lora_alpha = cfg_model.lora_alpha
        self._lora_attn_modules = list(cfg_model.lora_attn_modules)
        self._apply_lora_to_mlp = cfg_model.get("apply_lora_to_mlp", False)
        self._apply_lora_to_output = cfg_model.get("apply_lora_to_output", False)
        fresh_adapters = adapter_state_dict is None
        if fresh_adapters:
            # Before checkpoint wrappers rename the modules: keys as in the state dict.
            adapter_state_dict = self._initial_adapter_state_dict(model)
        quantized = any(isinstance(p, NF4Tensor) for p in model.parameters())
        if quantized and self.world_size == 1:
            # FSDP2 over a single rank fails on NF4 weights (torch 2.13, torchao 0.15).
            raise ValueError(
                "QLoRA (NF4 base weights) with this recipe needs 2 or more ranks "
                "(tune run --nproc_per_node N ...); on one GPU use "
                "offload_plugin/recipes/lora_finetune_single_device.py with a QLoRA config."
            )
        if quantized:
            # QLoRA: torchtune's loader of full weights into meta-device NF4 shards breaks
            # FSDP2's NF4 all-gather with this torch (see README). Instead each rank builds
            # the model whole on its device (NF4 keeps that small: ~6 GB for 8B), loads the
            # weights, and fully_shard splits the real tensors, which FSDP2 handles for NF4.
            with training.set_default_dtype(self._dtype), self._device:
                model = config.instantiate(cfg_model)
            lora_missing, lora_unexpected = model.load_state_dict(adapter_state_dict, strict=False)
            base_missing, base_unexpected = model.load_state_dict(base_state_dict, strict=False)
        set_trainable_params(model, get_adapter_params(model))
        if self._compile:
            training.compile_model(model, verbose=self._is_rank_zero)
        if self._act_ckpt:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        # One FSDP unit per transformer layer (plus custom_sharded_layers, e.g. a large
        # embedding): only one layer's full weights exist at a time in forward and backward.
        training.shard_model(
            model=model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=custom_sharded_layers)],
            cpu_offload=self._fsdp_cpu_offload,
            reshard_after_forward=reshard_after_forward,
        )
        if not quantized:
            with training.set_default_dtype(self._dtype), self._device:
                for m in model.modules():
                    if isinstance(m, (LoRALinear, DoRALinear)):
                        # Memory for the adapter shards (and DoRA magnitudes); values come below.
                        m.to_empty(device="cpu" if self._fsdp_cpu_offload else self._device)
                    if hasattr(m, "rope_init"):  # RoPE caches are buffers outside the state dict
                        m.rope_init()
            lora_missing, lora_unexpected = training.load_from_full_model_state_dict(
                model, adapter_state_dict, self._device, cpu_offload=self._fsdp_cpu_offload
            )
            base_missing, base_unexpected = training.load_from_full_model_state_dict(
                model, base_state_dict, self._device, cpu_offload=self._fsdp_cpu_offload
            )
        if fresh_adapters:
            # DoRA magnitudes start as the norms of the base weights (plus the zero adapter
            # update), so only now; a resumed run has its trained ones from the checkpoint.
            for m in model.modules():
                if hasattr(m, "initialize_dora_magnitude"):
                    m.initialize_dora_magnitude()
            lora_missing = lora_unexpected = None  # the fresh adapters have no magnitudes to miss
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=self._lora_attn_modules,
            apply_lora_to_mlp=self._apply_lora_to_mlp,
            apply_lora_to_output=self._apply_lora_to_output,
            base_missing=base_missing,
            base_unexpected=base_unexpected,
            lora_missing=lora_missing,
            lora_unexpected=lora_unexpected,
        )
        training.validate_no_params_on_meta_device(model)
        adapter_params = get_adapter_params(model)
        training.validate_expected_param_dtype(adapter_params.items(), dtype=self._dtype)
        self._act_ctx = training.get_act_offloading_ctx_manager(model, self._act_offload)
        n_train = sum(p.numel() for p in adapter_params.values())  # DTensor.numel() is the global size
        n_params = sum(p.numel() for p in model.parameters())
        utils.log_rank_zero(
            log,
            f"Model has {n_params / 1e6:.1f}M parameters, {n_train / 1e6:.2f}M trainable (adapters), "
            f"sharded over {self.world_size} rank(s).",
        )
        dist.barrier()
        return model

    def _initial_adapter_state_dict(self, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """Full-size initial adapter weights drawn from the run's seed, the same on every rank.

        torchtune's distributed recipe initializes each rank's shard from that rank's RNG,
        so the adapters, and the whole run, change with the number of GPUs. These are
        loaded like a checkpoint instead: the same seed starts from the same adapters on
        1, 2 or 8 ranks. The adapters are small (rank x dim), so building them whole is cheap.
        """
        generator = torch.Generator().manual_seed(self.seed)
        state_dict = {}
        for name, m in model.named_modules():
            if isinstance(m, (LoRALinear, DoRALinear)):
                lora_a = torch.empty(m.lora_a.weight.shape, dtype=self._dtype)
                # torchtune's LoRA initialization: Kaiming-uniform A and zero B, so the
                # adapted model starts as the base model.
                torch.nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
                state_dict[f"{name}.lora_a.weight"] = lora_a
                state_dict[f"{name}.lora_b.weight"] = torch.zeros(m.lora_b.weight.shape, dtype=self._dtype)
        return state_dict

    def _setup_optimizer(self, cfg_optimizer: Mapping, opt_state_dict: Optional[Dict[str, Any]]):
        # model.parameters() are FSDP2's DTensor shards, frozen base weights included (as
        # torchtune passes them); each rank optimizes its own shards of the adapters.
        optimizer = config.instantiate(cfg_optimizer, self._model.parameters())
        if opt_state_dict is not None:
            # The checkpoint holds the full (gathered) state, keyed by parameter name; every
            # rank has read it and keeps the slices of its own shards.
            training.load_from_full_optimizer_state_dict(self._model, optimizer, opt_state_dict, self._device)
        utils.log_rank_zero(log, f"Optimizer {type(optimizer).__name__} is initialized.")
        return optimizer

    def _setup_loss(self, cfg_loss: Mapping) -> torch.nn.Module:
        loss_fn = config.instantiate(cfg_loss)
        if self._compile:
            training.compile_loss(loss_fn, verbose=self._is_rank_zero)
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
        # One permutation per (seed, epoch), dealt round-robin to the ranks: step k of all
        # ranks together sees the examples one process with batch_size * world_size would,
        # and a resumed run sees the same batches as an uninterrupted one.
        sampler = DistributedSampler(ds, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=self.seed)
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
        """Save the adapter and the merged model; before the last epoch also the training state.

        Every rank takes part in gathering the full state dicts; rank 0 receives them on the
        host, merges and writes them, staged and published atomically.
        """
        intermediate = epoch + 1 < self.total_epochs
        # Full tensors on rank 0's host, NF4 base weights dequantized.
        state_dict = training.gather_cpu_state_dict(
            self._model,
            self._is_rank_zero,
            device=self._device,
            adapter_weights_only=self._save_adapter_weights_only,
        )
        opt_state = None
        if intermediate:
            opt_state = training.get_full_optimizer_state_dict(
                self._model, self._optimizer, self._is_rank_zero, device=self._device
            )
        if self._is_rank_zero:
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
                ckpt[training.MODEL_KEY] = get_merged_lora_ckpt(
                    self._copy_live_tensors(state_dict), rank=self._lora_rank, alpha=self._lora_alpha
                )
            if intermediate:
                ckpt.update(
                    {
                        training.OPT_KEY: opt_state,
                        training.SEED_KEY: self.seed,
                        training.EPOCHS_KEY: self.epochs_run,
                        training.TOTAL_EPOCHS_KEY: self.total_epochs,
                        training.MAX_STEPS_KEY: self.max_steps_per_epoch,
                    }
                )
            recipe_utils.save_checkpoint_atomically(
                self._checkpointer,
                ckpt,
                epoch=epoch,
                intermediate_checkpoint=intermediate,
                adapter_only=self._save_adapter_weights_only,
            )
        # No rank trains on, or exits, before the checkpoint is on disk.
        dist.barrier()

    def _copy_live_tensors(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The state dict with copies of the tensors that are the model's own memory.

        With one rank on CPU, ``gather_cpu_state_dict`` has nothing to gather or move and
        hands back the live weights; ``get_merged_lora_ckpt`` adds the adapters into the
        base weights in place, which would change the model being trained. With more ranks
        or a GPU the gathered tensors are new, and nothing is copied.
        """
        shards = (p.to_local() if isinstance(p, DTensor) else p for p in self._model.parameters())
        # Plain tensors only: an NF4 base weight is gathered into a new dequantized tensor.
        live = {t.untyped_storage().data_ptr() for t in shards if type(t) in (torch.Tensor, torch.nn.Parameter)}
        return {
            k: v.clone() if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in live else v
            for k, v in state_dict.items()
        }

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
        # Each rank's loss was summed over its own tokens and FSDP2's reduce-scatter averaged
        # the gradients over ranks: world_size / num_tokens (all ranks' tokens) turns that
        # into the gradient of the mean over every token of the step, as on one device.
        recipe_utils.scale_grads(self._model, self._optimizer, self.world_size / num_tokens)
        metrics = {}
        if self._clip_grad_norm is not None:
            grad_norm = recipe_utils.clip_grad_norm(self._model, self._optimizer, float(self._clip_grad_norm))
            if isinstance(grad_norm, DTensor):  # torch's clip over FSDP2 gradients: the global norm, replicated
                grad_norm = grad_norm.full_tensor()
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
                pbar = tqdm(total=self._steps_per_epoch, disable=not self._is_rank_zero)
                for idx, batch in enumerate(self._dataloader):
                    if idx // self._grad_accum >= self._steps_per_epoch:
                        break
                    utils.batch_to_device(batch, self._device)
                    batch_tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
                    num_tokens = num_tokens + batch_tokens
                    last_micro_batch = (idx + 1) % self._grad_accum == 0
                    if last_micro_batch:
                        # The step's token count over all ranks, before the last backward:
                        # offloaded updates that start during it need their scale now.
                        dist.all_reduce(num_tokens)
                        # overlap_last_backward applies 1 / its argument; this makes it the
                        # world_size / num_tokens of _optimizer_step.
                        recipe_utils.overlap_last_backward(
                            self._optimizer, num_tokens / self.world_size, self._clip_grad_norm
                        )
                    loss = self._loss_step(batch) * batch_tokens
                    loss.backward()
                    running_loss = running_loss + loss.detach()
                    prof.step()
                    if not last_micro_batch:
                        continue

                    step_metrics = self._optimizer_step(num_tokens)
                    self.global_step += 1
                    dist.all_reduce(running_loss)  # the logged loss covers every rank's tokens
                    loss_to_log = (running_loss / num_tokens).item()
                    pbar.update(1)
                    pbar.set_description(f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_to_log}")
                    if self._is_rank_zero and self.global_step % self._log_every_n_steps == 0:
                        log_dict = {
                            "loss": loss_to_log,
                            "lr": training.get_lr(self._optimizer),
                            "tokens_per_second_per_gpu": num_tokens.item()
                            / ((time.perf_counter() - t0) * self.world_size),
                            **{key: float(value) for key, value in step_metrics.items()},
                            **recipe_utils.optimizer_metrics(self._optimizer),  # rank 0's share
                        }
                        if self._log_peak_memory:
                            log_dict.update(training.get_memory_stats(device=self._device))
                        self._metric_logger.log_dict(log_dict, step=self.global_step)
                    t0, running_loss, num_tokens = time.perf_counter(), 0.0, 0
                pbar.close()
                self.epochs_run += 1
                self.save_checkpoint(epoch=curr_epoch)

    def cleanup(self) -> None:
        """Close the metric logger and leave the process group."""
        if self._is_rank_zero:
            self._metric_logger.close()
        dist.destroy_process_group()


def _init_process_group(device: torch.device) -> None:
    """Join the launcher's process group, or form a world of one without a launcher."""
    backend = training.get_distributed_backend(device.type)
    if device.type != "cpu":
        # Also a gloo group for tensors on the host: an optimizer keeping its state there
        # gathers it (checkpoints) and reduces host gradient norms through it; NCCL cannot.
        backend = f"{device.type}:{backend},cpu:gloo"
    if "WORLD_SIZE" in os.environ:  # torchrun (tune run --nproc_per_node N), srun, ...
        dist.init_process_group(backend)
    else:
        # Plain `tune run` or `python`: no rendezvous to join, so an in-process store.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@config.parse
def recipe_main(cfg: Mapping) -> None:
    """Entry point: config from ``--config`` plus ``key=value`` overrides."""
    config.log_config(recipe_name="LoRAFinetuneRecipeDistributed", cfg=cfg)
    recipe = LoRAFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
