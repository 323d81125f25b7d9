"""The package's layout holds what docs/design.md promises: each state family is a folder that
imports no other family, nothing outside the families names a family's modules (they ask
offload_plugin.formats.registry), no module imports another in a loop (deferred imports
counted), and the top of the package stays a dozen modules or fewer."""

import ast
from pathlib import Path

import pytest

from offload_plugin.formats import registry

PACKAGE = Path(__file__).resolve().parents[1] / "offload_plugin"
FORMATS = PACKAGE / "formats"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set:
    """Every offload_plugin module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("offload_plugin")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("offload_plugin"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # (a module imported by name)
    return found


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def _family_of(module: str):
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "formats" and parts[2] in registry.FAMILIES else None


def test_every_family_folder_is_registered_and_declares_itself():
    folders = sorted(p.name for p in FORMATS.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(registry.FAMILIES)
    for fam in registry.families():
        assert fam.format_module.startswith(f"offload_plugin.formats.{fam.name}.")
        assert registry.get(fam.name) is registry.get(fam.name)  # (its FORMAT loads)


@pytest.mark.parametrize("name", registry.FAMILIES)
def test_a_family_imports_no_other_family(name):
    crossing = {(m, i) for m, deps in GRAPH.items() if _family_of(m) == name
                for i in deps if _family_of(i) not in (None, name)}
    assert not crossing


def test_only_the_registry_and_the_package_face_name_a_familys_modules():
    allowed = {"offload_plugin", "offload_plugin.formats.registry"}  # (the face: the public classes)
    naming = {(m, i) for m, deps in GRAPH.items() if _family_of(m) is None and m not in allowed
              for i in deps if _family_of(i) is not None and i.count(".") > 2}
    # Where the host update runs torch's own Adam(W), it calls that family's kernels: the
    # host side is the adamw family's host path (offload_plugin.host.inner_step, gradients).
    assert {i for _, i in naming} <= {"offload_plugin.formats.adamw.kernels", "offload_plugin.formats.adamw.native",
                                      "offload_plugin.formats.adamw.streamed"}, naming


def test_no_module_imports_another_in_a_loop():
    seen, on_path, loops = set(), [], []

    def visit(m):
        if m in on_path:
            loops.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for dep in sorted(GRAPH[m]):
            if not m.startswith(dep + "."):  # (a package's own __init__ is no loop)
                visit(dep)
        on_path.pop()

    for m in sorted(GRAPH):
        visit(m)
    assert not loops


def test_the_top_of_the_package_is_a_dozen_modules_at_most():
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 12, top
