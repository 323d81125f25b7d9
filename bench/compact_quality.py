"""Training quality of the compact AdamW state against exact AdamW and bitsandbytes' AdamW8bit.

Trains the demo tiny Llama (offload_plugin.demo.tiny_llama, bf16 weights as the GPU
holds them) on a generated next-token task with real signal (each token is a fixed
random successor of the previous one 90% of the time: a learnable bigram map, loss floor
about 1.0 nats) with the same data and initialization for every optimizer, on CPU:

  exact          torch AdamW on fp32 masters (fp32 moments); the bf16 weights are their copy
  compact        offload_plugin.compact_adam: bf16 weight + 16-bit remainder (an exact fp32
                 master), 8-bit block-wise moments (tensors under 4096 elements exact, as
                 bitsandbytes keeps those in 32 bits; the same for the two below)
  compact_sr     the same 8-bit moments, bf16 weight alone with stochastic rounding (seeded)
  compact_bf16   the same 8-bit moments, bf16 weight alone, rounded to nearest (no master)
  bnb            bitsandbytes AdamW8bit (CPU backend) on fp32 masters
  bnb_bf16       bitsandbytes AdamW8bit on the bf16 weights directly (how it is usually run)

and prints each one's final loss (mean of the last 20 steps) against exact's, and its
loss curve's mean absolute distance from exact's.

    python bench/compact_quality.py --steps 300 --lr 1e-3 3e-4
"""

import argparse
import math
import time
from typing import Callable, Dict, List

import torch

from offload_plugin import compact_adam

VARIANTS = ["exact", "compact", "compact_sr", "compact_bf16", "bnb", "bnb_bf16"]
VOCAB, SEQ, BATCH = 512, 64, 16
MIN_8BIT = 4096  # bitsandbytes' min_8bit_size


def make_batches(steps: int, seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> List[torch.Tensor]:
    """``steps`` batches of ``batch`` sequences of ``seq`` + 1 tokens of the bigram task."""
    BATCH, SEQ = batch, seq
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(VOCAB, generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
        for t in range(SEQ):
            follow = torch.rand(BATCH, generator=gen) < 0.9
            x[:, t + 1] = torch.where(follow, successor[x[:, t]], torch.randint(0, VOCAB, (BATCH,), generator=gen))
        batches.append(x)
    return batches


def _model(seed: int):
    from offload_plugin.demo import tiny_llama

    torch.manual_seed(seed)
    model = tiny_llama()
    # The usual LLM initialization (std 0.02): the builder's own gives logits of ~100s and
    # a first loss of ~125 nats, a regime no fine-tuning run is in.
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    return model.to(torch.bfloat16)


def _sr_split(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """bf16 of fp32 p by stochastic rounding: add 16 random low bits, truncate."""
    bits = p.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    noise = torch.randint(0, 1 << 16, p.shape, generator=gen, dtype=torch.int64)
    hi = torch.where(p.isfinite(), (bits + noise) >> 16, bits >> 16)
    return torch.where(hi >= 1 << 15, hi - (1 << 16), hi).to(torch.int16).view(torch.bfloat16)


def _stepper(variant: str, params: List[torch.nn.Parameter], wd: float) -> Callable[[float], None]:
    """A function step(lr) that applies one optimizer step to the bf16 ``params`` from their .grad."""
    lr = 0.0  # every step sets it
    betas, eps = (0.9, 0.999), 1e-8
    if variant in ("exact", "bnb"):
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
        if variant == "exact":
            opt = torch.optim.AdamW(masters, lr=lr, betas=betas, eps=eps, weight_decay=wd)
        else:
            import bitsandbytes as bnb
            opt = bnb.optim.AdamW8bit(masters, lr=lr, betas=betas, eps=eps, weight_decay=wd)

        def step(lr):
            for g in opt.param_groups:
                g["lr"] = lr
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
            opt.step()
            for m, p in zip(masters, params):
                p.data.copy_(m.detach())
        return step
    if variant == "bnb_bf16":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)

        def step(lr):
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
        return step
    # Tensors under MIN_8BIT elements keep exact state, as bitsandbytes keeps them in 32 bits
    # (its min_8bit_size): norms and biases, a negligible share of the memory.
    small = [p for p in params if p.numel() < MIN_8BIT]
    exact_small = _stepper("exact", small, wd) if small else (lambda lr: None)
    params = [p for p in params if p.numel() >= MIN_8BIT]
    states = [compact_adam.CompactAdamState.zeros(p.data.view(-1), master_weights=variant == "compact")
              for p in params]
    gen = torch.Generator().manual_seed(1234)

    def step(lr):
        exact_small(lr)
        for s, p in zip(states, params):
            g = p.grad.reshape(-1).contiguous()
            if variant != "compact_sr":
                compact_adam.step_(s, g, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd)
                continue
            # The same update, the new fp32 weight then rounded stochastically.
            s.step += 1
            coeffs = compact_adam._coefficients(lr, betas[0], betas[1], wd, eps, s.step, True, False, None, None)
            before = s.weight.clone()
            compact_adam.reference_step(s, g, coeffs, True)  # moments (and an RNE weight)
            s.weight.copy_(before)
            factor, _, decay, b1, omb1, b2, omb2, bc2, eps_t, nss = coeffs.unbind()
            m, v = s.moments()
            p32 = s.weight.float() * decay + (m * nss) / (v.double().sqrt().float() * bc2 + eps_t)
            s.weight.copy_(_sr_split(p32, gen))
    return step


def train(variant: str, steps: int = 300, lr: float = 1e-3, wd: float = 0.01, seed: int = 0,
          batches=None) -> List[float]:
    """Loss per step of the tiny Llama trained with ``variant`` (see the module docstring)."""
    model = _model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    step = _stepper(variant, params, wd)
    batches = batches if batches is not None else make_batches(steps, seed)
    warmup = max(1, steps // 10)
    losses = []
    for k, x in enumerate(batches[:steps]):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        for p in params:
            p.grad = None
        loss.backward()
        # Linear warmup, then cosine decay: the optimizers see a changing lr, as in fine-tuning.
        scale = (k + 1) / warmup if k < warmup else 0.5 * (1 + math.cos(math.pi * (k - warmup) / (steps - warmup)))
        step(lr * scale)
        losses.append(loss.item())
    return losses


def summary(curves: Dict[str, List[float]], tail: int = 20) -> Dict[str, dict]:
    ref = curves["exact"]
    final_ref = sum(ref[-tail:]) / tail
    out = {}
    for name, c in curves.items():
        final = sum(c[-tail:]) / tail
        out[name] = {"final": final, "final_vs_exact": final / final_ref - 1,
                     "curve_distance": sum(abs(a - b) for a, b in zip(c, ref)) / len(ref)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, nargs="*", default=[1e-3])
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--variants", nargs="*", default=VARIANTS)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--seq", type=int, default=SEQ)
    args = p.parse_args()
    for lr in args.lr:
        for seed in args.seeds:
            batches = make_batches(args.steps, seed, args.batch, args.seq)
            curves = {}
            for v in args.variants:
                t0 = time.perf_counter()
                try:
                    curves[v] = train(v, args.steps, lr, seed=seed, batches=batches)
                except ImportError as err:
                    print(f"{v}: skipped ({err})")
                    continue
                print(f"  {v}: {time.perf_counter() - t0:.1f} s", flush=True)
            print(f"lr {lr}, seed {seed}, {args.steps} steps:")
            for name, s in summary(curves).items():
                print(f"  {name:14s} final {s['final']:.4f} ({s['final_vs_exact']:+.2%} vs exact)  "
                      f"curve distance {s['curve_distance']:.4f}", flush=True)


if __name__ == "__main__":
    main()
