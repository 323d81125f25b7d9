"""bench/bench_train.py end to end on CPU: a tiny model, three optimizers, numbers in the JSON."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = ["gpu_adamw", "offload", "offload_grads"]


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
