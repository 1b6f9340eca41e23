"""The conda env, the Apptainer image and CI install the same pinned versions.

Neither conda nor apptainer runs here, so these tests read the files: every environment must
install through requirements/constraints.txt, pin nothing that disagrees with it, use the same
Python, and every package the project depends on must be pinned there.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ENVS = REPO / "workflow/envs"
CONSTRAINTS = REPO / "requirements/constraints.txt"
DEF_FILE = ENVS / "imagenet-ddp.def"


def _name(requirement: str) -> str:
    """PEP 503 normalized distribution name of a requirement string."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[_name(name)] = version.strip()
    return out


def python_minor_of_ci() -> str:
    return re.search(r"Python (\d+\.\d+)", CONSTRAINTS.read_text()).group(1)


def test_every_dependency_is_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    missing = sorted({_name(r) for r in wanted} - set(pins()))
    assert not missing, f"pin these in requirements/constraints.txt: {missing}"


TEST_TOOLS = {"pytest", "pytest-xdist", "pytest-timeout", "execnet", "ruff", "snakefmt",
              "webdataset", "braceexpand", "import-linter", "grimp"}  # fmt: skip


def _env_pip(env_file: Path = ENVS / "imagenet-ddp.yaml") -> list[str]:
    env = yaml.safe_load(env_file.read_text())
    return next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))


@pytest.mark.parametrize("env_file", sorted(ENVS.glob("*.yaml")), ids=lambda p: p.name)
def test_conda_env_holds_the_pins_and_not_the_packages_version(env_file):
    """Issue 41: the env file holds every pin of requirements/constraints.txt but the test
    tools, so a new pin is a new env (Snakemake hashes the file's text); the package is a copy
    of the workflow's folder, never editable. Issue 50: that hash is also the `software-env`
    rerun trigger, so the file holds no package version: its bytes are the same under a
    release that changes no pin, and `--sdm conda` reruns no finished job for it."""
    from imagenet_ddp import __version__

    env = yaml.safe_load(env_file.read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    python = next(d for d in conda if _name(d) == "python")
    assert python.split("=", 1)[1] == python_minor_of_ci(), python
    pip = _env_pip(env_file)
    pinned = {}
    for spec in pip:
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s,;]+)", spec)
        if match:
            pinned[_name(spec)] = match.group(2)
    assert pinned == {k: v for k, v in pins().items() if k not in TEST_TOOLS}
    assert not any(a.startswith(("-e", "--editable", "--constraint")) for a in pip), pip
    text = env_file.read_text()
    assert __version__ not in text and "imagenet-ddp 0" not in text
    # every byte of the file is one of these: nothing the package's version is derived into
    assert "__version__" not in text and "{" not in text.replace("${IMAGENET_DDP_ROOT}", "")


def test_conda_env_resolves_from_a_copy_in_another_prefix(tmp_path, monkeypatch):
    """`--sdm conda --conda-prefix ~/envs`: Snakemake copies the env file to
    <prefix>/<hash>.yaml (snakemake.deployment.conda Env.create) and conda writes its pip
    arguments into a requirements file beside that copy and runs pip there (conda_env's pip
    installer). pip's own parser, run there, finds the checkout: it is named through
    IMAGENET_DDP_ROOT, which the Snakefile sets to its own folder, never a path relative to
    the file."""
    from pip._internal.network.session import PipSession
    from pip._internal.req.req_file import parse_requirements

    snakefile = (REPO / "Snakefile").read_text()  # its own folder, a module's clone too
    assert 'os.environ["IMAGENET_DDP_ROOT"] = str(workflow.current_basedir)' in snakefile
    prefix = tmp_path / "site-envs"
    prefix.mkdir()
    copied = prefix / "0123abcd.yaml"
    shutil.copyfile(ENVS / "imagenet-ddp.yaml", copied)
    pip = _env_pip(copied)
    assert not any(".." in arg for arg in pip), pip  # relative to a file that gets copied
    requirements = prefix / "condaenv.test.requirements.txt"
    requirements.write_text("\n".join(pip))
    monkeypatch.chdir(prefix)
    monkeypatch.setenv("IMAGENET_DDP_ROOT", str(REPO))  # the Snakefile's folder
    parsed = list(parse_requirements(str(requirements), session=PipSession()))
    local = [p.requirement for p in parsed if not p.is_editable and p.requirement.startswith("/")]
    # the checkout, with the optional extras (test_every_optional_component_is_installed)
    assert [Path(re.sub(r"\[[^]]*\]$", "", e)).resolve() for e in local] == [REPO]
    assert not any(p.is_editable for p in parsed)


def test_apptainer_image_installs_through_the_constraints_on_the_same_python():
    text = DEF_FILE.read_text()
    base = re.search(r"^From:\s*python:(\d+\.\d+)", text, re.M)
    assert base and base.group(1) == python_minor_of_ci(), "base image's Python"
    copied = re.search(r"^\s*requirements/constraints.txt\s+(\S+)", text, re.M).group(1)
    assert re.search(rf"-c {re.escape(copied)}\b", text), "pip install must use -c <constraints>"
    assert not re.search(r"==\d", text), "pin versions in requirements/constraints.txt only"
    # torch.compile (inductor) needs a C compiler on the node, inside the image (issue 18).
    assert re.search(r"apt-get install .*\bgcc\b", text) and "gcc --version" in text


def test_image_has_the_verbs_libraries_nccl_needs_for_infiniband():
    """Without libibverbs and a provider for the HCA, NCCL falls back to TCP between nodes
    (issue 26). Only a real InfiniBand site shows NCCL using them (docs/proven.md)."""
    text = DEF_FILE.read_text()
    install = re.search(r"apt-get install (?:[^\n]*\\\n)*[^\n]*", text).group(0)
    for package in ("libibverbs1", "ibverbs-providers", "librdmacm1"):
        assert re.search(rf"\b{package}\b", install), package
    # %test fails the build where the library or the mlx5 provider's config is missing.
    test = text.split("%test", 1)[1].split("%labels", 1)[0]
    assert "libibverbs.so.1" in test and "/etc/libibverbs.d/mlx5.driver" in test


def test_profile_binds_what_srun_needs_inside_the_container():
    """The launcher calls srun inside the rule's container: the example binds its config, the
    munge socket, the directory of libslurmfull.so and the plugins, and libmunge; squeue and
    scontrol for a job that finds its run held (jobs.holders: requeued behind the holder). No
    rank needs scontrol (python-hostlist)."""
    text = (REPO / "profiles/slurm/config.yaml").read_text()
    args = re.search(r'^# apptainer-args: "([^"]*)"', text, re.M).group(1)
    binds = args.split("--bind ", 1)[1].split(",")
    needed = ("/etc/slurm", "/run/munge", "/usr/bin/srun", "/usr/bin/squeue", "/usr/bin/scontrol")
    for path in needed:
        assert path in binds, path
    assert any(b.endswith("slurm-wlm") or b.endswith("lib64/slurm") for b in binds), binds
    assert any("libmunge.so" in b for b in binds)


def test_every_rule_with_a_shell_names_its_conda_env_and_container():
    for smk in sorted((REPO / "workflow/rules").glob("*.smk")):
        for rule in re.split(r"^rule ", smk.read_text(), flags=re.M)[1:]:
            name = rule.split(":", 1)[0]
            if "\n    shell:" in rule:
                assert "\n    conda:" in rule and "\n    container:" in rule, f"{smk.name}: {name}"


def test_this_environment_has_the_pinned_versions():
    """What CI and the README install: catches a pin that was changed but not installed."""
    wrong = {}
    for name, version in pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # e.g. nvidia-ml-py where optional
        if installed != version:
            wrong[name] = (version, installed)
    assert not wrong, f"pinned vs installed: {wrong}"


FAKE_APPTAINER = """#!/bin/sh
# Test double (apptainer is not installed here): records the call, runs the command on the host.
if [ "$1" = "--version" ]; then echo "apptainer version 1.3.4"; exit 0; fi
echo "$*" >> "$FAKE_APPTAINER_LOG"
echo "runtime for srun tasks: $IMAGENET_DDP_CONTAINER_RUNTIME" >> "$FAKE_APPTAINER_LOG"
echo "args for srun tasks: $IMAGENET_DDP_CONTAINER_ARGS" >> "$FAKE_APPTAINER_LOG"
for last; do :; done
exec bash -c "$last"
"""


def test_with_sdm_apptainer_every_job_runs_in_the_configured_image(tmp_path, monkeypatch):
    import os

    from tests.workflow_helpers import copy_workflow, snakemake

    workdir = copy_workflow(tmp_path / "w")
    missing = snakemake(workdir, "-n", "--profile", "profiles/local", "--sdm", "apptainer",
                        check=False)  # fmt: skip
    assert missing.returncode != 0
    assert "config.yaml: container.image 'imagenet-ddp.sif' not found; build it with " in (
        missing.stdout + missing.stderr
    )
    (workdir / "imagenet-ddp.sif").write_bytes(b"")
    fake = tmp_path / "bin/apptainer"
    fake.parent.mkdir()
    fake.write_text(FAKE_APPTAINER)
    fake.chmod(0o755)
    log = tmp_path / "apptainer.log"
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_APPTAINER_LOG", str(log))
    snakemake(workdir, "--profile", "profiles/local", "--sdm", "apptainer",
              "--apptainer-args=--nv --bind /opt/site", "--until", "demo_data")  # fmt: skip
    call = log.read_text()
    assert call.startswith(f"exec --home {workdir} --nv --bind /opt/site ")
    # and its --apptainer-args, whose binds the srun tasks repeat (issue 51)
    assert "args for srun tasks: --nv --bind /opt/site\n" in call
    assert " imagenet-ddp.sif bash -c " in call and "imagenet-ddp demo-data" in call
    # apptainer from a dir of its own (as a module's): the container's environment carries
    # its absolute path, which the launcher's srun tasks run (jobs.container, issue 36)
    assert f"runtime for srun tasks: {fake}\n" in call
    assert (workdir / "resources/demo/ILSVRC2012/ILSVRC2012_img_train.tar").is_file()


def test_the_image_and_the_conda_env_hold_every_component_a_setting_can_ask_for():
    """Issue 36: a run with wandb_project set inside the image trained untracked ("W&B off").
    Every optional extra of the package is a setting's component; the image and the conda env
    install them all, and the image's %test imports each."""
    from imagenet_ddp.settings.run_checks import OPTIONAL_COMPONENTS

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"]) - {"test"}
    assert {extra for _, extra in OPTIONAL_COMPONENTS.values()} == extras
    text = DEF_FILE.read_text()
    installed = re.search(r'"/opt/imagenet-ddp\[([^\]]*)\]"', text)
    assert installed and set(installed.group(1).split(",")) == extras, "image"
    test = text.split("%test", 1)[1].split("%labels", 1)[0]
    imports = re.search(r'python -c "import ([^"]*)"\n', test.split("--help", 1)[1]).group(1)
    assert {module for module, _ in OPTIONAL_COMPONENTS.values()} <= set(imports.split(", "))
    package = next(a for a in _env_pip() if a.startswith("${IMAGENET_DDP_ROOT}"))
    assert set(re.search(r"\[([^\]]*)\]$", package).group(1).split(",")) == extras, "conda env"


def test_a_setting_whose_component_the_jobs_lack_is_refused_in_one_line():
    """Jobs in Snakemake's own environment (no --sdm): a run asking for W&B or MLflow where
    that environment lacks it is refused at the dry-run; in the image or the conda env
    (which hold every component) nothing is refused."""
    from imagenet_ddp.settings.run_checks import optional_component_problems

    runs = {"a": {"wandb_project": "p", "mlflow_uri": ""}, "b": {"mlflow_uri": "file:/m"}}
    missing = optional_component_problems(runs, deployment="", has_module=lambda m: False)
    assert missing == [
        "config.yaml: run 'a': wandb_project is set but wandb is not installed in the "
        "environment the jobs run in (this Snakemake's): install it (pip install "
        "'imagenet-ddp[wandb]'), use --sdm apptainer or conda, or unset wandb_project",
        "config.yaml: run 'b': mlflow_uri is set but mlflow is not installed in the "
        "environment the jobs run in (this Snakemake's): install it (pip install "
        "'imagenet-ddp[mlflow]'), use --sdm apptainer or conda, or unset mlflow_uri",
    ]
    assert optional_component_problems(runs, deployment="") == []  # installed here
    for sdm in ("apptainer", "conda"):
        assert optional_component_problems(runs, deployment=sdm, has_module=lambda m: 0) == []


BLOCK_WANDB = """\
import sys
class Absent:  # wandb as if not installed in the environment Snakemake (and its jobs) run in
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "wandb":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Absent())
from snakemake.cli import main
sys.argv[0] = "snakemake"
main()
"""


def test_the_dry_run_refuses_wandb_project_where_the_jobs_environment_lacks_wandb(tmp_path):
    """Real Snakemake, wandb unimportable in its environment: a run with wandb_project is
    refused in one line without --sdm; with --sdm apptainer (the image has it) it is not."""
    import os
    import subprocess
    import sys

    from tests.workflow_helpers import copy_workflow

    workdir = copy_workflow(tmp_path / "w", runs=[{"name": "tracked", "wandb_project": "p"}])
    (workdir / "imagenet-ddp.sif").write_bytes(b"")

    fake = tmp_path / "bin/apptainer"  # --sdm apptainer needs one on PATH, even for -n
    fake.parent.mkdir()
    fake.write_text(FAKE_APPTAINER)
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}

    def dry_run(*args):
        out = subprocess.run([sys.executable, "-c", BLOCK_WANDB, "-n", *args], cwd=workdir,
                             env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        return out.returncode, out.stdout + out.stderr

    code, out = dry_run()
    assert (
        code != 0
        and (
            "config.yaml: run 'tracked': wandb_project is set but wandb is not installed in the "
            "environment the jobs run in (this Snakemake's): install it (pip install "
            "'imagenet-ddp[wandb]'), use --sdm apptainer or conda, or unset wandb_project"
        )
        in out.splitlines()
    ), out[-2000:]
    code, out = dry_run("--sdm", "apptainer")
    assert code == 0, out[-2000:]
