"""Every Python example in docs/frameworks.md runs as written (on the CPU, offline), each in
a process of its own, where its framework is installed."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "frameworks.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)

pytestmark = pytest.mark.slow  # (a process each, importing its framework)


def _framework(example: str) -> str:
    """The top-level package of the example's first framework import."""
    for name in re.findall(r"^(?:from|import) (\w+)", example, flags=re.M):
        if name not in ("torch", "offload_plugin"):
            return name
    return "torch"


def test_the_page_has_an_example_per_framework():
    assert {_framework(e) for e in EXAMPLES} >= {"transformers", "accelerate", "lightning", "torchtitan"}


@pytest.mark.parametrize("example", EXAMPLES, ids=_framework)
def test_example_runs(example, tmp_path):
    """The example, verbatim, exits 0."""
    if importlib.util.find_spec(_framework(example)) is None:
        pytest.skip(f"{_framework(example)} is not installed (its extra)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
