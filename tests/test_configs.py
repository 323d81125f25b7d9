"""Every YAML under configs/ loads, names only importable components, and says how to launch it."""

import os
import re
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import config
from torchtune.config._utils import _get_component_from_path

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("**/*.yaml"))
ALLOWED_ROOTS = ("torchtune.", "offload_plugin.", "torch.")
LAUNCH = re.compile(r"^#\s+tune run (?:--nproc_per_node \d+ )?(\S+\.py) --config (\S+\.yaml)", re.M)


def _components(node, where="cfg"):
    """Yield (where, dotpath) for every _component_ in a config tree, through dicts and lists."""
    if isinstance(node, DictConfig):
        for key, value in node.items_ex(resolve=False):
            if key == "_component_":
                yield where, value
            else:
                yield from _components(value, f"{where}.{key}")
    elif isinstance(node, ListConfig):
        for i, value in enumerate(node):
            yield from _components(value, f"{where}[{i}]")


def test_glob_finds_every_config_file():
    """The parametrized tests below see every .yaml under configs/, none skipped."""
    walked = [
        Path(root) / name for root, _, names in os.walk(CONFIG_DIR) for name in names if name.endswith(".yaml")
    ]
    assert len(CONFIGS) == len(walked) > 0
    assert set(CONFIGS) == set(walked)


def test_component_walker_reaches_nested_lists():
    """The walker finds components inside lists of dicts, not just at the top level."""
    cfg = OmegaConf.create({"a": {"_component_": "x.A", "b": [{"_component_": "x.B"}, {"c": {"_component_": "x.C"}}]}})
    assert [path for _, path in _components(cfg)] == ["x.A", "x.B", "x.C"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_config_components_resolve(path):
    """Each _component_ in the config is an importable object from torchtune, offload_plugin or torch."""
    cfg = OmegaConf.load(path)
    found = list(_components(cfg))
    assert found, "no _component_ at all"
    for where, dotpath in found:
        assert dotpath.startswith(ALLOWED_ROOTS), f"{where}: {dotpath} is outside torchtune/offload_plugin/torch"
        assert callable(_get_component_from_path(dotpath)), f"{where}: {dotpath} is not callable"
    assert OmegaConf.to_container(cfg, resolve=True)  # every ${...} interpolation resolves


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_config_uses_offload_optimizer(path):
    """The optimizer is offload_plugin.CPUOffloadOptimizer and builds from the config's own arguments."""
    cfg = OmegaConf.load(path)
    assert cfg.optimizer._component_ == "offload_plugin.CPUOffloadOptimizer"
    if cfg.get("optimizer_in_bwd", False):
        # Only our full recipe takes it; with it, our configs ship the streamed update (the
        # fastest exact mode measured) and nothing the recipe refuses under it.
        assert "full" in path.name
        assert cfg.optimizer.get("offload_gradients", False) is False
        assert cfg.get("early_forward", False) is False
        assert cfg.get("gradient_accumulation_steps", 1) == 1 and cfg.get("clip_grad_norm") is None
    optimizer = config.instantiate(cfg.optimizer, [torch.nn.Parameter(torch.zeros(4))])
    assert isinstance(optimizer, torch.optim.Optimizer)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_config_header_names_existing_recipe_and_itself(path):
    """The header's launch command uses our `tune run offload_plugin/recipes/X.py --config configs/...` form and both files exist."""
    text = path.read_text()
    launches = LAUNCH.findall(text)
    assert launches, "no `tune run offload_plugin/recipes/X.py --config configs/Y.yaml` line in the header"
    for recipe, cfg_path in launches:
        assert recipe.startswith("offload_plugin/recipes/"), recipe
        assert (REPO / "recipes" / Path(recipe).name).is_file(), f"{recipe} does not exist"
        assert REPO / cfg_path == path, f"header launches {cfg_path}, not this file"
    assert not re.search(r":\s*None\b", text), "use null, not None"
