"""Our FSDP2 recipes on 2 CPU processes (gloo), checked against single-process runs (issue #5).

Every run goes through the ``tune`` command line on the tiny offline demo model, as a user
would launch it: ``tune run --nproc_per_node 2 ...`` for 2 ranks, plain ``tune run`` for
one process. The sampler deals one permutation of the data round-robin to the ranks, so a
step of 2 ranks accumulating 2 micro-batches each sees the examples a step of one process
accumulating 4 does: losses, gradient norms and weights must agree up to float summation
order. The one-process reference is our single-device recipe for full fine-tuning and the
LoRA recipe itself launched without torchrun (its adapters are drawn from the seed, the
single-device recipe's are not). Resuming on 2 ranks must reproduce the uninterrupted run
exactly.

Each test runs with torch's AdamW and with ``offload_plugin.CPUOffloadOptimizer``, which
offloads each rank's shard of FSDP2's DTensor parameters. Needs ``pip install -e .`` (the recipes install as ``offload_plugin.recipes``); no GPU,
no network.
"""

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omegaconf import OmegaConf
from torchtune.config._utils import _get_component_from_path

from disk_log import read_log

pytestmark = pytest.mark.slow  # (starts processes: left out of the quick lane, pytest -m "not slow")

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIGS = REPO / "configs" / "demo"
STEPS = 4  # optimizer steps per epoch; two epochs per run
NPROC = ["--nproc_per_node", "2"]
# Stated here so that the full fine-tuning runs of both recipes share them whatever their configs say.
FULL_HPARAMS = ["optimizer.lr=2e-3", "optimizer.weight_decay=0.01", "clip_grad_norm=1.0"]
# A step sees 4 examples, in micro-batches of one: 2 per rank on 2 ranks (resumed runs too),
# 4 in one process. Equal micro-batches leave the runs only the order of summation to differ
# in; padding examples of different lengths together changes gradients by ~1e-5 on its own.
# Accumulation also checks the token normalization across micro-batches and ranks.
TWO_RANKS = ["batch_size=1", "gradient_accumulation_steps=2"]
ONE_PROCESS = ["batch_size=1", "gradient_accumulation_steps=4"]
RECIPE = {
    "full": "offload_plugin/recipes/full_finetune_distributed.py",
    "lora": "offload_plugin/recipes/lora_finetune_distributed.py",
}
# The final model (for LoRA the merged one) and, for the resume test, the trained weights.
FINAL_MODEL = "epoch_1/model-00001-of-00001.bin"
FINAL_TRAINED = {"full": FINAL_MODEL, "lora": "epoch_1/adapter_model.pt"}


OPTIMIZERS = [
    pytest.param("torch.optim.AdamW", id="AdamW"),
    pytest.param("offload_plugin.CPUOffloadOptimizer", id="CPUOffloadOptimizer"),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A prepared demo dir plus an environment whose HF_HOME (Arrow cache) is private."""
    root = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ, HF_HOME=str(root / "hf_home"), PYTHONUNBUFFERED="1")
    _run([sys.executable, "-m", "offload_plugin.demo", "prepare", "--output-dir", str(root / "demo")], env, root)
    return root, env


def _run(cmd, env, cwd=REPO):
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return proc


def _swap_optimizer(config: str, optimizer: str) -> list:
    """Overrides that build ``optimizer`` instead of the config's, dropping the keys it does not take."""
    keys = OmegaConf.load(DEMO_CONFIGS / config).optimizer.keys()
    accepted = inspect.signature(_get_component_from_path(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        accepted = keys  # takes anything (CPUOffloadOptimizer passes extras to optimizer_cls)
    removed = [f"~optimizer.{k}" for k in keys if k != "_component_" and k not in accepted]
    return [f"optimizer._component_={optimizer}", *removed]


def _tune_run(recipe, config, workdir, out, optimizer, *overrides, launcher=NPROC):
    """`tune run [--nproc_per_node 2] RECIPE --config configs/demo/CONFIG` with small-run overrides."""
    root, env = workdir
    cmd = [
        sys.executable, "-m", "torchtune._cli.tune", "run", *launcher, recipe,
        "--config", str(DEMO_CONFIGS / config),
        f"demo_dir={root / 'demo'}", f"output_dir={out}", *_swap_optimizer(config, optimizer),
        f"max_steps_per_epoch={STEPS}", "epochs=2",
        "lr_scheduler.num_warmup_steps=2", "metric_logger.filename=log.txt", *overrides,
    ]  # fmt: skip
    return _run(cmd, env)


def _assert_same_steps(out: Path, reference: Path) -> None:
    """Both runs logged every step with the same lr, and losses and gradient norms within float noise.

    The gradient norm (logged before clipping) catches a wrong gradient scale, to which
    Adam's update itself is nearly blind.
    """
    logged, expected = read_log(out), read_log(reference)
    assert sorted(logged) == sorted(expected) == list(range(1, 2 * STEPS + 1))
    for key, rtol in (("lr", 0), ("loss", 1e-6), ("grad_norm", 1e-6)):  # they agree to ~1e-7
        got = torch.tensor([logged[s][key] for s in sorted(logged)], dtype=torch.float64)
        want = torch.tensor([expected[s][key] for s in sorted(expected)], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=lambda m: f"{key}: {m}")


def _weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_trained_alike(out: Path, reference: Path, workdir, rtol: float = 1e-4) -> None:
    """Each final weight of two runs differs by less than ``rtol`` of how far training moved it.

    Elementwise tolerances do not fit Adam: where a gradient is near zero its update is
    still about ``lr * sign(grad)``, so summation-order noise can move single elements by
    up to ~lr. Measured against each tensor's whole change from the demo checkpoint, these
    runs agree to ~3e-6; a bug (a lost shard, a wrong scale) shows as ~1. Tensors training
    left alone (LoRA's frozen ones) must be equal.
    """
    initial = _weights(workdir[0] / "demo" / "model" / "model.pt")
    final, expected = _weights(out / FINAL_MODEL), _weights(reference / FINAL_MODEL)
    assert final.keys() == expected.keys() == initial.keys()
    for name in expected:
        moved = (expected[name] - initial[name]).double().norm()
        differ = (final[name] - expected[name]).double().norm()
        assert differ <= rtol * moved, f"{name}: runs differ by {differ:.3g}, training moved it by {moved:.3g}"


@pytest.fixture(scope="module", params=OPTIMIZERS)
def optimizer(request):
    return request.param


@pytest.fixture(scope="module")
def full_runs(workdir, optimizer):
    """Full fine-tuning, two epochs: on 2 ranks, and with the single-device recipe as the reference."""
    root, _ = workdir
    tag = optimizer.rsplit(".", 1)[-1]
    two = root / f"full_2ranks_{tag}"
    _tune_run(RECIPE["full"], "tiny_full_offload_distributed.yaml", workdir, two, optimizer, *TWO_RANKS, *FULL_HPARAMS)
    one = root / f"full_single_device_{tag}"
    _tune_run(
        "offload_plugin/recipes/full_finetune_single_device.py", "tiny_full_offload.yaml", workdir, one, optimizer,
        *ONE_PROCESS, *FULL_HPARAMS, launcher=[],
    )  # fmt: skip
    return two, one


@pytest.fixture(scope="module")
def lora_runs(workdir, optimizer):
    """LoRA, two epochs: on 2 ranks, and the same recipe as one process (no torchrun) as the reference."""
    root, _ = workdir
    tag = optimizer.rsplit(".", 1)[-1]
    two = root / f"lora_2ranks_{tag}"
    _tune_run(RECIPE["lora"], "tiny_lora_offload_distributed.yaml", workdir, two, optimizer, *TWO_RANKS)
    one = root / f"lora_1process_{tag}"
    _tune_run(
        RECIPE["lora"], "tiny_lora_offload_distributed.yaml", workdir, one, optimizer,
        *ONE_PROCESS, launcher=[],
    )  # fmt: skip
    return two, one


def test_full_two_ranks_match_single_device_recipe(full_runs, workdir):
    """FSDP2 on 2 ranks trains like full_finetune_single_device: same losses, gradient norms and final weights."""
    two, one = full_runs
    _assert_same_steps(two, one)
    _assert_trained_alike(two, one, workdir)


def test_lora_two_ranks_match_one_process(lora_runs, workdir):
    """LoRA on 2 ranks trains like one process on the same global batches, from the same seed-drawn adapters."""
    two, one = lora_runs
    _assert_same_steps(two, one)
    _assert_trained_alike(two, one, workdir)  # the merged models: base plus each run's adapters


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_resume_on_two_ranks_reproduces_uninterrupted_run(kind, request, workdir, optimizer, tmp_path):
    """Resuming after epoch 1 on 2 ranks (sharded model and optimizer state restored) repeats the uninterrupted run exactly."""
    straight, _ = request.getfixturevalue(f"{kind}_runs")
    # The disk state right after epoch 1: the 2-epoch run's files without the final epoch.
    out = tmp_path / "resumed"
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    overrides = [*TWO_RANKS, *(FULL_HPARAMS if kind == "full" else []), "resume_from_checkpoint=True"]
    if kind == "full":  # full fine-tuning resumes the model from output_dir
        overrides.append("checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.bin]")
    config = f"tiny_{kind}_offload_distributed.yaml"
    _tune_run(RECIPE[kind], config, workdir, out, optimizer, *overrides)

    expected = {s: m for s, m in read_log(straight).items() if s > STEPS}
    resumed = read_log(out)
    assert sorted(resumed) == sorted(expected)
    for step in expected:
        assert resumed[step]["loss"] == expected[step]["loss"], step
        assert resumed[step]["lr"] == expected[step]["lr"], step
    final, reference = _weights(out / FINAL_TRAINED[kind]), _weights(straight / FINAL_TRAINED[kind])
    assert final.keys() == reference.keys()
    for name in reference:
        assert torch.equal(final[name], reference[name]), name


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")),
])  # fmt: skip
def test_qlora_two_ranks_offloaded_like_adamw(workdir, tmp_path, device):
    """QLoRA under FSDP2: NF4 base weights sharded over 2 ranks, each rank's adapter shards
    offloaded, trains like torch's AdamW on the same 2 ranks (gloo on CPU, NCCL on 2 GPUs).
    The demo model's 128-wide NF4 weights cannot be split in two (NF4 shards in whole
    16384-element blocks), so this builds a 256-wide twin of it with its own random
    checkpoint. One process is refused with a message (FSDP2 over one rank fails on NF4
    weights here)."""
    from torchtune.models.llama3_2._component_builders import llama3_2

    from offload_plugin.demo import TINY_LLAMA_ARGS

    shape = dict(TINY_LLAMA_ARGS, embed_dim=256, intermediate_dim=512)
    torch.manual_seed(0)
    (tmp_path / "model").mkdir()
    torch.save(llama3_2(**shape).state_dict(), tmp_path / "model" / "model.pt")
    config = OmegaConf.load(DEMO_CONFIGS / "tiny_lora_offload_distributed.yaml")
    config.model = OmegaConf.merge(
        {k: v for k, v in config.model.items() if k != "_component_"},
        {"_component_": "torchtune.models.llama3_2._component_builders.lora_llama3_2",
         "quantize_base": True, **shape},
    )
    config.checkpointer.checkpoint_dir = str(tmp_path / "model")
    config_path = tmp_path / "tiny_qlora_offload_distributed.yaml"
    OmegaConf.save(config, config_path)

    def command(out, launcher, *overrides):
        root, _ = workdir
        return [
            sys.executable, "-m", "torchtune._cli.tune", "run", *launcher, RECIPE["lora"],
            "--config", str(config_path), f"demo_dir={root / 'demo'}", f"output_dir={out}",
            f"max_steps_per_epoch={STEPS}", "epochs=1", "lr_scheduler.num_warmup_steps=2",
            "metric_logger.filename=log.txt", f"device={device}", *TWO_RANKS, *overrides,
        ]  # fmt: skip

    ours, adamw = tmp_path / "qlora_ours", tmp_path / "qlora_adamw"
    _run(command(ours, NPROC), workdir[1])
    _run(command(adamw, NPROC, "optimizer._component_=torch.optim.AdamW", "optimizer.fused=True"), workdir[1])
    logged, expected = read_log(ours), read_log(adamw)
    assert sorted(logged) == sorted(expected) == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        got = torch.tensor([logged[s][key] for s in sorted(logged)], dtype=torch.float64)
        want = torch.tensor([expected[s][key] for s in sorted(expected)], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m: f"{key}: {m}")
    assert logged[STEPS]["loss"] < logged[1]["loss"]
    trained, reference = (_weights(d / "epoch_0" / "adapter_model.pt") for d in (ours, adamw))
    assert trained.keys() == reference.keys() and trained
    if device == "cpu":  # both runs update on the host with torch's CPU arithmetic
        for name in reference:
            torch.testing.assert_close(trained[name], reference[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
    else:
        # AdamW on the GPU rounds differently from the host update, and Adam turns the
        # ~1e-7 differences of near-zero gradients (lora_a's are zero at first, as lora_b
        # starts at zero) into ~lr steps in single elements. What the adapters do to the
        # model, lora_b @ lora_a, must still agree closely.
        for name in (n for n in reference if n.endswith("lora_a.weight")):
            b_name = name.replace("lora_a", "lora_b")
            got, want = (w[b_name].double() @ w[name].double() for w in (trained, reference))
            differ, moved = (got - want).norm(), want.norm()
            assert moved > 0 and differ <= 1e-3 * moved, f"{name[:-14]}: B@A differs by {differ:.3g} of {moved:.3g}"

    one = subprocess.run(command(tmp_path / "one", []), env=workdir[1], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode != 0 and "needs 2 or more ranks" in one.stdout + one.stderr


@pytest.mark.parametrize("inner, scale_key", [("CompactAdamW", "exp_avg_absmax"), ("AdamW8bit", "absmax1")])
def test_8bit_state_on_two_ranks_trains_and_resumes_exactly(workdir, tmp_path, inner, scale_key):
    """optimizer_cls=CompactAdamW or AdamW8bit in our FSDP2 recipe on 2 ranks: it trains, and
    resuming after epoch 1 from the recipe's own checkpoint (the optimizer state gathered
    whole, then loaded back onto the shards) repeats the uninterrupted run exactly. The demo
    model's down projections (rows of 256) are 8-bit, its other tensors fp32 (rows of 128)."""
    compact = ["dtype=bf16", f"optimizer.optimizer_cls=offload_plugin.{inner}", "optimizer.min_8bit_size=0"]
    optimizer = "offload_plugin.CPUOffloadOptimizer"
    config = "tiny_full_offload_distributed.yaml"
    straight = tmp_path / "straight"
    _tune_run(RECIPE["full"], config, workdir, straight, optimizer, *TWO_RANKS, *FULL_HPARAMS, *compact)
    logged = read_log(straight)
    assert logged[2 * STEPS]["loss"] < logged[1]["loss"]
    saved = torch.load(straight / "recipe_state" / "recipe_state.pt", map_location="cpu", weights_only=True)
    layouts = {scale_key in entry for entry in saved["optimizer"]["state"].values()}
    assert layouts == {True, False}, "both the 8-bit and the fp32 layout are in the checkpoint"
    out = tmp_path / "resumed"
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("epoch_1", "logs"))
    _tune_run(RECIPE["full"], config, workdir, out, optimizer, *TWO_RANKS, *FULL_HPARAMS, *compact,
              "resume_from_checkpoint=True", "checkpointer.checkpoint_files=[epoch_0/model-00001-of-00001.bin]")
    expected = {s: m for s, m in logged.items() if s > STEPS}
    resumed = read_log(out)
    assert sorted(resumed) == sorted(expected)
    for step in expected:
        assert resumed[step]["loss"] == expected[step]["loss"], step
    final, reference = _weights(out / FINAL_MODEL), _weights(straight / FINAL_MODEL)
    assert final.keys() == reference.keys()
    for name in reference:
        assert torch.equal(final[name], reference[name]), name
