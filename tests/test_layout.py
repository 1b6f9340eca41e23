"""The package's layout (docs/layout.md): imports only go down the layers, no import cycle, no
module at the package's top level beyond those allowed, every subpackage says what it holds, and
docs/layout.md names every module. Fast: parses the package's sources, imports nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.workflow_helpers import REPO

PACKAGE = REPO / "src" / "imagenet_ddp"

# A unit is a module at the package's top level or a subpackage. A module may import its own
# unit, any unit of its own layer, and any unit of a lower one: never a higher one.
# LAYERS-BEGIN (the layers of docs/layout.md, lowest first; issue 30)
TOP_LEVEL = {"cli", "errors", "io", "models", "mounts", "optimizers", "precision", "provenance"}
LAYERS = [
    ("foundations", {"errors", "io", "models", "mounts", "optimizers", "precision", "provenance"}),
    ("settings", {"settings"}),
    ("data", {"data"}),
    ("jobs", {"jobs"}),
    ("monitoring", {"monitoring"}),
    ("training", {"training"}),
    ("stages above training", {"evaluation", "preflight", "report"}),
    ("entry point", {"cli"}),
]
# LAYERS-END


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module's dotted name below the package ('' for its own __init__) and its file."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """What each module imports of the package (function-level imports included), as names
    below the package: `from imagenet_ddp.x import y` is x.y where x.y is a module, else x."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(["imagenet_ddp", *filter(None, [*here, base])])
                found = [f"{base}.{alias.name}" for alias in node.names]
                found = [f if f.removeprefix("imagenet_ddp.") in modules else base for f in found]
            else:
                continue
            for target in found:
                if target == "imagenet_ddp" or target.startswith("imagenet_ddp."):
                    targets.add(target.removeprefix("imagenet_ddp").removeprefix("."))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def unit(module: str) -> str:
    return module.split(".")[0]


def layer_problems(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """One line per unit not in exactly one layer and per import from a lower layer to a higher."""
    level = {}
    problems = []
    for index, (_, units) in enumerate(layers):
        for u in units:
            if u in level:
                problems.append(f"{u} is in two layers")
            level[u] = index
    for module in graph:
        if module and unit(module) not in level:
            problems.append(f"{module}: its unit {unit(module)!r} is in no layer")
    for module, targets in sorted(graph.items()):
        if not module or unit(module) not in level:
            continue
        for target in sorted(targets):
            if level.get(unit(target), -1) > level[unit(module)]:
                below, above = layers[level[unit(module)]][0], layers[level[unit(target)]][0]
                problems.append(f"{module} ({below}) imports {target} ({above}), a higher layer")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles among the modules (each found once per module that starts one)."""
    found, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            found.append(path[path.index(module) :] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def top_level_problems(modules: dict[str, Path], allowed=TOP_LEVEL) -> list[str]:
    """Modules at the package's top level (not subpackages) that are not allowed there."""
    return [f"{m}.py is at the package's top level" for m, path in modules.items()
            if m and "." not in m and path.name != "__init__.py" and m not in allowed]  # fmt: skip


def unnamed_in_doc(modules: dict[str, Path], doc: str) -> list[str]:
    """Modules that docs/layout.md does not name: a subpackage as `name/`, a module by its file
    name (`name.py`) or, in a list of several, its bare name as a word."""
    missing = []
    for module, path in modules.items():
        if not module:
            continue
        stem = module.split(".")[-1]
        if path.name == "__init__.py":
            if f"{stem}/" not in doc:
                missing.append(f"{module}/")
        elif not re.search(rf"(?<![\w/.-]){re.escape(stem)}(\.py)?(?![\w-])", doc):
            missing.append(f"{module.replace('.', '/')}.py")
    return missing


def test_imports_only_go_down_the_layers():
    assert layer_problems(import_graph(package_modules())) == []


def test_no_import_cycle():
    assert cycles(import_graph(package_modules())) == []


def test_no_module_at_the_top_level_beyond_those_allowed():
    assert top_level_problems(package_modules()) == []


def test_each_subpackage_says_what_it_holds():
    for path in sorted(PACKAGE.rglob("__init__.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring and docstring.strip(), f"{path.relative_to(REPO)} has no docstring"


def test_layout_doc_names_every_module():
    assert unnamed_in_doc(package_modules(), (REPO / "docs" / "layout.md").read_text()) == []


def test_the_checks_fail_where_they_should(tmp_path):
    """Each check on a package it must refuse: an upward import, a cycle, a top-level module
    not allowed, a module the doc does not name."""
    low, high = sorted(LAYERS[0][1])[0], sorted(LAYERS[-1][1])[0]
    (tmp_path / low).mkdir()
    (tmp_path / low / "__init__.py").write_text('"""Low."""\n')
    (tmp_path / low / "down.py").write_text(f"from imagenet_ddp.{high} import main\n")
    (tmp_path / f"{high}.py").write_text(f"import imagenet_ddp.{low}.down\n")
    (tmp_path / "stray_module.py").write_text("")
    modules = package_modules(tmp_path)
    graph = import_graph(modules)
    assert graph[f"{low}.down"] == {high}
    assert any(f"{low}.down (" in p and "a higher layer" in p for p in layer_problems(graph))
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert any("stray_module.py" in p for p in top_level_problems(modules))
    assert unnamed_in_doc(modules, f"{low}/ down.py {high}.py") == ["stray_module.py"]
