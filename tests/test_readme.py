"""Every command in README.md is run here, or, where it needs a download or a GPU, checked.

Commands that only need this repository (the demo configs) run verbatim; commands for the
real-model configs are checked for the files and torchtune names they use.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 "


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _commands():
    return [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]


def _without_setup(command):
    """The part of a quick-start command after the venv and pip install steps."""
    assert command.startswith(SETUP), command
    return command.split(" && ", 3)[3]


def _run(command, cwd, tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), PYTHONUNBUFFERED="1")
    # `tune` as installed next to this interpreter (the venv of the test run).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _losses(log_dir):
    text = "".join(p.read_text() for p in Path(log_dir).glob("*.txt"))
    return [float(v) for v in re.findall(r"\bloss:([0-9.]+)", text)]


def test_quick_start_has_two_commands_and_ci_runs_the_test_one():
    """The README opens with a demo command and a test command; .ci/run runs the latter verbatim."""
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    demo, tests = [b.strip() for b in re.findall(r"```bash\n(.*?)```", quick, flags=re.S)]
    assert demo.startswith(SETUP) and tests.startswith(SETUP)
    assert tests in (REPO / ".ci" / "run").read_text()
    assert _without_setup(tests) == "pytest -q"


def test_demo_quick_start_trains(tmp_path):
    """The demo command (after its install steps) prepares the data and the loss falls."""
    demo = _commands()[0]
    _run(_without_setup(demo), REPO, tmp_path)
    losses = _losses("/tmp/offload-plugin/tiny_qlora_offload/logs")
    assert len(losses) >= 100 and sum(losses[-10:]) < sum(losses[:10]), losses


def _local_commands():
    """README commands on the demo configs: runnable here (device=cuda falls back to CPU)."""
    return [c for c in _commands()[2:] if "configs/demo/" in c]


@pytest.mark.parametrize("command", _local_commands())
def test_demo_commands_run(command, tmp_path):
    """Each demo-config command runs verbatim; a copied recipe from an empty directory."""
    cwd = REPO
    if command.startswith("cp "):
        cwd = tmp_path / "project"
        cwd.mkdir()
        for name in ("recipes", "configs"):
            (cwd / name).symlink_to(REPO / name)
    _run(f"python -m offload_plugin.demo prepare && {command}", cwd, tmp_path)


def _torchtune_config_names():
    from torchtune._recipe_registry import get_all_recipes

    return {c.name for r in get_all_recipes() for c in r.configs}, {r.name for r in get_all_recipes()}


@pytest.mark.parametrize("command", [c for c in _commands()[2:] if "configs/demo/" not in c])
def test_other_commands_name_real_files(command):
    """Commands for real models name recipes and configs that exist (here or in torchtune)."""
    configs, recipes = _torchtune_config_names()
    words = shlex.split(command)
    if words[2:3] == ["--nproc_per_node"]:  # torchrun's launcher option, then the recipe
        words = words[:2] + words[4:]
    assert words[:2] == ["tune", "run"], command
    recipe, config = words[2], words[words.index("--config") + 1]
    if recipe.startswith("offload_plugin/recipes/"):
        assert (REPO / "recipes" / Path(recipe).name).is_file(), recipe
        assert (REPO / config).is_file(), config
    else:
        assert recipe in recipes and config in configs, command
        override = words[words.index("--config") + 2]
        assert override == "optimizer._component_=offload_plugin.CPUOffloadOptimizer"


def test_python_example_runs():
    """The Python example in the README runs as written."""
    (example,) = _blocks("python")
    exec(compile(example, "README.md", "exec"), {})
