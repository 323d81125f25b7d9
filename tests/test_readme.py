"""Every command in README.md and docs/*.md is run here, or, where it needs a download or a GPU, checked.

Commands that only need this repository (the demo configs, torchtune's stock recipes on the
tests' tiny configs, the resume example, bench/report.py, bench/investigations/trace_report.py on a
committed result) run verbatim; commands for the real-model configs are checked for the files and
torchtune names they use; benchmark commands for the scripts, flags, stages and optimizer names
they use. Links between the pages must reach a file and a section; the pages keep to their
lengths and carry no run diaries.
"""

import functools
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

pytestmark = pytest.mark.slow  # (starts processes: left out of the quick lane, pytest -m "not slow")

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# The pages whose commands are checked: the README, then every page under docs/
# (docs/performance.md holds the benchmark commands; the others may have none).
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 "


def _blocks(lang, text=README):
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _commands(text=README):
    return [line for block in _blocks("bash", text) for line in block.splitlines() if line.strip()]


def _page_commands():
    """(page, command) for every line of every ```bash block of every page but the
    README's quick start (its two commands have tests of their own)."""
    found = []
    for page in PAGES:
        commands = _commands(page.read_text())
        found += [(page.relative_to(REPO).as_posix(), c) for c in commands[2 if page.name == "README.md" and page.parent == REPO else 0:]]
    return found


def _inline_commands():
    """Commands quoted inline in the pages' prose (`python bench/...`, `bash ...`)."""
    found = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", text):
            if re.match(r"(python3? bench/|bash )\S", span):
                found.append((page.relative_to(REPO).as_posix(), span))
    return found


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
    # (torchtitan apart: its pins exclude transformers', docs/frameworks.md says so)
    assert _without_setup(tests) == "pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro && pytest -q"


def test_demo_quick_start_trains(tmp_path):
    """The demo command (after its install steps) prepares the data and the loss falls."""
    demo = _commands()[0]
    proc = _run(_without_setup(demo), REPO, tmp_path)
    losses = _losses("/tmp/offload-plugin/tiny_qlora_offload/logs")
    assert len(losses) >= 100 and sum(losses[-10:]) < sum(losses[:10]), losses
    # The checkpoint's final place is named (torchtune's lines name the staging folder).
    where = Path("/tmp/offload-plugin/tiny_qlora_offload")
    assert f"Checkpoint of epoch 0 moved into place in {where}" in proc.stdout + proc.stderr
    assert (where / "epoch_0" / "adapter_model.pt").is_file()


# Configs that need only the demo files: ours, and the tests' tiny configs for torchtune's
# stock recipes (way 2's offline example).
LOCAL_CONFIGS = ("configs/demo/", "tests/assets/stock_recipes/")


def _resume_pair():
    """The README's resume example: a run, then the command that resumes it."""
    commands = _commands()[2:]
    (pair,) = [(commands[i - 1], c) for i, c in enumerate(commands) if "resume_from_checkpoint=True" in c]
    return pair


def _local_commands():
    """README commands on the demo files: runnable here (device=cuda falls back to CPU). The
    resume example runs as a pair in its own test."""
    return [c for c in _commands()[2:] if any(d in c for d in LOCAL_CONFIGS) and c not in _resume_pair()]


def _runs_here(command):
    """Commands that need only this repository and a CPU, and finish in seconds."""
    words = shlex.split(command)
    return words[:2] in (["python", "bench/report.py"], ["python3", "bench/report.py"],
                         ["python", "bench/investigations/trace_report.py"],
                         ["python3", "bench/investigations/trace_report.py"])


def _without_launchers(words):
    """The command after leading VAR=value assignments and `taskset -c CPUS`."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if words[:2] == ["taskset", "-c"]:
        words = words[3:]
    return words


@functools.cache
def _help_text(script):
    proc = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{script} --help\n{proc.stderr[-3000:]}"
    return proc.stdout


def _bench_module(script):
    spec = importlib.util.spec_from_file_location(f"_readme_{Path(script).stem}", REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_bench_script(script, args):
    """`python bench/X.py ARGS`: the script exists, its argparse accepts every flag, and
    the benchmark drivers' parse_args accepts the whole command line (as on a GPU machine)
    with optimizer names it knows."""
    assert (REPO / script).is_file(), script
    help_text = _help_text(script)
    for arg in args:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), f"{script} has no {flag}"
        elif "/" in arg:  # a positional path (trace_report.py RESULT.json)
            assert (REPO / arg).exists(), arg
    if "\ndef parse_args(" in (REPO / script).read_text():
        module = _bench_module(script)
        with mock.patch("torch.cuda.is_available", return_value=True), \
                mock.patch("torch.cuda.device_count", return_value=8), \
                mock.patch("torch.set_num_threads"):
            try:
                parsed = module.parse_args(list(args))
            except SystemExit as exit_:  # argparse's error (printed above)
                raise AssertionError(f"{script} refuses {args}") from exit_
        if getattr(parsed, "optimizers", None):
            unknown = set(parsed.optimizers.split(",")) - set(module.OPTIMIZERS)
            assert not unknown, f"{script}: unknown optimizers {sorted(unknown)}"


def _run_h200_stages():
    text = (REPO / "bench" / "run_h200.sh").read_text()
    return set(re.findall(r"^ {4}([a-z0-9]+)\)", text, flags=re.M))


def _check_tune_run(words, command):
    """`tune run RECIPE --config CONFIG ...`: our recipe and config files exist, or
    torchtune's names with our optimizer swapped in."""
    configs, recipes = _torchtune_config_names()
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


def _check_command(command):
    """A command that needs a download or a GPU: what it names exists and is accepted."""
    words = _without_launchers(shlex.split(command))
    if words[:2] == ["tune", "run"]:
        _check_tune_run(words, command)
    elif words[:1] == ["bash"]:
        script = words[1]
        assert (REPO / script).is_file(), script
        if script == "bench/run_h200.sh":
            stages = words[2:]
            assert stages and set(stages) <= _run_h200_stages(), f"{command}: stages {stages}"
        else:
            assert words[2:] == [], command
    elif words[:1] in (["python"], ["python3"]) and words[1].startswith("bench/"):
        _check_bench_script(words[1], words[2:])
    else:
        raise AssertionError(f"no check for this kind of command: {command}")


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


def _logged_steps(log_dir):
    text = "".join(p.read_text() for p in Path(log_dir).glob("*.txt"))
    return [int(v) for v in re.findall(r"^Step (\d+) \|", text, flags=re.M)]


def test_resume_example_resumes_after_the_saved_epoch(tmp_path):
    """The README's resume command, verbatim, after its first command stopped once epoch_0 was
    saved (its second epoch's files removed, as if it had been killed): it trains the second
    epoch only and saves it."""
    first, resume = _resume_pair()
    out = Path("/tmp/offload-plugin/tiny_full_offload")  # the demo config's output_dir
    shutil.rmtree(out, ignore_errors=True)
    _run(f"python -m offload_plugin.demo prepare && {first}", REPO, tmp_path)
    assert _logged_steps(out / "logs") == list(range(1, 41))
    shutil.rmtree(out / "epoch_1")
    shutil.rmtree(out / "logs")
    _run(resume, REPO, tmp_path)
    assert _logged_steps(out / "logs") == list(range(21, 41))
    assert (out / "epoch_1" / "model-00001-of-00001.bin").is_file()


def test_way_two_has_offline_stock_recipe_commands():
    """Way 2 shows torchtune's stock recipes (by name, not our files) on the demo files, among
    them one with only optimizer._component_ changed; test_demo_commands_run runs them."""
    way2 = README.split("### 2. ", 1)[1].split("\n### ", 1)[0]
    stock = [c for c in _commands(way2) if any(d in c for d in LOCAL_CONFIGS)]
    assert stock and all(shlex.split(c)[2] in _torchtune_config_names()[1] for c in stock)
    assert any(c.endswith(" optimizer._component_=offload_plugin.CPUOffloadOptimizer") for c in stock)


def test_config_table_lists_every_demo_config():
    """Each file of configs/demo/ is named in the README's table of configs."""
    for path in (REPO / "configs" / "demo").glob("*.yaml"):
        assert re.search(rf"^\|.*`{re.escape(path.name)}`", README, flags=re.M), path.name


@pytest.mark.parametrize("page,limit", [("README.md", 250), ("docs/performance.md", 300)])
def test_pages_keep_to_their_length(page, limit):
    assert len((REPO / page).read_text().splitlines()) <= limit


def test_no_run_diaries_in_the_docs_and_configs():
    """How results were reached lives in commit messages and bench/results/, not in the pages,
    configs or recipes: no session numbers, no dated measurements (raw file names may carry dates)."""
    assert not (REPO / "docs" / "notes.md").exists()
    paths = [*PAGES, *(REPO / "configs").rglob("*.yaml"), *(REPO / "recipes").glob("*.py")]
    for path in paths:
        text = re.sub(r"bench/results/\S*|`[^`]*\.(json|txt)`", "", path.read_text())
        assert not re.search(r"\bsessions? [0-9]+\b|\(s[0-9]{2}\)", text, flags=re.I), path
        assert not re.search(r"\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b", text), path


def _torchtune_config_names():
    from torchtune._recipe_registry import get_all_recipes

    return {c.name for r in get_all_recipes() for c in r.configs}, {r.name for r in get_all_recipes()}


@pytest.mark.parametrize("command", [c for c in _commands()[2:] if not any(d in c for d in LOCAL_CONFIGS) and not _runs_here(c)])
def test_other_commands_name_real_files(command):
    """Commands for real models name recipes and configs that exist (here or in torchtune);
    benchmark and GPU-check commands name scripts, flags and stages that exist."""
    _check_command(command)


def test_results_page_has_its_commands():
    """docs/performance.md gives the commands behind its tables (checked below)."""
    commands = [c for page, c in _page_commands() if page == "docs/performance.md"]
    assert any("bench/bench_train.py" in c for c in commands)
    assert any("bench/run_h200.sh" in c for c in commands)


@pytest.mark.parametrize("page,command", [pc for pc in _page_commands() if pc[0] != "README.md"])
def test_docs_commands(page, command, tmp_path):
    """Commands in docs/*.md: demo configs and report scripts run verbatim, the others
    (GPU benchmarks) are checked for their scripts, flags, stages and optimizers."""
    if "configs/demo/" in command:
        _run(f"python -m offload_plugin.demo prepare && {command}", REPO, tmp_path)
    elif _runs_here(command):
        _run(command, REPO, tmp_path)
    else:
        _check_command(command)


@pytest.mark.parametrize("command", [c for c in _commands()[2:] if _runs_here(c)])
def test_readme_report_commands_run(command, tmp_path):
    """README commands that need only this repository (bench/report.py) run verbatim."""
    _run(command, REPO, tmp_path)


@pytest.mark.parametrize("page,command", _inline_commands())
def test_inline_commands(page, command):
    """Commands quoted inline in the pages' text are checked like those in code blocks."""
    _check_command(command)


def _slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path):
    text = path.read_text()
    return set(re.findall(r'<a id="([^"]+)"', text)) | {
        _slug(h) for h in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_reach_files_and_sections(page):
    """Every relative link in a page reaches a file, and its #section an anchor there."""
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target}"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: {target} has no such section"


def test_python_example_runs():
    """The Python example in the README runs as written."""
    (example,) = _blocks("python")
    exec(compile(example, "README.md", "exec"), {})


def _collected(*args):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:warnings", *args],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if "::" in line}


def test_quick_lane_and_gpu_marker_select_what_the_readme_says():
    """`pytest -m "not slow"` (the README's quick lane) leaves out only tests marked slow and
    still has tests of every test module but those that only start processes; `pytest -m gpu`
    selects what .ci/gpu-checks runs (`-k "cuda or gpu"`)."""
    everything, quick, slow = _collected(), _collected("-m", "not slow"), _collected("-m", "slow")
    assert quick and slow and quick | slow == everything and not quick & slow
    modules = lambda ids: {i.split("::")[0] for i in ids}
    assert modules(everything) - modules(quick) <= {
        f"tests/{m}.py" for m in ("test_recipes", "test_bench_smoke", "test_distributed", "test_crash_safety",
                                  "test_dtensor", "test_dtensor_changed_weights", "test_readme",
                                  "test_stock_recipes", "test_exit", "test_packaging",
                                  "frameworks/test_docs_examples")}
    assert _collected("-m", "gpu") == _collected("-k", "cuda or gpu")


def test_tests_readme_maps_every_test_file():
    """tests/README.md names each test file and helper (so a newcomer finds every behaviour's
    home), and nothing that is gone."""
    text = (REPO / "tests" / "README.md").read_text()
    files = {p.relative_to(REPO / "tests").as_posix() for p in (REPO / "tests").rglob("*.py")
             if p.name not in ("__init__.py",)}
    named = set(re.findall(r"`([\w/]+\.py)`", text))
    assert files - named == set(), "not in tests/README.md"
    assert named - files == set(), "named in tests/README.md but gone"
