"""What a new user sees when something is missing or misused, as the README promises it.

- A demo config run before ``python -m offload_plugin.demo prepare`` says to run that command
  (torchtune's checkpointer alone says only ``... is not a valid directory``).
- The once-only warning for offloaded gradients that nothing scaled or clipped starts on a
  line of its own (torchtune's stock recipes draw a tqdm bar on the same stream without
  ending its line) and says why the recipe's logged grad_norm is 0.0 and what to do.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from offload_plugin import CPUOffloadOptimizer, demo

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIGS = sorted((REPO / "configs" / "demo").glob("*.yaml"))


def _config(path: Path, **overrides):
    cfg = OmegaConf.load(path)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize("path", DEMO_CONFIGS, ids=lambda p: p.name)
def test_a_demo_config_without_its_files_names_the_prepare_command(path, tmp_path):
    missing = tmp_path / "not_prepared"
    with pytest.raises(FileNotFoundError) as error:
        demo.check_prepared(_config(path, demo_dir=str(missing)))
    message = str(error.value)
    assert f"`python -m offload_plugin.demo prepare --output-dir {missing}`" in message
    assert str(missing / "model") in message and str(missing / "tokenizer.model") in message


def test_the_default_demo_dir_gives_the_bare_command(tmp_path, monkeypatch):
    """With the configs' demo_dir (prepare's default folder) the command is the README's, as is."""
    monkeypatch.setattr(demo, "DEFAULT_DIR", str(tmp_path / "demo"))
    cfg = _config(REPO / "configs" / "demo" / "tiny_qlora_offload.yaml", demo_dir=str(tmp_path / "demo"))
    with pytest.raises(FileNotFoundError, match=r"`python -m offload_plugin\.demo prepare`: run that first"):
        demo.check_prepared(cfg)


def test_prepared_demo_files_and_other_models_pass(tmp_path):
    """Only a missing file stops a run; configs on real models are left to torchtune."""
    folder = tmp_path / "demo"
    (folder / "model").mkdir(parents=True)
    for name in (demo.TOKENIZER_FILE, demo.DATA_FILE, demo.CHECKPOINT_FILE):
        (folder / name).touch()
    demo.check_prepared(_config(REPO / "configs" / "demo" / "tiny_full_offload.yaml", demo_dir=str(folder)))
    demo.check_prepared(_config(REPO / "configs" / "llama3_2" / "1B_qlora_offload_single_device.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["lora_finetune_single_device", "full_finetune_single_device"])
def test_tune_run_on_a_missing_demo_says_what_to_run(recipe, tmp_path):
    """The whole command as a user types it: our recipe stops before torchtune's checkpointer."""
    kind = "qlora" if recipe.startswith("lora") else "full"
    missing = tmp_path / "not_prepared"
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        ["tune", "run", f"offload_plugin/recipes/{recipe}.py", "--config", f"configs/demo/tiny_{kind}_offload.yaml",
         f"demo_dir={missing}", f"output_dir={tmp_path / 'out'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"python -m offload_plugin.demo prepare --output-dir {missing}" in proc.stderr
    assert "is not a valid directory" not in proc.stderr
