"""The package's layout shows its architecture, and imports point down: the tools (command line,
benches, studies, reports, the in-process simulation) use the runtime (jobs, launch, a run wired
together, metrics), which builds the core (the controller and its rules at meshrl/'s top, and the
role packages actors/, tasks/, weight_sync/, configs/), which uses the models."""

import ast
from pathlib import Path

import meshrl

PACKAGE = Path(meshrl.__file__).parent
LAYERS = {"tools": 3, "runtime": 2, "models": 0}  # any other module is the core: 1


def layer(module: str) -> int:
    if module == "meshrl.__main__":  # `python -m meshrl`: the command line itself
        return 4
    parts = module.split(".")
    return LAYERS.get(parts[1], 1) if len(parts) > 1 else 1


def meshrl_imports(path: Path) -> set[str]:
    """The meshrl modules `path` imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "meshrl":
            found |= {f"{node.module}.{a.name}" if node.module == "meshrl" else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "meshrl"}
    return found


def module_name(path: Path) -> str:
    return ".".join(("meshrl",) + path.relative_to(PACKAGE).with_suffix("").parts)


def test_imports_point_down_never_from_the_core_to_the_runtime_or_the_tools():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        upward += [f"{name} imports {m}" for m in meshrl_imports(path) if layer(m) > layer(name)]
    assert not upward, "\n".join(sorted(upward))


def test_the_top_of_the_package_holds_at_most_twelve_modules_and_no_test_fakes():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    assert not any("fake" in name for name in top)
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == {
        "actors", "configs", "models", "runtime", "tasks", "tools", "weight_sync"}


def test_the_layer_rule_sees_an_upward_import(tmp_path):
    """The check above is not vacuous: an import from the core up to the tools is found."""
    core = tmp_path / "core.py"
    core.write_text("def f():\n    from meshrl.tools.report import summary\n")
    assert {layer(m) for m in meshrl_imports(core)} == {3}
