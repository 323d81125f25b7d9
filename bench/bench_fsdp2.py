"""FSDP2 full fine-tuning on N GPUs of one host: each optimizer's step time and memory.

The distributed twin of ``bench_train.py``: the same random-init bf16 torchtune model on
every rank (same seed), sharded with torchtune's ``shard_model`` (one FSDP2 unit per
transformer layer, plus embedding and output as in torchtune's 8B_full config, plus the
root), random tokens (each rank its own micro-batches, the same every step), chunked
cross-entropy summed over tokens, gradients scaled by ``world_size / global_tokens`` (FSDP2
averages gradients over ranks, so this gives the gradient of the global token mean, as
torchtune's distributed recipe scales), optional clipping, ``step()``, ``zero_grad()``.

Optimizers: ``fsdp_gpu_adamw`` (torch's fused AdamW on the GPU shards),
``fsdp_cpu_offload_policy`` (FSDP2's ``CPUOffloadPolicy``: shards, gradients and torch's
AdamW on the host, as torchtune's ``fsdp_cpu_offload=True``), and ours
(``offload_plugin.CPUOffloadOptimizer``, each rank offloading its own shard). Each runs
in a fresh ``torchrun`` (this script with ``--single NAME``), under a timeout; a failure,
skip or timeout is recorded and the run goes on.

    # on a 2-GPU machine, from the repository root
    python bench/bench_fsdp2.py --model llama3_1_8b --nproc 2 --tokens-per-step 16384 \\
        --seq-len 2048 --grad-accum 2 --activation-checkpointing --steps 4 --warmup 1
    # CPU smoke test (gloo); CPUOffloadPolicy is skipped there
    python bench/bench_fsdp2.py --tiny --device cpu --tokens-per-step 1024 --seq-len 128 \\
        --grad-accum 2 --steps 3 --warmup 1 --optimizers fsdp_gpu_adamw,offload_grads

Writes JSON (``"kind": "fsdp2"``; default ``bench/results/fsdp2/<date>-fsdp2-<model>-full-<tokens>...``)
that ``bench/report.py`` renders with the single-GPU results.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402
from bench_train import GIB, LR, MARKER, REPO, TINY, _git_commit, _version, column  # noqa: E402

CHILD_ARGS = "BENCH_FSDP2_CHILD_ARGS"
PARTIAL = "BENCH_STEPS "
BASE = "fsdp_gpu_adamw"
POLICY = "fsdp_cpu_offload_policy"
# Modules sharded on their own besides the transformer layers: torchtune's 8B_full config
# (custom_sharded_layers). The tiny model ties its output to the embedding, so neither
# can be a unit of its own there.
SEPARATE_UNITS = {"llama3_1_8b": ["tok_embeddings", "output"], "tiny": None}


def _ours(model, args, **kw):
    from offload_plugin import CPUOffloadOptimizer

    kw.setdefault("master_weights", True)  # names without "nomaster": fp32 masters, as recorded
    return CPUOffloadOptimizer(model.parameters(), lr=args.lr, fused=True,
                               host_threads=args.host_threads, **kw)


# name -> factory(sharded_model, args). torch's AdamW takes DTensor shards, fused too.
OPTIMIZERS = {
    BASE: lambda m, a: torch.optim.AdamW(m.parameters(), lr=a.lr, fused=True),
    # torchtune's 8B_full config with fsdp_cpu_offload=True builds the same fused AdamW,
    # now over CPU shards: torch's fused CPU kernel (bf16 state, like the GPU variant), with
    # os.cpu_count() // num_gpus threads per rank (torchtune's set_torch_num_threads; ours
    # gets the same). Its 70B configs recommend fused=True with CPU offload too.
    POLICY: lambda m, a: torch.optim.AdamW(m.parameters(), lr=a.lr, fused=True),
    "offload": lambda m, a: _ours(m, a),
    "offload_grads": lambda m, a: _ours(m, a, offload_gradients=True),
    "offload_grads_nomaster": lambda m, a: _ours(m, a, offload_gradients=True, master_weights=False),
}
DEFAULT_OPTIMIZERS = f"{BASE},offload_grads,offload_grads_nomaster,{POLICY}"


def skip_reason(name, args):
    if name == POLICY and args.device != "cuda":
        # torch 2.13 on CPU: "Cannot access accelerator device when none is available"
        # (the policy pins the host shards).
        return "CPUOffloadPolicy needs CUDA (it pins the host shards)"
    return None


# ----------------------------------------------------------------------------- child
def _die_with_launcher():
    """torchrun starts each rank in its own session: if the launcher is killed (timeout),
    the ranks must not live on holding GPU and pinned host memory."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def build_sharded_model(args, dev, mesh, cpu_offload):
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    torch.manual_seed(args.seed)  # every rank builds the same full model, keeps its shard
    with training.set_default_dtype(torch.bfloat16), dev:
        if args.tiny:
            from torchtune.models.llama3_2._component_builders import llama3_2

            model = llama3_2(max_seq_len=args.seq_len, **TINY)
        else:
            from torchtune.models.llama3_1 import llama3_1_8b

            model = llama3_1_8b()
    if args.activation_checkpointing:  # before sharding, as torchtune's recipe does
        training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    names = SEPARATE_UNITS["tiny" if args.tiny else args.model]
    # With cpu_offload, FSDP2 copies each shard of the GPU-built model to pinned host memory.
    training.shard_model(model, [partial(training.get_shard_conditions, names_to_match=names)],
                         cpu_offload=cpu_offload, dp_mesh=mesh)
    return model


def run_single(args, name, rank, world, dev):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtune import training
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def reduce(values, op):  # one collective for several numbers
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op)
        return t.tolist()

    res = {"optimizer": name, "threads": torch.get_num_threads(), "notes": []}
    if cuda:
        res["device_name"] = torch.cuda.get_device_name()
    mesh = init_device_mesh(dev.type, (world,))
    model = build_sharded_model(args, dev, mesh, cpu_offload=name == POLICY)
    res["params"] = sum(p.numel() for p in model.parameters())  # DTensor numel: global
    if cuda:
        # The full model built before sharding is gone: measure training from here.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        res["model_gpu_gib"] = reduce([torch.cuda.memory_allocated() / GIB], dist.ReduceOp.MAX)[0]
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)

    mb = args.tokens_per_step // (world * args.seq_len * args.grad_accum)  # sequences per micro-batch
    vocab = model.tok_embeddings.num_embeddings
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, vocab, (args.grad_accum, world * mb, args.seq_len + 1), generator=gen)
    batches = list(tokens[:, rank * mb:(rank + 1) * mb].to(dev).unbind(0))  # this rank's share
    scale = world / args.tokens_per_step

    sync()
    t0 = time.perf_counter()
    opt = OPTIMIZERS[name](model, args)
    sync()
    setup_s = time.perf_counter() - t0
    ours = hasattr(opt, "host_memory_bytes")
    if ours:
        res["host_threads"] = opt.host_threads
    # As bench_train: with offloaded gradients and no clipping, the last backward already
    # feeds the updates (sharded: their transfers; step() applies grad_scale).
    overlap = ours and opt.offload_gradients and not args.clip_grad_norm

    def forward_backward():
        total = torch.zeros((), device=dev)
        for i, toks in enumerate(batches):
            if overlap and i == len(batches) - 1:
                opt.overlap_next_step(grad_scale=scale)
            labels = toks[:, 1:]
            loss = loss_fn(model(toks[:, :-1]), labels) * labels.numel()  # summed over tokens
            loss.backward()
            total += loss.detach()
        return total

    times, losses = [], []
    busy = lambda: getattr(opt.engine.worker, "busy_s", 0.0) if ours else 0.0  # noqa: E731
    for step in range(args.steps):
        if step == args.warmup:
            busy0 = busy()
        sync()
        reduce([0.0], dist.ReduceOp.SUM)  # a barrier: all ranks start the step together
        t0 = time.perf_counter()
        total = forward_backward()
        if ours:
            if not opt.overlapping:
                opt.scale_grads(scale)
            if args.clip_grad_norm:
                opt.clip_grad_norm_(args.clip_grad_norm)
        else:
            training.scale_grads(model, torch.tensor(scale))
            if args.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)  # the logged loss covers every rank's tokens
        losses.append(total.item() / args.tokens_per_step)
        sync()
        times.append(time.perf_counter() - t0)
        if rank == 0:  # the parent keeps the latest, for a run stopped by its timeout
            print(PARTIAL + json.dumps({"step_times": times, "losses": losses}), flush=True)
            print(f"[{name}] step {step}: {times[-1]:.3f} s, loss {losses[-1]:.6f}",
                  file=sys.stderr, flush=True)
    timed = times[args.warmup:]
    # Slowest rank: the step is as slow as it (the collectives wait for it anyway).
    # Host work per timed step (ours), to set against step_s: host-bound or stalled?
    host_busy_s = (busy() - busy0) / len(timed)
    step_s, res["setup_s"], host_busy_s = reduce(
        [sum(timed) / len(timed), setup_s, host_busy_s], dist.ReduceOp.MAX)
    res["host_busy_s"] = host_busy_s if ours else None
    res.update(step_times=times, losses=losses, step_s=step_s,
               tokens_per_s=args.tokens_per_step / step_s)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    opt_host = opt.host_memory_bytes() / GIB if ours else 0.0
    res["host_rss_gib"], opt_host = reduce([rss, opt_host], dist.ReduceOp.SUM)  # all ranks
    res["opt_host_gib"] = opt_host if ours else None
    peaks = [rss] + ([torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB]
                     if cuda else [])
    peaks = reduce(peaks, dist.ReduceOp.MAX)
    res["host_rss_gib_max_rank"] = peaks[0]
    if cuda:
        res["peak_gpu_gib"], res["reserved_gpu_gib"] = peaks[1:]
    return res


def child_main(args):
    _die_with_launcher()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        # Ours reduces on the mesh's device (NCCL). CPUOffloadPolicy's host gradients need
        # gloo beside NCCL (clip_grad_norm_), which torchtune adds with fsdp_cpu_offload.
        backend = "cuda:nccl,cpu:gloo" if args.single == POLICY else "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    try:
        res = run_single(args, args.single, rank, world, dev)
    except BaseException as err:  # OOM and friends: record and report
        msg = str(err).strip().splitlines()
        res = {"optimizer": args.single, "rank": rank,
               "error": f"{type(err).__name__}: {msg[0][:300] if msg else ''}"}
        if dev.type == "cuda":  # this rank's own numbers: no collectives after a failure
            res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / GIB
        print(MARKER + json.dumps(res), flush=True)
        sys.stderr.flush()
        os._exit(1)  # torchrun then stops the other ranks, which may wait in a collective
    if rank == 0:
        print(MARKER + json.dumps(res), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent
def run_child(name, args, timeout):
    """One torchrun with --single NAME; echo its output, return rank 0's (or an error) result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(args.nproc), str(Path(__file__).resolve())]
    # The arguments travel in the environment: torchrun's parser would take --nproc, even
    # after the script, as an abbreviation of its own --nproc-per-node.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               **{CHILD_ARGS: json.dumps([*sys.argv[1:], "--single", name])})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO)
    tail, partial = collections.deque(maxlen=5), {}

    def stop():  # SIGTERM: torchrun stops its ranks; SIGKILL if it does not exit in time
        done = f", {len(partial.get('step_times', []))} step(s) done"
        last = f" (last output: {' / '.join(list(tail))[-300:]})"
        results.append({"optimizer": name, "error": f"timed out after {timeout:.0f} s{done}{last}",
                        **partial})
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    results = []
    timer = threading.Timer(timeout, stop)
    timer.start()
    for line in proc.stdout:
        if MARKER in line:
            results.append(json.loads(line.split(MARKER, 1)[1]))
        elif PARTIAL in line:
            partial = json.loads(line.split(PARTIAL, 1)[1])
        else:
            sys.stderr.write(f"  | {line}")
            if line.strip():
                tail.append(line.strip())
    rc = proc.wait()
    timer.cancel()
    # Rank 0's result even if the exit hung; else the first rank to fail (or the timeout).
    ok = [r for r in results if "error" not in r]
    if ok or results:
        return (ok or results)[0]
    return {"optimizer": name, "error": f"child exited with {rc}: {' / '.join(tail)[-300:]}"}


COLUMNS = [
    column("step s", "step_s"),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    column("peak GPU GiB (max rank)", "peak_gpu_gib", 1),
    column("reserved GiB", "reserved_gpu_gib", 1),
    column("host RSS GiB (all ranks)", "host_rss_gib", 1),
    column("host RSS GiB (max rank)", "host_rss_gib_max_rank", 1),
    column("opt host GiB (all ranks)", "opt_host_gib", 1),
    column("setup s", "setup_s", 1),
    column("host busy s/step", "host_busy_s"),
]


def markdown_table(results):
    """One row per optimizer; ratios are against fsdp_gpu_adamw when it ran."""
    return bench_train.markdown_table(results, COLUMNS, BASE)


def describe(run):
    """A one-line heading for a results JSON."""
    a = run["args"]
    model = "tiny" if a["tiny"] else a["model"]
    extra = (f", grad accum {a['grad_accum']}" if a["grad_accum"] > 1 else "") + (
        ", activation checkpointing" if a["activation_checkpointing"] else "") + (
        f", clip {a['clip_grad_norm']}" if a.get("clip_grad_norm") else "")
    return (f"{model} full, FSDP2 over {run['world_size']} x {run.get('gpu') or a['device']}, "
            f"{a['tokens_per_step']} tokens/step, seq {a['seq_len']}{extra} ({run['date']})")


def parent_main(args):
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        sys.exit(f"unknown optimizers {unknown}; known: {', '.join(OPTIMIZERS)}")
    date = datetime.date.today().isoformat()
    model = "tiny" if args.tiny else args.model
    out = args.out or REPO / "bench" / "results" / "fsdp2" / (
        f"{date}-fsdp2-{model}-full-{args.tokens_per_step}"
        + (f"-ga{args.grad_accum}" if args.grad_accum > 1 else "")
        + ("-ac" if args.activation_checkpointing else "") + ".json")

    start, results = time.perf_counter(), []
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        left = (args.time_budget - (t0 - start)) if args.time_budget else float("inf")
        reason = skip_reason(name, args) or (
            "the run's --time-budget is spent" if left < 30 else None)
        res = ({"optimizer": name, "skipped": reason} if reason
               else run_child(name, args, min(args.child_timeout, left)))
        res["wall_s"] = time.perf_counter() - t0
        print(f"== {name}: " + (f"skipped ({res['skipped']})" if "skipped" in res else
                                f"FAILED ({res['error']})" if "error" in res else
                                f"{res['step_s']:.3f} s/step"), file=sys.stderr, flush=True)
        results.append(res)

    run = {
        "kind": "fsdp2",
        "date": date,
        "gpu": next((r["device_name"] for r in results if r.get("device_name")), None),
        "world_size": args.nproc,
        "versions": {p: _version(p) for p in ("torch", "torchtune", "torchao", "offload-plugin")},
        "git_commit": _git_commit(),
        "host_cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k not in ("single", "out")},
        "results": results,
    }
    print(f"\n### {describe(run)}\n\n{markdown_table(results)}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(run, indent=2) + "\n")
    print(f"\nwrote {out}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama3_1_8b"], default="llama3_1_8b")
    p.add_argument("--tiny", action="store_true",
                   help="2-layer 128-dim Llama-3.2-shaped model, vocab 512 (smoke tests)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) on this host")
    p.add_argument("--tokens-per-step", type=int, required=True, help="over all ranks")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the mean")
    p.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS,
                   help=f"comma-separated, from: {', '.join(OPTIMIZERS)}")
    p.add_argument("--clip-grad-norm", type=float, default=None)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: os.cpu_count() // --nproc)")
    p.add_argument("--host-threads", type=int, default=None,
                   help="CPUOffloadOptimizer(host_threads=...) (default: --threads - 1 with "
                        "CUDA, leaving each rank a core to launch kernels; --threads on CPU)")
    p.add_argument("--child-timeout", type=float, default=1800, help="seconds per optimizer")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run: later optimizers get what is left")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: child mode
    args = p.parse_args(argv)
    if args.tokens_per_step % (args.nproc * args.seq_len * args.grad_accum):
        p.error("--tokens-per-step must be a multiple of --nproc x --seq-len x --grad-accum")
    if not 0 <= args.warmup < args.steps:
        p.error("need 0 <= --warmup < --steps")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        p.error(f"--device cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    if args.host_threads is None:
        args.host_threads = max(1, args.threads - 1) if args.device == "cuda" else args.threads
    torch.set_num_threads(args.threads)
    return args


if __name__ == "__main__":
    _args = parse_args(json.loads(os.environ.pop(CHILD_ARGS)) if CHILD_ARGS in os.environ else None)
    child_main(_args) if _args.single else parent_main(_args)
