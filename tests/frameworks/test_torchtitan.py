"""torchtitan 0.3.0: ``OffloadOptimizersContainer`` (offload_plugin.integrations.torchtitan)
against torchtitan's own ``OptimizersContainer``, driven as torchtitan's ``Trainer.train_step``
drives it.

Each step, as torchtitan's: ``zero_grad(set_to_none=training.disable_cuda_graphs)`` (False by
default), forward and backward of each micro-batch with the loss summed over tokens and
divided by the step's token count, ``dist_utils.clip_grad_norm_`` over every model part's
parameters (``foreach=True``), ``optimizers.step()``, ``lr_schedulers.step()`` (the warmup and
linear decay of ``LRSchedulersContainer``). The model stands in for a two-stage pipeline (two
model parts, one optimizer each, the whole model's FQNs) with two param groups (no weight
decay on norms and biases). torchtitan's debug llama needs triton, which a CPU-only torch
lacks, so the model is a small decoder of our own. Resuming goes through torchtitan's
``CheckpointManager``: DCP files of the containers' flat, FQN-keyed state dicts.
"""

from functools import partial

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import (  # noqa: E402
    LRSchedulersContainer, OptimizersContainer, ParamGroupConfig,
)
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.cudagraph import cudagraph_teardown, wrap_with_cuda_graph  # noqa: E402

from offload_plugin import CPUOffloadOptimizer  # noqa: E402
from offload_plugin.integrations.torchtitan import OffloadOptimizersContainer, offload_optimizers  # noqa: E402

pytestmark = pytest.mark.filterwarnings(  # DCP in one process; torchtitan's scheduler load
    "ignore:torch.distributed is disabled, unavailable or uninitialized",
    "ignore:To get the last learning rate computed by the scheduler",
)

VOCAB, DIM, HIDDEN, SEQ, BATCH = 64, 32, 128, 8, 4
STEPS, SAVED_AT, ACCUM, MAX_NORM = 6, 3, 2, 0.5
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SCHEDULE = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1)

# mode: (our container's options, or None for torchtitan's own container; the optimizer's
# name in torchtitan's config; the parameters' dtype).
MODES = {
    "torchtitan": (None, "AdamW", torch.float32),
    "default": ({}, "AdamW", torch.float32),
    "offload_gradients": ({"offload_gradients": True}, "AdamW", torch.float32),
    # Our name for bitsandbytes' AdamW8bit (torchtitan has none): 8-bit state for the 32x128
    # and 128x32 weights, nested in its state dict.
    "adamw8bit": ({}, "AdamW8bit", torch.bfloat16),
}
EXACT = ["default", "offload_gradients"]  # bit for bit torchtitan's own AdamW container
# zero_grad(set_to_none=...): False is torchtitan's default (CUDA graphs on), True with
# training.disable_cuda_graphs.
SET_TO_NONE = pytest.mark.parametrize("set_to_none", [False, True], ids=["keep-grads", "grads-to-none"])
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, h):
        return h + self.w2(nn.functional.gelu(self.w1(h)))


class Stage(nn.Module):
    """A pipeline stage of a small decoder, keeping the whole model's FQNs as torchtitan's
    stages do (the layers it lacks are absent, its missing ends None)."""

    def __init__(self, layer_ids, first, last):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM) if first else None
        self.layers = nn.ModuleDict({str(i): Block() for i in layer_ids})
        self.norm = nn.RMSNorm(DIM) if last else None
        self.output = nn.Linear(DIM, VOCAB, bias=False) if last else None

    def forward(self, h):
        h = self.tok_embeddings(h) if self.tok_embeddings is not None else h
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def _model_parts(seed, mode="default"):
    torch.manual_seed(seed)
    parts = [Stage([0], first=True, last=False), Stage([1], first=False, last=True)]
    return [part.to(MODES[mode][2]) for part in parts]


def _optimizer_config(mode):
    """torchtitan's config (implementation "fused"), ours made from it for our modes."""
    options, name, _ = MODES[mode]
    config = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm|bias", optimizer_name=name, optimizer_kwargs={**HYPER, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=HYPER),
    ])
    return config if options is None else offload_optimizers(config, **options)


def _batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, (tokens * 5 + 3) % VOCAB


def _forward_backward(parts, tokens, labels, valid_tokens, extra_kwargs):
    """torchtitan's Trainer._forward_backward_body (what its CUDA graph captures)."""
    h = tokens
    for part in parts:
        h = part(h)
    loss = nn.functional.cross_entropy(h.flatten(0, 1), labels.flatten(), reduction="sum") / valid_tokens
    loss.backward()
    return loss


def _train_step(parts, optimizers, schedulers, step, set_to_none, forward_backward):
    """torchtitan's Trainer.train_step without parallelism; returns the losses and the norm."""
    optimizers.zero_grad(set_to_none=set_to_none)
    device = next(parts[0].parameters()).device
    batches = [[t.to(device) for t in _batch(step, micro)] for micro in range(ACCUM)]
    valid_tokens = torch.tensor(sum(labels.numel() for _, labels in batches), device=device)
    # (.clone(): a CUDA graph's loss is overwritten by its next replay, as torchtitan notes)
    losses = [forward_backward(tokens, labels, valid_tokens, {}).detach().clone() for tokens, labels in batches]
    norm = dist_utils.clip_grad_norm_(
        [p for m in parts for p in m.parameters()], MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False)
    optimizers.step()
    schedulers.step()
    return losses + [norm]


def _train(mode, set_to_none, *, folder=None, seed=0, start=0, stop=STEPS, device="cpu", cuda_graphs=False):
    """Build model parts, optimizers, schedulers (and with ``folder`` torchtitan's checkpointer,
    which loads the latest checkpoint there when ``start``), train steps ``start+1..stop``
    (forward and backward in torchtitan's CUDA graph with ``cuda_graphs``); returns the parts,
    the container and each step's losses and gradient norm."""
    parts = [part.to(device) for part in _model_parts(seed, mode)]
    optimizers = _optimizer_config(mode).build(model_parts=parts)
    schedulers = SCHEDULE.build(optimizers=optimizers, training_steps=STEPS)
    checkpointer = None
    if folder is not None:
        checkpointer = CheckpointManager.Config(
            enable=True, interval=SAVED_AT, keep_latest_k=0, exclude_from_loading=["dataloader"],
        ).build(dataloader=None, model_parts=parts, optimizers=optimizers, lr_schedulers=schedulers,
                states={}, sd_adapter=None, base_folder=str(folder))
        if start:
            assert checkpointer.load(), "no checkpoint found"
    forward_backward = partial(_forward_backward, parts)
    if cuda_graphs:
        forward_backward = wrap_with_cuda_graph(forward_backward)
    record = []
    try:
        for step in range(start + 1, stop + 1):
            record.append(_train_step(parts, optimizers, schedulers, step, set_to_none, forward_backward))
            if checkpointer is not None:
                checkpointer.save(step, last_step=step == STEPS)
    finally:
        if cuda_graphs:
            cudagraph_teardown()
    return parts, optimizers, torch.stack([torch.stack(r) for r in record]).cpu()


def _assert_same_params(expected_parts, actual_parts):
    for expected, actual in zip(expected_parts, actual_parts, strict=True):
        named = dict(actual.named_parameters())
        for name, p in expected.named_parameters():
            same = torch.equal(p, named[name])
            assert same, f"{name} differs by up to {(p - named[name]).abs().max():.3g}"


def test_builds_cpu_offload_optimizers_like_torchtitans():
    """One CPUOffloadOptimizer per model part, with torchtitan's param groups: the same keys
    (param_names, fused, foreach) and values as torch's AdamW in torchtitan's container."""
    theirs = _optimizer_config("torchtitan").build(model_parts=_model_parts(0))
    ours = _optimizer_config("offload_gradients").build(model_parts=_model_parts(0))
    assert isinstance(ours, OffloadOptimizersContainer) and len(ours) == len(theirs) == 2
    for mine, reference in zip(ours, theirs):
        assert isinstance(mine, CPUOffloadOptimizer) and mine.offload_gradients
        for group, expected in zip(mine.param_groups, reference.param_groups, strict=True):
            assert group.keys() == expected.keys()
            assert {k: v for k, v in group.items() if k != "params"} == {
                k: v for k, v in expected.items() if k != "params"}
            assert group["fused"] and not group["foreach"]


@pytest.mark.parametrize("mode", EXACT)
@SET_TO_NONE
def test_trains_like_torchtitans_container(mode, set_to_none):
    """torchtitan's train step (its zero_grad, token-sum loss, clip_grad_norm_ over the model
    parts, LR warmup and decay): every parameter, loss and gradient norm bitwise as torchtitan's
    own AdamW container gives them."""
    reference_parts, _, reference = _train("torchtitan", set_to_none)
    parts, _, record = _train(mode, set_to_none)
    assert reference[:, -1].max() > MAX_NORM, "clipping must have clipped in this test"
    _assert_same_params(reference_parts, parts)
    assert torch.equal(reference, record)


@pytest.mark.parametrize("mode", EXACT + ["adamw8bit"])
@SET_TO_NONE
def test_resumes_through_torchtitans_checkpointer(mode, set_to_none, tmp_path):
    """Preempted after the checkpoint at step SAVED_AT and restarted into fresh model parts of
    other weights and a fresh container (torchtitan's CheckpointManager: DCP files of the flat,
    FQN-keyed state dict, 8-bit state too): the uninterrupted run's weights, losses and norms."""
    full_parts, full_optimizers, full = _train(mode, set_to_none)
    _train(mode, set_to_none, folder=tmp_path, stop=SAVED_AT)
    parts, optimizers, resumed = _train(mode, set_to_none, folder=tmp_path, seed=1, start=SAVED_AT)
    _assert_same_params(full_parts, parts)
    assert torch.equal(full[SAVED_AT:], resumed)
    state, expected = optimizers.state_dict(), full_optimizers.state_dict()
    assert state.keys() == expected.keys(), f"keys lost or gained: {sorted(state.keys() ^ expected.keys())[:4]}"
    assert any(k.startswith("state.output.weight.") for k in state)
    assert all(torch.equal(state[k], v) for k, v in expected.items() if isinstance(v, torch.Tensor))


@CUDA
def test_streamed_update_under_torchtitans_cuda_graphs():
    """torchtitan's default on a GPU (forward and backward replayed from a CUDA graph,
    zero_grad(set_to_none=False)): the streamed update gives torchtitan's container's bits."""
    train = partial(_train, set_to_none=False, device="cuda", cuda_graphs=True)
    reference_parts, _, reference = train("torchtitan")
    parts, _, record = train("default")
    _assert_same_params(reference_parts, parts)
    assert torch.equal(reference, record)


@CUDA
def test_offloaded_gradients_refused_under_torchtitans_cuda_graphs():
    """Offloaded gradients leave through backward hooks that a CUDA graph's replay skips:
    torchtitan's zero_grad(set_to_none=False) on a GPU (graphs on) says to disable them."""
    with pytest.raises(RuntimeError, match="disable_cuda_graphs"):
        _train("offload_gradients", set_to_none=False, device="cuda", cuda_graphs=True)


def _one_group(name):
    return OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs={"lr": 1e-2})])


@pytest.mark.parametrize("name", ["AdamW", "Adam", "AdamW8bit", "torch.optim.SGD"])
def test_optimizer_names(name):
    """torchtitan's names, AdamW8bit and a dotted class path choose the optimizer run on the
    host, and one step runs through torchtitan's state dict round trip."""
    parts = _model_parts(0, "adamw8bit")  # (bf16: every one of these takes it)
    optimizers = offload_optimizers(_one_group(name)).build(model_parts=parts)
    assert [o.optimizer_cls.__name__ for o in optimizers] == [name.rsplit(".", 1)[-1]] * 2
    _train_step(parts, optimizers, SCHEDULE.build(optimizers=optimizers, training_steps=STEPS), 1, True,
                partial(_forward_backward, parts))
    optimizers.load_state_dict(optimizers.state_dict())


def test_refuses_what_it_cannot_run():
    """implementation='fused_opt_states_bf16' (a hook on torch's Adam) and an optimizer with no
    host version (DistMuon) are refused, not ignored."""
    bf16_states = _optimizer_config("default")
    bf16_states.implementation = "fused_opt_states_bf16"
    with pytest.raises(ValueError, match="fused_opt_states_bf16"):
        bf16_states.build(model_parts=_model_parts(0))
    with pytest.raises(NotImplementedError, match="DistMuon"):
        offload_optimizers(_one_group("DistMuon")).build(model_parts=_model_parts(0))
