"""End to end: the workflow used as a Snakemake `module` from another folder (docs/cluster.md
"As a module"), the demo run through `use rule * from imagenet as imagenet_*`; then a `git pull`
without a reinstall (the clone's package a version the environment does not have)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.workflow_helpers import REPO, TINY_CONFIG_OVERRIDES, planned_jobs, snakemake

pytestmark = pytest.mark.e2e

RUN = "resnet18-1x2"
CONSUMER = """\
configfile: "config.yaml"


module imagenet:
    snakefile:
        "{clone}/Snakefile"
    config:
        config


use rule * from imagenet as imagenet_*
"""


@pytest.fixture(scope="module")
def consumer(module_tmp) -> tuple[Path, Path, str]:
    """(the using workflow's folder, the clone, its run's output): the demo, one run, run
    through the module with the clone's local profile."""
    clone = module_tmp / "clone"  # as a user clones it: its package not installed from here
    for name in ("workflow", "profiles", "src", "requirements"):
        shutil.copytree(REPO / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("Snakefile", "config.yaml"):
        shutil.copy(REPO / name, clone / name)
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["demo"] = dict(TINY_CONFIG_OVERRIDES["demo"])
    config["prepare"] = dict(TINY_CONFIG_OVERRIDES["prepare"])
    config["train_defaults"].update(TINY_CONFIG_OVERRIDES["train_defaults_update"])
    config["runs"] = [{"name": RUN, "max_allocations": 2}]  # train's retries: 1
    work = module_tmp / "analysis"
    work.mkdir()
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (work / "Snakefile").write_text(CONSUMER.format(clone=clone))
    output = snakemake(work, "--profile", str(clone / "profiles/local"))
    return work, clone, output.stdout + output.stderr


def test_the_demo_runs_as_a_module_and_plans_nothing_then_refuses_another_version(consumer):
    """Issue 50: the parse reads its own files (schema, src/, env file) beside its Snakefile,
    not the using workflow's folder; the report rules stay local under the prefix (a
    `localrules:` would name them unprefixed: Snakemake warns and submits them); every output
    is the using workflow's; then nothing to do, with the profile and with Snakemake's
    defaults (every rerun trigger)."""
    work, clone, text = consumer
    assert "localrules directive specifies rules that are not present" not in text
    assert re.search(r"rule imagenet_train:", text) and "rule imagenet_aggregate:" in text
    metrics = json.loads((work / f"results/runs/{RUN}/eval.json").read_text())
    assert metrics and (work / "results/aggregate/runs.csv").is_file()
    assert not (clone / "results").exists() and not (clone / ".snakemake").exists()
    profile = ("--profile", str(clone / "profiles/local"))
    assert planned_jobs(work, *profile) == {}
    assert planned_jobs(work, "-c2") == {}
    again = snakemake(work, *profile)
    assert "Nothing to be done" in again.stdout + again.stderr
    # train's resources, as a profile sets them, are read under the prefix (here: refused)
    mpi = snakemake(work, "-n", *profile, "--set-resources", "imagenet_train:mpi=mpirun",
                    check=False)  # fmt: skip
    assert mpi.returncode != 0 and "--set-resources imagenet_train:mpi='mpirun'" in mpi.stderr

    # Then the clone's package is another version than the installed one its jobs run (a
    # `git pull`, no reinstall). A report stage refuses in one line naming both versions and
    # the reinstall; a forced training refuses before it stages or resumes anything, its
    # refusal recorded, and its retry asks for one task without the run's ranks and refuses
    # at once. The real CLI of the installed package, run by Snakemake's jobs.
    from imagenet_ddp import __version__
    from imagenet_ddp.jobs import attempts

    init = clone / "src/imagenet_ddp/__init__.py"
    pulled = f"{__version__}.post1"
    init.write_text(init.read_text().replace(f'"{__version__}"', f'"{pulled}"'))
    line = f"planned this job with imagenet-ddp {pulled}, but the package installed here is"
    report = snakemake(work, *profile, "results/aggregate/runs.md", check=False)
    assert report.returncode != 0
    assert line in (work / "logs/aggregate.log").read_text()
    model = f"results/runs/{RUN}/model.pt"
    root = work / "results/checkpoints" / RUN
    before = sorted(p.name for p in root.rglob("*.pt"))
    forced = snakemake(work, *profile, "--forcerun", model, model, check=False)
    text = forced.stdout + forced.stderr
    assert forced.returncode != 0
    refused = [a for a in attempts.load(root) if a["outcome"] == "refused"]
    assert [a["snakemake_attempt"] for a in refused] == [1, 2], text[-5000:]
    assert all(line in a["error"] and a["gpus"] == 0 for a in refused), refused
    assert pulled in refused[0]["error"] and "pip install" in refused[0]["error"]
    jobs = re.findall(
        r"^(?:local)?rule imagenet_train:\n(?:    .*\n)*?    resources: (.*)", text, re.M
    )
    shapes = [resources.split(", job=")[0] for resources in jobs]
    assert len(shapes) == 2 and "tasks_per_node=2" in shapes[0], shapes
    assert "nodes=1, cpus_per_task=1" in shapes[1] and "tasks_per_node" not in shapes[1], shapes
    assert sorted(p.name for p in root.rglob("*.pt")) == before  # nothing set aside or resumed
