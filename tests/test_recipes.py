"""End-to-end runs of our recipes (and torchtune's) with the offload optimizer, on CPU.

Every run uses the tiny offline demo model of ``offload_plugin.demo`` and goes through the
``tune`` command line, as a user would launch it. Needs ``pip install -e .`` (the recipes
install as ``offload_plugin.recipes``).
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disk_log import read_log

pytestmark = pytest.mark.slow  # (starts processes: left out of the quick lane, pytest -m "not slow")

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIGS = REPO / "configs" / "demo"
STEPS = 15  # optimizer steps per epoch: enough for the loss to fall, a few seconds each run
RECIPE = {
    "qlora": "lora_finetune_single_device.py",
    "lora": "lora_finetune_single_device.py",
    "full": "full_finetune_single_device.py",
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A prepared demo dir plus an environment whose HF_HOME (Arrow cache) is private."""
    root = tmp_path_factory.mktemp("recipes")
    env = dict(os.environ, HF_HOME=str(root / "hf_home"), PYTHONUNBUFFERED="1")
    _run([sys.executable, "-m", "offload_plugin.demo", "prepare", "--output-dir", str(root / "demo")], env, root)
    return root, env


def _run(cmd, env, cwd):
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def _tune_run(recipe, kind, workdir, out, *overrides, cwd=REPO):
    """Launch `tune run RECIPE --config configs/demo/tiny_KIND_offload.yaml` with small-run overrides."""
    root, env = workdir
    cmd = [
        sys.executable, "-m", "torchtune._cli.tune", "run", recipe,
        "--config", str(DEMO_CONFIGS / f"tiny_{kind}_offload.yaml"),
        f"demo_dir={root / 'demo'}", f"output_dir={out}",
        "batch_size=4", f"max_steps_per_epoch={STEPS}", "lr_scheduler.num_warmup_steps=3",
        "metric_logger.filename=log.txt", *overrides,
    ]  # fmt: skip
    return _run(cmd, env, cwd)


def _losses(out: Path) -> list:
    return [m["loss"] for _, m in sorted(read_log(out).items())]


@pytest.fixture(scope="module")
def straight_runs(workdir):
    """Two uninterrupted epochs per recipe kind, shared by the loss and resume tests."""
    root, _ = workdir
    runs = {}
    for kind, offload_grads in (("qlora", False), ("lora", True), ("full", True)):
        out = root / f"straight_{kind}"
        _tune_run(
            f"offload_plugin/recipes/{RECIPE[kind]}", kind, workdir, out,
            "epochs=2", f"optimizer.offload_gradients={offload_grads}",
        )  # fmt: skip
        runs[kind] = (out, offload_grads)
    return runs


@pytest.mark.parametrize("kind", ["qlora", "lora", "full"])
def test_loss_falls_and_metrics_logged(straight_runs, kind):
    """Our recipe trains the demo model with CPUOffloadOptimizer: loss falls, metrics and checkpoint are written."""
    out, _ = straight_runs[kind]
    logged = read_log(out)
    assert sorted(logged) == list(range(1, 2 * STEPS + 1))
    losses = _losses(out)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    first = logged[1]
    for key in ("loss", "lr", "tokens_per_second_per_gpu", "grad_norm", "optimizer_step_s"):
        assert key in first, f"{key} not logged: {first}"
    assert first["optimizer_host_memory_gib"] > 0
    weights = "adapter_model.pt" if kind != "full" else "model-00001-of-00001.bin"
    assert (out / "epoch_1" / weights).is_file()


@pytest.mark.parametrize("kind", ["qlora", "lora", "full"])
def test_resume_reproduces_uninterrupted_run(straight_runs, workdir, tmp_path, kind):
    """Resuming after epoch 1 from the saved checkpoint logs the same losses and lrs as the uninterrupted run."""
    straight, offload_grads = straight_runs[kind]
    # The disk state right after epoch 1: the 2-epoch run's files without the final epoch.
    out = tmp_path / "resumed"
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    overrides = ["epochs=2", f"optimizer.offload_gradients={offload_grads}", "resume_from_checkpoint=True"]
    if kind == "full":  # full fine-tuning resumes the model from output_dir
        overrides.append("checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.bin]")
    _tune_run(f"offload_plugin/recipes/{RECIPE[kind]}", kind, workdir, out, *overrides)

    expected = {s: m for s, m in read_log(straight).items() if s > STEPS}
    resumed = read_log(out)
    assert sorted(resumed) == sorted(expected)
    for step in expected:
        assert resumed[step]["loss"] == expected[step]["loss"], step
        assert resumed[step]["lr"] == expected[step]["lr"], step


def test_gradient_accumulation_matches_larger_batch(straight_runs, workdir, tmp_path):
    """Two accumulated micro-batches of 2 train like one batch of 4: token-normalized loss, scaling through the optimizer."""
    straight, offload_grads = straight_runs["full"]
    out = tmp_path / "accum"
    _tune_run(
        f"offload_plugin/recipes/{RECIPE['full']}", "full", workdir, out,
        "epochs=2", "batch_size=2", "gradient_accumulation_steps=2", f"optimizer.offload_gradients={offload_grads}",
    )  # fmt: skip
    torch.testing.assert_close(torch.tensor(_losses(out)), torch.tensor(_losses(straight)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("clip", ["null", "0.5"], ids=["no-clipping", "clipping"])
def test_overlapped_updates_match_updates_after_backward(workdir, tmp_path, clip):
    """offload_gradients starts updates during backward (without clipping), or scales the
    gradients and takes their norms during it (with clipping): losses equal the plain order's."""
    runs = {}
    for offload_grads in (False, True):
        out = tmp_path / f"offload_{offload_grads}"
        _tune_run(
            f"offload_plugin/recipes/{RECIPE['full']}", "full", workdir, out,
            "batch_size=2", "gradient_accumulation_steps=2", f"clip_grad_norm={clip}",
            "optimizer.fused=True", f"optimizer.offload_gradients={offload_grads}",
        )  # fmt: skip
        runs[offload_grads] = _losses(out)
    assert len(runs[True]) == STEPS
    torch.testing.assert_close(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind,accum", [("full", 2), ("lora", 1)])
def test_early_forward_trains_and_saves_like_waiting_in_step(workdir, tmp_path, kind, accum):
    """early_forward=True (opt-in): step() returns before the host update
    ends and each module's forward waits for its weights. The losses and the saved model
    (adapters for LoRA) are the same bits as with step() waiting."""
    runs, weights = {}, {}
    for early in (False, True):
        out = tmp_path / f"early_{early}"
        _tune_run(
            f"offload_plugin/recipes/{RECIPE[kind]}", kind, workdir, out,
            "batch_size=2", f"gradient_accumulation_steps={accum}",
            "optimizer.offload_gradients=True", f"early_forward={early}",
        )  # fmt: skip
        runs[early] = _losses(out)
        (saved,) = out.glob("epoch_0/*.bin" if kind == "full" else "epoch_0/adapter_model.pt")
        weights[early] = torch.load(saved, map_location="cpu", weights_only=True)
    assert len(runs[True]) == STEPS and runs[True] == runs[False]
    assert weights[True].keys() == weights[False].keys()
    for name, value in weights[False].items():
        assert torch.equal(weights[True][name], value), name


@pytest.mark.parametrize("kind", ["qlora", "lora"])
def test_torchtune_stock_lora_recipe_matches_torch_adamw(workdir, tmp_path, kind):
    """torchtune's own lora_finetune_single_device, only the optimizer's _component_ changed
    (its scale_grads and clip_grad_norm_ act on the device gradients): the same losses as
    torch's fused AdamW in the same recipe, and the loss falls."""
    runs = {
        "ours": ["optimizer._component_=offload_plugin.CPUOffloadOptimizer",
                 "optimizer.offload_gradients=False"],
        "torch": ["optimizer._component_=torch.optim.AdamW", "optimizer.fused=True",
                  "~optimizer.optimizer_cls", "~optimizer.offload_gradients", "~optimizer.delayed_update"],
    }
    for name, overrides in runs.items():
        _tune_run("lora_finetune_single_device", kind, workdir, tmp_path / name, *overrides)
    losses = _losses(tmp_path / "ours")
    assert losses == _losses(tmp_path / "torch")
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("in_bwd", [True, False], ids=["optimizer_in_bwd", "step-after-backward"])
def test_torchtune_stock_full_recipe_matches_torch_adamw(workdir, tmp_path, in_bwd):
    """torchtune's own full_finetune_single_device, only the optimizer's _component_ changed:
    the same losses and weights as torch's AdamW in the same recipe. With optimizer_in_bwd
    (the stock configs' setting) each parameter gets its own optimizer, stepped in its
    gradient hook."""
    common = ["clip_grad_norm=null", f"optimizer_in_bwd={in_bwd}", "optimizer.fused=True"]
    runs = {
        "ours": ["optimizer._component_=offload_plugin.CPUOffloadOptimizer"],
        "torch": ["optimizer._component_=torch.optim.AdamW", "~optimizer.optimizer_cls",
                  "~optimizer.offload_gradients", "~optimizer.delayed_update"],
    }
    for name, overrides in runs.items():
        _tune_run("full_finetune_single_device", "full", workdir, tmp_path / name, *common, *overrides)
    assert _losses(tmp_path / "ours") == _losses(tmp_path / "torch")
    assert len(_losses(tmp_path / "ours")) == STEPS
    weights = {name: torch.load(next((tmp_path / name).glob("epoch_0/*.bin")), weights_only=True)
               for name in runs}
    for key, value in weights["torch"].items():
        assert torch.equal(weights["ours"][key], value), key


def test_torchtune_stock_full_recipe_with_optimizer_in_bwd_resumes_exactly(workdir, tmp_path):
    """torchtune's own full recipe under optimizer_in_bwd (its wrapper saves one state dict per
    parameter name) with only _component_ changed, resumed after epoch 1: the same losses
    and lrs as straight through."""
    common = ["clip_grad_norm=null", "optimizer_in_bwd=True", "optimizer.fused=True", "epochs=2",
              "optimizer._component_=offload_plugin.CPUOffloadOptimizer"]
    straight = tmp_path / "straight"
    _tune_run("full_finetune_single_device", "full", workdir, straight, *common)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    _tune_run("full_finetune_single_device", "full", workdir, resumed, *common, "resume_from_checkpoint=True",
              "checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.bin]")
    expected = {s: m for s, m in read_log(straight).items() if s > STEPS}
    logged = read_log(resumed)
    assert sorted(logged) == sorted(expected) and len(expected) == STEPS
    for step in expected:
        assert (logged[step]["loss"], logged[step]["lr"]) == (expected[step]["loss"], expected[step]["lr"]), step


def test_our_full_recipe_with_optimizer_in_bwd_matches_torch_adamw_and_resumes(workdir, tmp_path):
    """Our full recipe with optimizer_in_bwd (one optimizer per parameter, stepped in its
    gradient hook, as torchtune's): the same losses and weights as torch's AdamW stepped
    the same way in the same recipe, with the config's scheduler; resumed after epoch 1,
    the same losses and lrs as straight through."""
    recipe = f"offload_plugin/recipes/{RECIPE['full']}"
    common = ["optimizer_in_bwd=True", "clip_grad_norm=null", "early_forward=False",
              "gradient_accumulation_steps=1", "optimizer.fused=True", "epochs=2"]
    torch_adamw = ["optimizer._component_=torch.optim.AdamW", "~optimizer.optimizer_cls",
                   "~optimizer.offload_gradients", "~optimizer.delayed_update"]
    _tune_run(recipe, "full", workdir, tmp_path / "ours", *common)
    _tune_run(recipe, "full", workdir, tmp_path / "torch", *common, *torch_adamw)
    losses = _losses(tmp_path / "ours")
    assert losses == _losses(tmp_path / "torch")
    assert len(losses) == 2 * STEPS
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
    weights = {out: torch.load(next((tmp_path / out).glob("epoch_1/*.bin")), weights_only=True)
               for out in ("ours", "torch")}
    for key, value in weights["torch"].items():
        assert torch.equal(weights["ours"][key], value), key

    resumed = tmp_path / "resumed"  # the disk state right after epoch 1
    shutil.copytree(tmp_path / "ours", resumed, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    _tune_run(recipe, "full", workdir, resumed, *common, "resume_from_checkpoint=True",
              "checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.bin]")
    expected = {s: m for s, m in read_log(tmp_path / "ours").items() if s > STEPS}
    logged = read_log(resumed)
    assert sorted(logged) == sorted(expected)
    for step in expected:
        assert (logged[step]["loss"], logged[step]["lr"]) == (expected[step]["loss"], expected[step]["lr"]), step


@pytest.mark.parametrize("saved_in_bwd", [False, True])
def test_our_full_recipe_resumes_with_optimizer_in_bwd_switched(workdir, tmp_path, saved_in_bwd):
    """A run saved with optimizer_in_bwd one way resumes with it the other way (our 8B config
    switched to optimizer_in_bwd: True), the optimizer state carried over: the losses stay
    within 1e-5 of the uninterrupted run's (the two ways round the gradient scaling
    differently: 3e-7 here; a resume that lost the state is 14% off), the lrs equal."""
    recipe = f"offload_plugin/recipes/{RECIPE['full']}"
    common = ["clip_grad_norm=null", "early_forward=False", "gradient_accumulation_steps=1",
              "optimizer.fused=True", "epochs=2"]
    straight = tmp_path / "straight"
    _tune_run(recipe, "full", workdir, straight, *common, f"optimizer_in_bwd={saved_in_bwd}")
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    _tune_run(recipe, "full", workdir, resumed, *common, f"optimizer_in_bwd={not saved_in_bwd}",
              "resume_from_checkpoint=True", "checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.bin]")
    expected = {s: m for s, m in read_log(straight).items() if s > STEPS}
    logged = read_log(resumed)
    assert sorted(logged) == sorted(expected)
    assert logged[STEPS + 1]["loss"] == expected[STEPS + 1]["loss"]  # (the saved weights, before any update)
    for step in expected:
        assert logged[step]["lr"] == expected[step]["lr"], step
        assert logged[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=0), step


def test_copied_recipe_runs_from_another_directory(workdir, tmp_path):
    """A recipe copied under another name into an empty directory runs from there unchanged."""
    shutil.copy(REPO / "recipes" / "full_finetune_single_device.py", tmp_path / "my_offload_recipe.py")
    out = tmp_path / "copied"
    _tune_run("my_offload_recipe.py", "full", workdir, out, "epochs=1", cwd=tmp_path)
    assert len(_losses(out)) == STEPS
    assert (out / "epoch_0" / "model-00001-of-00001.bin").is_file()


def test_demo_prepare_is_deterministic(workdir, tmp_path):
    """`python -m offload_plugin.demo prepare` writes the same tokenizer, data and checkpoint bytes every time."""
    root, env = workdir
    _run([sys.executable, "-m", "offload_plugin.demo", "prepare", "--output-dir", str(tmp_path)], env, tmp_path)
    for name in ("tokenizer.model", "alpaca_tiny.json", "model/model.pt"):
        digests = {hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (tmp_path, root / "demo")}
        assert len(digests) == 1, f"{name} differs between two prepare runs"


def test_delayed_update_converges_like_exact_mode(straight_runs, workdir, tmp_path):
    """The opt-in one-step-delayed update trains the demo model too, on a different path.

    The demo's lr (2e-3, to train a tiny model in seconds) is where a one-step-stale
    gradient costs most: measured over the 120-step demo, final loss 0.65 vs 0.39 exact.
    """
    exact_out, offload_grads = straight_runs["full"]
    out = tmp_path / "delayed"
    _tune_run(
        f"offload_plugin/recipes/{RECIPE['full']}", "full", workdir, out,
        "epochs=2", f"optimizer.offload_gradients={offload_grads}", "optimizer.delayed_update=True",
    )  # fmt: skip
    delayed, exact = _losses(out), _losses(exact_out)
    assert len(delayed) == len(exact) == 2 * STEPS
    assert delayed[:2] == exact[:2]  # the first update lands one step later...
    assert delayed[2] != exact[2]  # ...so the paths part from step 3 on
    head, tail = sum(delayed[:5]) / 5, sum(delayed[-5:]) / 5
    assert tail < 0.6 * head, delayed  # and it converges: exact's tail here is ~0.35x head


def test_partial_offload_and_device_accumulation_train_exactly_like_full_offload(workdir, tmp_path):
    """The opt-in speed settings that keep results: a share of the update on the device
    (device_fraction) and gradients accumulated on the device until the last micro-batch
    (accumulate_on_device). The demo trains to the very same losses as full offload."""
    out = tmp_path / "partial"
    proc = _tune_run(
        f"offload_plugin/recipes/{RECIPE['full']}", "full", workdir, out, "epochs=2",
        "optimizer.offload_gradients=True", "optimizer.device_fraction=0.3",
        "optimizer.accumulate_on_device=True", "gradient_accumulation_steps=2",
    )  # fmt: skip
    exact_ga2 = tmp_path / "exact_ga2"
    _tune_run(
        f"offload_plugin/recipes/{RECIPE['full']}", "full", workdir, exact_ga2, "epochs=2",
        "optimizer.offload_gradients=True", "gradient_accumulation_steps=2",
    )  # fmt: skip
    assert _losses(out) == _losses(exact_ga2)
    assert "on the device" in proc.stdout + proc.stderr  # a share really was kept there
