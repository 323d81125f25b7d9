"""Torch's AdamW on the GPU against ours, in one process, on one QLoRA model: step time of a
stock-recipe loop, the two optimizers taking turns in blocks of steps.

bench_stock.py runs each optimizer in a fresh process of torchtune's recipe; there one
process's steps ran at 0.80-1.05x another's over the same batches (docs/performance.md),
more than the few percent issue #19 is about. Here both optimizers step the same model's
adapters in one process, alternating every ``--block`` steps, so that whatever a process
or a stretch of time gives (GPU clocks, the host's scheduling) falls on both alike. Each
step is what torchtune's ``lora_finetune_single_device`` does: forward with the chunked
loss, backward, ``scale_grads``, ``step()``, ``zero_grad(set_to_none=True)``, then the
loss's ``.item()``. The two optimizers update the same parameters (each from its own
state): the numbers are times, not a comparison of results.

    # on the GPU machine: torchtune's 1B QLoRA config's adapters (rank 64, q/v/output + MLP)
    python bench/qlora_ab.py
    # CPU smoke test (the tiny model; the streamed update needs a GPU, so ours is the host update)
    python bench/qlora_ab.py --tiny --device cpu --blocks 2 --block 2 --seq-len 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import TINY  # noqa: E402  (the tiny model's shape; puts the repository on sys.path)

# torchtune's llama3_2/1B_qlora_single_device.yaml
CONFIG_LORA = dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                   lora_rank=64, lora_alpha=128, lora_dropout=0.0)


def build(args):
    from torchtune import training
    from torchtune.models.llama3_2 import qlora_llama3_2_1b
    from torchtune.models.llama3_2._component_builders import lora_llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16), torch.device(args.device):
        if args.tiny:
            model = lora_llama3_2(**CONFIG_LORA, quantize_base=True, max_seq_len=args.seq_len, **TINY)
        else:
            model = qlora_llama3_2_1b(**CONFIG_LORA)
    set_trainable_params(model, get_adapter_params(model))
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=384, help="tokens per sample (the stock runs' batches "
                   "of alpaca at max_seq_len 1024 average about 1,500 tokens a step)")
    p.add_argument("--block", type=int, default=4, help="steps per turn")
    p.add_argument("--blocks", type=int, default=8, help="turns per optimizer (the first of each left out)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from torchtune import training
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    from offload_plugin import CPUOffloadOptimizer

    model = build(args)
    trainable = [q for q in model.parameters() if q.requires_grad]
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    vocab = model.tok_embeddings.num_embeddings
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=gen).to(args.device)
               for _ in range(4)]
    optimizers = {  # the stock config's optimizer, and ours with default options
        "torch_adamw": torch.optim.AdamW(trainable, lr=3e-4, weight_decay=0.01, fused=True),
        "ours": CPUOffloadOptimizer(trainable, lr=3e-4, weight_decay=0.01),
    }

    def one_step(opt, i: int) -> float:
        t0 = time.perf_counter()
        tokens = batches[i % len(batches)]
        labels = tokens[:, 1:]
        num_tokens = (labels != loss_fn.ignore_index).sum()
        loss = loss_fn(model(tokens[:, :-1]), labels) * num_tokens
        loss.backward()
        training.scale_grads(model, 1 / num_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # (the recipe's running_loss.item() / num_tokens for its log)
        return time.perf_counter() - t0

    times = {name: [] for name in optimizers}
    for name, opt in optimizers.items():  # warm up each (first steps build state and plans)
        for i in range(2):
            one_step(opt, i)
    for block in range(args.blocks):
        order = list(optimizers) if block % 2 == 0 else list(optimizers)[::-1]  # (neither always follows the other)
        for name in order:
            times[name].append([one_step(optimizers[name], block * args.block + i) for i in range(args.block)])
    base = times["torch_adamw"][1:]
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "settings": {k: str(v) for k, v in vars(args).items()},
              "trainable_elements": sum(q.numel() for q in trainable), "blocks": times}
    for name in optimizers:
        mine = times[name][1:]
        mean = statistics.mean(t for b in mine for t in b)
        # Each turn against the base's turn next to it (the same stretch of time).
        paired = [sum(b) / sum(a) for a, b in zip(base, mine)]
        result[name] = {"mean_step_s": mean, "median_step_s": statistics.median(t for b in mine for t in b),
                        "speed_vs_torch_adamw": statistics.mean(t for b in base for t in b) / mean,
                        "turn_time_ratios": paired}
        print(f"{name}: mean step {mean * 1e3:.1f} ms, median {result[name]['median_step_s'] * 1e3:.1f} ms, "
              f"speed vs torch AdamW {result[name]['speed_vs_torch_adamw']:.3f}x "
              f"(turn time ratios {', '.join(f'{r:.3f}' for r in paired)})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
