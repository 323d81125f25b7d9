"""The user's scenario: torchtune's QLoRA model, optimizer built from config, cosine schedule, resume."""

import pytest
import torch
from omegaconf import OmegaConf

from reference_twin import DEVICES

OPTIMIZER_CFG = {
    "_component_": "offload_plugin.CPUOffloadOptimizer",
    "optimizer_cls": "torch.optim.AdamW",
    "lr": 3e-3,
    "weight_decay": 0.01,
}
VOCAB, SEQ = 128, 32


def qlora_model(device):
    """A 2-layer Llama-3.2-shaped model with NF4 base weights and LoRA adapters."""
    from torchtune.models.llama3_2._component_builders import lora_llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    from torchtune.training import set_default_dtype

    torch.manual_seed(0)
    # Built in place, as torchtune's recipes do: NF4 weights don't follow a later .to(device).
    with set_default_dtype(torch.bfloat16), torch.device(device):
        model = lora_llama3_2(
            ["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
            vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128,
            intermediate_dim=256, max_seq_len=SEQ, lora_rank=4, lora_alpha=8,
            quantize_base=True,
        )
    set_trainable_params(model, get_adapter_params(model))
    return model


def build(model):
    """The optimizer as torchtune's recipes build it: all parameters, NF4 weights included."""
    from torchtune import config

    return config.instantiate(OmegaConf.create(OPTIMIZER_CFG), model.parameters())


def run(model, opt, sched, steps, start):
    from torchtune import training

    device = next(model.parameters()).device
    losses, lrs = [], []
    for step in range(start, start + steps):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        tokens = tokens.to(device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum"
        )
        loss.backward()
        opt.scale_grads(1.0 / tokens[:, 1:].numel())
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item() / tokens[:, 1:].numel())
        lrs.append(training.get_lr(opt))
    return losses, lrs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_qlora_from_config_trains_and_resumes(device, offload_gradients):
    """model.parameters() with NF4 weights, cosine warmup, get_lr, save/resume: same adapters."""
    from torchtune.modules.peft import get_adapter_params
    from torchtune.training import get_cosine_schedule_with_warmup

    OPTIMIZER_CFG["offload_gradients"] = offload_gradients
    model = qlora_model(device)
    opt = build(model)
    adapters = get_adapter_params(model)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(adapters)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)
    losses, lrs = run(model, opt, sched, 8, 0)
    assert lrs[0] < lrs[1] and lrs[-1] < max(lrs)
    assert losses[-1] < losses[0] - 1.0, f"loss did not fall on a repeated batch: {losses}"
    final = {k: v.clone() for k, v in get_adapter_params(model).items()}

    # Interrupted run: 4 steps, checkpoint, rebuild everything, 4 more.
    model = qlora_model(device)
    opt = build(model)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)
    run(model, opt, sched, 4, 0)
    ckpt = {
        "adapter": {k: v.clone() for k, v in get_adapter_params(model).items()},
        "optimizer": opt.state_dict(),
    }
    model = qlora_model(device)
    model.load_state_dict(ckpt["adapter"], strict=False)
    opt = build(model)
    opt.load_state_dict(ckpt["optimizer"])
    # torchtune builds the scheduler after loading, with last_epoch = global_step - 1.
    sched = get_cosine_schedule_with_warmup(
        opt, num_warmup_steps=2, num_training_steps=8, last_epoch=3
    )
    _, resumed_lrs = run(model, opt, sched, 4, 4)
    assert resumed_lrs == lrs[4:]
    for name, value in get_adapter_params(model).items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0, msg=name)
