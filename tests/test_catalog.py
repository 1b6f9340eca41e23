"""Snakemake workflow catalog conventions: a LICENSE, `min_version`, the catalog's usage file,
a plugin lower bound in pyproject.toml no older than the options profiles/slurm uses, and
every rule running the package's one command."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.workflow_helpers import REPO

# The plugin release that first had each option a profile may set (its CHANGELOG.md and
# `git log -S <setting>` of snakemake-executor-plugin-slurm). An option missing here fails the
# test below: look its version up before using it.
PLUGIN_OPTION_SINCE = {
    "slurm-init-seconds-before-status-checks": (0, 1),
    "slurm-status-attempts": (0, 1),
    "slurm-requeue": (0, 11),
    "slurm-keep-successful-logs": (0, 12),
    "slurm-delete-logfiles-older-than": (0, 12),
    "slurm-efficiency-report": (1, 5),
    "slurm-efficiency-report-path": (1, 5),
    "slurm-status-command": (2, 0, 1),
    "slurm-jobname-prefix": (2, 2),
    "slurm-array-jobs": (2, 6),
}


def dependency_lower_bound(name: str) -> tuple[int, ...]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(rf"{re.escape(name)}\s*[><=]", d)]
    return tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))


def test_the_plugin_bound_covers_every_option_the_profiles_use():
    bound = dependency_lower_bound("snakemake-executor-plugin-slurm")
    for profile in ("profiles/slurm", "tests/slurm_cluster/profile"):
        options = yaml.safe_load((REPO / profile / "config.yaml").read_text())
        used = [key for key in options if key.startswith("slurm-")]
        unknown = [key for key in used if key not in PLUGIN_OPTION_SINCE]
        assert not unknown, f"{profile}: add the plugin version of {unknown} to the table"
        too_new = {k: PLUGIN_OPTION_SINCE[k] for k in used if PLUGIN_OPTION_SINCE[k] > bound}
        assert not too_new, f"{profile} needs plugin {too_new}; pyproject allows {bound}"
    assert bound >= (2, 6)  # slurm-array-jobs in profiles/slurm


def test_array_jobs_name_rules_of_the_workflow():
    options = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    rules = set(
        re.findall(r"^\s*rule (\w+):", (REPO / "workflow/rules/data.smk").read_text(), re.M)
    )
    assert set(options["slurm-array-jobs"].replace(";", ",").split(",")) <= rules


def test_min_version_is_pyprojects_lower_bound():
    [version] = re.findall(r'^min_version\("([\d.]+)"\)', (REPO / "Snakefile").read_text(), re.M)
    assert tuple(int(x) for x in version.split(".")) == dependency_lower_bound("snakemake")
    # CI's bare environment dry-runs at this floor (tests/test_bare_env.py checks its version)
    floor = (REPO / "requirements/snakemake-floor.txt").read_text()
    assert re.findall(r"^snakemake==([\d.]+)$", floor, re.M) == [version]
    # before 9.20.0 a profile's runtime was read as seconds (#4053): CI's bare dry-run shows it
    assert tuple(map(int, version.split("."))) >= (9, 20, 0)


def test_the_license_is_the_one_pyproject_names():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000  # the full text


def test_the_catalog_usage_file():
    usage = yaml.safe_load((REPO / ".snakemake-workflow-catalog.yml").read_text())["usage"]
    assert usage["mandatory-flags"]["flags"] == "--profile profiles/slurm"
    assert usage["software-stack-deployment"] == {
        "conda": True,
        "apptainer": True,
        "apptainer+conda": False,
    }
    assert usage["report"] is True
    for path in ("workflow/envs/imagenet-ddp.yaml", "workflow/envs/imagenet-ddp.def"):
        assert (REPO / path).is_file()


def test_every_rule_runs_the_imagenet_ddp_command():
    """A rule's job is one `imagenet-ddp <stage>` (cli.py): no `python -m` entry points beside
    it, whose interpreter could differ from the command's environment."""
    text = "".join(p.read_text() for p in sorted((REPO / "workflow/rules").glob("*.smk")))
    shells = re.findall(r"^\s*shell:\n((?:\s+(?:f?[\"'][^\n]*[\"']|#[^\n]*)\n)+)", text, re.M)
    assert len(shells) == len(re.findall(r"^\s*shell:", text, re.M)) >= 10
    for shell in shells:
        assert re.search(r"\bimagenet-ddp [a-z-]+ ", shell), shell
        assert "python" not in shell, shell


# Names of Snakemake's, the plugin's and torch's private state: each is a break at their next
# release (issue 41). The workflow reads Snakemake's public settings only and writes none.
PRIVATE = re.compile(
    r"_parsed_(default|overwrite)_resources|RECORD_FORMAT_VERSION|\.snakemake/metadata"
    r"|is_main_process|torch\.utils\._|rule_\w+_wildcards|\bsqueue --me\b"
)


def test_no_private_state_of_snakemake_the_plugin_or_torch_is_used():
    sources = [REPO / "Snakefile", *sorted((REPO / "workflow").rglob("*.smk"))]
    sources += sorted((REPO / "src").rglob("*.py"))
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert not found, "\n".join(found)
