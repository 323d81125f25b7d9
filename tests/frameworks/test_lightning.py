"""Lightning 2.6: a LightningModule whose ``configure_optimizers`` returns CPUOffloadOptimizer
trains bit for bit as the same module returning the reference optimizer.

Lightning drives an automatic-optimization optimizer through ``optimizer.step(closure)``: the
closure runs ``training_step``, ``zero_grad()`` (set_to_none=True, first micro-batch of each
accumulation window only), backward, ``on_before_optimizer_step`` and then
``torch.nn.utils.clip_grad_norm_`` over the parameters in the optimizer's param groups
(``gradient_clip_val``); ``grad_norm(module)`` in ``on_before_optimizer_step`` reads each
``p.grad``. Its checkpoint holds ``optimizer.state_dict()``; ``fit(ckpt_path=...)`` loads it
into the optimizer a fresh ``configure_optimizers`` built and then moves every state tensor
to the module's device (``_optimizer_to_device``: a GPU's, on one).
"""

from functools import partial

import pytest

L = pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from offload_plugin import CPUOffloadOptimizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings(  # Lightning's advice, not about the optimizer
    "ignore:.*does not have many workers",
    "ignore:Be aware that when using `ckpt_path`, callbacks",
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
)

VOCAB, DIM, HIDDEN, SEQ, BATCH = 64, 32, 128, 8, 4
ACCUM, CLIP = 2, 0.5
STEPS_PER_EPOCH = 2  # optimizer steps: an epoch is STEPS_PER_EPOCH * ACCUM batches
STEPS = 3 * STEPS_PER_EPOCH
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
# mode: (our options, Lightning precision). The reference for each is _reference(mode).
MODES = {
    "default": ({}, "32-true"),
    "offload_gradients": ({"offload_gradients": True}, "32-true"),
    # bf16-true converts the module to bf16 before configure_optimizers runs.
    "adamw8bit": ({"optimizer_cls": "offload_plugin.AdamW8bit"}, "bf16-true"),
}


def _reference(mode):
    """The optimizer our mode computes bit for bit: torch's fused AdamW, or bitsandbytes'."""
    if mode == "adamw8bit":
        bnb = pytest.importorskip("bitsandbytes")
        return lambda params: bnb.optim.AdamW8bit(params, **HYPER)
    return lambda params: torch.optim.AdamW(params, fused=True, **HYPER)


def _ours(mode):
    return lambda params: CPUOffloadOptimizer(params, **MODES[mode][0], **HYPER)


class TinyLM(L.LightningModule):
    """A next-token MLP: embedding, hidden layer, vocabulary projection (8-bit and 32-bit
    bitsandbytes state: the 64x128 and 128x64 weights have 8192 elements, the rest fewer than 4096)."""

    def __init__(self, make_optimizer, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Embedding(VOCAB, DIM), nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, VOCAB),
        )
        self.make_optimizer = make_optimizer
        self.losses, self.norms = [], []

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self.net(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.losses.append(loss.detach().clone())
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Lightning's documented way to log gradient norms: after backward, before clipping.
        norms = grad_norm(self, norm_type=2)
        self.norms.append(norms.get("grad_2.0_norm_total", torch.tensor(0.0)))

    def configure_optimizers(self):
        optimizer = self.make_optimizer(self.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.7**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (STEPS_PER_EPOCH * ACCUM * BATCH, SEQ), generator=g)
    return DataLoader(TensorDataset(tokens, (tokens * 5 + 3) % VOCAB), batch_size=BATCH, shuffle=False)


def _fit(make_optimizer, root, mode, *, steps=STEPS, seed=0, ckpt_path=None, callbacks=(), device="cpu"):
    """Train a fresh TinyLM with Lightning's Trainer; returns the module."""
    module = TinyLM(make_optimizer, seed)
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=steps, accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP, precision=MODES[mode][1], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks), default_root_dir=root,
    )
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    assert trainer.global_step == steps
    return module


def _assert_same_training(expected, actual, first_step=0):
    """Every parameter bitwise equal, and the losses and gradient norms from ``first_step`` on."""
    named = dict(actual.named_parameters())
    for name, p in expected.named_parameters():
        same = torch.equal(p, named[name])
        assert same, f"{name} differs by up to {(p - named[name]).abs().max():.3g}"
    assert torch.equal(torch.stack(expected.losses[first_step * ACCUM:]), torch.stack(actual.losses))
    assert torch.equal(torch.stack(expected.norms[first_step:]), torch.stack(actual.norms))


@pytest.mark.parametrize("mode", list(MODES))
def test_trains_like_the_reference_optimizer(mode, tmp_path):
    """Lightning's closure, accumulation, clipping over the param groups and a per-step LR
    scheduler: every parameter bitwise what the reference optimizer gives."""
    reference = _fit(_reference(mode), tmp_path / "reference", mode)
    ours = _fit(_ours(mode), tmp_path / "ours", mode)
    assert max(reference.norms) > CLIP, "clipping must have clipped in this test"
    _assert_same_training(reference, ours)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["default", "offload_gradients"])
def test_resumes_from_lightning_checkpoint(mode, device, tmp_path):
    """Stopped after an epoch and resumed with fit(ckpt_path=...) from ModelCheckpoint's file
    into a fresh module of other initial weights: the uninterrupted run's weights and losses
    (on a GPU Lightning moves the loaded state to it, _optimizer_to_device, before training on)."""
    fit = partial(_fit, _ours(mode), mode=mode, device=device)
    uninterrupted = fit(tmp_path / "full")
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1)
    fit(tmp_path / "first", steps=STEPS_PER_EPOCH, callbacks=[saver])
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    state = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    assert {"exp_avg", "exp_avg_sq"} <= state[0].keys()  # torch's layout, saved by Lightning

    resumed = fit(tmp_path / "resumed", seed=1, ckpt_path=checkpoint)
    _assert_same_training(uninterrupted, resumed, first_step=STEPS_PER_EPOCH)
