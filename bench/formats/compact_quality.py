"""Training quality of the compact AdamW state against exact AdamW and bitsandbytes' AdamW8bit.

Trains the demo tiny Llama (offload_plugin.demo.tiny_llama, bf16 weights as the GPU
holds them) with the same data and initialization for every optimizer, on CPU, on one of
two tasks with real signal that run offline:

  --data bigram  (default) a generated next-token task, trained from scratch: each token
                 is a fixed random successor of the previous one 90% of the time (a
                 learnable bigram map, loss floor about 1.0 nats)
  --data demo    the demo's alpaca-style data and tokenizer, from the demo's random-init
                 checkpoint, as configs/demo/ fine-tune it (python -m offload_plugin.demo
                 prepare; written into a temporary folder unless --demo-dir is given)

The variants (--variants):

  exact            torch AdamW on fp32 masters (fp32 moments); the bf16 weights are their copy
  exact_offload    the product, exact: CPUOffloadOptimizer(master_weights=True), torch's
                   AdamW on fp32 host masters
  compact_offload  the product, compact: CPUOffloadOptimizer(optimizer_cls=CompactAdamW)
                   on the bf16 parameters (tensors under 4096 elements exact, as below)
  compact_offload_all  the same with min_8bit_size=0: every tensor compact, norms included
  compact          offload_plugin.formats.compact.native standalone: bf16 weight + 16-bit remainder (an
                   exact fp32 master), 8-bit block-wise moments (tensors under 4096 elements
                   exact, as bitsandbytes keeps those in 32 bits; the same for compact_sr
                   and compact_bf16)
  compact_all      the same standalone update on every tensor: the product's
                   compact_offload_all must give these losses bit for bit
  compact_sr       the same 8-bit moments, bf16 weight alone with stochastic rounding (seeded)
  compact_bf16     the same 8-bit moments, bf16 weight alone, rounded to nearest (no master)
  adamw8bit_offload  the product with bitsandbytes' update: CPUOffloadOptimizer(optimizer_cls=
                   AdamW8bit) on the bf16 parameters (bnb_bf16's bits)
  adamw8bit_sr_offload  the same with stochastic_rounding=True (not bitsandbytes' bits)
  offload_bf16     the product's default: CPUOffloadOptimizer() runs torch's AdamW on the
                   bf16 parameters as they are (bf16 moments, no master)
  bnb              bitsandbytes AdamW8bit (CPU backend) on fp32 masters
  bnb_bf16         bitsandbytes AdamW8bit on the bf16 weights directly (how it is usually run)

It prints each one's final loss (mean of the last 20 steps) against exact's and its loss
curve's mean absolute distance from exact's, and writes the curves as JSON (--json) and
an SVG plot (--svg, hand-written: no plotting dependency).

    python bench/formats/compact_quality.py --steps 300 --lr 1e-3 3e-4
    python bench/formats/compact_quality.py --data demo --steps 300 --lr 2e-3 --batch 8 --clip 1.0 \\
        --json demo.json --svg demo.svg
"""

import argparse
import atexit
import json
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple
from xml.sax.saxutils import escape

import torch

from offload_plugin.formats.compact import native as compact_adam

VARIANTS = ["exact", "exact_offload", "compact_offload", "compact_offload_all", "adamw8bit_offload", "adamw8bit_sr_offload", "compact", "compact_all", "compact_sr",
            "compact_bf16", "offload_bf16", "bnb", "bnb_bf16"]
VOCAB, SEQ, BATCH = 512, 64, 16
MIN_8BIT = 4096  # bitsandbytes' min_8bit_size
IGNORE = -100  # torchtune's CROSS_ENTROPY_IGNORE_IDX: padding and masked labels
Batch = Tuple[torch.Tensor, torch.Tensor]  # (input tokens, target tokens), same shape


# --- data and models ---------------------------------------------------------------------------

def make_batches(steps: int, seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> List[Batch]:
    """``steps`` batches of ``batch`` sequences of ``seq`` tokens of the bigram task."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(VOCAB, generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
        for t in range(seq):
            follow = torch.rand(batch, generator=gen) < 0.9
            x[:, t + 1] = torch.where(follow, successor[x[:, t]], torch.randint(0, VOCAB, (batch,), generator=gen))
        batches.append((x[:, :-1], x[:, 1:]))
    return batches


def bigram_model(seed: int) -> torch.nn.Module:
    from offload_plugin.demo import tiny_llama

    torch.manual_seed(seed)
    model = tiny_llama()
    # The usual LLM initialization (std 0.02): the builder's own gives logits of ~100s and
    # a first loss of ~125 nats, a regime no fine-tuning run is in.
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    return model.to(torch.bfloat16)


def demo_files(demo_dir: Optional[str]) -> Path:
    """The folder holding the demo's tokenizer, data and checkpoint, written if missing
    (deterministic: the same files as ``python -m offload_plugin.demo prepare``)."""
    from offload_plugin import demo

    if demo_dir:
        out = Path(demo_dir)
    else:
        out = Path(tempfile.mkdtemp(prefix="compact-quality-demo-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
    if not all((out / f).exists() for f in (demo.TOKENIZER_FILE, demo.DATA_FILE, demo.CHECKPOINT_FILE)):
        demo.prepare(str(out))
    return out


def demo_batches(steps: int, seed: int, batch: int, folder: Path) -> List[Batch]:
    """``steps`` batches of the demo's alpaca data, tokenized and padded as the demo configs'
    recipe does (torchtune's alpaca_dataset with its prompt, labels on the whole text, the
    demo tokenizer), in a seeded shuffled order, epoch after epoch."""
    from offload_plugin import demo
    from torchtune.data import padded_collate_sft
    from torchtune.datasets import alpaca_dataset
    from torchtune.models.llama2 import llama2_tokenizer

    tokenizer = llama2_tokenizer(str(folder / demo.TOKENIZER_FILE), max_seq_len=256, prompt_template=None)
    data = alpaca_dataset(tokenizer, source="json", data_files=str(folder / demo.DATA_FILE), split="train")
    gen = torch.Generator().manual_seed(seed)
    order: List[int] = []
    while len(order) < steps * batch:
        order += torch.randperm(len(data), generator=gen).tolist()
    batches = []
    for k in range(steps):
        b = padded_collate_sft([data[i] for i in order[k * batch:(k + 1) * batch]],
                               padding_idx=tokenizer.pad_id, ignore_idx=IGNORE)
        # The recipe predicts labels[t + 1] from tokens[:t + 1].
        batches.append((b["tokens"][:, :-1], b["labels"][:, 1:]))
    return batches


def demo_model(folder: Path) -> torch.nn.Module:
    """The demo's random-init checkpoint (the model configs/demo/ fine-tune), in bf16."""
    from offload_plugin import demo

    model = demo.tiny_llama()
    model.load_state_dict(torch.load(folder / demo.CHECKPOINT_FILE, weights_only=True))
    return model.to(torch.bfloat16)


# --- the optimizers ----------------------------------------------------------------------------

def _sr_split(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """bf16 of fp32 p by stochastic rounding: add 16 random low bits, truncate."""
    bits = p.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    noise = torch.randint(0, 1 << 16, p.shape, generator=gen, dtype=torch.int64)
    hi = torch.where(p.isfinite(), (bits + noise) >> 16, bits >> 16)
    return torch.where(hi >= 1 << 15, hi - (1 << 16), hi).to(torch.int16).view(torch.bfloat16)


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def _zero_grads(params: List[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = None


Stepper = Tuple[Callable[[float], None], Callable[[], None]]  # step(lr), zero_grad()


def _stepper(variant: str, params: List[torch.nn.Parameter], wd: float) -> Stepper:
    """(step, zero_grad): step(lr) applies one optimizer step to the bf16 ``params`` from
    their .grad; zero_grad() clears the gradients (the product's own, for its variants)."""
    lr = 0.0  # every step sets it
    betas, eps = (0.9, 0.999), 1e-8
    zero = lambda: _zero_grads(params)  # noqa: E731
    if "_offload" in variant or variant == "offload_bf16":
        # The product, as a recipe builds it: CPUOffloadOptimizer over the bf16 model's
        # parameters (on a machine without a GPU its copies are synchronous).
        from offload_plugin import CompactAdamW, CPUOffloadOptimizer

        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd)
        if variant == "compact_offload":
            opt = CPUOffloadOptimizer(params, optimizer_cls=CompactAdamW, **kw)
        elif variant in ("adamw8bit_offload", "adamw8bit_sr_offload"):
            opt = CPUOffloadOptimizer(params, optimizer_cls="offload_plugin.AdamW8bit",
                                      stochastic_rounding=variant == "adamw8bit_sr_offload", **kw)
        elif variant == "compact_offload_all":
            opt = CPUOffloadOptimizer(params, optimizer_cls=CompactAdamW, min_8bit_size=0, **kw)
        else:
            opt = CPUOffloadOptimizer(params, master_weights=variant == "exact_offload", **kw)

        def step(lr):
            _set_lr(opt, lr)
            opt.step()
        return step, opt.zero_grad
    if variant in ("exact", "bnb"):
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
        if variant == "exact":
            # fused: the kernel CPUOffloadOptimizer runs on its host masters (exact_offload
            # must then give these losses bit for bit); foreach differs in last bits.
            opt = torch.optim.AdamW(masters, lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True)
        else:
            import bitsandbytes as bnb
            opt = bnb.optim.AdamW8bit(masters, lr=lr, betas=betas, eps=eps, weight_decay=wd)

        def step(lr):
            _set_lr(opt, lr)
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
            opt.step()
            for m, p in zip(masters, params):
                p.data.copy_(m.detach())
        return step, zero
    if variant == "bnb_bf16":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)

        def step(lr):
            _set_lr(opt, lr)
            opt.step()
        return step, zero
    if variant not in ("compact", "compact_all", "compact_sr", "compact_bf16"):
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    # Tensors under MIN_8BIT elements keep exact state, as bitsandbytes keeps them in 32 bits
    # (its min_8bit_size): norms and biases, a negligible share of the memory. compact_all
    # makes them compact too, as CompactAdamW does (it has no such threshold).
    floor = 0 if variant == "compact_all" else MIN_8BIT
    small = [p for p in params if p.numel() < floor]
    exact_small = _stepper("exact", small, wd)[0] if small else (lambda lr: None)
    compact = [p for p in params if p.numel() >= floor]
    master = variant in ("compact", "compact_all")  # compact_sr and compact_bf16: the bf16 weight alone
    states = [compact_adam.CompactAdamState.zeros(p.data.view(-1), master_weights=master)
              for p in compact]
    gen = torch.Generator().manual_seed(1234)

    def step(lr):
        exact_small(lr)
        for s, p in zip(states, compact):
            g = p.grad.reshape(-1).contiguous()
            if variant != "compact_sr":
                compact_adam.step_(s, g, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd)
                continue
            # The same update, the new fp32 weight then rounded stochastically. It takes the
            # new moments before they are quantized, as reference_step does: their 8-bit
            # codes can round a small exp_avg_sq to zero beside a nonzero exp_avg, a step
            # of lr * m / eps (from the decoded codes, with the full lr from the first step,
            # this variant diverged).
            s.step += 1
            coeffs = compact_adam._coefficients(lr, betas[0], betas[1], wd, eps, s.step, True, False, None, None)
            factor, _, decay, b1, omb1, b2, omb2, bc2, eps_t, nss, _ = coeffs.unbind()
            m, v = s.moments()
            gf = g.float() * factor
            m, v = m * b1 + gf * omb1, v * b2 + (gf * gf) * omb2
            p32 = s.weight.float() * decay + (m * nss) / (v.double().sqrt().float() * bc2 + eps_t)
            compact_adam.reference_step(s, g, coeffs, True)  # the quantized moments (and an RNE weight)
            s.weight.copy_(_sr_split(p32, gen))
    return step, zero


# --- training and the summary ------------------------------------------------------------------

def train(variant: str, steps: int = 300, lr: float = 1e-3, wd: float = 0.01, seed: int = 0,
          batches: Optional[List[Batch]] = None, model: Optional[torch.nn.Module] = None,
          clip: float = 0.0) -> List[float]:
    """Loss per step of the tiny Llama (``model``, else the bigram task's from ``seed``)
    trained with ``variant`` (see the module docstring) on ``batches``."""
    model = model if model is not None else bigram_model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    step, zero_grad = _stepper(variant, params, wd)
    batches = batches if batches is not None else make_batches(steps, seed)
    warmup = max(1, steps // 10)
    losses = []
    for k, (x, y) in enumerate(batches[:steps]):
        zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1), ignore_index=IGNORE)
        loss.backward()
        if clip:
            # On the model's bf16 gradients, the same for every variant (as the demo
            # configs' clip_grad_norm), so that only the optimizers differ.
            torch.nn.utils.clip_grad_norm_(params, clip)
        # Linear warmup, then cosine decay: the optimizers see a changing lr, as in fine-tuning.
        scale = (k + 1) / warmup if k < warmup else 0.5 * (1 + math.cos(math.pi * (k - warmup) / (steps - warmup)))
        step(lr * scale)
        losses.append(loss.item())
    return losses


def summary(curves: Dict[str, List[float]], tail: int = 20) -> Dict[str, dict]:
    """Per variant: the final loss (mean of the last ``tail`` steps), it against exact's, and
    the curve's mean absolute distance from exact's over every step."""
    ref = curves["exact"]
    tail = min(tail, len(ref))
    final_ref = sum(ref[-tail:]) / tail
    out = {}
    for name, c in curves.items():
        final = sum(c[-tail:]) / tail
        out[name] = {"final": final, "final_vs_exact": final / final_ref - 1,
                     "curve_distance": sum(abs(a - b) for a, b in zip(c, ref)) / len(ref)}
    return out


def targets_met(s: Dict[str, dict], variant: str, bnb: str) -> str:
    """Issue #20's two targets for ``variant``: final loss within 1% of exact's, and the
    curve no further from exact's than bitsandbytes' (``bnb``) on the same run."""
    if variant not in s or "exact" not in s:
        return ""
    final_ok = abs(s[variant]["final_vs_exact"]) <= 0.01
    verdict = f"final within 1%: {'yes' if final_ok else 'NO'}"
    if bnb in s:
        close = s[variant]["curve_distance"] <= s[bnb]["curve_distance"]
        verdict += f"; curve distance <= {bnb}'s: {'yes' if close else 'NO'}"
    return verdict


# --- the plot ----------------------------------------------------------------------------------

COLORS = ["#000000", "#7f7f7f", "#d62728", "#1f77b4", "#17becf", "#9467bd", "#8c564b",
          "#e377c2", "#2ca02c", "#bcbd22"]
W, PANEL_H, LEFT, RIGHT, TOP, GAP = 840, 250, 70, 250, 40, 60


def _ticks(lo: float, hi: float, n: int = 5) -> List[float]:
    """About ``n`` round numbers spanning [lo, hi]."""
    raw = (hi - lo) / n or 1.0
    unit = 10 ** math.floor(math.log10(raw))
    step = next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit >= raw)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _smooth(c: List[float], window: int) -> List[float]:
    """Centered moving average (shorter at the ends): a step's loss is noisy, the trend is
    what the difference panel is for."""
    h = window // 2
    return [sum(c[max(0, i - h):i + h + 1]) / len(c[max(0, i - h):i + h + 1]) for i in range(len(c))]


def _is_product(name: str) -> bool:
    return name.endswith("_offload") or name == "offload_bf16"


def _dash(name: str) -> str:
    return ' stroke-dasharray="6,4"' if _is_product(name) else ""


def _panel(curves: Dict[str, List[float]], top: float, lo: float, hi: float, panel: str,
           ylabel: str, colors: Dict[str, str]) -> List[str]:
    """One panel's axes, ticks and one polyline per curve (clipped to the panel)."""
    steps = max(len(c) for c in curves.values())
    x0, x1, y0, y1 = LEFT, W - RIGHT, top + PANEL_H, top
    sx = lambda i: x0 + (x1 - x0) * i / max(1, steps - 1)  # noqa: E731
    sy = lambda v: y0 - (y0 - y1) * (v - lo) / (hi - lo)  # noqa: E731
    out = [f'<clipPath id="clip-{panel}"><rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{PANEL_H}"/></clipPath>',
           f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{PANEL_H}" fill="none" stroke="#000"/>']
    for v in _ticks(lo, hi):
        out.append(f'<line x1="{x0 - 4}" y1="{sy(v):.1f}" x2="{x1}" y2="{sy(v):.1f}" stroke="#ddd"/>'
                   f'<text x="{x0 - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    for i in _ticks(0, steps):
        out.append(f'<text x="{sx(i):.1f}" y="{y0 + 16}" text-anchor="middle">{i:g}</text>')
    out.append(f'<text x="{x0 - 52}" y="{(y0 + y1) / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 {x0 - 52} {(y0 + y1) / 2:.0f})">{escape(ylabel)}</text>')
    out.append(f'<g id="{panel}" clip-path="url(#clip-{panel})">')
    # The product's curves last and dashed: where one equals its standalone twin bit for
    # bit, the twin shows through the gaps.
    for name in sorted(curves, key=_is_product):
        points = " ".join(f"{sx(i):.1f},{sy(v):.2f}" for i, v in enumerate(curves[name]))
        out.append(f'<polyline data-variant="{escape(name)}" points="{points}" fill="none" '
                   f'stroke="{colors[name]}" stroke-width="1.2"{_dash(name)}/>')
    out.append("</g>")
    return out


def write_svg(path: str, curves: Dict[str, List[float]], title: str, window: int = 15) -> None:
    """Two panels: the loss curves (group id "loss", one polyline per variant), and each
    curve's difference from exact's, smoothed over ``window`` steps (group id "diff"): the
    curves overlap at the top's scale. The difference axis is set by the variants close to
    exact; one far off (plain bf16) leaves the panel, and the legend says so, as it says
    which curves equal an earlier one bit for bit."""
    colors = {n: COLORS[i % len(COLORS)] for i, n in enumerate(curves)}
    losses = [v for c in curves.values() for v in c]
    lo, hi = min(losses), max(losses)
    ref = curves["exact"]
    diffs = {n: _smooth([a - b for a, b in zip(c, ref)], window) for n, c in curves.items()}
    extent = {n: max(abs(v) for v in d) for n, d in diffs.items() if n != "exact"}
    scale = sorted(extent.values())[len(extent) // 2] if extent else 0.0  # the median variant's
    near = [e for e in extent.values() if e <= 4 * scale] or [1e-3]
    d = 1.1 * max(max(near), 1e-6)
    off = {n for n, e in extent.items() if e > 1.1 * d}
    height = TOP + 2 * PANEL_H + GAP + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
           f'viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="#fff"/>',
           f'<text x="{W / 2:.0f}" y="20" text-anchor="middle" font-size="13">{escape(title)}</text>']
    out += _panel(curves, TOP, lo - 0.02 * (hi - lo), hi + 0.02 * (hi - lo), "loss", "training loss", colors)
    bottom = TOP + PANEL_H + GAP
    out += _panel(diffs, bottom, -d, d, "diff", f"loss - exact's ({window}-step mean)", colors)
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2:.0f}" y="{bottom + PANEL_H + 34}" '
               'text-anchor="middle">step</text>')
    names = list(curves)
    for k, name in enumerate(names):
        y = TOP + 10 + 16 * k
        twin = next((n for n in names[:k] if curves[n] == curves[name]), None)
        label = name + (f" (= {twin})" if twin else "") + (" (off scale)" if name in off else "")
        out.append(f'<line x1="{W - RIGHT + 12}" y1="{y}" x2="{W - RIGHT + 32}" y2="{y}" '
                   f'stroke="{colors[name]}" stroke-width="2"{_dash(name)}/>'
                   f'<text x="{W - RIGHT + 38}" y="{y + 4}">{escape(label)}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")


# --- the command line --------------------------------------------------------------------------

def _commit() -> str:
    """HEAD and whether offload_plugin/ differs from it: what the numbers were measured on."""
    import offload_plugin

    where = Path(offload_plugin.__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "offload_plugin"], cwd=where,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=["bigram", "demo"], default="bigram")
    p.add_argument("--demo-dir", help="the demo's files (written there if missing); default: a temporary folder")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, nargs="*", default=[1e-3])
    p.add_argument("--seeds", type=int, nargs="*", default=[0],
                   help="bigram: data and initialization; demo: the data's order")
    p.add_argument("--variants", nargs="*", default=VARIANTS)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--seq", type=int, default=SEQ, help="bigram only: tokens per sequence")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=0.0, help="clip the gradients' norm to this (0: no clipping)")
    p.add_argument("--json", help="write the loss curves and the summary here")
    p.add_argument("--svg", help="plot the first run's loss curves here")
    args = p.parse_args()
    if "exact" not in args.variants:
        p.error("--variants must include exact: the others are measured against it")
    folder = demo_files(args.demo_dir) if args.data == "demo" else None
    record = {"data": args.data, "steps": args.steps, "batch": args.batch, "commit": _commit(),
              "seq": args.seq if args.data == "bigram" else None, "clip": args.clip,
              "weight_decay": args.weight_decay, "torch": torch.__version__, "runs": []}
    for lr in args.lr:
        for seed in args.seeds:
            if folder is None:
                batches, model_of = make_batches(args.steps, seed, args.batch, args.seq), lambda: bigram_model(seed)
            else:
                batches, model_of = demo_batches(args.steps, seed, args.batch, folder), lambda: demo_model(folder)
            curves, seconds = {}, {}
            for v in args.variants:
                t0 = time.perf_counter()
                try:
                    curves[v] = train(v, args.steps, lr, args.weight_decay, seed, batches, model_of(), args.clip)
                except ImportError as err:
                    print(f"{v}: skipped ({err})")
                    continue
                seconds[v] = time.perf_counter() - t0
                print(f"  {v}: {seconds[v]:.1f} s", flush=True)
            s = summary(curves)
            record["runs"].append({"lr": lr, "seed": seed, "curves": curves, "summary": s, "seconds": seconds})
            print(f"{args.data}, lr {lr}, seed {seed}, {args.steps} steps:")
            for name, row in s.items():
                print(f"  {name:16s} final {row['final']:.4f} ({row['final_vs_exact']:+.3%} vs exact)  "
                      f"curve distance {row['curve_distance']:.5f}", flush=True)
            for bnb in ("bnb", "bnb_bf16"):
                if "compact_offload" in s and bnb in s:
                    print(f"  compact_offload vs {bnb}: {targets_met(s, 'compact_offload', bnb)}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if args.svg and record["runs"]:
        run = record["runs"][0]
        write_svg(args.svg, run["curves"], f"{args.data}: tiny Llama, bf16, {args.steps} steps, "
                                           f"lr {run['lr']:g}, seed {run['seed']}")


if __name__ == "__main__":
    main()
