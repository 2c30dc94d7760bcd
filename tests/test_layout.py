"""The package's layers and its import graph: imports point down, and they never go round.

Bottom to top: the types and pure rules; the models; the components (the roles' actors and their configs,
the tasks, the weight ring, the losses, checkpoints); the core (the controller, its rollouts and restarts,
the run's composed config); the runtime (jobs, launch, a run wired together, metrics); the tools on top
(the command line, benches, studies, reports, checks). A module may import its own layer or those below,
never one above, and the graph of meshrl's modules has no cycle. The graph counts every import a module
can run: at its top, inside functions, under TYPE_CHECKING, and the package __init__s an import runs
first (importing meshrl.tasks.zorplex from elsewhere runs meshrl/tasks/__init__.py), so a cycle cannot hide
in a function-level import."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import meshrl

PACKAGE = Path(meshrl.__file__).parent
LAYERS = (  # bottom first; a module is in the layer of its longest matching name
    ("rules", ("meshrl", "meshrl.types", "meshrl.advantages", "meshrl.checks", "meshrl.plugins", "meshrl.lr_schedule",
               "meshrl.work_buffer", "meshrl.episodes")),
    ("models", ("meshrl.models",)),
    ("components", ("meshrl.actors", "meshrl.tasks", "meshrl.weight_sync", "meshrl.losses", "meshrl.exact", "meshrl.checkpoint",
                    "meshrl.train_step")),
    ("core", ("meshrl.controller", "meshrl.buffer_calls", "meshrl.rollout", "meshrl.attempt", "meshrl.restarts", "meshrl.configs")),
    ("runtime", ("meshrl.runtime",)),
    ("tools", ("meshrl.tools", "meshrl.__main__")),
)


def layer(module: str) -> int:
    """The index of `module`'s layer; KeyError for a module no layer names (a new one must be placed)."""
    best = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            # the package's root names itself only: every other module would match it
            if module == name or (name != "meshrl" and module.startswith(name + ".")):
                if best is None or len(name) > best[0]:
                    best = (len(name), index)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/test_layout.py's LAYERS")
    return best[1]


def modules(root: Path, package: str = "meshrl") -> dict[str, Path]:
    """Every module under `root` by its dotted name (a package by its own name, for its __init__)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = (package,) + path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def graph(root: Path, package: str = "meshrl") -> dict[str, set[str]]:
    """module -> the package's modules its imports run: each one named, and the packages above it (a
    module's own package is not counted: it runs first whoever imports the module, and a package's
    __init__ may gather its submodules' names)."""
    known = modules(root, package)

    def ran(target: str) -> set[str]:
        parts = target.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(known)

    edges = {}
    for name, path in known.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == package:
                    targets |= ran(node.module)
                    targets |= {f"{node.module}.{a.name}" for a in node.names} & set(known)  # a submodule
            elif isinstance(node, ast.Import):
                targets |= {m for a in node.names if a.name.split(".")[0] == package for m in ran(a.name)}
        edges[name] = targets - {name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({LAYERS[layer(m)][0]}) imports {t} ({LAYERS[layer(t)][0]})"
                  for m, targets in edges.items() for t in targets if layer(t) > layer(m))


def test_every_module_has_a_layer_and_no_module_imports_a_layer_above_its_own():
    edges = graph(PACKAGE)
    assert {m: layer(m) for m in edges}  # KeyError names a module no layer places
    assert not upward(edges), "\n".join(upward(edges))


def test_the_import_graph_of_meshrl_has_no_cycle():
    assert not cycles(graph(PACKAGE)), cycles(graph(PACKAGE))


def test_the_checks_see_a_planted_cycle_an_upward_import_and_an_unplaced_module(tmp_path):
    """Not vacuous: a package where a and b import each other (b inside a function, under a package
    __init__ that imports a) has its cycle found; an import from the core up to the tools is found; a module
    outside every layer is named."""
    root = tmp_path / "meshrl"
    (root / "core").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "core" / "__init__.py").write_text("from meshrl.core.a import f\n")
    (root / "core" / "a.py").write_text("def f():\n    from meshrl.core import b\n")
    (root / "core" / "b.py").write_text("from meshrl.core.a import f\n")
    (root / "rollout.py").write_text("def g():\n    from meshrl.tools.report import summary\n")
    (root / "tools").mkdir()
    (root / "tools" / "__init__.py").write_text("")
    (root / "tools" / "report.py").write_text("")
    edges = graph(root)
    assert cycles(edges) == [["meshrl.core", "meshrl.core.a", "meshrl.core.b"]]
    assert upward({"meshrl.rollout": edges["meshrl.rollout"]}) == [
        "meshrl.rollout (core) imports meshrl.tools (tools)", "meshrl.rollout (core) imports meshrl.tools.report (tools)"]
    with pytest.raises(KeyError, match="meshrl.core is in no layer"):
        layer("meshrl.core")


@pytest.mark.processes
def test_the_runs_config_loads_neither_monarch_nor_vllm_and_a_grader_loads_no_torch():
    """The run's config, with every section beside its owner, is read where Monarch and vLLM may not load:
    the command line and `meshrl check gpu`, which stands in for Monarch on a machine without it. A grader's
    process (its actor and its config section, which its constructor's arguments unpickle) loads no torch."""
    def loaded(modules: str, of: set[str]) -> list[str]:
        code = f"import sys, {modules}; print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(of)!r})))"
        return eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)

    assert loaded("meshrl.configs, meshrl.configs.named, meshrl.tools.cli", {"monarch", "vllm", "torchtitan"}) == []
    assert loaded("meshrl.actors.grader_config, meshrl.actors.grader, meshrl.tasks.sum_digits", {"torch"}) == []
