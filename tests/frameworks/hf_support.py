"""Shared pieces of the framework tests: a tiny Llama, token data, and one training run of
HF ``Trainer``, TRL ``SFTTrainer`` or a plain Accelerate loop, each returning what the tests
compare: every parameter and the per-step logs (losses, gradient norms, learning rates)."""

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from datasets import Dataset
from tokenizers import Tokenizer, models
from torch.utils.data import DataLoader
from transformers import (
    LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer, TrainerCallback,
    TrainingArguments, get_cosine_schedule_with_warmup,
)

LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-2, 0.1, 0.5
BATCH, ACCUM, STEPS, WARMUP = 2, 2, 6, 2  # 6 optimizer steps of 2 micro-batches of 2 sequences
VOCAB, SEQ = 128, 16
PAD, EOS = VOCAB - 2, VOCAB - 1  # the data never holds them


def tiny_llama(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).to(dtype)


def token_ids():
    """Exactly STEPS * ACCUM micro-batches of random token ids."""
    return torch.randint(0, PAD, (STEPS * ACCUM * BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def word_tokenizer():
    """A word-level tokenizer over the ids, built offline (SFTTrainer wants one for its padding)."""
    vocab = {f"t{i}": i for i in range(PAD)} | {"<pad>": PAD, "<eos>": EOS}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="<pad>", eos_token="<eos>")


def params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class _StopAfter(TrainerCallback):
    """Stops training after optimizer step ``step``, once the checkpoint of that step is saved."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def train_hf(output_dir, optimizer=None, *, dtype=torch.float32, sft=False, stop_after=None,
             resume=None, model_seed=0, **overrides):
    """One HF ``Trainer`` (or TRL ``SFTTrainer``, with SFTConfig's defaults: gradient
    checkpointing and bf16 autocast) run of STEPS steps, logging every step.

    ``optimizer`` is the trainer's ``optimizer_cls_and_kwargs`` (None: its default, torch's
    AdamW(fused=True)), or a function of the arguments that returns it. ``stop_after``: save a checkpoint after that step and stop there;
    ``resume``: a checkpoint folder to resume from. Returns the trainer, its parameters and
    the logs of its steps (those of the steps before ``resume`` come from the checkpoint)."""
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
        learning_rate=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
        lr_scheduler_type="cosine", warmup_steps=WARMUP, logging_steps=1,
        save_strategy="steps" if stop_after else "no", save_steps=stop_after or 1,
    ) | overrides
    ids = token_ids().tolist()
    if sft:
        from trl import SFTConfig, SFTTrainer
    args = SFTConfig(**settings) if sft else TrainingArguments(**settings)
    if callable(optimizer) and not isinstance(optimizer, tuple):
        optimizer = optimizer(args)  # (built from the arguments: integrations.hf.trainer_optimizer)
    common = dict(model=tiny_llama(dtype, model_seed), optimizer_cls_and_kwargs=optimizer,
                  callbacks=[_StopAfter(stop_after)] if stop_after else None)
    if sft:
        trainer = SFTTrainer(args=args, train_dataset=Dataset.from_dict({"input_ids": ids}),
                             processing_class=word_tokenizer(), **common)
    else:
        trainer = Trainer(args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}), **common)
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer, params(trainer.model), [log for log in trainer.state.log_history if "loss" in log]


# How the Accelerate loop clears gradients. Accelerate runs optimizer.zero_grad() only where
# the optimizer steps (its documented loop calls it every micro-batch); model.zero_grad() it
# does not gate, so the loop calls that after a step only.
CLEARS = {
    "optimizer.zero_grad": lambda accelerator, model, optimizer: optimizer.zero_grad(),
    "model.zero_grad": lambda accelerator, model, optimizer: accelerator.sync_gradients and model.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda accelerator, model, optimizer: (
        accelerator.sync_gradients and model.zero_grad(set_to_none=False)),
}


def train_accelerate(make_optimizer, clear="optimizer.zero_grad", state_dir=None, *, stop_after=None,
                     resume_after=None, model_seed=0):
    """A plain Accelerate loop on the CPU: accumulate, backward, clip when the gradients sync,
    step, cosine schedule with warmup, ``CLEARS[clear]``.

    ``make_optimizer(parameters)`` builds the optimizer. ``stop_after``: ``save_state`` into
    ``state_dir`` after that step and stop; ``resume_after``: ``load_state`` from it into the
    fresh model and optimizer and go on after that step. Returns the parameters and, per
    step, the micro-batch losses, the gradient norm and the learning rate."""
    AcceleratorState._reset_state(True)  # (a fresh Accelerator, as in a new process)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = tiny_llama(seed=model_seed)
    optimizer = make_optimizer(model.parameters())
    scheduler = get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, DataLoader(token_ids(), batch_size=BATCH), scheduler)
    if resume_after:
        accelerator.load_state(str(state_dir))
        loader = accelerator.skip_first_batches(loader, resume_after * ACCUM)
    logs, losses = [], []
    for ids in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            losses.append(loss.item())
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                logs.append({"losses": losses, "grad_norm": norm.item(), "learning_rate": scheduler.get_last_lr()})
                losses = []
            optimizer.step()
            scheduler.step()
            CLEARS[clear](accelerator, model, optimizer)
        if len(logs) == stop_after and accelerator.sync_gradients:
            accelerator.save_state(str(state_dir))
            break
    return params(model), logs
