"""torchao's offload correctness scenario, looped: a race in CPUOffloadOptimizer, or torch?

torchao's ``test_optim_cpu_offload_correctness`` (test/test_low_bit_optim.py) trains
``Linear(32, W) ReLU Linear(W, 64) ReLU Linear(64, 64) ReLU Linear(64, 128)`` (W = 131072;
``model[2]`` frozen in its code, its comment says the small layer) for two steps of batch 4
under ``CosineAnnealingLR(100)``, first a twin with ``torch.optim.AdamW()`` (foreach on
CUDA), then the offload optimizer on a deep copy, and compares with
``torch.testing.assert_close`` (float32: 1e-5 abs + 1.3e-6 rel). Its model is not seeded:
every run draws other weights.

For each seed this script builds that model once and trains copies of it with:
  A   torch.optim.AdamW() as in torchao's test (foreach on CUDA, the per-tensor loop on CPU);
  Bc  torch.optim.AdamW(fused=True) on the device (what our streamed update runs);
  Bh  torch.optim.AdamW(fused=True) on host copies of the weights, given the gradients
      copied to the host, weights copied back (what our host update runs);
  ours, once per mode: the default (streamed on a GPU), offload_gradients, master_weights,
      both; run without any probe (nothing added to its timing).
It checks ours bit for bit against the matching exact twin (Bc for the streamed update, Bh
for the host update) and against A with torchao's tolerance, and the torch twins among
themselves (A vs Bc, A vs Bh with torchao's tolerance; Bc vs Bh, and a second A, bit for bit).
The torch twins record their gradients (leaf hooks), the weights before each step and the
first layer's pre-activations. On any mismatch of ours, the same seed is replayed: ours again
without probes (does the mismatch come back bit for bit?), then ours with the probes, and each
differing element (up to --max-elements) is written out with both twins' weights, gradients
at each step and, for the first layer, the pre-activations of its unit.

    python bench/investigations/sync_stress.py --trials 200 --seconds 300        # on a GPU; JSON to $OUT
    python bench/investigations/sync_stress.py --device cpu --width 4096 --trials 4   # a dry run

Configurations alternate over the seeds: frozen layer 2 (torchao's code) or 4 (its comment),
and 1 or 2 micro-batches per step.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import platform
import sys
import time
import warnings

import torch
from torch import nn

from offload_plugin import CPUOffloadOptimizer
from offload_plugin.engines import streamed

MODES = {
    "default": {},
    "offload_gradients": {"offload_gradients": True},
    "master_weights": {"master_weights": True},
    "master_weights+offload_gradients": {"master_weights": True, "offload_gradients": True},
}
RTOL, ATOL = 1.3e-6, 1e-5  # torch.testing.assert_close's float32 defaults


def build(seed: int, device: str, width: int, frozen: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 64), nn.ReLU(),
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 128),
    ).to(device)
    model[frozen].requires_grad_(False)
    return model


class TorchTwin:
    """A torch.optim.AdamW on the twin's parameters (``kwargs``: foreach / fused)."""

    def __init__(self, model: nn.Module, **kwargs) -> None:
        self.opt = self.sched_target = torch.optim.AdamW(model.parameters(), **kwargs)

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()


class HostFusedTwin:
    """torch.optim.AdamW(fused=True) on host copies of the weights, given the gradients
    copied to the host; the results copied back: what the host update computes."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.host = [p.detach().to("cpu", copy=True) for p in self.params]
        self.opt = self.sched_target = torch.optim.AdamW(self.host, fused=True)

    def step(self) -> None:
        for h, p in zip(self.host, self.params):
            h.grad = p.grad.to("cpu")
        self.opt.step()
        with torch.no_grad():
            for h, p in zip(self.host, self.params):
                p.copy_(h)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.opt.zero_grad()


class Ours:
    def __init__(self, model: nn.Module, **kwargs) -> None:
        self.opt = self.sched_target = CPUOffloadOptimizer(model.parameters(), **kwargs)
        self.streamed = self.opt.engine.streams

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def train(model, make, seed: int, accum: int, probes: bool, steps: int = 2):
    """torchao's loop: ``steps`` optimizer steps of ``accum`` batches of 4, a cosine
    schedule. With ``probes``: each step's summed gradients (leaf hooks, registered before
    the optimizer's), the weights before each step and layer 0's outputs."""
    device = next(model.parameters()).device
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rec, handles, acc = None, [], {}
    if probes:
        rec = {"grads": [], "before": [], "h0": []}
        for n, p in named:
            def hook(g, n=n):
                acc[n] = g.detach().clone() if n not in acc else acc[n] + g
            handles.append(p.register_hook(hook))
        handles.append(model[0].register_forward_hook(
            lambda m, i, o: rec["h0"].append(o.detach().clone())))
    stepper = make(model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(stepper.sched_target, 100)
    rng = torch.Generator(device=device).manual_seed(seed)
    for _ in range(steps):
        for _ in range(accum):
            x = torch.randn(4, 32, device=device, generator=rng)
            model(x).sum().backward()
        if probes:
            rec["grads"].append(dict(acc))
            acc.clear()
            rec["before"].append({n: p.detach().clone() for n, p in named})
        stepper.step()
        stepper.zero_grad()
        sched.step()
    for h in handles:
        h.remove()
    final = {n: p.detach().clone() for n, p in named}
    return final, rec, stepper


def compare(ours: dict, ref: dict) -> dict:
    """Bitwise and assert_close(ours, ref) (ref as torchao's 'expected') over all tensors."""
    out = {"bitwise": True, "n_bits_differ": 0, "max_abs": 0.0, "n_over_tol": 0}
    for n in ref:
        a, b = ours[n], ref[n]
        differ = a.ne(b)
        nd = int(differ.sum())
        diff = (a - b).abs()
        over = diff > ATOL + RTOL * b.abs()
        out["n_bits_differ"] += nd
        out["bitwise"] &= nd == 0
        out["max_abs"] = max(out["max_abs"], float(diff.max()) if diff.numel() else 0.0)
        out["n_over_tol"] += int(over.sum())
    out["close"] = out["n_over_tol"] == 0
    return out


def over_tol(ours: dict, ref: dict, limit: int) -> list:
    found = []
    for n in ref:
        diff = (ours[n] - ref[n]).abs()
        bad = (diff > ATOL + RTOL * ref[n].abs()).nonzero()
        for idx in bad[:limit].tolist():
            found.append((n, tuple(idx)))
    return found[:limit]


def grads_equal(ra: dict, rb: dict) -> list:
    """Per step: are the summed gradients and the weights before the step bitwise equal?"""
    steps = []
    for ga, gb, wa, wb in zip(ra["grads"], rb["grads"], ra["before"], rb["before"]):
        nd_g = sum(int(ga[n].ne(gb[n]).sum()) for n in ga)
        nd_w = sum(int(wa[n].ne(wb[n]).sum()) for n in wa)
        rel = max(float(((ga[n] - gb[n]).abs() / gb[n].abs().clamp_min(1e-30)).max()) for n in ga)
        steps.append({"grads_bitwise": nd_g == 0, "grads_n_differ": nd_g,
                      "grads_max_rel_diff": rel, "weights_before_bitwise": nd_w == 0,
                      "weights_before_n_differ": nd_w})
    return steps


def element(n, idx, twins: dict) -> dict:
    """One element across twins: final weight, weight before and gradient at each step; for
    layers 0 and 2, the pre-activations over the batch of the first layer's unit that the
    element belongs to (layer 0) or reads (layer 2), at each forward."""
    out = {"param": n, "index": list(idx)}
    for name, (final, rec) in twins.items():
        e = {"final": float(final[n][idx])}
        if rec is not None:
            e["before"] = [float(w[n][idx]) for w in rec["before"]]
            e["grad"] = [float(g[n][idx]) for g in rec["grads"]]
            unit = idx[0] if n in ("0.weight", "0.bias") else idx[1] if n == "2.weight" else None
            if unit is not None:  # the first layer's unit this weight reads or writes
                e["h0_unit"] = [h[:, unit].tolist() for h in rec["h0"]]
        out[name] = e
    return out


def trial(seed: int, args, device: str) -> dict:
    started = time.time()
    frozen = (2, 4)[seed % 2]
    accum = (1, 2)[(seed // 2) % 2]
    base = build(seed, device, args.width, frozen)
    fin, rec = {}, {}
    for name, make in (("A", lambda m: TorchTwin(m)), ("Bc", lambda m: TorchTwin(m, fused=True)),
                       ("Bh", HostFusedTwin), ("A2", lambda m: TorchTwin(m))):
        fin[name], rec[name], _ = train(copy.deepcopy(base), make, seed, accum, probes=name != "A2")
    out = {"seed": seed, "frozen": frozen, "accum": accum, "torch": {
        "A_vs_Bc": compare(fin["Bc"], fin["A"]), "A_vs_Bh": compare(fin["Bh"], fin["A"]),
        "Bc_vs_Bh": compare(fin["Bh"], fin["Bc"]), "A_vs_A2": compare(fin["A2"], fin["A"]),
        "A_vs_Bc_steps": grads_equal(rec["A"], rec["Bc"]),
        "A_vs_Bh_steps": grads_equal(rec["A"], rec["Bh"]),
        "Bc_vs_Bh_steps": grads_equal(rec["Bc"], rec["Bh"]),
    }, "modes": {}}
    for mode in args.modes:
        kwargs = MODES[mode]
        mine, _, stepper = train(copy.deepcopy(base), lambda m: Ours(m, **kwargs), seed, accum, probes=False)
        exact_ref = "Bc" if stepper.streamed else "Bh"
        r = {"streamed": stepper.streamed, "exact_ref": exact_ref,
             "vs_exact": compare(mine, fin[exact_ref]), "vs_A": compare(mine, fin["A"])}
        del stepper
        if not (r["vs_exact"]["bitwise"] and r["vs_A"]["close"]):
            again, _, _ = train(copy.deepcopy(base), lambda m: Ours(m, **kwargs), seed, accum, probes=False)
            probed, prec, _ = train(copy.deepcopy(base), lambda m: Ours(m, **kwargs), seed, accum, probes=True)
            r["replay_bitwise_same"] = compare(again, mine)["bitwise"]
            r["probed_bitwise_same"] = compare(probed, mine)["bitwise"]
            r["ours_vs_A_steps"] = grads_equal(prec, rec["A"])
            r["ours_vs_exact_steps"] = grads_equal(prec, rec[exact_ref])
            # The elements over torchao's tolerance against A, and whether the exact torch
            # twin is over it at the same elements.
            bad = over_tol(mine, fin["A"], args.max_elements)
            ref_bad = set(over_tol(fin[exact_ref], fin["A"], 1 << 30))
            r["elements_vs_A"] = [dict(element(n, idx, {"ours": (mine, prec), "A": (fin["A"], rec["A"]),
                                                         exact_ref: (fin[exact_ref], rec[exact_ref])}),
                                       exact_twin_also_over_tol=(n, idx) in ref_bad) for n, idx in bad]
            r["elements_vs_exact"] = []
            for n in fin[exact_ref]:
                for idx in mine[n].ne(fin[exact_ref][n]).nonzero()[:args.max_elements].tolist():
                    r["elements_vs_exact"].append(element(n, tuple(idx), {
                        "ours": (mine, prec), exact_ref: (fin[exact_ref], rec[exact_ref])}))
        out["modes"][mode] = r
    # Where torch alone is over torchao's tolerance: the elements, for the record.
    for pair, (x, y) in {"A_vs_Bc": ("Bc", "A"), "A_vs_Bh": ("Bh", "A")}.items():
        if not out["torch"][pair]["close"]:
            out["torch"][pair]["elements"] = [
                element(n, idx, {x: (fin[x], rec[x]), y: (fin[y], rec[y])})
                for n, idx in over_tol(fin[x], fin[y], args.max_elements)]
    gc.collect()  # each optimizer's pinned blocks are released when it is collected
    out["seconds"] = time.time() - started
    return out


def summarize(trials: list, modes: list) -> dict:
    s = {"trials": len(trials), "torch": {}, "modes": {}}
    for pair in ("A_vs_Bc", "A_vs_Bh"):
        s["torch"][pair + "_over_tol"] = sum(not t["torch"][pair]["close"] for t in trials)
    s["torch"]["Bc_vs_Bh_bits_differ"] = sum(not t["torch"]["Bc_vs_Bh"]["bitwise"] for t in trials)
    s["torch"]["A_vs_A2_bits_differ"] = sum(not t["torch"]["A_vs_A2"]["bitwise"] for t in trials)
    s["torch"]["step1_grads_differ_any_pair"] = sum(
        not all(t["torch"][k][0]["grads_bitwise"] for k in ("A_vs_Bc_steps", "A_vs_Bh_steps", "Bc_vs_Bh_steps"))
        for t in trials)
    for mode in modes:
        rs = [(t, t["modes"][mode]) for t in trials if mode in t["modes"]]
        fails = [(t, r) for t, r in rs if not r["vs_A"]["close"]]
        s["modes"][mode] = {
            "runs": len(rs),
            "streamed": sum(r["streamed"] for _, r in rs),
            "exact_mismatch": sum(not r["vs_exact"]["bitwise"] for _, r in rs),
            "torchao_check_failed": len(fails),
            "of_which_exact_torch_twin_failed_too": sum(
                not t["torch"]["A_vs_" + r["exact_ref"]]["close"] for t, r in fails),
            "by_config": {f"frozen{f}_accum{a}": [
                sum(1 for t, _ in rs if (t["frozen"], t["accum"]) == (f, a)),
                sum(1 for t, _ in fails if (t["frozen"], t["accum"]) == (f, a))]
                for f in (2, 4) for a in (1, 2)},
            "max_abs_vs_A": max((r["vs_A"]["max_abs"] for _, r in rs), default=0.0),
        }
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seconds", type=float, default=float("inf"), help="stop starting trials after this")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--width", type=int, default=131072)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-elements", type=int, default=8)
    p.add_argument("--atol", type=float, default=ATOL, help="torchao's check's atol")
    p.add_argument("--rtol", type=float, default=RTOL, help="its rtol (tiny ones exercise the replay)")
    p.add_argument("--output", default=os.path.join(os.environ.get("OUT", "."), "sync_stress.json"))
    args = p.parse_args()
    args.modes = args.modes.split(",")
    globals().update(ATOL=args.atol, RTOL=args.rtol)
    logging.getLogger("offload_plugin").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="offload_plugin")
    if args.device == "cpu":
        streamed.config.on_cpu = True  # the default mode runs the streamed code on CPU tensors
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
           "threads": torch.get_num_threads(), "width": args.width,
           "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
           "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "atol": ATOL, "rtol": RTOL}
    trials, start = [], time.time()
    for seed in range(args.first_seed, args.first_seed + args.trials):
        if time.time() - start > args.seconds:
            break
        t = trial(seed, args, args.device)
        trials.append(t)
        flags = " ".join(f"{m}:{'=' if r['vs_exact']['bitwise'] else 'X'}{'' if r['vs_A']['close'] else '!'}"
                         for m, r in t["modes"].items())
        tor = t["torch"]
        print(f"seed {seed} frozen {t['frozen']} accum {t['accum']} | A~Bc {tor['A_vs_Bc']['close']} "
              f"A~Bh {tor['A_vs_Bh']['close']} max|A-Bc| {tor['A_vs_Bc']['max_abs']:.2e} | {flags}", flush=True)
        if len(trials) % 10 == 0 or seed == args.first_seed + args.trials - 1:
            with open(args.output, "w") as f:
                json.dump({"env": env, "seconds": time.time() - start,
                           "summary": summarize(trials, args.modes), "trials": trials}, f)
    summary = summarize(trials, args.modes)
    with open(args.output, "w") as f:
        json.dump({"env": env, "seconds": time.time() - start, "summary": summary, "trials": trials}, f)
    print(json.dumps(summary, indent=1))
    bad = sum(m["exact_mismatch"] for m in summary["modes"].values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
