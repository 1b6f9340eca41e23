"""The package's layout (docs/layout.md): imports only go down the layers and no import cycle
(import-linter's contracts in pyproject.toml, which also refuse a top-level module no layer
names), every subpackage says what it holds, and docs/layout.md names every module."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.workflow_helpers import REPO

PACKAGE = REPO / "src" / "imagenet_ddp"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module's dotted name below the package ('' for its own __init__) and its file."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def lint_imports(config: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([str(LINT_IMPORTS), str(config), "--no-cache"],
                          cwd=config.parent, env=env, capture_output=True, text=True)  # fmt: skip


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


def test_imports_only_go_down_the_layers_with_no_cycle():
    result = lint_imports(REPO / "pyproject.toml", REPO / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout, result.stdout


def test_each_subpackage_says_what_it_holds():
    for path in sorted(PACKAGE.rglob("__init__.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring and docstring.strip(), f"{path.relative_to(REPO)} has no docstring"


def test_layout_doc_names_every_module():
    assert unnamed_in_doc(package_modules(), (REPO / "docs" / "layout.md").read_text()) == []


def test_the_checks_fail_where_they_should(tmp_path):
    """The project's own contracts on a copy of the package's units that breaks each: an
    import from a lower layer to a higher one, a cycle inside one unit, a top-level module no
    layer names; and a module the doc does not name."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    units = [u.strip() for layer in layers for u in layer.split(":")]
    fake = tmp_path / "imagenet_ddp"
    for unit in units:
        (fake / unit).mkdir(parents=True)
        (fake / unit / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    low, high = units[-1], units[0]
    (fake / low / "down.py").write_text(f"from imagenet_ddp.{high} import main\n")
    (fake / high / "main.py").write_text("")
    (fake / "data" / "a.py").write_text("import imagenet_ddp.data.b\n")
    (fake / "data" / "b.py").write_text("import imagenet_ddp.data.a\n")
    (fake / "stray_module.py").write_text("")
    lines = ["[importlinter]", "root_package = imagenet_ddp"]
    lines += ["[importlinter:contract:layers]", "name = layers", "type = layers",
              "containers = imagenet_ddp", "exhaustive = true", "layers =",
              *(f"    {layer}" for layer in layers)]  # fmt: skip
    lines += ["[importlinter:contract:cycles]", "name = cycles", "type = acyclic_siblings",
              "ancestors = imagenet_ddp"]  # fmt: skip
    (tmp_path / "setup.cfg").write_text("\n".join(lines) + "\n")
    output = (result := lint_imports(tmp_path / "setup.cfg", tmp_path)).stdout + result.stderr
    assert result.returncode != 0, output
    assert f"imagenet_ddp.{low}.down -> imagenet_ddp.{high}" in output, output
    assert "imagenet_ddp.stray_module" in output, output
    assert "No cycles are allowed in imagenet_ddp.data." in output, output
    assert unnamed_in_doc(package_modules(fake), "data/ a.py b.py down.py main.py " +
                          " ".join(f"{u}/" for u in units)) == ["stray_module.py"]  # fmt: skip


# One home per concept (issue 51): each is defined or computed in one module, the others call it.
ONE_HOME = {
    r"\b128 \+": "io.py",  # exit_by_signal
    r"^\s+return (2|75|130)$|EXIT_\w+ = \d": "io.py",  # EXIT_INPUT, EXIT_REQUEUE
    r'"timm/"': "models.py",  # TIMM_PREFIX
    r"0\.485|0\.229": "models.py",  # IMAGENET_MEAN_STD
    r'eval_crop_size"?\)? or': "settings/evaluation.py",  # eval_crop
    r"batch_size \* world": "settings/geometry.py",  # global_batch
    r"-c\{|-w\{": "settings/geometry.py",  # checkpoint_tag (Geometry.tag names, keys nothing)
    r"HEARTBEAT_S \+|\d \* HEARTBEAT_S|STALE_S = \d": "io.py",  # liveness thresholds
    r'get\("alive"\)': "jobs/attempts.py",  # last_sign, the one reader of a heartbeat
}


def test_each_concept_has_one_home():
    for pattern, home in ONE_HOME.items():
        found = sorted(
            str(path.relative_to(PACKAGE))
            for path in PACKAGE.rglob("*.py")
            if re.search(pattern, path.read_text(), re.M)
        )
        assert found in ([home], []), (pattern, found)
