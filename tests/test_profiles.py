"""The profiles leave the GPU type to each run's `gpu_type` (`--gres=gpu:<type>:<n>`).

A GPU model in a profile's `constraint` (sbatch -C) applies to every job of its rule whatever
the run asks: `constraint: "a100"` on `preflight_run` kept the preflight of an H100 run from
ever being scheduled on an H100-only site, and training waited for it for ever.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted(ROOT.glob("profiles/*/config.yaml")) + sorted(
    ROOT.glob("tests/slurm_cluster/profile/config.yaml")
)
# GPU models as sites name them in node features (NVIDIA, AMD, Intel), case-insensitive.
GPU_MODEL = re.compile(
    r"(?i)\b(?:[a-z]*[_-]?)?(?:[abhklpvt]\d{1,3}|l40s?|gh200|gb200|rtx\w*|titan\w*|"
    r"mi\d{2,3}\w*|max\d*|pvc|quadro\w*|tesla\w*|geforce\w*)\b"
)


def resource_sets(profile: dict) -> list[tuple[str, dict]]:
    sets = [("default-resources", profile.get("default-resources") or {})]
    for rule, resources in (profile.get("set-resources") or {}).items():
        sets.append((f"set-resources: {rule}", resources or {}))
    return sets


def gpu_models_in(resources: dict) -> list[str]:
    """GPU models that a rule's resources ask for as node features."""
    found = []
    for key, value in resources.items():
        text = str(value)
        if key == "constraint":
            found += GPU_MODEL.findall(text)
        elif key == "slurm_extra":  # -C X, --constraint=X, --constraint X
            for features in re.findall(r"(?:-C\s*|--constraint[=\s]+)(\S+)", text):
                found += GPU_MODEL.findall(features)
    return found


def test_the_pattern_finds_gpu_models_and_leaves_other_features():
    assert gpu_models_in({"constraint": "a100"}) == ["a100"]
    assert gpu_models_in({"constraint": "ib&H100"}) == ["H100"]
    assert gpu_models_in({"constraint": "gpu_v100|gpu_a40"}) == ["gpu_v100", "gpu_a40"]
    assert gpu_models_in({"slurm_extra": "--exclusive -C mi250x"}) == ["mi250x"]
    assert gpu_models_in({"slurm_extra": "--constraint=l40s --signal=USR1@300"}) == ["l40s"]
    assert gpu_models_in({"constraint": "ib&skylake&nvme"}) == []
    assert gpu_models_in({"slurm_extra": "--signal=USR1@300 --exclusive"}) == []


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_profile_constrains_a_gpu_model(path):
    profile = yaml.safe_load(path.read_text()) or {}
    for where, resources in resource_sets(profile):
        models = gpu_models_in(resources)
        assert not models, (
            f"{path.relative_to(ROOT)}: {where} asks for GPU model(s) {models} as node "
            "features; the GPU type is each run's `gpu_type` (config.yaml), not the profile's"
        )


def test_the_workflow_profile_leaves_the_sites_part_to_the_site():
    """profiles/slurm is the workflow's part: no default-resources (beside a site profile it
    would replace the site's account and partition as a whole), and every rule SLURM runs gets
    its time and memory from set-resources, so it needs no default of ours."""
    profile = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    assert "default-resources" not in profile
    assert "slurm_account" not in str(profile.get("set-resources"))
    rules_text = "".join(p.read_text() for p in sorted((ROOT / "workflow/rules").glob("*.smk")))
    rules = set(re.findall(r"^\s*rule (\w+):", rules_text, flags=re.M))
    assert not re.search(r"^localrules:", rules_text, re.M)  # unprefixed under a module
    # the rules marked `localrule: True` in their own block
    local = set(re.findall(r"^rule (\w+):\n(?:(?:    .*)?\n)*?    localrule: True$", rules_text,
                            flags=re.M))  # fmt: skip
    targets = {"preflight", "keys"}  # no job of their own
    submitted = rules - local - targets
    assert {"train", "verify", "prepare"} <= submitted and "aggregate" not in submitted
    for rule in sorted(submitted):
        resources = profile["set-resources"].get(rule) or {}
        assert {"runtime", "mem_mb"} <= set(resources), rule


def test_the_controller_job_passes_the_profiles_through_and_refuses_an_order_that_drops_ours(
    tmp_path,
):
    """Issue 42: profiles/slurm/controller.sbatch run as a job with a site profile that sets
    set-resources of its own (train: qos). Given as --profile <site> --workflow-profile
    profiles/slurm, real Snakemake's plan keeps the workflow's train resources (partition,
    runtime, memory, the stop warning) and the site's defaults (its account); a site's flag for
    train goes in execution.slurm_extra (a profile's set-resources of a rule replaces the
    other profile's whole, Snakemake's merge). The reverse order, or the site's alone, would
    drop ours without a word, and is refused in one line before Snakemake runs."""
    import os
    import subprocess
    import sys

    from tests.workflow_helpers import copy_workflow

    workdir = copy_workflow(tmp_path / "wf")
    site = workdir / "site"
    site.mkdir()
    (site / "config.yaml").write_text(
        "executor: slurm\ndefault-resources: {slurm_account: site_account}\n"
        "set-resources: {train: {qos: long}}\n"
    )
    env = {**os.environ, "IMAGENET_DDP_SNAKEMAKE": f"{sys.executable} -m snakemake"}
    script = workdir / "profiles/slurm/controller.sbatch"

    def controller(*args):
        return subprocess.run(["bash", str(script), *args], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    # The `=` forms, as Snakemake accepts them (issue 51: `--profile=X` went unseen).
    ran = controller("--profile=site", "--workflow-profile=profiles/slurm", "-n",
                     "--config", "execution={slurm_extra: --qos=long}")  # fmt: skip
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
    train = re.search(r"rule train:.*?resources: ([^\n]*)", ran.stdout, re.S).group(1)
    kept = ("slurm_partition=gpu", "runtime=1440", "mem_mb=128000", "slurm_account=site_account",
            "slurm_extra=--signal=USR1@300 --qos=long")  # fmt: skip
    for resource in kept:
        assert resource in train, (resource, train)
    for wrong in (("--profile", "profiles/slurm", "--workflow-profile", "site"),
                  ("--profile", "site"), ("--profile=site",), ("--prof", "site"),
                  ("--profile=profiles/slurm", "--wo=site"), ("SNAKEMAKE_PROFILE=site",),
                  ("--profile", "profiles/slurm", "--profile", "site")):  # fmt: skip
        if wrong[0].startswith("SNAKEMAKE_PROFILE="):  # Snakemake's own variable, no option
            env["SNAKEMAKE_PROFILE"], wrong = wrong[0].split("=")[1], ()
        refused = controller(*wrong, "-n")
        env.pop("SNAKEMAKE_PROFILE", None)
        assert refused.returncode == 2 and "Snakefile" not in refused.stdout, refused.stdout
        [line] = refused.stderr.splitlines()
        assert "give --profile <site profile> --workflow-profile profiles/slurm" in line


@pytest.mark.parametrize(
    ("runtime", "extra", "lead"),
    [
        (6, "--signal=USR1@300", 300),  # the default warning: sent up to 360 s before the limit
        (2, "--signal=B:USR1@60 --exclusive", 60),
        (2, "--signal USR1", 60),  # sbatch's default lead
        (5, "--signal=USR1@30 --signal=USR1@240", 240),  # sbatch takes the last
    ],
)
def test_a_time_limit_within_the_stop_warning_is_a_problem(runtime, extra, lead):
    from imagenet_ddp.jobs.site import stop_warning_problem

    problem = stop_warning_problem(runtime, extra)
    assert problem.startswith(f"train's runtime ({runtime} min) is within its stop warning (")
    assert f"...@{lead}: sent up to {lead + 60} s before the time limit" in problem
    assert stop_warning_problem(runtime + 0.5, extra) is None  # at worst 30 s to train
    assert stop_warning_problem(None, extra) is None  # no runtime set: no limit to check
    assert stop_warning_problem(runtime, "--exclusive") is None  # no warning asked for


def test_the_dry_run_refuses_a_train_time_limit_within_its_stop_warning(tmp_path):
    """Real Snakemake: the warning comes up to 60 s early (slurmctld's 30 s check), so a train
    runtime within it would have every job told to stop as it starts, and the run's
    allocations spent without training. Read from what train submits: the rule's own
    `--signal` (execution.stop_signal) or a set-resources slurm_extra, which replaces it."""
    from tests.workflow_helpers import copy_workflow, snakemake

    workdir = copy_workflow(tmp_path / "wf")

    def dry_run(*args):
        result = snakemake(workdir, "-n", *args, check=False)
        return result.returncode, result.stdout + result.stderr

    code, out = dry_run("--set-resources", "train:runtime=6")
    lines = [line for line in out.splitlines() if "stop warning" in line]
    assert code != 0 and lines == [
        "train's runtime (6 min) is within its stop warning (--signal ...@300: sent up to 360 s "
        "before the time limit), so each job would be told to stop as it starts: raise train's "
        "runtime (set-resources train: runtime) or lower the seconds of execution.stop_signal"
    ], out[-2000:]
    assert "Traceback" not in out
    assert dry_run("--set-resources", "train:runtime=7")[0] == 0
    code, out = dry_run("--set-resources", "train:runtime=2", "--config",
                        "execution={stop_signal: USR1@90}")  # fmt: skip
    assert code != 0 and "(--signal ...@90: sent up to 150 s before" in out, out[-2000:]
    code, out = dry_run("--set-resources", "train:runtime=2",
                        "train:slurm_extra='--signal=USR1@30'")  # fmt: skip
    assert code == 0, out[-2000:]
    code, out = dry_run("--set-resources", "train:runtime=7",
                        "train:slurm_extra='--signal=USR1@400 --exclusive'")  # fmt: skip
    assert code != 0 and "(--signal ...@400: sent up to 460 s before" in out, out[-2000:]


def test_a_requeued_controller_job_runs_snakemake_without_the_forces_its_first_run_had(tmp_path):
    """SLURM runs a requeued batch job's script again as submitted (SLURM_RESTART_COUNT 1 and
    up): profiles/slurm/controller.sbatch then leaves Snakemake's forces out (-R and its
    targets, -F, --force, --forcerun=...; the first run forced already), and says so in one
    line; the other arguments stay, in order. Its first run keeps them. The successor it
    submits at its time limit leaves them out on the test cluster (tests/test_slurm_e2e.py)."""
    import os
    import subprocess

    fake = tmp_path / "snakemake"
    fake.write_text('#!/bin/bash\necho "snakemake $*"\n')
    fake.chmod(0o755)
    args = ["--config", "a=b c", "-R", "results/a.pt", "results/b.pt", "-n", "--force",
            "-F", "--forcerun=x.pt", "all", "-Ry", "z", "--until", "train"]  # fmt: skip
    kept = "--config a=b c -n all z --until train"
    for restart, shown in (("0", " ".join(args)), ("2", kept)):
        env = {**os.environ, "IMAGENET_DDP_SNAKEMAKE": str(fake), "SLURM_RESTART_COUNT": restart}
        ran = subprocess.run(
            ["bash", str(ROOT / "profiles/slurm/controller.sbatch"), *args], cwd=tmp_path,
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stdout + ran.stderr
        lines = ran.stdout.splitlines()
        assert f"snakemake --profile profiles/slurm {shown}" in lines, lines
        requeued = [line for line in lines if line.startswith("== requeued")]
        forces = "-R results/a.pt results/b.pt --force -F --forcerun=x.pt -Ry"
        assert requeued == ([] if restart == "0" else [
            f"== requeued (restart 2): without {forces} (a force applies once)"
        ]), lines  # fmt: skip
