"""What the workflow's parse checks of where its jobs run, and the SLURM shape of each train
job. Torch-free: it runs while Snakemake parses the rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from imagenet_ddp.data.stage import configured_scratch_problem, prepared_info, scratch_in_ram
from imagenet_ddp.jobs.attempts import nodes_ahead, refusal_ahead
from imagenet_ddp.jobs.launchers import launcher_problem
from imagenet_ddp.settings.geometry import on_nodes, slurm_resources
from imagenet_ddp.settings.node_memory import (
    DataSizes,
    node_memory_problems,
    prepared_sample_bytes,
)
from imagenet_ddp.settings.run_checks import (
    container_problem,
    optional_component_problems,
    split_sizes,
)


def site_problems(
    config: Mapping, runs: Mapping[str, Mapping], *, apptainer: bool, conda: bool
) -> list[str]:
    """What would fail every job of the site, one line each: a local image that is missing
    (--sdm apptainer), a component a run asks for that the jobs' environment lacks, a scratch
    dir every node shares, an unknown launcher."""
    deployment = "apptainer" if apptainer else "conda" if conda else ""
    launcher = launcher_problem(config["execution"]["launcher"])
    problems = [
        container_problem(config["container"]["image"], apptainer=apptainer),
        *optional_component_problems(runs, deployment=deployment),
        configured_scratch_problem(config["stage"]["scratch_dir"]),
        launcher and f"config.yaml: {launcher}",
    ]
    return [p for p in problems if p]


def stop_warning_problem(runtime_minutes: float | None, slurm_extra: str) -> str | None:
    """A train time limit (minutes) within the lead of its ``--signal`` warning (``slurm_extra``
    as train submits it): slurmctld sends it up to 60 s early (its 30 s check, sbatch(1)), so
    each job would be told to stop as it starts, allocation after allocation."""
    leads = re.findall(r"--signal[= ](?:[RB]+:)?\w+(?:@(\d+))?", slurm_extra or "")
    if runtime_minutes is None or not leads:
        return None
    lead = int(leads[-1] or 60)  # sbatch's last --signal counts; without @N, 60 s
    if runtime_minutes * 60 > lead + 60:
        return None
    return (
        f"train's runtime ({runtime_minutes:g} min) is within its stop warning (--signal "
        f"...@{lead}: sent up to {lead + 60} s before the time limit), so each job would be "
        "told to stop as it starts: raise train's runtime (set-resources train: runtime) or "
        "lower the seconds of execution.stop_signal"
    )


def memory_problems(
    runs: Mapping[str, Mapping], config: Mapping, mem_mb: float | None, manifest=None
) -> tuple[list[str], list[str]]:
    """(refusals, warnings) of each run's training job against train's ``mem_mb`` per node
    (settings.node_memory), with the split's sizes from the config and the train copy staged
    in RAM where stage.scratch_dir is a tmpfs here (data.stage.scratch_in_ram): the prepared
    copy's own sizes where the prepare rule's ``manifest`` names one at prepare.short_side."""
    train, holdout, _ = split_sizes(config)
    short_side = config["prepare"]["short_side"]
    info = prepared_info(manifest, short_side) if manifest else None
    in_ram = scratch_in_ram(config["stage"]["scratch_dir"], info, train + holdout, short_side)
    sample_bytes = prepared_sample_bytes(short_side)
    if info and info.get("num_samples"):  # what DALI's workers hand over: its JPEGs
        sample_bytes = info["total_bytes"] / info["num_samples"]
    data = DataSizes(train, holdout, *(in_ram or ()), sample_bytes=sample_bytes)
    return node_memory_problems(runs, mem_mb, data)


# A retry that its job will refuse (max_allocations reached, or two attempts without progress)
# only prints why and exits: Snakemake's retries are one rule-wide count, so it is still
# submitted, but as one task on one node without GPUs.
REFUSED_SHAPE = {"nodes": 1, "cpus_per_task": 1, "tasks_per_node": None, "tasks": None,
                 "gres": None, "mpi": None}  # fmt: skip


def train_resources(
    run: Mapping[str, Any], settings: Mapping, checkpoint_root: str, attempt: int, since: float
) -> dict[str, Any]:
    """The SLURM resources of a train job of ``run`` (``settings``: as the rank gets them), from
    the attempt record: its shape on the node count this submission asks for
    (attempts.nodes_ahead), or :data:`REFUSED_SHAPE` for a retry that will refuse."""
    if attempt > 1 and refusal_ahead(checkpoint_root, settings, attempt):
        return REFUSED_SHAPE
    shaped = on_nodes(run, nodes_ahead(checkpoint_root, settings, attempt, since))
    return {**slurm_resources(shaped), "nodes": shaped["nodes"],
            "cpus_per_task": shaped["cpus_per_task"]}  # fmt: skip


def launch_prefix(rule: str, given: Any) -> tuple[str, str | None]:
    """(the command that starts a job's ranks, a problem): the rule's `mpi` resource as given
    (Snakemake's launch prefix, `--set-resources train:mpi="srun --mpi=pmix"`; quotes
    dropped), plain `srun` where none is set."""
    prefix = given.strip("'\"") if isinstance(given, str) and given.strip("'\" ") else "srun"
    if prefix.split()[0].rsplit("/", 1)[-1] != "srun":
        return prefix, (f"--set-resources {rule}:mpi={prefix!r}: the ranks are started with srun;"
                        " give srun and its flags, e.g. 'srun --mpi=pmix'")  # fmt: skip
    return prefix, None
