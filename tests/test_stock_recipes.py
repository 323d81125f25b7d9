"""torchtune's own single-device recipes, unchanged, with CPUOffloadOptimizer as their optimizer.

torchtune 0.6.1 ships five single-device recipes that build their optimizer from
``cfg.optimizer``. ``full_finetune_single_device`` and ``lora_finetune_single_device`` are run in
``test_recipes.py``; this file runs the other three: ``lora_dpo_single_device``,
``knowledge_distillation_single_device`` and ``ppo_full_finetune_single_device``.

Each test launches the STOCK recipe by name through the ``tune`` command line twice, on the tiny
offline demo model (``offload_plugin.demo``) and a config under ``tests/assets/stock_recipes/``:
once with ``optimizer._component_=offload_plugin.CPUOffloadOptimizer`` (its defaults: AdamW, fused,
state in host memory) and once with torch's fused AdamW. Nothing else differs between the two runs.
Our default host update is torch's fused AdamW on the same fp32 values, so the logged losses and the
saved weights must be the same bits, not merely close.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disk_log import read_log

pytestmark = pytest.mark.slow  # (starts processes: left out of the quick lane, pytest -m "not slow")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).resolve().parent / "assets" / "stock_recipes"
# The only overrides that differ between the two runs of a test.
OPTIMIZERS = {
    "ours": ["optimizer._component_=offload_plugin.CPUOffloadOptimizer"],
    "torch": ["optimizer._component_=torch.optim.AdamW", "optimizer.fused=True"],
}
STEPS = 8  # optimizer steps of the DPO and KD configs (max_steps_per_epoch)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The configs' ``work_dir``: the demo files, a preference data set and a reward model checkpoint,
    plus an environment whose HF_HOME (the datasets' Arrow cache) is private."""
    root = tmp_path_factory.mktemp("stock_recipes")
    env = dict(os.environ, HF_HOME=str(root / "hf_home"), PYTHONUNBUFFERED="1")
    _run([sys.executable, "-m", "offload_plugin.demo", "prepare", "--output-dir", str(root / "demo")], env, root)
    _write_preference_data(root / "dpo_tiny.json")
    _write_classifier(root / "classifier" / "model.pt")
    return root, env


def _write_preference_data(path: Path, num_examples: int = 64) -> None:
    """Chosen/rejected conversations for ``preference_dataset(source="json")``: the chosen answer is the
    demo task's right output, the rejected one another example's output (another task's, so they differ)."""
    from offload_plugin.demo import make_examples  # imports torchtune: only once the fixture runs

    examples = make_examples(num_examples, seed=1)
    rows = []
    for i, ex in enumerate(examples):
        question = {"role": "user", "content": f"{ex['instruction']}\n{ex['input']}"}
        wrong = examples[(i + 1) % num_examples]["output"]
        rows.append({
            "chosen": [question, {"role": "assistant", "content": ex["output"]}],
            "rejected": [question, {"role": "assistant", "content": wrong}],
        })  # fmt: skip
    path.write_text(json.dumps(rows, indent=1))


def _write_classifier(path: Path) -> None:
    """A random-init tiny ``llama2_classifier`` (one class): PPO's reward model and its value model's start.

    torchtune has no tiny classifier checkpoint, and the demo checkpoint cannot serve: its output
    projection is tied to the embedding, so it has no ``output.weight`` for a classifier head.
    """
    from offload_plugin.demo import TINY_LLAMA_ARGS
    from torchtune.models.llama2._component_builders import llama2_classifier

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state_dict = llama2_classifier(num_classes=1, **TINY_LLAMA_ARGS).state_dict()
    path.parent.mkdir(parents=True)
    torch.save(state_dict, path)


def _run(cmd, env, cwd):
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def _tune_run_both(recipe: str, config: str, workdir, tmp_path, *overrides) -> dict:
    """Run the stock RECIPE with tests/assets/stock_recipes/CONFIG.yaml once per optimizer.

    Returns:
        dict: the output_dir of each run, keyed ``ours`` and ``torch``.
    """
    root, env = workdir
    outs = {}
    for name, optimizer in OPTIMIZERS.items():
        out = tmp_path / name
        cmd = [
            sys.executable, "-m", "torchtune._cli.tune", "run", recipe,
            "--config", str(CONFIGS / f"{config}.yaml"),
            f"work_dir={root}", f"output_dir={out}", *overrides, *optimizer,
        ]  # fmt: skip
        _run(cmd, env, REPO)
        outs[name] = out
    return outs


def _losses(out: Path) -> list:
    return [m["loss"] for _, m in sorted(read_log(out).items())]


def _assert_same_weights(ours: Path, torchs: Path) -> dict:
    """The two saved state dicts hold the same tensors, bit for bit; returns ours."""
    mine, theirs = (torch.load(p, map_location="cpu", weights_only=True) for p in (ours, torchs))
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key
    return mine


def _mean(values) -> float:
    return sum(values) / len(values)


def test_stock_lora_dpo_recipe_matches_torch_adamw(workdir, tmp_path):
    """torchtune's lora_dpo_single_device, which hands the optimizer ALL the model's parameters
    (the frozen base too, whose grads stay None) and accumulates 2 micro-batches per step:
    the same DPO losses and saved adapters as torch's fused AdamW, and the loss falls from ln 2."""
    outs = _tune_run_both("lora_dpo_single_device", "tiny_lora_dpo", workdir, tmp_path)
    assert sorted(read_log(outs["ours"])) == list(range(1, STEPS + 1))
    losses = _losses(outs["ours"])
    assert losses == _losses(outs["torch"])
    # LoRA's up-projections start at zero, so the policy starts as the reference: DPO's loss is ln 2.
    assert losses[0] == pytest.approx(math.log(2))
    assert _mean(losses[-3:]) < losses[0] - 0.05, losses
    _assert_same_weights(*(out / "epoch_0" / "adapter_model.pt" for out in outs.values()))


def test_stock_knowledge_distillation_recipe_matches_torch_adamw(workdir, tmp_path):
    """torchtune's knowledge_distillation_single_device, a LoRA student of the full demo model:
    the recipe scales the accumulated device gradients (scale_grads) and clips them before step().
    The same losses and saved adapters as torch's fused AdamW, and the loss falls."""
    outs = _tune_run_both("knowledge_distillation_single_device", "tiny_kd_lora", workdir, tmp_path)
    assert sorted(read_log(outs["ours"])) == list(range(1, STEPS + 1))
    losses = _losses(outs["ours"])
    assert losses == _losses(outs["torch"])
    assert _mean(losses[-3:]) < _mean(losses[:3]) - 0.1, losses
    _assert_same_weights(*(out / "epoch_0" / "adapter_model.pt" for out in outs.values()))


@pytest.mark.parametrize("in_bwd", [False, True], ids=["step-after-backward", "optimizer_in_bwd"])
def test_stock_ppo_recipe_matches_torch_adamw(workdir, tmp_path, in_bwd):
    """torchtune's ppo_full_finetune_single_device: one optimizer over the policy's and the value
    model's parameters, given as a generator (itertools.chain), or with optimizer_in_bwd one
    optimizer per parameter stepped in its gradient hook. Generation samples from the policy, so
    any difference in the weights would change the trajectories too. The same PPO losses and saved
    policy and value weights as torch's fused AdamW, and both models did train.

    PPO's loss is no objective that falls, so it is not checked to fall; the weights are checked to move.
    """
    root, _ = workdir
    outs = _tune_run_both(
        "ppo_full_finetune_single_device", "tiny_ppo_full", workdir, tmp_path, f"optimizer_in_bwd={in_bwd}"
    )
    # 4 trajectories of 4 prompts (num_steps=16), each 2 minibatches: logged at optimizer steps 2, 4, 6, 8.
    assert sorted(read_log(outs["ours"])) == [2, 4, 6, 8]
    assert _losses(outs["ours"]) == _losses(outs["torch"])
    shard = Path("epoch_0") / "model-00001-of-00001.bin"
    starts = {shard: root / "demo" / "model" / "model.pt", "value" / shard: root / "classifier" / "model.pt"}
    for saved, start in starts.items():  # the policy, then the value model
        trained = _assert_same_weights(outs["ours"] / saved, outs["torch"] / saved)
        initial = torch.load(start, map_location="cpu", weights_only=True)
        assert any(not torch.equal(trained[k], initial[k]) for k in initial), f"{saved} did not train"
