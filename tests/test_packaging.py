"""What ``pip install .`` (not editable) puts in site-packages: every subpackage, the kernel
sources and the recipes. An editable install imports from the checkout and hides a package
left out of pyproject.toml (``offload_plugin.engines.schedules`` was, until this test)."""

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # (starts processes: left out of the quick lane, pytest -m "not slow")

ROOT = Path(__file__).resolve().parents[1]


def _listed_packages() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r"^packages = (\[.*?\])", text, re.M | re.S)
    assert match, "pyproject.toml names its packages in [tool.setuptools] packages = [...]"
    return ast.literal_eval(match.group(1))


def test_every_subpackage_is_listed():
    found = {"offload_plugin." + ".".join(p.parent.relative_to(ROOT / "offload_plugin").parts)
             for p in (ROOT / "offload_plugin").rglob("__init__.py")}
    found = {name.rstrip(".") for name in found}
    missing = found - set(_listed_packages())
    assert not missing, f"add {sorted(missing)} to packages in pyproject.toml"


@pytest.mark.skipif(shutil.which("git") is None, reason="builds from a clean copy made with git")
def test_a_built_wheel_imports_and_holds_kernels_and_recipes(tmp_path):
    pytest.importorskip("setuptools")
    # A clean copy of the tracked files (a build writes build/ and egg-info beside them).
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("offload_plugin-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("offload_plugin/engines/schedules/after_backward.py", "offload_plugin/formats/adamw/csrc/adam_master_bf16.cpp",
                   "offload_plugin/formats/compact/csrc/adam_compact.cpp", "offload_plugin/recipes/lora_finetune_single_device.py"):
        assert needed in names, f"{needed} is not in the wheel"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Imported from the wheel's files alone, away from the checkout.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import offload_plugin, offload_plugin.recipes; "
            "from offload_plugin import CPUOffloadOptimizer; import torch; "
            "p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3); "
            "o = CPUOffloadOptimizer([p], lr=0.1); o.step(); "
            "assert offload_plugin.__file__.startswith(sys.argv[1]), offload_plugin.__file__; "
            "print(float(p.sum()))")
    out = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 3.0  # the step moved the weights
