"""What fits where: the largest torchtune model each mode of ours fully fine-tunes under a GPU
memory cap and a host memory budget, and its tokens/s.

For each GPU cap (smallest first) and mode, the models of the ladder (torchtune 0.6.1's
builders, ``LADDER``) are tried largest first, each in a process of its own
(``bench/bench_train.py --single MODE``: random init built on the GPU in bf16, activation
checkpointing, torchtune's in-backward stepping, one sequence of ``--seq-len`` tokens per
step) with a timeout; the first that trains ``--steps`` steps with its peak host RSS within
``--host-gib`` is the answer. Before anything runs, a model is left out, and the reason
recorded, where its bf16 weights alone reach the cap, or where the mode's host state (the
state format's ``state_bytes`` per element, summed over the model's parameters) plus
``--host-overhead-gib`` exceeds ``--host-gib``. A model that fits under a smaller cap fits
under a larger one: only larger ones are tried there, and without one that fits the
smaller cap's answer stands (its run is shown). ``--time-budget`` bounds the invocation:
no attempt starts with less than ``--min-attempt-s`` left, each gets at most what is left.

    # on the GPU machine (about 9 minutes for 24 and 48 GiB; 80 GiB alone about 6)
    python bench/what_fits.py --caps 24,48 --time-budget 540
    python bench/what_fits.py --caps 80 --time-budget 540
    # smoke test on a CPU machine: a ladder of tiny models, no cap
    python bench/what_fits.py --tiny --device cpu --caps 24 --steps 2 --warmup 1 --host-gib 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))
import bench_train  # noqa: E402

GIB = 2**30
# Smallest first: bench_train.py's --model names (its BUILDERS).
LADDER = ["llama3_2_1b", "llama3_2_3b", "llama3_1_8b", "gemma2_9b", "qwen2_5_14b", "gemma2_27b",
          "qwen2_5_32b", "llama3_1_70b"]
TINY_LADDER = {"tiny_2l": 2, "tiny_4l": 4, "tiny_8l": 8}  # --tiny: layers of bench_train's tiny model
# mode -> (bench_train entry stepped in backward, its optimizer_cls, what the results call it)
MODES = {
    "exact": ("offload_in_bwd", "torch.optim.AdamW", "default options (exact AdamW)"),
    "compact": ("compact_in_bwd", "offload_plugin.CompactAdamW", "CompactAdamW"),
    "adamw8bit": ("adamw8bit_in_bwd", bench_train.ADAMW8BIT, "AdamW8bit"),
}
FALLBACK_STATE_BYTES = {"exact": 4, "compact": 4, "adamw8bit": 2}  # where a format cannot be read


def _model_args(args, model: str, device: str) -> SimpleNamespace:
    tiny = model in TINY_LADDER
    return SimpleNamespace(tiny=tiny, tiny_layers=TINY_LADDER.get(model, 2), model=model, job="full",
                           device=device, seq_len=args.seq_len, seed=0, activation_checkpointing=False)


def _meta_params(args, model: str) -> list:
    with torch.device("meta"):
        return list(bench_train.build_model(_model_args(args, model, "meta")).parameters())


def _host_state_bytes(mode: str, params: list) -> tuple[int, str]:
    """The mode's host state for ``params``: its state format's bytes per element, summed."""
    from offload_plugin import options
    from offload_plugin.formats import inner, registry as state_formats

    try:
        cls = options.resolve_optimizer_cls(MODES[mode][1])
        fmt = state_formats.for_optimizer(inner.contract(cls), cls)
        return sum(fmt.state_bytes(p) * p.numel() for p in params), f"state format {fmt.name or '?'}"
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        n = sum(p.numel() for p in params)
        return FALLBACK_STATE_BYTES[mode] * n, f"{FALLBACK_STATE_BYTES[mode]} bytes per parameter ({err})"


def plan(args) -> dict:
    """Each model's parameters, bf16 weight bytes and, per mode, host state bytes."""
    models = {}
    for model in args.models:
        params = _meta_params(args, model)
        numel = sum(p.numel() for p in params)
        models[model] = {"params": numel, "weights_gib": 2 * numel / GIB, "host_state_gib": {}}
        for mode in args.modes:
            nbytes, how = _host_state_bytes(mode, params)
            models[model]["host_state_gib"][mode] = nbytes / GIB
            models[model].setdefault("host_state_from", {})[mode] = how
    return models


def left_out(info: dict, mode: str, cap: float, args) -> str | None:
    """Why ``info``'s model cannot fit ``cap`` or the host budget, before running it."""
    if args.device == "cuda" and info["weights_gib"] >= cap:
        return f"bf16 weights alone {info['weights_gib']:.1f} GiB >= the {cap:g} GiB cap"
    need = info["host_state_gib"][mode] + args.host_overhead_gib
    if need > args.host_gib:
        return (f"host state {info['host_state_gib'][mode]:.1f} GiB + {args.host_overhead_gib:g} GiB "
                f"for the process > the {args.host_gib:g} GiB host")
    return None


def attempt(args, mode: str, model: str, cap: float, timeout: float) -> dict:
    """One training run in a process of its own: bench_train.py's result, or why none came."""
    tokens = args.seq_len * args.batch
    cmd = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--single", MODES[mode][0],
           "--job", "full", "--tokens-per-step", str(tokens), "--seq-len", str(args.seq_len),
           "--activation-checkpointing", "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--device", args.device]
    cmd += ["--tiny", "--tiny-layers", str(TINY_LADDER[model])] if model in TINY_LADDER else ["--model", model]
    if args.device == "cuda":
        cmd += ["--gpu-memory-gib", f"{cap:g}"]
    if args.cpu_streamed:
        cmd.append("--cpu-streamed")
    print(f"== {mode} {model} under {cap:g} GiB (timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(bench_train.MARKER)]
    if not lines:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        res = {"error": f"exited with {proc.returncode}: {' / '.join(tail)[-300:]}"}
    else:
        res = json.loads(lines[-1][len(bench_train.MARKER):])
    res["wall_s"] = time.perf_counter() - t0
    return res


def _row(mode, model, cap, info, outcome, reason=None, res=None) -> dict:
    row = {"mode": mode, "model": model, "cap_gib": cap, "params": info["params"],
           "host_state_gib": info["host_state_gib"][mode], "outcome": outcome, "reason": reason}
    for key in ("tokens_per_s", "step_s", "peak_gpu_gib", "reserved_gpu_gib", "host_rss_gib", "opt_host_gib",
                "bytes_h2d_per_step", "setup_s", "wall_s", "device_name", "losses"):
        if res and res.get(key) is not None:
            row[key] = res[key]
    return row


def search(args, models: dict, run=attempt, clock=time.perf_counter) -> list[dict]:
    """Every (cap, mode): the models tried and left out, in order; ``run`` is :func:`attempt`
    (tests pass their own). Returns rows of outcome "fits", "failed", "left out",
    "not tried" (the time budget, or a larger model fitted first) or "as under N GiB"."""
    started, rows = clock(), []
    best: dict = {}  # mode -> (index in the ladder, row) of the largest fit so far (smaller caps)
    order = sorted(models, key=lambda m: models[m]["params"])  # smallest first
    for cap in sorted(args.caps):
        for mode in args.modes:
            floor = best.get(mode, (-1, None))
            found, budget_hit = None, False
            for i in reversed(range(floor[0] + 1, len(order))):
                model, info = order[i], models[order[i]]
                why = left_out(info, mode, cap, args)
                if why:
                    rows.append(_row(mode, model, cap, info, "left out", why))
                    continue
                left = args.time_budget - (clock() - started) if args.time_budget else args.attempt_timeout
                if left < args.min_attempt_s:
                    budget_hit = True
                    rows.append(_row(mode, model, cap, info, "not tried", f"time budget: {max(left, 0):.0f} s left"))
                    continue
                res = run(args, mode, model, cap, min(args.attempt_timeout, left))
                if "error" in res or not res.get("tokens_per_s"):
                    rows.append(_row(mode, model, cap, info, "failed", res.get("error", "no timed step"), res))
                elif res.get("host_rss_gib", 0) > args.host_gib:
                    rows.append(_row(mode, model, cap, info, "failed",
                                     f"host peak RSS {res['host_rss_gib']:.1f} GiB > the {args.host_gib:g} GiB host", res))
                else:
                    found = i
                    rows.append(_row(mode, model, cap, info, "fits", None, res))
                    best[mode] = (i, rows[-1])
                    break
            if found is None and floor[1] is not None:
                prev = floor[1]
                rows.append(dict(prev, cap_gib=cap, outcome=f"as under {prev['cap_gib']:g} GiB",
                                 reason="larger models not reached (time budget): at least this" if budget_hit
                                 else "no larger model fits"))
    return rows


def largest(rows: list[dict]) -> dict:
    """(mode, cap) -> the row of the largest model that fits."""
    out = {}
    for r in rows:
        if r["outcome"] == "fits" or r["outcome"].startswith("as under"):
            out[(r["mode"], r["cap_gib"])] = r
    return out


def markdown(run: dict) -> str:
    """The results page's table: a row per mode, a column per GPU cap; then every attempt."""
    rows, caps, modes = run["rows"], run["caps"], run["modes"]
    best = largest(rows)
    head = ["mode (host state per parameter)"] + [f"{c:g} GiB GPU" for c in caps]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in modes:
        cells = [MODES[mode][2]]
        for cap in caps:
            r = best.get((mode, cap))
            tried = [x for x in rows if x["mode"] == mode and x["cap_gib"] == cap]
            if r is not None:
                at_least = "at least " if "not reached" in (r.get("reason") or "") else ""
                size = f"{r['params'] / 1e9:.1f}B" if r["params"] >= 1e8 else f"{r['params'] / 1e6:.1f}M"
                gpu = f", peak GPU {r['peak_gpu_gib']:.1f} GiB" if r.get("peak_gpu_gib") is not None else ""
                cells.append(f"{at_least}**{r['model']}** ({size}): {r['tokens_per_s']:,.0f} tokens/s{gpu}, "
                             f"host RSS {r.get('host_rss_gib', 0):.1f} GiB")
            elif any(x["outcome"] == "not tried" for x in tried):
                cells.append("not reached (time budget)")
            else:
                cells.append("none" if tried else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| GPU cap | mode | model | outcome | tokens/s | peak GPU GiB | host RSS GiB | host state GiB (estimate) | why |",
              "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda r, k, spec: format(r[k], spec) if r.get(k) is not None else "-"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['cap_gib']:g} | {r['mode']} | {r['model']} | {r['outcome']} | {fmt(r, 'tokens_per_s', ',.0f')} | "
                     f"{fmt(r, 'peak_gpu_gib', '.1f')} | {fmt(r, 'host_rss_gib', '.1f')} | "
                     f"{r['host_state_gib']:.1f} | {(r.get('reason') or '')[:160]} |")
    return "\n".join(lines)


def describe(run: dict) -> str:
    s = run["settings"]
    return (f"What fits where: full fine-tuning, seq {s['seq_len']} x batch {s['batch']}, activation "
            f"checkpointing, stepped in backward, {s['steps']} steps (warmup {s['warmup']}), host budget "
            f"{s['host_gib']:g} GiB ({run.get('gpu') or s['device']}, {run['date']})")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caps", default="24,48,80", help="comma-separated GPU caps in GiB")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from: {', '.join(MODES)}")
    p.add_argument("--models", default=None, help="comma-separated, smallest first (default: the ladder: "
                                                  f"{', '.join(LADDER)}; with --tiny {', '.join(TINY_LADDER)})")
    p.add_argument("--tiny", action="store_true", help="a ladder of tiny models (smoke tests)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cpu-streamed", action="store_true",
                   help="with --device cpu: the streamed update's code on the host (bench_train.py's)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--host-gib", type=float, default=64, help="the host memory budget")
    p.add_argument("--host-overhead-gib", type=float, default=2,
                   help="host memory of the process beyond the optimizer state, in the estimate")
    p.add_argument("--attempt-timeout", type=float, default=240, help="seconds per attempt at most")
    p.add_argument("--time-budget", type=float, default=None, help="seconds for the whole invocation")
    p.add_argument("--min-attempt-s", type=float, default=60,
                   help="no attempt starts with less than this left of --time-budget")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default bench/results/fits/<date>-fits-<caps>.json)")
    args = p.parse_args(argv)
    args.caps = [float(c) for c in args.caps.split(",") if c.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(set(args.modes) - set(MODES))}; known: {', '.join(MODES)}")
    ladder = list(TINY_LADDER) if args.tiny else LADDER
    args.models = [m.strip() for m in args.models.split(",")] if args.models else ladder
    known = set(TINY_LADDER) | {m for m, job in bench_train.BUILDERS if job == "full"}
    if set(args.models) - known:
        p.error(f"unknown models {sorted(set(args.models) - known)}")
    if not 0 <= args.warmup < args.steps:
        p.error("need 0 <= --warmup < --steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu)")
    return args


def main() -> None:
    args = parse_args()
    date = datetime.date.today().isoformat()
    models = plan(args)
    rows = search(args, models)
    run = {"kind": "fits", "date": date, "gpu": next((r["device_name"] for r in rows if r.get("device_name")), None),
           "git_commit": bench_train._git_commit(),
           "settings": {k: v for k, v in vars(args).items() if k != "out"},
           "caps": args.caps, "modes": args.modes, "models": models, "rows": rows}
    print(f"\n### {describe(run)}\n\n{markdown(run)}")
    out = args.out or REPO / "bench" / "results" / "fits" / f"{date}-fits-{'-'.join(f'{c:g}' for c in args.caps)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
