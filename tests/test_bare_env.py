"""A dry-run and `--lint` on a login node whose environment has only Snakemake and the SLURM
executor plugin: what runs while Snakemake parses the rules (workflow/rules/common.smk and the
modules it imports from src/) needs no torch, torchvision, numpy, pandas or scikit-learn, and
the package need not be installed there (the jobs run in `--sdm conda`/`apptainer`).

The bare environment is made by .ci/run (`.venv-bare`: the oldest Snakemake the workflow allows,
requirements/snakemake-floor.txt, with the SLURM plugin and the rest of
requirements/constraints.txt; BARE_VENV_COMMAND) or pointed at by IMAGENET_DDP_BARE_VENV. Its
dry-run proves the version floor (Snakefile min_version) is one the workflow runs on. Without it
the test is skipped with the reason, except in CI (IMAGENET_DDP_REQUIRE_BARE_VENV=1), where it
fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.workflow_helpers import REPO

# Not importable while the rules are parsed (a login node's bare Snakemake environment).
HEAVY = ("torch", "torchvision", "numpy", "pandas", "sklearn", "scipy", "matplotlib", "PIL")


def parse_time_modules() -> list[str]:
    """The package's modules that the rules import at parse time."""
    text = "".join(p.read_text() for p in sorted((REPO / "workflow/rules").glob("*.smk")))
    return sorted(set(re.findall(r"^from (imagenet_ddp[\w.]*) import", text, re.M)))


def test_parse_time_modules_import_without_heavy_packages():
    """Runs in the full environment, where numpy and pandas exist (the SLURM plugin pulls them
    into the bare one too): blocked here, so any import of them at parse time fails."""
    modules = parse_time_modules()
    assert "imagenet_ddp.settings.runs" in modules and "imagenet_ddp.settings.run_checks" in modules
    code = (
        "import sys\n"
        f"for name in {HEAVY!r}: sys.modules[name] = None\n"
        f"sys.path.insert(0, {str(REPO / 'src')!r})\n"
        f"for module in {modules!r}: __import__(module)\n"
        "assert 'imagenet_ddp.settings.presets' in sys.modules\n"  # run resolution imports it
        "from imagenet_ddp.models import CLASSIFICATION_MODELS\n"
        "assert len(CLASSIFICATION_MODELS) > 50\n"
    )
    # The installed (editable) package is on the path too, but src/ comes first, as in common.smk.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


BARE_VENV_COMMAND = (
    "python3 -m venv {venv} && grep -v '^snakemake==' requirements/constraints.txt > "
    "{venv}/constraints-floor.txt && {venv}/bin/python -m pip install -c "
    "{venv}/constraints-floor.txt -r requirements/snakemake-floor.txt "
    "snakemake-executor-plugin-slurm"
)


def bare_python() -> Path:
    venv = Path(os.environ.get("IMAGENET_DDP_BARE_VENV") or REPO / ".venv-bare")
    python = venv / "bin" / "python"
    if not python.exists():
        message = (
            f"no bare Snakemake environment at {venv} (make it with "
            f"`{BARE_VENV_COMMAND.format(venv=venv.name)}`, as .ci/run does)"
        )
        if os.environ.get("IMAGENET_DDP_REQUIRE_BARE_VENV") == "1":  # CI: must run, never skip
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return python


def fresh_clone(dest: Path) -> Path:
    """A clone of the repository as a user gets it, with the working tree's uncommitted changes
    (a stash commit, reachable through --shared) and new workflow files that git does not
    ignore yet: no .venv, no results."""
    git = ["git", "-C", str(REPO)]
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(dest)], check=True)
    stash = subprocess.run([*git, "stash", "create"], capture_output=True, text=True, check=True)
    if stash.stdout.strip():
        subprocess.run(["git", "-C", str(dest), "checkout", "-q", stash.stdout.strip()], check=True)
    new = subprocess.run(
        [*git, "ls-files", "-o", "--exclude-standard", "-z"], capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, new.split("\0")):
        if not name.startswith(("src/", "workflow/", "profiles/")):
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    return dest


def test_dry_run_and_lint_with_snakemake_alone(tmp_path):
    python = bare_python()
    absent = subprocess.run(
        [str(python), "-c", f"import importlib.util as u; print([m for m in {HEAVY[:2]!r} "
         "+ ('sklearn', 'imagenet_ddp') if u.find_spec(m)])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert absent == "[]", f"{python} is not bare: {absent}"
    floor = re.search(r'^min_version\("([\d.]+)"\)', (REPO / "Snakefile").read_text(), re.M)
    version = subprocess.run(
        [str(python), "-c", "import snakemake; print(snakemake.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert version == floor.group(1), (
        f"{python} has Snakemake {version}, not the floor {floor.group(1)}: remake it with "
        f"`{BARE_VENV_COMMAND.format(venv=python.parent.parent)}`"
    )
    clone = fresh_clone(tmp_path / "clone")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("PYTHONPATH", None)
    snakemake = [str(python), "-m", "snakemake"]
    dry = subprocess.run(
        [*snakemake, "--profile", "profiles/slurm", "-n", "-p"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = dry.stdout + dry.stderr
    assert dry.returncode == 0, log[-4000:]
    assert "hyperparameters=" in log and re.search(r"rule train:", log), log[-4000:]
    # Reviewable: a train job in under 2.8 KB (its compact spec twice: resources, command),
    # threads as SLURM grants them (not the 1 core a dry-run counts); nothing written.
    for block in (b for b in dry.stdout.split("\n\n") if "rule train:" in b):
        assert len(block.encode()) < 2800 and "--job '{" in block, block
    assert not (clone / "results").exists() and not (tmp_path / "cache/imagenet-ddp").exists()
    workers = yaml.safe_load((clone / "config.yaml").read_text())["prepare"]["workers"]
    assert f"--workers {workers} " in dry.stdout and "--workers 1 " not in dry.stdout
    lint = subprocess.run(
        [*snakemake, "--profile", "profiles/slurm", "--lint"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert lint.returncode == 0, (lint.stdout + lint.stderr)[-4000:]
    # Beside a site's own global profile: the site's part (default-resources: account, a
    # default runtime) holds, as profiles/slurm sets no default-resources; the workflow's
    # part (set-resources per rule) wins where it says something.
    site = tmp_path / "site"
    site.mkdir()
    (site / "config.yaml").write_text(
        "executor: slurm\nslurm-logdir: /shared/slurm_logs\n"
        "default-resources: {slurm_account: site_account, runtime: 5}\n"
    )
    # and a timm model and optimizer, which the run's check judges where torch and timm are
    timm_run = "train_defaults={model: timm/resnet50.a1_in1k, optimizer: timm/lamb}"
    pair = subprocess.run(
        [*snakemake, "--profile", str(site), "--workflow-profile", "profiles/slurm", "-n",
         "--config", timm_run],
        cwd=clone, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = pair.stdout + pair.stderr
    assert pair.returncode == 0, log[-4000:]
    assert "rule check:" in log or "checkpoint check:" in log, log[-4000:]
    assert f"Using profiles {site} and workflow specific profile profiles/slurm" in log
    train = re.search(r"rule train:.*?resources: ([^\n]*)", log, re.S).group(1)
    assert "slurm_partition=gpu" in train and "runtime=1440" in train, train
    assert "slurm_account=site_account" in train, train
    verify = re.search(r"rule verify:.*?resources: ([^\n]*)", log, re.S).group(1)
    assert "slurm_account=site_account" in verify and "runtime=120" in verify, verify
    assert "my_account" not in log
    # train's own stop warning, whatever the profiles say
    assert "slurm_extra=--signal=USR1@300" in train, train
    # A bad model name is still refused: checked against the list kept with the package.
    bad = subprocess.run(
        [*snakemake, "-n", "--config", "train_defaults={model: resnet9000}"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode != 0 and "model 'resnet9000'" in bad.stdout + bad.stderr
