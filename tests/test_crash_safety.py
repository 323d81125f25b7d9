"""SIGKILL during a checkpoint save, with our recipes and the embedded demo model, on CPU.

Each crashed run goes through ``tune run`` like a user's, but under a small launcher that
SIGKILLs the process at one exact moment of the epoch-1 save: halfway through writing a
file (``torch.save``) or right after one rename (``os.replace``). Patching those two calls
from the outside keeps the recipes free of test hooks and lets the same kill hit
torchtune's plain ``save_checkpoint`` too, which shows what the crash-safe save prevents.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtune import training
from torchtune.training import FullModelTorchTuneCheckpointer

pytestmark = pytest.mark.slow  # (starts processes: left out of the quick lane, pytest -m "not slow")

REPO = Path(__file__).resolve().parents[1]
STEPS = 4  # optimizer steps per epoch
EPOCHS = 3
RECIPE = {"full": "full_finetune_single_device.py", "lora": "lora_finetune_single_device.py"}
WEIGHTS = {"full": "model-00001-of-00001.bin", "lora": "adapter_model.pt"}

# Runs the tune CLI in this process after arming one kill, given as
# CRASH_AT="save_half|replace_after:PATH_SUFFIX:N" (the N-th call on a path ending with
# PATH_SUFFIX). CRASH_UNPROTECTED=1 swaps the crash-safe save for torchtune's plain one.
LAUNCHER = '''
import io, os, runpy, signal, sys
import torch

how, suffix, nth = os.environ["CRASH_AT"].split(":")
seen = [0]

def hit(path):
    if not str(path).endswith(suffix):
        return False
    seen[0] += 1
    return seen[0] == int(nth)

def kill():
    os.kill(os.getpid(), signal.SIGKILL)

real_save, real_replace = torch.save, os.replace

def save(obj, f, *args, **kwargs):
    if how == "save_half" and hit(f):
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        with open(f, "wb") as out:  # what a kill in the middle of torch.save leaves
            out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        kill()
    return real_save(obj, f, *args, **kwargs)

def replace(src, dst, *args, **kwargs):
    real_replace(src, dst, *args, **kwargs)
    if how == "replace_after" and hit(dst):
        kill()

torch.save, os.replace = save, replace
if os.environ.get("CRASH_UNPROTECTED") == "1":
    from offload_plugin import recipe_utils

    recipe_utils.save_checkpoint_atomically = lambda ckptr, sd, **kw: ckptr.save_checkpoint(sd, **kw)
sys.argv = ["tune", *sys.argv[1:]]
runpy.run_module("torchtune._cli.tune", run_name="__main__")
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A prepared demo dir, the kill launcher, and an environment whose HF_HOME is private."""
    root = tmp_path_factory.mktemp("crash")
    env = dict(os.environ, HF_HOME=str(root / "hf_home"), PYTHONUNBUFFERED="1")
    proc = _run([sys.executable, "-m", "offload_plugin.demo", "prepare", "--output-dir", str(root / "demo")], env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (root / "crash_launcher.py").write_text(LAUNCHER)
    return root, env


def _run(cmd, env):
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def _tune_run(kind, workdir, out, *overrides, crash_at=None, unprotected=False):
    """Launch our KIND recipe on the demo config for EPOCHS epochs; with crash_at, under the kill launcher."""
    root, env = workdir
    prog = [sys.executable, "-m", "torchtune._cli.tune"]
    if crash_at:
        prog = [sys.executable, str(root / "crash_launcher.py")]
        env = dict(env, CRASH_AT=crash_at, CRASH_UNPROTECTED=str(int(unprotected)))
    cmd = [
        *prog, "run", f"offload_plugin/recipes/{RECIPE[kind]}",
        "--config", str(REPO / "configs" / "demo" / f"tiny_{kind}_offload.yaml"),
        f"demo_dir={root / 'demo'}", f"output_dir={out}", f"epochs={EPOCHS}",
        "batch_size=4", f"max_steps_per_epoch={STEPS}", "lr_scheduler.num_warmup_steps=3",
        "optimizer.offload_gradients=True", *overrides,
    ]  # fmt: skip
    return _run(cmd, env)


def _resume(kind, workdir, out, epochs_done, **kwargs):
    overrides = ["resume_from_checkpoint=True", "metric_logger.filename=resumed.txt"]
    if kind == "full":  # torchtune 0.6.1 resumes full fine-tuning from the model file the config names
        overrides.append(f"checkpointer.checkpoint_files=[epoch_{epochs_done - 1}/{WEIGHTS['full']}]")
    return _tune_run(kind, workdir, out, *overrides, **kwargs)


def _logged(path: Path) -> dict:
    """{step: {metric: value}} read back from DiskLogger's file."""
    steps = {}
    for line in path.read_text().splitlines():
        m = re.match(r"Step (\d+) \| (.*)", line)
        if m:
            steps[int(m.group(1))] = {k: float(v) for k, v in (kv.split(":") for kv in m.group(2).split())}
    return steps


def _load_as_torchtune_resumes(kind, root, out, epochs_done) -> dict:
    """What torchtune's own checkpointer loads from OUT on resume, with no recovery step of ours."""
    files = [f"epoch_{epochs_done - 1}/{WEIGHTS['full']}"] if kind == "full" else ["model.pt"]
    ckptr = FullModelTorchTuneCheckpointer(
        checkpoint_dir=str(root / "demo" / "model"), checkpoint_files=files, model_type="LLAMA3_2",
        output_dir=str(out), should_load_recipe_state=True,
    )  # fmt: skip
    return ckptr.load_checkpoint()


@pytest.fixture(scope="module")
def straight_runs(workdir):
    """One uninterrupted EPOCHS-epoch run per recipe kind: the reference every resume must reproduce."""
    root, _ = workdir
    runs = {}
    for kind in RECIPE:
        out = root / f"straight_{kind}"
        proc = _tune_run(kind, workdir, out, "metric_logger.filename=log.txt")
        assert proc.returncode == 0, proc.stderr[-6000:]
        runs[kind] = out
    return runs


# (recipe kind, kill point, epochs a resume finds finished). Before the commit rename the
# previous checkpoint (epoch 0) must be what a resume sees; after it, the save is rolled forward.
SCENARIOS = [
    pytest.param("full", f"save_half:epoch_1/{WEIGHTS['full']}:1", 1, id="full-half-written-weights"),
    pytest.param("full", "save_half:recipe_state/recipe_state.pt:2", 1, id="full-half-written-recipe-state"),
    pytest.param("full", "replace_after:.epoch_1.complete:1", 2, id="full-committed-not-published"),
    pytest.param("lora", f"save_half:epoch_1/{WEIGHTS['lora']}:1", 1, id="lora-half-written-adapter"),
    pytest.param("lora", f"replace_after:epoch_1/{WEIGHTS['lora']}:1", 2, id="lora-adapter-published-not-state"),
]


@pytest.mark.parametrize("kind, crash_at, epochs_done", SCENARIOS)
def test_kill_during_save_keeps_checkpoint_and_resume_matches(straight_runs, workdir, tmp_path, kind, crash_at, epochs_done):
    """SIGKILL mid-save of epoch 1 keeps a loadable checkpoint; the resume logs the uninterrupted run's losses."""
    root, _ = workdir
    out = tmp_path / "crashed"
    proc = _tune_run(kind, workdir, out, "metric_logger.filename=log.txt", crash_at=crash_at)
    assert proc.returncode == -signal.SIGKILL, f"not killed where planned:\n{proc.stderr[-6000:]}"

    if epochs_done == 1:  # killed before the commit: the epoch-0 set is untouched
        ckpt = _load_as_torchtune_resumes(kind, root, out, epochs_done)
        assert ckpt[training.EPOCHS_KEY] == 1
        key = training.MODEL_KEY if kind == "full" else training.ADAPTER_KEY
        expected = torch.load(straight_runs[kind] / "epoch_0" / WEIGHTS[kind], weights_only=True)
        torch.testing.assert_close(ckpt[key], expected, rtol=0, atol=0)
    else:  # killed after the commit: the complete save waits to be rolled forward
        assert (out / ".epoch_1.complete").is_dir()

    proc = _resume(kind, workdir, out, epochs_done)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".epoch_")], "staging left behind"
    expected = {s: m for s, m in _logged(straight_runs[kind] / "logs" / "log.txt").items() if s > epochs_done * STEPS}
    resumed = _logged(out / "logs" / "resumed.txt")
    assert sorted(resumed) == sorted(expected) == list(range(epochs_done * STEPS + 1, EPOCHS * STEPS + 1))
    for step in expected:
        assert resumed[step]["loss"] == expected[step]["loss"], step
        assert resumed[step]["lr"] == expected[step]["lr"], step


@pytest.mark.parametrize(
    "kind, crash_at",
    [
        pytest.param("full", "save_half:recipe_state/recipe_state.pt:2", id="full-half-written-recipe-state"),
        pytest.param("lora", f"save_half:epoch_1/{WEIGHTS['lora']}:1", id="lora-half-written-adapter"),
    ],
)
def test_same_kill_breaks_torchtunes_plain_save(workdir, tmp_path, kind, crash_at):
    """Control: the same kill during torchtune's plain save_checkpoint leaves no resumable checkpoint."""
    out = tmp_path / "crashed"
    proc = _tune_run(kind, workdir, out, "metric_logger.filename=log.txt", crash_at=crash_at, unprotected=True)
    assert proc.returncode == -signal.SIGKILL, f"not killed where planned:\n{proc.stderr[-6000:]}"
    proc = _resume(kind, workdir, out, epochs_done=1, crash_at="save_half:never:1", unprotected=True)
    assert proc.returncode != 0, "resume after a kill mid plain save unexpectedly worked"
