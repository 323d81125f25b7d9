"""Train one random-init torchtune model with each optimizer; compare step time and memory.

Every optimizer trains the same model (same seed, bf16, built on the device) on the same
random tokens with torchtune's chunked cross-entropy, in torchtune's order: forward and
backward per micro-batch (loss summed over tokens), scale the gradients by 1/num_tokens,
optionally clip, ``optimizer.step()``, ``zero_grad(set_to_none=True)``. Each optimizer runs
in a fresh subprocess (this script with ``--single NAME``), so peak GPU memory, host memory
and CUDA state do not leak between runs; a child that fails records its error and the run
goes on.

    # on the GPU machine, from the repository root
    python bench/bench_train.py --model llama3_2_1b --job full --tokens-per-step 4096 --seq-len 2048
    python bench/bench_train.py --model llama3_1_8b --job full --tokens-per-step 16384 \\
        --seq-len 2048 --grad-accum 4 --activation-checkpointing --measure-host-update
    # stepped in backward, ours under a 24 GiB cap against torch's AdamW uncapped, with the
    # bytes each streamed step moves and the pinned copy bandwidth (bench/bus.py) beside them
    python bench/bench_train.py --model llama3_1_8b --job full --tokens-per-step 4096 --seq-len 2048 \\
        --activation-checkpointing --gpu-memory-gib 24 --uncapped gpu_adamw_in_bwd --measure-bus \\
        --profile-bus --optimizers gpu_adamw_in_bwd,adamw8bit_in_bwd,offload_in_bwd
    # smoke test on a CPU machine (torchao and bitsandbytes are skipped there)
    python bench/bench_train.py --tiny --device cpu --job full --tokens-per-step 512 \\
        --seq-len 128 --optimizers gpu_adamw,offload,offload_grads --steps 3 --warmup 1

Prints a markdown table and writes JSON (default
``bench/results/train/<date>-<model>-<job>-<tokens>.json``); ``python bench/report.py`` turns
every JSON under bench/results/ into one markdown section. Also measures
torch's fused CPU AdamW on flat fp32 tensors (capped at ``--ref-numel-cap`` elements) as the
host-update speed to compare with. To add an optimizer, add one line to ``OPTIMIZERS``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # offload_plugin, whether installed or not
sys.path.insert(1, str(REPO / "bench"))
import bus  # noqa: E402  (bench/bus.py: bytes moved per step, copy bandwidth)

LR = 1e-5
GIB = 2**30
MARKER = "BENCH_RESULT "
BUILDERS = {  # (model, job) -> torchtune builder
    ("llama3_2_1b", "full"): "torchtune.models.llama3_2.llama3_2_1b",
    ("llama3_2_1b", "qlora"): "torchtune.models.llama3_2.qlora_llama3_2_1b",
    ("llama3_1_8b", "full"): "torchtune.models.llama3_1.llama3_1_8b",
    ("llama3_1_8b", "qlora"): "torchtune.models.llama3_1.qlora_llama3_1_8b",
    # Full fine-tuning only, for bench/what_fits.py's ladder of sizes.
    ("llama3_2_3b", "full"): "torchtune.models.llama3_2.llama3_2_3b",
    ("gemma2_9b", "full"): "torchtune.models.gemma2.gemma2_9b",
    ("qwen2_5_14b", "full"): "torchtune.models.qwen2_5.qwen2_5_14b_base",
    ("gemma2_27b", "full"): "torchtune.models.gemma2.gemma2_27b",
    ("qwen2_5_32b", "full"): "torchtune.models.qwen2_5.qwen2_5_32b_base",
    ("llama3_1_70b", "full"): "torchtune.models.llama3_1.llama3_1_70b",
}
ADAMW8BIT = "offload_plugin.AdamW8bit"  # bitsandbytes' 8-bit AdamW update, state in host memory
LORA_KWARGS = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
                   apply_lora_to_mlp=True, lora_rank=8, lora_alpha=16)
TINY = dict(vocab_size=512, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128,
            intermediate_dim=256)  # kv dims = 128 so every NF4 linear is a multiple of 16384


# ----------------------------------------------------------------------------- optimizers
class Skip(Exception):
    """An optimizer that cannot run here (missing package, no CUDA): not a failure."""


def _ours(model, trainable, args, **kw):
    from offload_plugin import CPUOffloadOptimizer

    # A mode name without "nomaster" keeps fp32 masters, as in every result recorded here
    # before master_weights became opt-in.
    kw.setdefault("master_weights", True)
    _check_host_memory(trainable, args, **{k: v for k, v in kw.items() if k != "optimizer_cls"})
    # (an upper bound with --device-fraction or CompactAdamW)
    # model.parameters(), frozen NF4 weights included, as torchtune's recipes pass them.
    if args.device_fraction:
        kw["device_fraction"] = args.device_fraction
    return CPUOffloadOptimizer(model.parameters(), lr=LR, fused=True,
                               host_threads=args.host_threads, **kw)


def _torchao(model, trainable, args):
    if args.device != "cuda":
        raise Skip("torchao's CPUOffloadOptimizer supports CUDA/XPU only")
    from torchao.optim import CPUOffloadOptimizer as AOOffload

    # torchao cannot take frozen params. For full FT offload gradients, as FACTS.md's baseline.
    return AOOffload(trainable, torch.optim.AdamW, offload_gradients=args.job == "full",
                     lr=LR, fused=True)


def _bnb(model, trainable, args):
    if args.device != "cuda":
        raise Skip("bitsandbytes paged optimizers need CUDA")
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise Skip(f"bitsandbytes not importable ({err})") from None
    return bnb.optim.PagedAdamW8bit(trainable, lr=LR)


class _InBackward:
    """torchtune's ``optimizer_in_bwd: True`` (the stock full-finetune configs' setting), as
    its recipes build it: one optimizer per trainable parameter, stepped and zeroed in that
    parameter's post-accumulate-grad hook (torchtune's own register_optim_in_bwd_hooks).
    step() and zero_grad() after backward then do nothing; the loss is not scaled by
    1/tokens (the stock recipe cannot scale gradients the hooks already used)."""

    def __init__(self, model, make):
        from torchtune import training

        self.optimizers = {p: make([p]) for p in model.parameters() if p.requires_grad}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=self.optimizers)
        # Host seconds inside the hooks' step() calls so far: they share the thread that
        # launches backward's kernels (the hooks look step up at each call).
        self.hooks_s = 0.0
        for opt in self.optimizers.values():
            opt.step = self._timed(opt.step)
        first = next(iter(self.optimizers.values()))
        self.engine = getattr(first, "engine", None)
        self.offload_gradients = self.delayed_update = self.overlapping = False
        if hasattr(first, "host_memory_bytes"):
            self.host_memory_bytes = lambda: sum(o.host_memory_bytes() for o in self.optimizers.values())
            self.finish_step = lambda: [o.finish_step() for o in self.optimizers.values()]

    def _timed(self, step):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self.hooks_s += time.perf_counter() - t
        return timed

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass

    def scale_grads(self, factor):
        pass


def _ours_in_bwd(model, args, **kw):
    from offload_plugin import CPUOffloadOptimizer

    return _InBackward(model, lambda ps: CPUOffloadOptimizer(ps, lr=LR, host_threads=args.host_threads, **kw))


def _host_update(make):
    """``make`` with the streamed update switched off: the host update, for comparison."""
    def build(*args):
        from offload_plugin.engines import streamed

        streamed.config.enabled = False  # (each optimizer runs in a process of its own)
        return make(*args)
    return build


def _ours_default(model, args, **kw):
    """What plain Python gets: ``CPUOffloadOptimizer(model.parameters(), lr=...)`` (and
    ``optimizer_cls`` where given, nothing else)."""
    from offload_plugin import CPUOffloadOptimizer

    return CPUOffloadOptimizer(model.parameters(), lr=LR, **kw)


class _NoUpdate:
    """The floor for peak GPU memory: every gradient is freed as soon as backward has made
    it and nothing is updated. Peak memory above this run's is what an optimizer's
    gradients and state add (the issue's memory target compares that with GPU AdamW's)."""

    def __init__(self, params):
        drop = lambda p: setattr(p, "grad", None)  # noqa: E731
        self._hooks = [p.register_post_accumulate_grad_hook(drop) for p in params]

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


# name -> factory(model, trainable_params, args). One line per mode.
OPTIMIZERS = {
    "no_update": lambda m, t, a: _NoUpdate(t),
    "gpu_adamw": lambda m, t, a: torch.optim.AdamW(t, lr=LR, fused=True),
    "offload": lambda m, t, a: _ours(m, t, a),
    "offload_grads": lambda m, t, a: _ours(m, t, a, offload_gradients=True),
    "offload_nomaster": lambda m, t, a: _ours(m, t, a, master_weights=False),
    "offload_grads_nomaster": lambda m, t, a: _ours(m, t, a, offload_gradients=True,
                                                    master_weights=False),
    # Opt-in, not exact: each gradient applied one step late, host work hidden behind the
    # next step's forward and backward.
    "offload_grads_delayed": lambda m, t, a: _ours(m, t, a, offload_gradients=True,
                                                   delayed_update=True),
    "offload_grads_nomaster_delayed": lambda m, t, a: _ours(
        m, t, a, offload_gradients=True, master_weights=False, delayed_update=True),
    # Opt-in: gradients stay on the GPU until the last micro-batch (no host additions;
    # a full set of gradients in GPU memory while accumulating). Exact.
    "offload_grads_devacc": lambda m, t, a: _ours(m, t, a, offload_gradients=True,
                                                  accumulate_on_device=True),
    "offload_grads_nomaster_devacc": lambda m, t, a: _ours(
        m, t, a, offload_gradients=True, master_weights=False, accumulate_on_device=True),
    "offload_grads_nomaster_devacc_delayed": lambda m, t, a: _ours(
        m, t, a, offload_gradients=True, master_weights=False, accumulate_on_device=True,
        delayed_update=True),
    # Exact, with overlap_next_step(early_forward=True) (our recipes: early_forward=True): the
    # next forward overlaps the end of the host update.
    "offload_grads_early": lambda m, t, a: _ours(m, t, a, offload_gradients=True),
    "offload_grads_nomaster_early": lambda m, t, a: _ours(m, t, a, offload_gradients=True,
                                                          master_weights=False),
    # Opt-in, not exact: CompactAdamW's 8-bit moments and bf16 + 16-bit remainder masters.
    "offload_grads_compact": lambda m, t, a: _ours(m, t, a, offload_gradients=True, master_weights=False,
                                                   optimizer_cls="offload_plugin.CompactAdamW"),
    "offload_grads_compact_early": lambda m, t, a: _ours(m, t, a, offload_gradients=True, master_weights=False,
                                                         optimizer_cls="offload_plugin.CompactAdamW"),
    "torchao": _torchao,
    "bnb_paged8bit": _bnb,
    # No options at all, as plain Python gets it (the streamed update on a GPU), and the same
    # with the host update.
    "offload_default": lambda m, t, a: _ours_default(m, a),
    "offload_default_host": _host_update(lambda m, t, a: _ours_default(m, a)),
    # optimizer_in_bwd as torchtune's stock full-finetune configs set it, default options.
    "offload_in_bwd": lambda m, t, a: _ours_in_bwd(m, a),
    "offload_in_bwd_host": _host_update(lambda m, t, a: _ours_in_bwd(m, a)),
    # Opt-in CompactAdamW under optimizer_in_bwd, no other option: its state streamed through
    # the GPU (compact_streamed), and the same with its host update.
    "compact_in_bwd": lambda m, t, a: _ours_in_bwd(m, a, optimizer_cls="offload_plugin.CompactAdamW"),
    "compact_in_bwd_host": _host_update(lambda m, t, a: _ours_in_bwd(m, a, optimizer_cls="offload_plugin.CompactAdamW")),
    "gpu_adamw_in_bwd": lambda m, t, a: _InBackward(m, lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True)),
    # Opt-in AdamW8bit (bitsandbytes' 8-bit update, ~2 bytes of state per parameter), no other
    # option: a plain step after backward, and stepped in backward as the two above.
    "adamw8bit": lambda m, t, a: _ours_default(m, a, optimizer_cls=ADAMW8BIT),
    "adamw8bit_in_bwd": lambda m, t, a: _ours_in_bwd(m, a, optimizer_cls=ADAMW8BIT),
}
DEFAULT_OPTIMIZERS = "gpu_adamw,offload,offload_grads,torchao,bnb_paged8bit"


def _names(text):
    """A comma-separated list of names (--optimizers, --uncapped)."""
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _targets(text):
    """--targets "a=0.9,b=0.8" -> {"a": 0.9, "b": 0.8}."""
    return {k.strip(): float(v) for k, v in (item.split("=", 1) for item in _names(text))}


def base_of(names, base=None):
    """The optimizer the ratios are against: ``base`` if given, else torch's fused AdamW on
    the GPU, stepped after backward or, where only that ran, in backward."""
    names = list(names)
    if base:
        return base
    return "gpu_adamw_in_bwd" if "gpu_adamw_in_bwd" in names and "gpu_adamw" not in names else "gpu_adamw"


def skip_reason(name, args):
    """Checked in the parent, so that no child is started for an optimizer that cannot run."""
    if name in ("torchao", "bnb_paged8bit") and args.device != "cuda":
        return f"{name} needs CUDA"
    if name == "bnb_paged8bit" and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes not installed"
    return None


def _check_host_memory(trainable, args, offload_gradients=False, master_weights=True,
                       delayed_update=False, accumulate_on_device=False):
    """Warn early instead of meeting the OOM killer after minutes of pinning."""
    from offload_plugin.host import memory as host_memory

    extra = 2 if offload_gradients and delayed_update else 0  # spare + landing buffers
    if offload_gradients and args.grad_accum > 1 and not extra and not master_weights:
        extra = 1  # landing buffer for accumulated gradients (else the weight stage serves)
    need = host_memory.bytes_needed(trainable, master_weights, 2, extra)
    avail = _mem_available()
    if avail is not None and need > 0.95 * avail:
        # Only a warning: some VMs report little MemAvailable until memory is touched.
        print(f"warning: needs ~{need / GIB:.0f} GiB host memory, "
              f"{avail / GIB:.0f} GiB reported available", file=sys.stderr)


def _mem_available():
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None


# ----------------------------------------------------------------------------- child
def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def build_model(args):
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(args.seed)
    with training.set_default_dtype(torch.bfloat16), torch.device(args.device):
        if args.tiny:
            from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2

            if args.job == "qlora":
                model = lora_llama3_2(**LORA_KWARGS, quantize_base=True,
                                      max_seq_len=args.seq_len, **TINY)
            else:
                model = llama3_2(max_seq_len=args.seq_len, **dict(TINY, num_layers=args.tiny_layers))
        else:
            module, _, name = BUILDERS[(args.model, args.job)].rpartition(".")
            builder = getattr(importlib.import_module(module), name)
            model = builder(**LORA_KWARGS) if args.job == "qlora" else builder()
    if args.job == "qlora":
        set_trainable_params(model, get_adapter_params(model))
    if args.activation_checkpointing:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={TransformerSelfAttentionLayer})
    return model


def _trace_result(marks, jobs):
    """--trace: main-thread marks (host time; GPU time where the event was recorded) and
    host update jobs, in seconds from the first mark; the GPU clock is aligned with the
    host's at that mark (taken right after a synchronize)."""
    t_zero, event_zero = marks[0][1], marks[0][2]
    rows = []
    for what, t, event in marks:
        gpu = event_zero.elapsed_time(event) / 1e3 if event is not None else None
        rows.append([what, round(t - t_zero, 6), None if gpu is None else round(gpu, 6)])
    out = {"marks": rows}
    if jobs is not None:
        out["jobs_columns"] = ["start", "landed", "updated", "pushed", "numel", "order"]
        out["jobs"] = [[round(x - t_zero, 6) for x in job[:4]] + list(job[4:]) for job in jobs]
    return out


def _cpu_ticks():
    """(steal, total) CPU ticks of the whole machine so far (/proc/stat), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return fields[7], sum(fields)


def _allocator_counts():
    """torch's CUDA caching allocator so far: (alloc retries, cudaMalloc calls, cudaFree calls)."""
    stats = torch.cuda.memory_stats()
    return tuple(stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free"))


def _thp_mode():
    """Linux's transparent huge page mode (the bracketed word), or None."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def _python_probe_ms(rounds: int = 5) -> float:
    """Milliseconds a fixed pure-Python loop takes (the best of ``rounds``): the host's pace
    for the hooks' Python, to compare runs of one call."""
    best = math.inf
    for _ in range(rounds):
        t = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i & 7
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


class _GcPauses:
    """Seconds Python's cyclic collector ran in each step (gc.callbacks), to tell its pauses
    from the optimizer's own step-to-step spread."""

    def __init__(self):
        self.per_step, self._now, self._start = [], 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._now += time.perf_counter() - self._start
            self._start = None

    def end_step(self):
        self.per_step.append(round(self._now, 6))
        self._now = 0.0

    def close(self):
        gc.callbacks.remove(self._callback)


def run_single(args, name):
    """Train with one optimizer in this process; returns the result dict."""
    from torchtune import training
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    dev = args.device
    res = {"optimizer": name, "threads": torch.get_num_threads(), "notes": []}
    res["gpu_memory_limit_gib"] = None if name in _names(args.uncapped) else args.gpu_memory_gib
    if res["gpu_memory_limit_gib"] and dev != "cuda":
        res["notes"].append("--gpu-memory-gib has no effect on the CPU")
    elif res["gpu_memory_limit_gib"]:  # a smaller card: the caching allocator refuses more than this
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * GIB / total))
    if args.cpu_streamed:  # (smoke tests: the streamed engine's code on the host, as tests/ run it)
        from offload_plugin.engines import streamed

        streamed.config.on_cpu = True
    if dev == "cuda":
        res["device_name"] = torch.cuda.get_device_name()
    model = build_model(args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    res["trainable_params"] = sum(p.numel() for p in trainable)
    sync(dev)
    if dev == "cuda":
        res["model_gpu_gib"] = torch.cuda.memory_allocated() / GIB
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    # torchtune's activation offloading (the recipes' enable_activation_offloading): what
    # forward saves for backward goes to host memory and comes back when backward needs it.
    # Only under the GPU cap (a small card needs it; the uncapped baseline runs as it would).
    offloading = bool(args.activation_offloading and res["gpu_memory_limit_gib"])
    act_ctx = training.get_act_offloading_ctx_manager(model, offloading)
    if offloading:
        res["notes"].append("activation offloading")

    vocab = model.tok_embeddings.num_embeddings
    mb = args.tokens_per_step // (args.seq_len * args.grad_accum)
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, vocab, (mb, args.seq_len + 1), generator=gen).to(dev)
               for _ in range(args.grad_accum)]  # the same micro-batches every step

    try:
        t0 = time.perf_counter()
        opt = OPTIMIZERS[name](model, trainable, args)
        sync(dev)
        res["setup_s"] = time.perf_counter() - t0
        is_ours = hasattr(opt, "host_memory_bytes")
        if name == "torchao":  # it copies grads to the host inside backward's hooks
            res["notes"].append("grads copied to host during backward: scale/clip miss them"
                                + (", only the last micro-batch's grad is used"
                                   if args.job == "full" and args.grad_accum > 1 else ""))

        n_tokens = mb * args.seq_len * args.grad_accum
        # Ours with offloaded gradients, as our recipes do (recipe_utils.overlap_last_backward):
        # without clipping, updates start during the last backward (exact; the optimizer
        # applies 1/num_tokens itself); with clipping, gradients are scaled and normed
        # there, and the updates start at step(); delayed_update: weights return during
        # the last backward.
        delayed = is_ours and opt.delayed_update
        early = name.endswith("_early")
        overlap = is_ours and opt.offload_gradients
        from offload_plugin.recipe_utils import overlap_last_backward

        marks = None  # --trace: (what, host seconds, GPU event or None) for traced steps

        def mark(what):
            if marks is not None:
                event = None
                if dev == "cuda":
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                marks.append((what, time.perf_counter(), event))

        def forward_backward(overlap=overlap):
            total = torch.zeros((), device=dev)
            for i, tokens in enumerate(batches):
                if overlap and i == len(batches) - 1:
                    overlap_last_backward(opt, torch.tensor(n_tokens), args.clip_grad_norm,
                                          early_forward=early)
                inputs, labels = tokens[:, :-1], tokens[:, 1:]
                mark("forward")
                with act_ctx:
                    logits = model(inputs)
                loss = loss_fn(logits, labels) * labels.numel()  # summed over tokens
                del logits
                mark("backward")
                loss.backward()
                mark("backward_launched")
                total += loss.detach()
            return total

        def scale_clip():
            n = n_tokens
            if isinstance(opt, _InBackward):
                return  # the hooks stepped with the unscaled gradients, as the stock recipe
            if is_ours:
                if not opt.overlapping:
                    opt.scale_grads(1.0 / n)
                if args.clip_grad_norm:
                    opt.clip_grad_norm_(args.clip_grad_norm)
            else:
                training.scale_grads(model, torch.tensor(1.0 / n))
                if args.clip_grad_norm:
                    torch.nn.utils.clip_grad_norm_(trainable, args.clip_grad_norm)

        times, losses = [], []
        # How fast the host ran this run: runs of one call that differ only in the host's pace
        # (in-backward steps share a thread with the hooks' Python) show it here.
        res["python_probe_ms"] = _python_probe_ms()
        hooks = [opt.hooks_s] if isinstance(opt, _InBackward) else []
        gc_pauses = _GcPauses()  # Python's collector stops every thread holding the GIL
        busy = [opt.engine.worker.busy_s] if is_ours else []  # host worker's job seconds so far
        waited = [opt.engine.worker.waited_s] if is_ours else []  # ...spent waiting for copies
        ticks = []
        # The caching allocator's work per step: under a GPU cap a step that cannot find a
        # cached block frees the cache (cudaFree waits for the whole device) and retries.
        allocs = [_allocator_counts()] if dev == "cuda" else []
        for step in range(args.steps):
            if step == args.warmup:
                ticks.append(_cpu_ticks())
            if args.trace and step == args.steps - 2:  # the last two steps
                marks = []
                if is_ours:
                    opt.engine.worker.trace = []
            synced = args.timing == "sync" or step == 0
            if synced:
                sync(dev)
                t0 = time.perf_counter()
            mark("step")
            total = forward_backward()
            scale_clip()
            mark("opt_step")
            opt.step()
            mark("opt_step_returned")
            opt.zero_grad(set_to_none=True)
            # (early_forward: what step() left running is timed in the next step, whose
            # forward overlaps it, so every timed step holds one step's updates.)
            if args.timing == "sync":
                sync(dev)
            loss = total.item()  # (--timing item: the step ends here, and the next begins)
            end = time.perf_counter()
            times.append(end - t0)
            t0 = end
            gc_pauses.end_step()
            losses.append(loss / args.tokens_per_step)
            if is_ours:
                busy.append(opt.engine.worker.busy_s)
                waited.append(opt.engine.worker.waited_s)
            if hooks:
                hooks.append(opt.hooks_s)
            if allocs:
                allocs.append(_allocator_counts())
            print(f"[{name}] step {step}: {times[-1]:.3f} s, loss {losses[-1]:.4f}",
                  file=sys.stderr, flush=True)
        def one_step():
            forward_backward()
            scale_clip()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(dev)
        if args.profile_bus and dev == "cuda" and is_ours:
            try:  # one more step, profiled: where its copies ran (bench/bus.py's copy_window)
                sync(dev)
                res.update(bus.copy_window(one_step))
            except Exception as err:  # (the profiler's trouble is not the optimizer's)
                res["notes"].append(f"--profile-bus failed: {type(err).__name__}: {str(err)[:200]}")
        if args.profile_steps and dev == "cuda":
            # More steps, each profiled on its own: whether a slow step's copies ran slower
            # (the bus), its kernels longer (the GPU), or neither (gaps: the host, waits).
            try:
                sync(dev)
                res["step_profiles"] = [bus.copy_window(one_step) for _ in range(args.profile_steps)]
            except Exception as err:
                res["notes"].append(f"--profile-steps failed: {type(err).__name__}: {str(err)[:200]}")
        if is_ours:
            opt.finish_step()
        if marks:
            res["trace"] = _trace_result(marks, opt.engine.worker.trace if is_ours else None)
            if is_ours:
                opt.engine.worker.trace = None
        gc_pauses.close()
        res["gc_s_per_step"] = gc_pauses.per_step
        timed = times[args.warmup:]
        # The median timed step: a pause of Python's cyclic collector (0.2 s at 8B, in the
        # step it falls in) lands in one run's timed steps and another's warm-up by chance,
        # and would move a mean of six steps by 5%; gc_s_per_step shows where it fell.
        res.update(step_times=times, losses=losses, step_s=statistics.median(timed),
                   step_mean_s=sum(timed) / len(timed))
        res["tokens_per_s"] = args.tokens_per_step / res["step_s"]
        ticks.append(_cpu_ticks())
        if None not in ticks and len(ticks) == 2 and ticks[1][1] > ticks[0][1]:
            # The share of the machine's CPU time its hypervisor gave to others while timed.
            res["cpu_steal"] = (ticks[1][0] - ticks[0][0]) / (ticks[1][1] - ticks[0][1])
        if allocs:  # per step: (alloc retries, cudaMalloc calls, cudaFree calls)
            res["allocator_per_step"] = [[b - a for a, b in zip(x, y)] for x, y in zip(allocs, allocs[1:])]
            res["alloc_retries"] = sum(x[0] for x in res["allocator_per_step"][args.warmup:])
        if hooks:  # the hooks' step() calls' host seconds, the median timed step's
            res["hooks_s"] = statistics.median(b - a for a, b in zip(hooks[args.warmup:], hooks[args.warmup + 1:]))
        if busy:  # host work per timed step, to set against step_s: host-bound or stalled?
            res["host_busy_s"] = (busy[-1] - busy[args.warmup]) / len(timed)
            res["host_wait_s"] = (waited[-1] - waited[args.warmup]) / len(timed)

        if args.measure_host_update and is_ours and not delayed and not isinstance(opt, _InBackward):
            # The optimizer step alone: gradients in place, nothing else queued on the GPU.
            forward_backward(overlap=False)
            scale_clip()
            sync(dev)
            upd = []
            for _ in range(3):
                t0 = time.perf_counter()
                opt.step()
                sync(dev)
                upd.append(time.perf_counter() - t0)
            opt.zero_grad(set_to_none=True)
            res["host_update_s"] = min(upd)
            res["host_update_gparams_s"] = res["trainable_params"] / min(upd) / 1e9
        if is_ours:
            res["opt_host_gib"] = opt.host_memory_bytes() / GIB
            res.update(bus.streamed_bytes(opt) or {})  # what each step moved over the bus
    except Skip:
        raise
    except BaseException as err:  # OOM and friends: record and report, don't crash the run
        msg = str(err).strip().splitlines()
        res["error"] = f"{type(err).__name__}: {msg[0][:300] if msg else ''}"
    finally:
        if dev == "cuda":
            res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / GIB
            res["reserved_gpu_gib"] = torch.cuda.max_memory_reserved() / GIB
        res["host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
        res["host_huge_gib"] = bus.huge_page_gib()
    return res


def child_main(args):
    try:
        res = run_single(args, args.single)
    except Skip as err:
        res = {"optimizer": args.single, "skipped": str(err)}
    except BaseException as err:  # failed before the optimizer (model build, imports)
        msg = str(err).strip().splitlines()
        res = {"optimizer": args.single,
               "error": f"{type(err).__name__}: {msg[0][:300] if msg else ''}"}
    print(MARKER + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- parent
NONFINITE = "inf or NaN"  # (in offload_plugin's warnings of skipped steps)


def run_child(name, args):
    """Run this script with --single NAME; echo its output, return its result line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--single", name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(args.child_timeout, proc.kill)
    timer.start()
    tail, result, skips = collections.deque(maxlen=5), None, 0
    for line in proc.stdout:
        if MARKER in line:
            result = json.loads(line.split(MARKER, 1)[1])
        else:
            sys.stderr.write(f"  | {line}")
            skips += NONFINITE in line
            if line.strip():
                tail.append(line.strip())
    rc = proc.wait()
    timer.cancel()
    if result is None:
        why = {-9: "killed (SIGKILL: host out of memory, or --child-timeout)"}.get(rc, "")
        result = {"optimizer": name,
                  "error": f"child exited with {rc} {why}: {' / '.join(tail)[-300:]}"}
    if skips:  # (our optimizers' reports of steps skipped for an inf or NaN gradient)
        result["nonfinite_reports"] = skips
        result.setdefault("notes", []).append(f"{skips} steps reported skipped for an inf or NaN gradient: "
                                              "not a clean run")
    return result


def cpu_adamw_reference(numel, cap):
    """torch's fused CPU AdamW on flat fp32 tensors: params/s with this process's threads."""
    n = min(numel, cap)
    p = torch.zeros(n, dtype=torch.float32, requires_grad=True)
    p.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([p], lr=LR, fused=True)
    opt.step()  # allocates the state
    t0 = time.perf_counter()
    for _ in range(3):
        opt.step()
    rate = 3 * n / (time.perf_counter() - t0)
    return {"numel": n, "threads": torch.get_num_threads(), "gparams_s": rate / 1e9,
            "projected_s_full_size": numel / rate}


def _fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def column(header, key, nd=3):
    """A results-table column: its header and how a result fills it."""
    return header, lambda r: _fmt(r.get(key), nd)


COLUMNS = [
    column("median step s", "step_s"),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    column("peak GPU GiB", "peak_gpu_gib", 1),
    column("reserved GiB", "reserved_gpu_gib", 1),
    column("host RSS GiB", "host_rss_gib", 1),
    column("opt host GiB", "opt_host_gib", 1),
    column("setup s", "setup_s", 1),
    column("host update s", "host_update_s"),
    column("host busy s/step", "host_busy_s"),
    column("of which waiting s", "host_wait_s"),
]


def _added_memory(results, base):
    """Peak GPU memory above the no_update run's (gradients and optimizer state), as a
    column and as a fraction of ``base``'s; None without a no_update run."""
    floor_run = next((r for r in results if r["optimizer"] == "no_update"), None)
    if floor_run is None:
        return None
    floor = floor_run.get("peak_gpu_gib")  # None on CPU: the columns show "-"
    added = lambda r: (r["peak_gpu_gib"] - floor  # noqa: E731
                       if floor is not None and r.get("peak_gpu_gib") is not None else None)
    base_added = added(base) if base else None

    def share(r):
        a = added(r)
        return f"{100 * a / base_added:.1f}%" if a is not None and base_added else "-"
    return [("added GiB", lambda r: _fmt(added(r), 2)), ("added / base", share)]


def window_use(r):
    """The share of the bus used within the profiled step's copy window, each way."""
    each = [r.get(f"bus_use_{kind}_window") for kind in ("h2d", "d2h")]
    return " / ".join("-" if x is None else f"{100 * x:.0f}%" for x in each) if any(each) else "-"


def _gib_or_none(x):
    return "none" if x is None else f"{x:g}"


def _extra_columns(results, base):
    """Columns shown only where some result has what they show: the GPU cap where runs of
    one table had different ones (--uncapped), the bus (bytes moved per step each way by a
    streamed run, and with a bandwidth its share of the bus), and --targets."""
    cols = []
    if len({r.get("gpu_memory_limit_gib") for r in results if "step_s" in r}) > 1:
        cols.append(("GPU cap GiB", lambda r: _gib_or_none(r.get("gpu_memory_limit_gib"))))
    if any(r.get("bytes_h2d_per_step") for r in results):
        gb = lambda key: lambda r: _fmt(r[key] / 1e9 if r.get(key) else None, 2)  # noqa: E731
        cols += [("H2D GB/step", gb("bytes_h2d_per_step")), ("D2H GB/step", gb("bytes_d2h_per_step"))]
        if any(r.get("bus_use") is not None for r in results):
            cols += [column("bus floor s", "bus_floor_s"),
                     ("bus use", lambda r: "-" if r.get("bus_use") is None else f"{100 * r['bus_use']:.0f}%")]
        if any(r.get("bus_use_h2d_window") is not None for r in results):
            cols.append(("bus use while copying (h2d / d2h)", window_use))
    if any(r.get("hooks_s") is not None for r in results):  # (in-backward runs)
        cols += [column("hooks host s/step", "hooks_s"), column("Python probe ms", "python_probe_ms", 1),
                 column("huge-page GiB", "host_huge_gib", 1),
                 ("CPU steal", lambda r: "-" if r.get("cpu_steal") is None else f"{100 * r['cpu_steal']:.1f}%"),
                 column("GPU alloc retries", "alloc_retries", 0)]
    if any(r.get("target_vs_base") for r in results):
        speed = lambda r: (r["tokens_per_s"] / base["tokens_per_s"]  # noqa: E731
                           if base.get("tokens_per_s") and r.get("tokens_per_s") else None)
        cols += [("tokens/s / base", lambda r: _fmt(speed(r), 2) + ("x" if speed(r) else "")),
                 ("target", lambda r: f">= {r['target_vs_base']:.2f}x" if r.get("target_vs_base") else "-"),
                 ("met", lambda r: "-" if not r.get("target_vs_base") or speed(r) is None
                  else ("yes" if speed(r) >= r["target_vs_base"] else "**no**"))]
    return cols


def markdown_table(results, columns=COLUMNS, base_name=None):
    """One row per optimizer; ratios are against ``base_name`` when it ran (by default
    torch's fused AdamW on the GPU: ``base_of``)."""
    base_name = base_of([r["optimizer"] for r in results], base_name)
    base = next((r for r in results if r["optimizer"] == base_name and "step_s" in r), {})
    columns = list(columns) + _extra_columns(results, base) + (_added_memory(results, base) or [])
    heads = ["optimizer", *(h for h, _ in columns), f"step / {base_name}", f"peak / {base_name}"]
    rows = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in results:
        if "step_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r.get('error')}"
            rows.append(f"| {r['optimizer']} | {why} |" + " |" * (len(heads) - 2))
            continue
        ratio = lambda k: (f"{r[k] / base[k]:.2f}x"  # noqa: E731
                           if base.get(k) and r.get(k) is not None else "-")
        cells = [r["optimizer"], *(fill(r) for _, fill in columns), ratio("step_s"), ratio("peak_gpu_gib")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def step_profile_table(result):
    """--profile-steps: one row per profiled step, its wall time beside the time its kernels
    and its copies each way ran (a slow step shows which grew), and the copies' GB/s while
    they ran, from the bytes a step moves."""
    lines = [f"Profiled steps of {result['optimizer']} (synchronized, one at a time):", "",
             "| step | wall s | kernels busy s | H2D busy s | D2H busy s | H2D GB/s while copying | D2H GB/s while copying |",
             "|---|---|---|---|---|---|---|"]
    for i, p in enumerate(result["step_profiles"]):
        rate = {k: (result.get(f"bytes_{k}_per_step") or 0) / p[f"{k}_busy_s"] / 1e9
                if p.get(f"{k}_busy_s") and result.get(f"bytes_{k}_per_step") else None for k in ("h2d", "d2h")}
        lines.append(f"| {i + 1} | {_fmt(p.get('profiled_step_s'))} | {_fmt(p.get('kernel_busy_s'))} | "
                     f"{_fmt(p.get('h2d_busy_s'))} | {_fmt(p.get('d2h_busy_s'))} | {_fmt(rate['h2d'], 1)} | "
                     f"{_fmt(rate['d2h'], 1)} |")
    return "\n".join(lines)


def reference_line(ref, trainable):
    return (f"Host reference: torch fused AdamW on CPU, fp32, {ref['threads']} thread(s), "
            f"{ref['numel']:,} elements: {ref['gparams_s']:.2f} G params/s, i.e. "
            f"{ref['projected_s_full_size']:.3f} s for the {trainable:,} trainable params.")


def describe(run):
    """A one-line heading for a results JSON."""
    a = run["args"]
    model = "tiny" if a["tiny"] else a["model"]
    extra = (f", grad accum {a['grad_accum']}" if a["grad_accum"] > 1 else "") + (
        ", activation checkpointing" if a["activation_checkpointing"] else "") + (
        ", activation offloading (capped runs)" if a.get("activation_offloading") else "") + (
        f", clip {a['clip_grad_norm']}" if a.get("clip_grad_norm") else "") + (
        ", early_forward" if a.get("early_forward") else "") + (  # (older runs' flag)
        f", host_threads {a['host_threads']}" if a.get("host_threads") else "") + (
        f", GPU capped at {a['gpu_memory_gib']:g} GiB" if a.get("gpu_memory_gib") else "") + (
        f" (not {', '.join(_names(a['uncapped']))})" if a.get("gpu_memory_gib") and a.get("uncapped") else "") + (
        ", steps timed back to back to the loss's .item()" if a.get("timing") == "item" else "")
    return (f"{model} {a['job']}, {a['tokens_per_step']} tokens/step, seq {a['seq_len']}"
            f"{extra} ({run.get('gpu') or a['device']}, {run['date']})")


def measured_bus(args, out):
    """The pinned copy bandwidth: read from --bus-json, or measured (--measure-bus) by
    bench/bus.py in a process of its own after the runs (this one keeps off the GPU)."""
    if args.bus_json:
        try:
            return dict(json.loads(Path(args.bus_json).read_text()), source=args.bus_json)
        except (OSError, ValueError) as err:
            print(f"warning: no bandwidth from {args.bus_json}: {err}", file=sys.stderr)
            return None
    if not args.measure_bus:
        return None
    out = Path(out).with_suffix(".bus.json")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bus.py"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        print(f"warning: bench/bus.py failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    got = json.loads(out.read_text())
    out.unlink()
    return dict(got, source="measured after the runs (bench/bus.py)")


def bus_line(bandwidth):
    return (f"Bus: pinned copies host->GPU {bandwidth['h2d_GBps']} GB/s, GPU->host "
            f"{bandwidth['d2h_GBps']} GB/s, both at once {bandwidth['both_GBps_each_way']} GB/s each way "
            f"({bandwidth.get('source', '')}); \"bus use\" is bytes each way / step s / that.")


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit():
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True,  # noqa: E731
                                        text=True, timeout=10).stdout.strip()
        head = git("rev-parse", "HEAD") or None
        # Uncommitted changes to the code make HEAD a wrong label for the numbers.
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "offload_plugin", "bench")
        return f"{head}+uncommitted" if head and dirty else head
    except (OSError, subprocess.SubprocessError):
        return None


def parent_main(args):
    names = _names(args.optimizers)
    unknown = [n for n in names + _names(args.uncapped) + list(_targets(args.targets)) if n not in OPTIMIZERS]
    if unknown:
        sys.exit(f"unknown optimizers {unknown}; known: {', '.join(OPTIMIZERS)}")
    date = datetime.date.today().isoformat()
    model = "tiny" if args.tiny else args.model
    out = args.out or REPO / "bench" / "results" / "train" / (
        f"{date}-{model}-{args.job}-{args.tokens_per_step}"
        + (f"-ga{args.grad_accum}" if args.grad_accum > 1 else "")
        + ("-ac" if args.activation_checkpointing else "")
        + ("-ao" if args.activation_offloading else "") + ".json")

    results = []
    started = time.perf_counter()
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        reason = skip_reason(name, args)
        if not reason and args.time_budget and t0 - started + args.child_timeout > args.time_budget:
            reason = (f"not started: {t0 - started:.0f} s of the {args.time_budget:.0f} s budget spent, "
                      f"a run may take {args.child_timeout:.0f} s")
        res = {"optimizer": name, "skipped": reason} if reason else run_child(name, args)
        res["wall_s"] = time.perf_counter() - t0
        if "skipped" in res:
            print(f"== {name}: skipped ({res['skipped']})", file=sys.stderr)
        results.append(res)

    trainable = next((r["trainable_params"] for r in results if r.get("trainable_params")), 0)
    ref = cpu_adamw_reference(trainable, args.ref_numel_cap) if trainable and args.ref_numel_cap > 0 else None
    bandwidth = measured_bus(args, out)
    targets = _targets(args.targets)
    for r in results:
        r.update(bus.use(r, bandwidth))
        if r["optimizer"] in targets:
            r["target_vs_base"] = targets[r["optimizer"]]
    run = {
        "date": date,
        "gpu": next((r["device_name"] for r in results if r.get("device_name")), None),
        "versions": {p: _version(p) for p in
                     ("torch", "torchtune", "torchao", "bitsandbytes", "offload-plugin")},
        "git_commit": _git_commit(),
        "host_cpus": os.cpu_count(),
        "transparent_hugepage": _thp_mode(),
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "args": {k: v for k, v in vars(args).items() if k not in ("single", "out")},
        "trainable_params": trainable,
        "cpu_adamw_reference": ref,
        "bus": bandwidth,
        "base": base_of(names, args.base),
        "results": results,
    }
    table = markdown_table(results, base_name=run["base"])
    print(f"\n### {describe(run)}\n\n{table}")
    if ref:
        print("\n" + reference_line(ref, trainable))
    if bandwidth:
        print("\n" + bus_line(bandwidth))
    for r in results:
        if r.get("step_profiles"):
            print("\n" + step_profile_table(r))
    for r in results:
        if r.get("nonfinite_reports"):
            print(f"\nwarning: {r['optimizer']}: {r['nonfinite_reports']} steps reported skipped for an inf or "
                  "NaN gradient (not a clean run)")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(run, indent=2) + "\n")
    print(f"\nwrote {out}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted({m for m, _ in BUILDERS}), default="llama3_2_1b")
    p.add_argument("--job", choices=["full", "qlora"], default="full")
    p.add_argument("--tiny", action="store_true",
                   help="2-layer 128-dim Llama-3.2-shaped model, vocab 512 (smoke tests)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tokens-per-step", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--activation-offloading", action="store_true",
                   help="torchtune's activation offloading (enable_activation_offloading) for the runs under "
                        "--gpu-memory-gib: the activations saved for backward wait in host memory (more tokens "
                        "per step on a small GPU); --uncapped runs go without")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timing", choices=("sync", "item"), default="sync",
                   help="what a step's time ends at: sync, the whole device idle (every stream, the default); "
                        "item, the loss's .item() (the compute stream), as torchtune's loop waits each step for its "
                        "log line, steps then timed back to back: work left on other streams (the streamed "
                        "update's last copies out) overlaps the next forward, as in a recipe")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (step_s) and the mean (step_mean_s)")
    p.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS,
                   help=f"comma-separated, from: {', '.join(OPTIMIZERS)}")
    p.add_argument("--clip-grad-norm", type=float, default=None)
    p.add_argument("--trace", action="store_true",
                   help="record a timeline of the last two steps (main thread and, for ours, "
                        "each host update job) in the results")
    p.add_argument("--measure-host-update", action="store_true",
                   help="also time our optimizer's step() alone (gradients in place)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: torch's; 1 with --device cpu, "
                        "where a busy core makes 2 threads crawl)")
    p.add_argument("--host-threads", type=int, default=None,
                   help="CPUOffloadOptimizer(host_threads=...) (default: all cores but one)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="limit the GPU memory torch may allocate (set_per_process_memory_fraction)")
    p.add_argument("--device-fraction", type=float, default=0.0,
                   help="CPUOffloadOptimizer(device_fraction=...): share updated on the GPU")
    p.add_argument("--ref-numel-cap", type=int, default=2**28,
                   help="max elements for the standalone CPU AdamW figure (16 B each)")
    p.add_argument("--child-timeout", type=float, default=1800, help="seconds per optimizer")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole invocation: an optimizer whose run could end past it "
                        "(--child-timeout) is not started, and recorded as skipped")
    p.add_argument("--uncapped", default="",
                   help="comma-separated optimizers that run without --gpu-memory-gib's cap (the "
                        "uncapped baseline in the same invocation as capped runs)")
    p.add_argument("--base", default=None,
                   help="the optimizer the ratios are against (default gpu_adamw, or gpu_adamw_in_bwd "
                        "where only that ran)")
    p.add_argument("--targets", default="",
                   help='comma-separated NAME=RATIO: the tokens/s each should reach against the base '
                        '(e.g. "adamw8bit_in_bwd=0.9"), shown with the result')
    p.add_argument("--measure-bus", action="store_true",
                   help="measure the pinned copy bandwidth (bench/bus.py) after the runs, for the "
                        "bus columns (bytes moved per step / step s / bandwidth)")
    p.add_argument("--profile-bus", action="store_true",
                   help="profile one more step of ours (torch.profiler, CUDA): the window from its first "
                        "host<->GPU copy to its last, for the bus use while the step transfers")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then profile this many more steps of each CUDA run, one at a time: each one's wall "
                        "time, and the time its copies each way and its kernels ran (step_profiles)")
    p.add_argument("--bus-json", default=None,
                   help="the copy bandwidth measured before (bench/bus.py --json), instead")
    p.add_argument("--label", default=None,
                   help="a name shared by the invocations of one results table (bench/report.py "
                        "prints their runs together)")
    p.add_argument("--tiny-layers", type=int, default=TINY["num_layers"],
                   help="with --tiny: its number of layers (bench/what_fits.py's smoke test)")
    p.add_argument("--cpu-streamed", action="store_true",
                   help="smoke tests with --device cpu: run the streamed update's code on the host "
                        "(as tests/ do), so that the bus columns are filled")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: child mode
    args = p.parse_args(argv)
    if args.tokens_per_step % (args.seq_len * args.grad_accum):
        p.error("--tokens-per-step must be a multiple of --seq-len x --grad-accum")
    if not 0 <= args.warmup < args.steps:
        p.error("need 0 <= --warmup < --steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu)")
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


if __name__ == "__main__":
    _args = parse_args()
    child_main(_args) if _args.single else parent_main(_args)
