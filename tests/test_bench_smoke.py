"""bench/ scripts end to end on CPU: bench_train.py (a tiny model, numbers in the JSON),
formats/host_update_rate.py and report.py, as the README names them; and bench/'s layout, as
bench/README.md maps it."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow  # (starts processes: left out of the quick lane, pytest -m "not slow")

REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = ["gpu_adamw", "no_update", "offload", "offload_grads", "offload_grads_delayed"]


def test_bench_train_tiny_cpu_smoke(tmp_path):
    """The tiny CPU smoke run finishes and records step time and tokens/s for each optimizer."""
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--tiny", "--device", "cpu",
           "--job", "full", "--tokens-per-step", "512", "--seq-len", "128",
           "--optimizers", ",".join(OPTIMIZERS), "--steps", "3", "--warmup", "1",
           "--measure-host-update", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())
    results = {r["optimizer"]: r for r in run["results"]}
    assert list(results) == OPTIMIZERS
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r['error']}"
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["host_rss_gib"] > 0, name
        assert len(r["losses"]) == 3 and len(r["gc_s_per_step"]) == 3
    # Same model, same data: the first loss (before any update) is identical for all.
    assert len({r["losses"][0] for r in results.values()}) == 1
    # The memory floor run updates nothing: the same batch gives the same loss every step.
    assert len(set(results["no_update"]["losses"])) == 1
    assert len(set(results["offload"]["losses"])) == 3
    assert "| added GiB | added / base |" in proc.stdout  # the memory-target columns
    assert results["offload"]["host_update_s"] > 0
    assert run["cpu_adamw_reference"]["gparams_s"] > 0
    assert "| offload |" in proc.stdout


def test_gc_pauses_are_counted_in_the_step_they_happen():
    """bench_train's gc_s_per_step: a collection run in a step is timed in that step only,
    and the recorder leaves gc.callbacks as it found them."""
    import gc

    sys.path.insert(0, str(REPO / "bench"))
    import bench_train

    before = list(gc.callbacks)
    pauses = bench_train._GcPauses()
    gc.collect()
    pauses.end_step()
    pauses.end_step()
    pauses.close()
    assert pauses.per_step[0] > 0 and pauses.per_step[1] == 0.0
    assert gc.callbacks == before


def test_bench_trace_and_its_report(tmp_path):
    """--trace records the main thread's marks and every host update job of the last two
    steps; trace_report.py (as the README runs it) turns them into phase tables."""
    out = tmp_path / "trace.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--tiny", "--device", "cpu",
           "--job", "full", "--tokens-per-step", "256", "--seq-len", "64", "--steps", "4",
           "--warmup", "1", "--trace", "--optimizers", "gpu_adamw,offload_grads,offload_grads_early",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = {r["optimizer"]: r for r in json.loads(out.read_text())["results"]}
    per_step = results["offload_grads"]["trainable_params"]
    for name in ("offload_grads", "offload_grads_early"):
        trace = results[name]["trace"]
        assert [m[0] for m in trace["marks"]].count("opt_step") == 2
        updated = sum(job[4] for job in trace["jobs"])
        if name == "offload_grads":  # exactly the two traced steps' updates
            assert updated == 2 * per_step
        else:  # plus the tail of the step before, which the first traced forward overlaps
            assert 2 * per_step <= updated <= 3 * per_step
        for start, landed, done, pushed, numel, order in trace["jobs"]:
            assert start <= landed <= done <= pushed and numel > 0 and order >= 0
    assert "jobs" not in results["gpu_adamw"]["trace"]
    report = subprocess.run([sys.executable, str(REPO / "bench" / "investigations" / "trace_report.py"), str(out)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stderr[-2000:]
    assert report.stdout.count("| jobs started after |") == 2 and "| 4:opt_step |" in report.stdout
    # The README's example: the committed 8B trace.
    committed = REPO / "bench" / "results" / "train" / "2026-11-30-x2-s6-llama3_1_8b-full-4096.json"
    report = subprocess.run([sys.executable, str(REPO / "bench" / "investigations" / "trace_report.py"), str(committed)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0 and "### offload_grads_nomaster_early:" in report.stdout


def test_added_memory_columns_compare_with_the_floor_run():
    """Peak memory above the no_update run, and that as a share of GPU AdamW's."""
    sys.path.insert(0, str(REPO / "bench"))
    import bench_train

    results = [{"optimizer": name, "step_s": 1.0, "tokens_per_s": 1.0, "peak_gpu_gib": peak}
               for name, peak in [("gpu_adamw", 50.0), ("no_update", 30.0), ("offload_grads", 31.0)]]
    rows = bench_train.markdown_table(results).splitlines()
    assert rows[0].endswith("| added GiB | added / base | step / gpu_adamw | peak / gpu_adamw |")
    assert "| 20.00 | 100.0% |" in rows[2] and "| 1.00 | 5.0% |" in rows[4]


def test_host_update_rate_and_report_run(tmp_path):
    """The README's host-rate command (on a small parameter) and the report over the results."""
    rate = subprocess.run(
        [sys.executable, str(REPO / "bench" / "formats" / "host_update_rate.py"), "--numel", str(1 << 16),
         "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert rate.returncode == 0, rate.stderr[-2000:]
    assert "torch AdamW(fused) fp32" in rate.stdout and "offload update" in rate.stdout
    assert "memory bandwidth" in rate.stdout
    report = subprocess.run([sys.executable, str(REPO / "bench" / "report.py")],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stderr[-2000:]
    # Every committed training result and stock-recipe result appears (not other
    # benchmarks'), with its ratio column; the stock runs' ratios are over their baseline.
    saved = [json.loads(p.read_text()) for p in (REPO / "bench" / "results").rglob("*.json")]
    runs = [r for r in saved if "args" in r or r.get("kind") in ("stock", "fits")]
    labels = {(r["args"]["label"], r["date"]) for r in saved if r.get("args", {}).get("label")}
    assert report.stdout.count("### ") == len(runs) + len(labels)  # (a label's runs: one table more)
    assert "| gpu_adamw |" in report.stdout
    rounds = report.stdout.split("### 2026-12-02-s22-stock-1b-full-rounds.json")[1].split("###")[0]
    assert "| ours_recipe | 5,660 (5,167, 5,586, 6,227) | 1.00x | 1.000 |" in rounds
    assert "| ours_stock | 6,365 (5,065, 7,238, 6,793) | 1.12x |" in rounds
    turns = [r for r in saved if "blocks" in r and "ours" in r]
    assert report.stdout.count("qlora_ab-") == len(turns) > 0


FSDP2_OPTIMIZERS = ["fsdp_gpu_adamw", "offload_grads_nomaster", "offload_grads", "fsdp_cpu_offload_policy"]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="no C++ compiler: no native kernels to time")
def test_compact_update_rate_runs_alternating_rounds():
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "formats" / "compact_update_rate.py"), "--numel", str(1 << 16),
         "--bnb-numel", str(1 << 12), "--threads", "1", "--rounds", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = {line.split("  ")[0]: line for line in done.stdout.splitlines()}
    assert "1.00x exact" in lines["exact one pass (fp32 master)"]
    for label in ("compact (bf16 + remainder, 8-bit moments)", "compact, no master (bf16, 8-bit moments)"):
        assert "G params/s" in lines[label] and "x exact (rounds" in lines[label]
    assert "memory bandwidth" in done.stdout


def test_bench_fsdp2_tiny_cpu_smoke(tmp_path):
    """bench_fsdp2.py on 2 gloo ranks (torchrun): every optimizer trains, and the losses check
    the sharded offload path against torch's AdamW on the same FSDP2 model and data.

    Without master weights ours is the same computation as torch's fused AdamW on the bf16
    shards (bf16 weights and state), so the global losses must be identical. With fp32
    masters the first update rounds to the same bf16 weights, so the loss after it is still
    identical; later steps differ by design (torch's bf16 AdamW rounds away updates below
    half a bf16 ulp, the masters keep them), so only closeness is checked. The lr is large
    enough that the loss moves by far more than that tolerance.
    """
    out = tmp_path / "fsdp2.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_fsdp2.py"), "--tiny", "--device", "cpu",
           "--nproc", "2", "--tokens-per-step", "1024", "--seq-len", "128", "--grad-accum", "2",
           "--steps", "3", "--warmup", "1", "--lr", "1e-3", "--child-timeout", "120",
           "--optimizers", ",".join(FSDP2_OPTIMIZERS), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())
    assert run["kind"] == "fsdp2" and run["world_size"] == 2
    results = {r["optimizer"]: r for r in run["results"]}
    assert list(results) == FSDP2_OPTIMIZERS
    assert "CUDA" in results.pop("fsdp_cpu_offload_policy")["skipped"]
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r['error']}"
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["host_rss_gib"] > 0, name
        assert len(r["losses"]) == 3 and len(r["step_times"]) == 3, name
    torch_adamw = results["fsdp_gpu_adamw"]["losses"]
    assert results["offload_grads_nomaster"]["losses"] == torch_adamw
    masters = results["offload_grads"]["losses"]
    assert masters[:2] == torch_adamw[:2]
    assert abs(masters[2] - torch_adamw[2]) < 0.01 * abs(torch_adamw[2])
    assert torch_adamw[0] - torch_adamw[2] > 0.5  # the updates move the loss (non-vacuous)
    assert results["offload_grads"]["opt_host_gib"] > 0
    assert "| offload_grads |" in proc.stdout and "FSDP2 over 2 x cpu" in proc.stdout


def test_host_contention_runs_on_cpu():
    """bench/investigations/host_contention.py (the README cites its figures): on a machine without CUDA it
    times the update alone and next to a pure-Python thread, and says so."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "investigations" / "host_contention.py"), "--numel", str(1 << 18),
         "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    if proc.returncode != 0 and "native bf16 kernel not available" in proc.stderr + proc.stdout:
        pytest.skip("no native kernel here (no C++ compiler)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "update alone (no check), 1 thr" in proc.stdout
    assert "with nothing" in proc.stdout and "with python" in proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="bench/pinning.py pins host memory for a CUDA device")
def test_pinning_benchmark_runs_on_the_gpu(tmp_path):
    """bench/pinning.py pins a small block by each method and records the phases."""
    out = tmp_path / "pinning.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "pinning.py"), "--gib", "0.25",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"register", "fill+register", "hugepage+fill+register", "cudaHostAlloc"}
    assert all(r["GBps"] > 0 for r in results.values())


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="bench/investigations/copy_issue_cost.py issues copies to a CUDA device")
def test_copy_issue_cost_benchmark_runs_on_the_gpu(tmp_path):
    """bench/investigations/copy_issue_cost.py times both ways of issuing copies, alone and beside a
    thread launching kernels."""
    out = tmp_path / "issue.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "investigations" / "copy_issue_cost.py"), "--mib", "1",
                          "--pieces", "2", "--reps", "3", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert {(r["neighbour"], r["path"]) for r in rows} == {
        (n, p) for n in ("idle", "busy_neighbour") for p in ("runtime", "torch")}
    assert all(r["median_us"] > 0 for r in rows)


def test_change_check_cost_tiny_cpu_smoke(tmp_path):
    """bench/investigations/change_check_cost.py runs and times the version-counter checks of real steps."""
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(REPO / "bench" / "investigations" / "change_check_cost.py"), "--tiny", "--device", "cpu",
           "--steps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["label"] for r in rows[:2]] == ["default", "offload_gradients+early_forward"]
    for r in rows[:2]:
        assert r["step_s"] > 0 and r["check_s_per_step"] > 0 and r["tensors"] == 21
    assert rows[2]["check_s"] > 0


def test_compact_quality_curves_json_and_svg(tmp_path):
    """bench/formats/compact_quality.py (docs/performance.md's compact quality table) on a few steps:
    every requested variant's loss curve lands in the JSON and as one polyline per panel in
    the SVG, and the product's variants match what they claim to be. CPUOffloadOptimizer
    with CompactAdamW(min_8bit_size=0) is the standalone compact update on every tensor,
    bit for bit; with its default it keeps small tensors exact as the standalone one; with
    master weights it is torch's fused AdamW on fp32 masters, bit for bit; and the compact
    curve starts at exact's (same initialization and data) and then differs from it, by
    little."""
    import importlib.util
    import math
    import xml.etree.ElementTree as ET

    variants = ["exact", "exact_offload", "compact_offload", "compact_offload_all", "compact", "compact_all"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        variants.append("bnb")
    steps, out, svg = 8, tmp_path / "quality.json", tmp_path / "quality.svg"
    cmd = [sys.executable, str(REPO / "bench" / "formats" / "compact_quality.py"), "--steps", str(steps),
           "--batch", "4", "--seq", "32", "--lr", "1e-3", "--variants", *variants,
           "--json", str(out), "--svg", str(svg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())
    assert run["data"] == "bigram" and len(run["runs"]) == 1
    curves = run["runs"][0]["curves"]
    assert list(curves) == variants
    for name, c in curves.items():
        assert len(c) == steps and all(math.isfinite(v) for v in c), name
    assert set(run["runs"][0]["summary"]) == set(variants)

    ns = {"svg": "http://www.w3.org/2000/svg"}
    root = ET.fromstring(svg.read_text())
    for panel in ("loss", "diff"):
        group = root.find(f".//svg:g[@id='{panel}']", ns)
        lines = group.findall("svg:polyline", ns)
        assert sorted(p.get("data-variant") for p in lines) == sorted(variants), panel
        assert all(len(p.get("points").split()) == steps for p in lines), panel

    exact, compact = curves["exact"], curves["compact_offload"]
    assert curves["exact_offload"] == exact
    assert curves["compact_offload_all"] == curves["compact_all"]
    # With its default min_8bit_size the product keeps the small tensors exact as the
    # standalone "compact" does (its weight rounds ties away from zero, the standalone
    # one's to even: equal but for exact ties).
    assert max(abs(a - b) / b for a, b in zip(compact, curves["compact"])) < 1e-4
    assert compact != curves["compact_all"]
    assert compact[0] == exact[0]  # before any update: the same model on the same batch
    rel = [abs(a - b) / b for a, b in zip(compact[1:], exact[1:])]
    assert 0 < max(rel) < 1e-3, rel
    assert exact[0] - min(exact) > 0.1  # the updates move the loss: closeness is not vacuous


def test_random_checkpoint_shards_are_named_as_the_configs_list_them():
    """The 8B configs list model-0000{1..4}-of-00004.safetensors; every key lands in one."""
    module = _bench_module("random_checkpoint")
    sd = {f"w{i}": torch.zeros(10 + i) for i in range(9)}
    files = module.shards(sd, 4)
    assert [name for name, _ in files] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert all(part for _, part in files)
    assert [k for _, part in files for k in part] == list(sd)
    assert module.shards(sd, 1) == [("model.safetensors", sd)]


TINY = ["vocab_size=300", "num_layers=2", "num_heads=4", "num_kv_heads=2", "embed_dim=64",
        "intermediate_dim=128", "max_seq_len=128"]


@pytest.mark.parametrize("builder, args, model_type, files, tokenizer", [
    ("torchtune.models.llama3._component_builders.llama3", TINY, "LLAMA3", ["model.safetensors"],
     ("torchtune.models.llama3.llama3_tokenizer", "original/tokenizer.model", {})),
    ("torchtune.models.gemma2._component_builders.gemma2", TINY + ["head_dim=16"], "GEMMA2",
     [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)],
     ("torchtune.models.gemma.gemma_tokenizer", "original/tokenizer.model", {})),
    ("torchtune.models.mistral._component_builders.mistral", TINY, "MISTRAL",
     ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"],
     ("torchtune.models.mistral.mistral_tokenizer", "original/tokenizer.model", {})),
    ("torchtune.models.qwen2._component_builders.qwen2", TINY, "QWEN2",
     [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)],
     ("torchtune.models.qwen2_5.qwen2_5_tokenizer", "vocab.json", {"merges_file": "merges.txt"})),
], ids=["llama3", "gemma2", "mistral", "qwen2"])
def test_random_checkpoint_loads_through_torchtunes_checkpointer_and_tokenizer(
        tmp_path, monkeypatch, builder, args, model_type, files, tokenizer):
    """bench/random_checkpoint.py for each model family our configs cover: the files the
    stock configs list, which torchtune's FullModelHFCheckpointer turns back into the very
    weights written, and a tokenizer its builder loads that round-trips text byte by byte."""
    from omegaconf import OmegaConf
    from torchtune import config as tt_config
    from torchtune.training import FullModelHFCheckpointer, set_default_dtype

    module = _bench_module("random_checkpoint")
    kind = {"GEMMA2": "sentencepiece", "MISTRAL": "sentencepiece", "QWEN2": "qwen"}.get(model_type, "tiktoken")
    ckpt_dir = tmp_path / "checkpoint"
    argv = ["random_checkpoint.py", "--model", builder, "--output-dir", str(ckpt_dir), "--shards", str(len(files)),
            "--tokenizer", kind, *[f"--arg={a}" for a in args]] + (["--bin"] if files[0].endswith(".bin") else [])
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    ckpt = FullModelHFCheckpointer(checkpoint_dir=str(ckpt_dir), checkpoint_files=files, model_type=model_type,
                                   output_dir=str(tmp_path / "out"))
    loaded = ckpt.load_checkpoint()["model"]
    torch.manual_seed(0)  # (the script's default seed: the same weights again)
    with set_default_dtype(torch.bfloat16):
        model = tt_config.instantiate(OmegaConf.create({"_component_": builder, **OmegaConf.from_dotlist(args)}))
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    name, path, extra = tokenizer
    tok = tt_config.instantiate(OmegaConf.create(
        {"_component_": name, "path": str(ckpt_dir / path), **{k: str(ckpt_dir / v) for k, v in extra.items()}}))
    text = "Below is an instruction.  Write a response: wörld\n"
    ids = tok.encode(text, add_bos=False, add_eos=False)
    assert max(ids) < 300 and tok.decode(ids) == text


def _bench_module(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stock_bench_runs_of_two_jobs_do_not_share_logs(tmp_path):
    """torchtune's DiskLogger appends: a QLoRA run's steps 7-8 once counted in a full run
    of 6 steps that reused its folder. Each job and model now has its own."""
    import argparse

    bench = _bench_module("bench_stock")
    full = argparse.Namespace(work=tmp_path, job="full", model="8b")
    qlora = argparse.Namespace(work=tmp_path, job="qlora", model="8b")
    assert bench.run_dir(full, "ours_stock") != bench.run_dir(qlora, "ours_stock")
    logs = bench.run_dir(full, "ours_stock") / "logs"
    logs.mkdir(parents=True)
    (logs / "log.txt").write_text("".join(
        f"Step {s} | loss:{10 - s} tokens_per_second_per_gpu:{100 * s} peak_memory_alloc:2.0\n" for s in (1, 2, 3, 4)))
    got = bench.parse(bench.run_dir(full, "ours_stock"), "PEAK_RSS_KIB 1048576", warmup=2)
    assert got["steps"] == 4 and got["tokens_per_s"] == 350 and got["losses"] == [9, 8, 7, 6]
    assert got["host_peak_rss_gib"] == 1.0


def test_bench_train_in_backward_and_compact_modes_cpu_smoke(tmp_path):
    """optimizer_in_bwd as torchtune's stock recipe builds it (one optimizer per parameter,
    stepped in its gradient hook), ours and torch's, and CompactAdamW: each trains, and the
    in-backward runs of ours and torch's give the same losses (both AdamW on the CPU)."""
    out = tmp_path / "modes.json"
    modes = ["gpu_adamw_in_bwd", "offload_in_bwd", "offload_grads_compact_early"]
    cmd = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--tiny", "--device", "cpu",
           "--job", "full", "--tokens-per-step", "256", "--seq-len", "64", "--optimizers", ",".join(modes),
           "--steps", "3", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = {r["optimizer"]: r for r in json.loads(out.read_text())["results"]}
    for name in modes:
        assert "error" not in results[name], results[name]
        assert len(set(results[name]["losses"])) == 3, name  # the weights moved
        assert results[name]["python_probe_ms"] > 0, name  # (the host's pace, for comparing runs)
    assert results["offload_in_bwd"]["losses"] == results["gpu_adamw_in_bwd"]["losses"]
    # The hooks' host seconds per step: each in-backward run's hooks stepped (a median of
    # positive times); runs stepped after backward have none.
    for name in ("gpu_adamw_in_bwd", "offload_in_bwd"):
        assert 0 < results[name]["hooks_s"] < max(results[name]["step_times"]), name
    assert "hooks_s" not in results["offload_grads_compact_early"]
    assert "| hooks host s/step | Python probe ms | huge-page GiB | CPU steal | GPU alloc retries |" in proc.stdout
    assert "allocator_per_step" not in results["offload_in_bwd"]  # (torch's CUDA allocator's, on a GPU)
    if Path("/proc/self/smaps_rollup").exists():  # (Linux: how much of the process has huge pages)
        assert all(results[name]["host_huge_gib"] >= 0 for name in modes)


def test_stock_bench_gives_every_run_the_same_batches(tmp_path):
    """The stock configs ship seed: null; every run of the bench passes seed=0."""
    import argparse

    bench = _bench_module("bench_stock")
    args = argparse.Namespace(work=tmp_path, job="qlora", model="1b", checkpoint=tmp_path / "ckpt",
                              seq_len=1024, batch_size=4, steps=12)
    for name in bench.RUNS["qlora"]:
        assert "seed=0" in bench.command(args, name)


def test_stock_bench_runs_name_real_recipes_and_configs(tmp_path):
    """Every run of every job and model launches a recipe with a config that exists:
    torchtune's own (from its registry, for the recipe run) or ours (a file here)."""
    import argparse

    from torchtune._recipe_registry import get_all_recipes

    bench = _bench_module("bench_stock")
    stock = {r.name: {c.name for c in r.configs} for r in get_all_recipes()}
    for model, (_, jobs) in bench.MODELS.items():
        for job in jobs:  # (each model's jobs: no 3B LoRA config here)
            args = argparse.Namespace(work=tmp_path, job=job, model=model, checkpoint=tmp_path / "ckpt",
                                      seq_len=1024, batch_size=4, steps=12)
            for name, (recipe, _) in bench.RUNS[job].items():
                cmd = bench.command(args, name)
                target, config = cmd[4], cmd[cmd.index("--config") + 1]
                if recipe == "stock":
                    assert config in stock[target], (model, job, name)
                else:
                    # (our recipes install as the package offload_plugin.recipes: see README)
                    script = REPO / "recipes" / Path(target).relative_to("offload_plugin/recipes")
                    assert script.is_file() and (REPO / config).is_file(), (model, job, name)
                want = "full_finetune" if job == "full" else "lora_finetune"
                assert want in target and (job == "full") == ("full" in config), (model, job, name)
                # (torchtune has no Qwen2.5 QLoRA config: its LoRA one with NF4 base weights)
                qlora = "qlora" in config or "model.quantize_base=True" in cmd
                assert qlora == (job == "qlora"), (model, job, name)


def test_stock_bench_pairs_the_steps_of_alternating_runs():
    """With --repeats, a run's ratio to the baseline pairs step k of repeat j with the
    baseline's step k of repeat j (the same batches), after the warmup steps."""
    bench = _bench_module("bench_stock")

    def run(steps):
        return {"tokens_per_s": sum(steps[1:]) / len(steps[1:]), "peak_gpu_gib": 1.0,
                "host_peak_rss_gib": 2.0, "step_tokens_per_s": steps}

    results = {
        "stock_as_shipped": {"repeats": [run([1, 100, 200]), run([1, 110, 220])]},
        "ours_stock": {"repeats": [run([9, 90, 200]), {"error": "timed out"}]},
    }
    got = bench.summarize(results, "stock_as_shipped", warmup=1)
    assert got["ours_stock"]["paired_ratio"] == (0.9 + 1.0) / 2  # the failed repeat pairs nothing
    assert got["stock_as_shipped"]["paired_ratio"] == 1.0
    assert got["stock_as_shipped"]["tokens_per_s"] == (150 + 165) / 2


def test_stock_bench_flags_runs_with_skipped_steps():
    """A run whose optimizer reported steps skipped for an inf or NaN gradient is named under
    the table: its tokens/s is not that of a clean run (such reports once came from a defect
    in the streamed update, not from the gradients)."""
    bench = _bench_module("bench_stock")

    def run(skips):
        return {"tokens_per_s": 100.0, "peak_gpu_gib": 1.0, "host_peak_rss_gib": 2.0,
                "step_tokens_per_s": [100.0, 100.0], "nonfinite_reports": skips}

    results = bench.summarize({"stock_as_shipped": {"repeats": [run(0)]},
                               "ours_stock": {"repeats": [run(3), run(2)]}}, "stock_as_shipped", warmup=0)
    warnings = [line for line in bench.markdown_table(results, "stock_as_shipped").splitlines()
                if line.startswith("warning")]
    assert warnings == ["warning: ours_stock: 5 steps reported skipped for an inf or NaN gradient (not a clean run)"]


def test_step_overhead_bench_cpu_smoke():
    """bench/investigations/step_overhead.py runs on the CPU, back to back and --cold, at rank 8 (192
    tensors of 5.3M elements in all) and another rank, and times every variant."""
    for extra, elements in (([], 5308416), (["--cold", "--rank", "2"], 5308416 // 4)):
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "investigations" / "step_overhead.py"), "--steps", "2", *extra],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        got = json.loads(proc.stdout[proc.stdout.index("{"):])
        assert got["tensors"] == 192 and got["elements"] == elements and got["cold"] == bool(extra)
        assert set(got["median_step_ms"]) == {"torch_adamw_on_device", "ours_default", "ours_offload_gradients",
                                              "ours_host_update"}
        assert all(ms > 0 for ms in got["median_step_ms"].values())


def test_omp_teams_bench_cpu_smoke():
    """bench/investigations/omp_teams.py times the native update in a host thread with and without the
    training thread's OpenMP team, and in the training thread itself."""
    from offload_plugin.formats.adamw import native as native_adam

    if native_adam.kernel() is None:
        pytest.skip("no native kernel here (no C++ compiler)")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "investigations" / "omp_teams.py"), "--numel", "65536", "--calls", "5"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert len(got["us_per_call"]) == 3 and all(us > 0 for us in got["us_per_call"].values())


def test_launch_rate_bench_cpu_smoke():
    """bench/investigations/launch_rate.py times a burst of small ops after a step of each optimizer (and of
    none), relative to none."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "investigations" / "launch_rate.py"), "--rounds", "2",
                           "--launches", "50"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert set(got["median_us_per_launch"]) == {"no_optimizer", "torch_adamw_on_device", "ours_default"}
    assert all(us > 0 for us in got["median_us_per_launch"].values())
    assert got["vs_no_optimizer"]["no_optimizer"] == 1.0


def test_qlora_ab_tiny_cpu_smoke(tmp_path):
    """bench/qlora_ab.py's CPU smoke command (its docstring's) runs both optimizers in turns and
    records every step's time and each one's ratio to torch's AdamW."""
    out = tmp_path / "ab.json"
    cmd = [sys.executable, str(REPO / "bench" / "qlora_ab.py"), "--tiny", "--device", "cpu",
           "--blocks", "3", "--block", "2", "--seq-len", "64", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())
    assert run["trainable_elements"] > 0
    for name in ("torch_adamw", "ours"):
        assert [len(b) for b in run["blocks"][name]] == [2, 2, 2]
        assert all(t > 0 for b in run["blocks"][name] for t in b)
        assert len(run[name]["turn_time_ratios"]) == 2
    assert run["torch_adamw"]["speed_vs_torch_adamw"] == 1.0
    assert run["ours"]["speed_vs_torch_adamw"] > 0


def _adamw8bit_standin(tmp_path):
    """An environment whose ``offload_plugin.AdamW8bit`` exists: the class where it has
    landed, else CompactAdamW(master=False) in its place (a sitecustomize on PYTHONPATH)."""
    import os

    import offload_plugin

    env = dict(os.environ)
    if not hasattr(offload_plugin, "AdamW8bit"):
        (tmp_path / "sitecustomize.py").write_text(
            "import offload_plugin\n"
            "from offload_plugin import CompactAdamW\n"
            "class AdamW8bit(CompactAdamW):\n"
            "    def __init__(self, params, *args, **kw):\n"
            "        kw.setdefault('master', False)\n"
            "        super().__init__(params, *args, **kw)\n"
            "offload_plugin.AdamW8bit = AdamW8bit\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return env


def test_bench_train_adamw8bit_entries_and_bus_columns_cpu_smoke(tmp_path):
    """The AdamW8bit entries train (stepped in backward and after it); with the streamed
    code on the host, each streamed run records the bytes its steps move each way (the
    state: 2 bytes and a little per parameter for AdamW8bit, 4 for exact AdamW's bf16
    moments), the bus columns use a bandwidth passed in, the uncapped baseline runs beside
    capped runs, and report.py prints the label's runs as one table with the targets."""
    env = _adamw8bit_standin(tmp_path)
    bandwidth = tmp_path / "bus.json"
    bandwidth.write_text(json.dumps({"h2d_GBps": 50.0, "d2h_GBps": 50.0, "both_GBps_each_way": 0.01}))
    results = tmp_path / "results"
    modes = ["gpu_adamw_in_bwd", "adamw8bit_in_bwd", "offload_in_bwd", "adamw8bit"]
    for tokens in (256,):  # (one invocation: the test stays short)
        cmd = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--tiny", "--device", "cpu",
               "--job", "full", "--tokens-per-step", str(tokens), "--seq-len", "64", "--steps", "3",
               "--warmup", "1", "--optimizers", ",".join(modes), "--cpu-streamed", "--gpu-memory-gib", "24",
               "--uncapped", "gpu_adamw_in_bwd", "--targets", "adamw8bit_in_bwd=0.9,offload_in_bwd=0.8",
               "--label", "smoke-inbwd", "--bus-json", str(bandwidth), "--ref-numel-cap", "0",
               "--time-budget", "250", "--child-timeout", "60", "--out", str(results / f"t{tokens}.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads((results / "t256.json").read_text())
    assert run["base"] == "gpu_adamw_in_bwd" and run["bus"]["both_GBps_each_way"] == 0.01
    got = {r["optimizer"]: r for r in run["results"]}
    for name in modes:
        assert "error" not in got[name], got[name]
        assert len(set(got[name]["losses"])) == 3, name  # the weights moved
    assert got["gpu_adamw_in_bwd"]["gpu_memory_limit_gib"] is None
    assert got["offload_in_bwd"]["gpu_memory_limit_gib"] == 24
    assert "bytes_h2d_per_step" not in got["gpu_adamw_in_bwd"]
    numel = run["trainable_params"]
    assert got["offload_in_bwd"]["bytes_h2d_per_step"] == got["offload_in_bwd"]["bytes_d2h_per_step"] == 4 * numel
    assert got["offload_in_bwd"]["streamed_optimizers"] == 20 and got["adamw8bit"]["streamed_optimizers"] == 1
    for name in ("adamw8bit_in_bwd", "adamw8bit"):
        assert 2 * numel <= got[name]["bytes_h2d_per_step"] < 4.2 * numel, name  # (the stand-in: ~4)
        assert got[name]["bus_use"] > 0 and got[name].get("target_vs_base") in (0.9, None)
    assert "| H2D GB/step | D2H GB/step | bus floor s | bus use |" in proc.stdout
    assert "| GPU cap GiB |" in proc.stdout and "| >= 0.90x |" in proc.stdout
    report = subprocess.run([sys.executable, str(REPO / "bench" / "report.py"), "--results", str(results)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stderr[-2000:]
    table = report.stdout.split("### smoke-inbwd: tiny full, 256 tokens per step")[1].split("###")[0]
    assert "| 256 | torch AdamW (fused), GPU | none | " in table and "| ours, `AdamW8bit` | 24 GiB |" in table
    assert ">= 0.90x (" in table and "Bus: pinned copies" in table


def test_bus_reads_the_process_huge_pages():
    """bench/bus.py's huge-page count (beside each run's step, and per placement of
    --state-like): this process's AnonHugePages, in GiB, where Linux reports it."""
    sys.path.insert(0, str(REPO / "bench"))
    import bus

    got = bus.huge_page_gib()
    if not Path("/proc/self/smaps_rollup").exists():
        assert got is None
        return
    kib = next(int(line.split()[1]) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()
               if line.startswith("AnonHugePages:"))
    assert got == kib / 2**20


def test_bus_spans_and_use():
    """bench/bus.py's arithmetic: overlapping copies count once; the bus use is bytes each
    way over the step (or the copy window) over the bandwidth."""
    sys.path.insert(0, str(REPO / "bench"))
    import bus

    assert bus.spans([(0, 10), (5, 20), (30, 40)]) == {"window_s": 40e-6, "busy_s": 30e-6, "copies": 3}
    got = bus.use({"bytes_h2d_per_step": 2e9, "bytes_d2h_per_step": 2e9, "step_s": 0.1, "h2d_window_s": 0.05},
                  {"both_GBps_each_way": 50.0})
    assert got["bus_floor_s"] == 0.04 and abs(got["bus_use"] - 0.4) < 1e-9
    assert abs(got["bus_use_h2d_window"] - 0.8) < 1e-9 and "bus_use_d2h_window" not in got
    assert bus.use({"step_s": 1.0}, {"both_GBps_each_way": 50.0}) == {}
    # A profiled step's CUDA events (names as CUDA's profiler gives them), in microseconds.
    event = lambda name, a, b: SimpleNamespace(name=name, time_range=SimpleNamespace(start=a, end=b))  # noqa: E731
    got = bus.device_spans([event("Memcpy HtoD (Pinned -> Device)", 0, 10), event("Memcpy DtoH (Device -> Pinned)", 5, 25),
                            event("ampere_bf16_gemm", 0, 30), event("triton_adamw8bit", 20, 50),
                            event("Memcpy DtoD (Device -> Device)", 60, 90), event("Memset (Device)", 60, 90)])
    assert got == {"h2d_window_s": 10e-6, "h2d_busy_s": 10e-6, "h2d_copies": 1,
                   "d2h_window_s": 20e-6, "d2h_busy_s": 20e-6, "d2h_copies": 1,
                   "kernel_window_s": 50e-6, "kernel_busy_s": 50e-6, "kernel_launches": 2}


def test_step_profile_table_sets_each_steps_copy_time_against_the_bytes_it_moves():
    """--profile-steps' table: per profiled step its wall, kernel and copy times, and the
    copies' GB/s while they ran (bytes a step moves / the time they ran); '-' where a step
    had no copies that way."""
    bench = _bench_module("bench_train")
    result = {"optimizer": "adamw8bit_in_bwd", "bytes_h2d_per_step": 16e9, "bytes_d2h_per_step": 16e9,
              "step_profiles": [{"profiled_step_s": 0.62, "kernel_busy_s": 0.5, "h2d_busy_s": 0.32, "d2h_busy_s": 0.4},
                                {"profiled_step_s": 0.75, "kernel_busy_s": 0.5, "h2d_busy_s": 0.4}]}
    rows = bench.step_profile_table(result).splitlines()
    assert rows[-2] == "| 1 | 0.620 | 0.500 | 0.320 | 0.400 | 50.0 | 40.0 |"
    assert rows[-1] == "| 2 | 0.750 | 0.500 | 0.400 | - | 40.0 | - |"


def test_what_fits_searches_largest_first_and_leaves_out_what_cannot_fit():
    """what_fits.search with a stand-in for the runs: per cap, largest first, the host and
    weight estimates leave models out before anything runs, a failure falls back to the
    next smaller, a larger cap tries only larger models than the smaller cap's answer, and
    the time budget stops new attempts."""
    fits = _bench_module("what_fits")
    args = fits.parse_args(["--device", "cpu", "--caps", "24,48", "--host-gib", "64", "--modes", "exact,adamw8bit"])
    args.device = "cuda"  # (the weights-vs-cap check; nothing runs)
    gib = 2**30
    models = {name: {"params": n, "weights_gib": 2 * n / gib,
                     "host_state_gib": {"exact": 4 * n / gib, "adamw8bit": 2 * n / gib}}
              for name, n in [("small", 4e9), ("mid", 9e9), ("big", 14e9), ("wide", 20e9), ("huge", 30e9)]}
    tried = []

    def run(args, mode, model, cap, timeout):
        tried.append((cap, mode, model))
        if model == "mid" and cap == 24:  # out of memory under 24 GiB
            return {"error": "OutOfMemoryError: CUDA out of memory"}
        return {"tokens_per_s": 1000.0, "host_rss_gib": 70.0 if model == "huge" else 40.0, "peak_gpu_gib": 20.0}

    rows = fits.search(args, models, run=run)
    assert tried == [(24, "exact", "mid"), (24, "exact", "small"), (24, "adamw8bit", "mid"), (24, "adamw8bit", "small"),
                     (48, "exact", "big"), (48, "adamw8bit", "wide")]
    best = fits.largest(rows)
    assert best[("exact", 24)]["model"] == "small" and best[("exact", 48)]["model"] == "big"
    assert best[("adamw8bit", 48)]["model"] == "wide"
    why = {(r["cap_gib"], r["mode"], r["model"]): r["reason"] for r in rows if r["outcome"] == "left out"}
    assert "bf16 weights alone" in why[(24, "exact", "huge")] and "bf16 weights alone" in why[(24, "exact", "big")]
    assert "host state" in why[(48, "exact", "wide")] and "bf16 weights alone" in why[(48, "adamw8bit", "huge")]
    table = fits.markdown({"rows": rows, "caps": [24, 48], "modes": ["exact", "adamw8bit"]})
    assert "| default options (exact AdamW) | **small** (4.0B): 1,000 tokens/s" in table
    # A time budget already spent: nothing starts, and the table says so.
    args.time_budget, clock = 100, iter([0, 1000] + [1000] * 20).__next__
    rows = fits.search(args, models, run=run, clock=clock)
    assert {r["outcome"] for r in rows} <= {"left out", "not tried"}
    assert "not reached (time budget)" in fits.markdown({"rows": rows, "caps": [24, 48], "modes": ["exact", "adamw8bit"]})


def test_what_fits_tiny_cpu_smoke(tmp_path):
    """bench/what_fits.py end to end on the CPU: a ladder of tiny models, each mode's
    largest trains (in a process of its own) and the report prints the table."""
    env = _adamw8bit_standin(tmp_path)
    out = tmp_path / "results" / "fits.json"
    cmd = [sys.executable, str(REPO / "bench" / "what_fits.py"), "--tiny", "--device", "cpu", "--cpu-streamed",
           "--models", "tiny_2l,tiny_4l", "--caps", "24,48", "--steps", "2", "--warmup", "1", "--seq-len", "64",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())
    assert run["kind"] == "fits" and "args" not in run  # (report.py tells training runs by "args")
    fitted = [r for r in run["rows"] if r["outcome"] == "fits"]
    assert [(r["mode"], r["model"]) for r in fitted] == [("exact", "tiny_4l"), ("compact", "tiny_4l"), ("adamw8bit", "tiny_4l")]
    assert all(r["tokens_per_s"] > 0 and r["bytes_h2d_per_step"] > 0 for r in fitted)
    assert [r["outcome"] for r in run["rows"] if r["cap_gib"] == 48] == ["as under 24 GiB"] * 3
    report = subprocess.run([sys.executable, str(REPO / "bench" / "report.py"), "--results", str(out.parent)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "## What fits where" in report.stdout and "| AdamW8bit | **tiny_4l**" in report.stdout


def test_stock_bench_models_name_configs_that_exist_with_the_checkpoint_it_writes():
    """Each model and job bench_stock.py compares names torchtune's stock config and ours;
    both exist, list exactly the checkpoint files bench/random_checkpoint.py writes for the
    model (CHECKPOINTS), and read the kind of tokenizer it writes, else the recipes would
    look for files that are not there."""
    import torchtune
    from omegaconf import OmegaConf

    bench = _bench_module("bench_stock")
    writer = _bench_module("random_checkpoint")
    stock_root = Path(torchtune.__file__).resolve().parent.parent / "recipes" / "configs"
    reads = {"tiktoken": "llama3_tokenizer", "sentencepiece": ("gemma_tokenizer", "mistral_tokenizer"),
             "qwen": "qwen2_5_tokenizer"}

    def files(cfg):
        listed = cfg.checkpointer.checkpoint_files
        if "filename_format" in listed:
            n = int(listed.max_filename)
            return [listed.filename_format.format(f"{i:05d}", f"{n:05d}") for i in range(1, n + 1)]
        return list(listed)

    assert {"1b", "3b", "8b", "gemma2_2b", "gemma2_9b", "mistral_7b", "qwen2_5_7b"} <= set(bench.MODELS)
    for model, (builder, jobs) in bench.MODELS.items():
        assert builder.startswith("torchtune.models.")
        shards, tokenizer, bin_files = bench.CHECKPOINTS[model]
        written = [name for name, _ in writer.shards({f"w{i}": torch.zeros(1) for i in range(shards)}, shards, bin_files)]
        for job, (stock, ours) in jobs.items():
            assert job in bench.RUNS
            for path in (stock_root / f"{stock}.yaml", REPO / ours):
                cfg = OmegaConf.load(path)
                assert files(cfg) == written, (model, job, path)
                assert cfg.tokenizer._component_.endswith(reads[tokenizer]), (model, job, path)
                assert set(bench.tokenizer_files(model, Path("/x"))) <= set(cfg.tokenizer), (model, path)


def test_bench_hf_tiny_cpu_smoke(tmp_path):
    """bench/bench_hf.py under HF's Trainer on a tiny Llama: every run records its step times,
    tokens/s and host memory, and the table compares them with the base run."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_hf.py"), "--model", "tiny", "--device", "cpu",
           "--tokens-per-step", "256", "--seq-len", "128", "--steps", "2", "--warmup", "1",
           "--max-grad-norm", "0", "--runs", "ours,ours_grads,ours_inbwd,adamw_torch_fused",
           "--tmp", str(tmp_path / "runs"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = {r["run"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["ours", "ours_grads", "ours_inbwd", "adamw_torch_fused"]
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r['error']}"
        assert len(r["step_s"]) == 2 and r["tokens_per_s"] > 0 and r["peak_host_gib"] > 0, name
    assert "| adamw_torch_fused |  | " in proc.stdout and "1.00x" in proc.stdout


def test_bench_hf_keeps_what_a_run_that_timed_out_had_done(tmp_path):
    """A run past --timeout is recorded as failed with the phases it finished (its progress
    lines), not lost with the parent: the 8B runs that outlast their time say where it went."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_hf.py"), "--model", "tiny", "--device", "cpu",
           "--tokens-per-step", "256", "--seq-len", "128", "--steps", "2", "--warmup", "1", "--timeout", "2",
           "--runs", "ours_grads", "--tmp", str(tmp_path / "runs"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["error"].startswith("did not finish in 2 s") and isinstance(result["progress"], list)


BENCH = REPO / "bench"
SUBFOLDERS = ("formats", "investigations")  # the scripts not at the top of bench/
RESULTS = {"stock", "train", "fsdp2", "hf", "setup", "formats", "fits", "investigations"}  # a folder per table


def _scripts(folder):
    return {p.name for p in folder.iterdir() if p.is_file() and p.suffix in (".py", ".sh")}


def _named(readme):
    """The scripts a README names: bench/'s by name, its subfolders' by their path from bench/."""
    return set(re.findall(rf"`((?:{'|'.join(SUBFOLDERS)})/\w+\.(?:py|sh)|\w+\.(?:py|sh))`", readme.read_text()))


def test_bench_top_holds_the_benchmarks_behind_the_tables():
    """At most a dozen files at the top of bench/ beside its README (the benchmarks behind the
    results pages' tables and their tools); the rest in formats/ and investigations/."""
    top = {p.name for p in BENCH.iterdir() if p.is_file()} - {"README.md"}
    assert len(top) <= 12, sorted(top)
    assert top == _scripts(BENCH), "only scripts at the top of bench/"
    folders = {p.name for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {*SUBFOLDERS, "results"}, folders


def test_bench_readme_names_every_script():
    """bench/README.md says what each script at the top and in formats/ is for (formats/ ones by
    their path from bench/) and names none that is gone; investigations/README.md does so for its
    scripts, each with where its answer is documented."""
    scripts = _scripts(BENCH) | {f"formats/{name}" for name in _scripts(BENCH / "formats")}
    named = _named(BENCH / "README.md")
    assert scripts - named == set(), "not in bench/README.md"
    assert named - scripts == set(), "named in bench/README.md but gone"
    assert all(f"`{folder}/`" in (BENCH / "README.md").read_text() for folder in SUBFOLDERS)
    investigations = BENCH / "investigations" / "README.md"
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+\.py)` \|(.*)$", investigations.read_text(), flags=re.M)}
    assert set(rows) == _scripts(BENCH / "investigations"), "investigations/README.md: one row per script"
    for script, row in rows.items():  # (the question, then where its answer is: a page or a module)
        where = re.findall(r"docs/\w+\.md|offload_plugin/[\w/]+\.py", row)
        assert where, f"{script}: where is its answer?"
        assert all((BENCH.parent / path).is_file() for path in re.findall(r"offload_plugin/[\w/]+\.py", row)), row
    for target in re.findall(r"\]\(([^)#\s]+)", investigations.read_text()):
        assert (investigations.parent / target).resolve().is_file(), target


def test_results_are_grouped_by_the_table_they_feed():
    """bench/results/ holds a folder per table (each named in bench/README.md) and no loose file;
    the benchmarks' default outputs go to their table's folder."""
    results = BENCH / "results"
    assert not [p.name for p in results.iterdir() if p.is_file()], "files outside a table's folder"
    assert {p.name for p in results.iterdir() if p.is_dir()} == RESULTS
    readme = (BENCH / "README.md").read_text()
    for folder in RESULTS:
        assert f"`{folder}/`" in readme or f"`results/{folder}/`" in readme, folder
    for script, folder in (("bench_train.py", "train"), ("bench_stock.py", "stock"), ("bench_fsdp2.py", "fsdp2"),
                           ("what_fits.py", "fits")):
        assert f'REPO / "bench" / "results" / "{folder}" /' in (BENCH / script).read_text(), script
    # run_h200.sh writes each stage's results into a table's folder (bench(): its first argument)
    stages = (BENCH / "run_h200.sh").read_text()
    for out in re.findall(r'bench/results(?:/([^\s"/]+))?', stages):
        assert out in RESULTS | {"$folder", "<table>", ""}, out
    called = re.findall(r"^\s*bench (\S+) ", stages, flags=re.M)
    assert called and set(called) <= RESULTS, called
