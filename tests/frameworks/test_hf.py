"""CPUOffloadOptimizer under HF Trainer, TRL SFTTrainer and a plain Accelerate loop, on the
CPU and offline: each run against the same run with the framework's own optimizer, every
parameter, loss and logged gradient norm bit for bit (accumulation 2, clipping at 0.5, cosine
schedule with warmup, weight decay 0.1, 6 steps)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")

import torch  # noqa: E402

from offload_plugin import CPUOffloadOptimizer  # noqa: E402
from offload_plugin.integrations.hf import trainer_optimizer  # noqa: E402

from .hf_support import (  # noqa: E402
    CLEARS, LR, MAX_GRAD_NORM, STEPS, WEIGHT_DECAY, train_accelerate, train_hf,
)


# What HF builds by default (optim="adamw_torch_fused"; weight_decay is set on its two groups).
ADAMW = {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": WEIGHT_DECAY, "fused": True}
ADAMW8BIT = {k: v for k, v in ADAMW.items() if k != "fused"}
MODES = {"default": {}, "offload-gradients": {"offload_gradients": True}}
HF_CASES = pytest.mark.parametrize(
    "update,mode", [(u, m) for u in ("adamw", "8bit") for m in MODES],
    ids=[f"{u}-{m}" for u in ("adamw", "8bit") for m in MODES])


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch, tmp_path):
    """Nothing from the Hub, no cache outside tmp_path."""
    from datasets import config as datasets_config
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # (read at import)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets_config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", home / "datasets")


def hf_optimizers(update, mode):
    """The dtype, the reference's optimizer_cls_and_kwargs (None: HF's default) and ours."""
    if update == "adamw":
        return torch.float32, None, (CPUOffloadOptimizer, {**ADAMW, **MODES[mode]})
    bnb = pytest.importorskip("bitsandbytes")
    ours = {**ADAMW8BIT, "optimizer_cls": "offload_plugin.AdamW8bit", **MODES[mode]}
    return torch.bfloat16, (bnb.optim.AdamW8bit, ADAMW8BIT), (CPUOffloadOptimizer, ours)


def assert_same_training(reference, ours):
    """Two (parameters, logs) pairs equal: every logged value, every parameter bit for bit."""
    (ref_params, ref_logs), (our_params, our_logs) = reference, ours
    assert len(ref_logs) == STEPS
    assert max(log["grad_norm"] for log in ref_logs) > MAX_GRAD_NORM, "clipping must clip"
    assert our_logs == ref_logs  # losses, grad norms, learning rates
    differ = [name for name, p in ref_params.items() if not torch.equal(p, our_params[name])]
    assert not differ, f"parameters differ: {differ}"


def groups(trainer):
    """Each param group's parameter shapes and hyperparameters."""
    keys = ("lr", "initial_lr", "betas", "eps", "weight_decay", "fused")
    return [([p.shape for p in g["params"]], [g.get(k) for k in keys]) for g in trainer.optimizer.param_groups]


@HF_CASES
def test_trainer_matches_its_own_optimizer(update, mode, tmp_path):
    """HF Trainer with (CPUOffloadOptimizer, kwargs) trains bit for bit as with its fused AdamW (8bit: bnb's AdamW8bit)."""
    dtype, ref_optimizer, ours = hf_optimizers(update, mode)
    ref_trainer, *reference = train_hf(tmp_path / "ref", ref_optimizer, dtype=dtype)
    trainer, *result = train_hf(tmp_path / "ours", ours, dtype=dtype)
    assert isinstance(trainer.optimizer.optimizer, CPUOffloadOptimizer)
    assert groups(trainer) == groups(ref_trainer) and len(groups(trainer)) == 2  # decay, no decay
    assert_same_training(reference, result)


@HF_CASES
def test_trainer_resumes_from_its_checkpoint(update, mode, tmp_path):
    """Stopped at step 3, resumed from HF's checkpoint by a new Trainer on other weights: the uninterrupted run's bits."""
    dtype, ref_optimizer, ours = hf_optimizers(update, mode)
    _, *reference = train_hf(tmp_path / "ref", ref_optimizer, dtype=dtype)
    train_hf(tmp_path / "ours", ours, dtype=dtype, stop_after=3)
    _, *resumed = train_hf(tmp_path / "ours", ours, dtype=dtype, resume=tmp_path / "ours" / "checkpoint-3",
                           model_seed=1)
    assert_same_training(reference, resumed)


@pytest.mark.parametrize("sft", [False, True], ids=["Trainer", "SFTTrainer"])
def test_trainer_optimizer_takes_the_arguments_hyperparameters(sft, tmp_path):
    """integrations.hf.trainer_optimizer(args): lr, betas and eps from the TrainingArguments,
    so that ours in one argument trains as the trainer's default optimizer."""
    if sft:
        pytest.importorskip("trl")
    _, *reference = train_hf(tmp_path / "ref", sft=sft)
    _, *result = train_hf(tmp_path / "ours", lambda args: trainer_optimizer(args, offload_gradients=True), sft=sft)
    assert_same_training(reference, result)


@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_in_backward_matches_its_own_optimizer_unclipped(accum, tmp_path):
    """trainer_optimizer(args, in_backward=True) with max_grad_norm=0: each parameter updated
    during backward (the last of each accumulation window), HF's default optimizer's bits,
    the logged gradient norms included; a resume from HF's checkpoint continues them."""
    unclipped = dict(max_grad_norm=0.0, gradient_accumulation_steps=accum)
    ours = lambda args: trainer_optimizer(args, in_backward=True)  # noqa: E731
    _, ref_params, ref_logs = train_hf(tmp_path / "ref", **unclipped)
    trainer, params, logs = train_hf(tmp_path / "ours", ours, **unclipped)
    assert type(trainer.optimizer.optimizer).__name__ == "OptimizerInBackward"
    assert logs == ref_logs and all(log["grad_norm"] > 0 for log in logs)
    assert all(torch.equal(p, params[name]) for name, p in ref_params.items())
    train_hf(tmp_path / "resumed", ours, stop_after=3, **unclipped)
    _, params, logs = train_hf(tmp_path / "resumed", ours, resume=tmp_path / "resumed" / "checkpoint-3",
                               model_seed=1, **unclipped)
    assert logs == ref_logs and all(torch.equal(p, params[name]) for name, p in ref_params.items())


def test_trainer_in_backward_refuses_clipping(tmp_path):
    """in_backward=True with HF's default clipping is refused when the optimizer is asked
    for, saying to set max_grad_norm=0."""
    with pytest.raises(ValueError, match="max_grad_norm=0"):
        train_hf(tmp_path / "ours", lambda args: trainer_optimizer(args, in_backward=True))


@pytest.mark.parametrize("mode", list(MODES))
def test_sft_trainer_matches_its_own_optimizer(mode, tmp_path):
    """TRL SFTTrainer (gradient checkpointing, bf16 autocast) with (CPUOffloadOptimizer, kwargs): its default's bits."""
    pytest.importorskip("trl")
    _, *reference = train_hf(tmp_path / "ref", sft=True)
    _, *result = train_hf(tmp_path / "ours", (CPUOffloadOptimizer, {**ADAMW, **MODES[mode]}), sft=True)
    assert_same_training(reference, result)


def adamw(parameters):
    return torch.optim.AdamW(parameters, **ADAMW)


def offload(mode):
    return lambda parameters: CPUOffloadOptimizer(parameters, **ADAMW, **MODES[mode])


@pytest.mark.parametrize("clear", list(CLEARS))
@pytest.mark.parametrize("mode", list(MODES))
def test_accelerate_loop_matches_torch_adamw(mode, clear):
    """A plain Accelerate loop, gradients cleared by the optimizer or the model: AdamW(fused=True)'s bits."""
    assert_same_training(train_accelerate(adamw, clear), train_accelerate(offload(mode), clear))


@pytest.mark.parametrize("mode", list(MODES))
def test_accelerate_save_state_load_state_resumes_exactly(mode, tmp_path):
    """save_state at step 3, load_state into a fresh model on other weights: the uninterrupted AdamW run's bits."""
    reference = train_accelerate(adamw)
    _, first = train_accelerate(offload(mode), state_dir=tmp_path, stop_after=3)
    our_params, rest = train_accelerate(offload(mode), state_dir=tmp_path, resume_after=3, model_seed=1)
    assert_same_training(reference, (our_params, first + rest))
