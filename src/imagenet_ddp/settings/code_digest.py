"""A digest of the code a stage runs: the rules pass it as a param, so a change of that code
reruns the stage (Snakemake sees only a rule's shell text, `imagenet-ddp <stage> ...`).

The code of a stage is its entry modules and every module of this package they import,
directly or not (read from the source, not imported: torch-free, at parse time). Each module
counts by its syntax tree without docstrings: a comment, a docstring or a reformatting changes
no digest, a changed statement does. Training is no rule's param (a finished GPU job is not
resubmitted for a code change): its digest is recorded beside the model and the runs table
flags a model trained by other training code (:mod:`imagenet_ddp.report.aggregate`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = "imagenet_ddp"
ROOT = Path(__file__).resolve().parent.parent  # the package

# Each stage's entry modules (what its `imagenet-ddp <stage>` command calls).
STAGES = {
    "verify": ("data.archives",),
    "index": ("data.archives",),
    "split": ("data.split",),
    "prepare": ("data.prepare",),
    "evaluate": ("evaluation.evaluate",),  # the rank module: what computes the figures
    "accounting": ("report.accounting",),
    "aggregate": ("report.aggregate",),
    "plots": ("report.plots",),
    "training": ("training.worker",),
}


def _path(module: str) -> Path | None:
    """The source file of ``module`` (dotted, below the package), None if not one of ours."""
    parts = module.split(".")
    for candidate in (
        ROOT.joinpath(*parts).with_suffix(".py"),
        ROOT.joinpath(*parts, "__init__.py"),
    ):
        if candidate.is_file():
            return candidate
    return None


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _imports(tree: ast.AST) -> set[str]:
    """The package's modules that ``tree`` imports anywhere (also inside functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith(PACKAGE + ".") and _path(name[len(PACKAGE) + 1 :]):
                found.add(name[len(PACKAGE) + 1 :])
    return found


@functools.cache
def _module(module: str) -> tuple[str, frozenset[str]]:
    """``module``'s normalized syntax tree and the package modules it imports."""
    tree = _strip_docstrings(ast.parse(_path(module).read_text()))
    return ast.dump(tree), frozenset(_imports(tree))


def modules(*entries: str) -> list[str]:
    """``entries`` and every package module they import, directly or not, sorted."""
    seen, todo = set(), list(entries)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_module(module)[1])
    return sorted(seen)


def code_digest(stage: str) -> str:
    """The first 16 hex digits of the sha256 of ``stage``'s code (:data:`STAGES`)."""
    digest = hashlib.sha256()
    for module in modules(*STAGES[stage]):
        digest.update(f"{module}\n{_module(module)[0]}\n".encode())
    return digest.hexdigest()[:16]
