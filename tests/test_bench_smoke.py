"""bench/ scripts end to end on CPU: bench_train.py (a tiny model, numbers in the JSON),
host_update_rate.py and report.py, as the README names them."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = ["gpu_adamw", "offload", "offload_grads", "offload_grads_delayed"]


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
        assert len(r["losses"]) == 3
    # Same model, same data: the first loss (before any update) is identical for all.
    assert len({r["losses"][0] for r in results.values()}) == 1
    assert results["offload"]["host_update_s"] > 0
    assert run["cpu_adamw_reference"]["gparams_s"] > 0
    assert "| offload |" in proc.stdout


def test_host_update_rate_and_report_run(tmp_path):
    """The README's host-rate command (on a small parameter) and the report over the results."""
    rate = subprocess.run(
        [sys.executable, str(REPO / "bench" / "host_update_rate.py"), "--numel", str(1 << 16),
         "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert rate.returncode == 0, rate.stderr[-2000:]
    assert "torch AdamW(fused) fp32" in rate.stdout and "offload update" in rate.stdout
    assert "memory bandwidth" in rate.stdout
    report = subprocess.run([sys.executable, str(REPO / "bench" / "report.py")],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stderr[-2000:]
    # Every committed result appears, with its ratio column.
    assert report.stdout.count("### ") == len(list((REPO / "bench" / "results").glob("*.json")))
    assert "| gpu_adamw |" in report.stdout
