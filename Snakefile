# ImageNet (ILSVRC2012) classifiers trained with multi-node PyTorch DDP, measured and reported.
#   snakemake --profile profiles/local      # one machine
#   snakemake --profile profiles/slurm      # a SLURM cluster
# Review first: add -n (dry-run) to see every job and its resources.

import os
import signal
import sys

from snakemake.utils import min_version

# pyproject.toml's range (snakemake>=9.20.0,<10): 9.16.3 to 9.19 read a profile's `runtime:
# 1440` as seconds (train's -t: 24 min; fixed in 9.20.0, snakemake #4053). CI runs the pinned
# 9.27.1, and a dry-run and --lint at this floor (.ci/run's .venv-bare, tests/test_bare_env.py).
min_version("9.20.0")

# What this Snakemake process itself needs, here because no job's command can do it for it:
# Inside a SLURM job a warning signal (profiles/slurm: --signal=USR1@300) reaches every process
# of every step but the batch step, this Snakemake included when it runs a one-rank job in the
# executor's own step; by default it would end Snakemake and with it the launcher. The ranks
# handle it (checkpoint, exit 75).
if "SLURM_JOB_ID" in os.environ:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

# Jobs call the `imagenet-ddp` command of the environment that runs Snakemake (also inside a
# SLURM job, where the jobstep re-reads this file), even when that environment is not activated.
os.environ["PATH"] = os.pathsep.join(
    [os.path.dirname(sys.executable), os.environ["PATH"]]
)


# This workflow's own folder, the clone where another workflow uses it as a `module` (whose
# workflow.basedir is that workflow's folder: docs/cluster.md "As a module"): its files are read
# relative to it, and the conda env file's pip arguments name it (workflow/envs/imagenet-ddp.yaml:
# Snakemake copies that file into its conda prefix, where a relative path would not resolve).
if not workflow.current_basedir.is_local:
    sys.exit(
        f"imagenet-ddp as a module: {workflow.current_basedir} is not a local folder; clone the "
        "workflow and name its Snakefile by path (module ...: snakefile: '<clone>/Snakefile')"
    )
os.environ["IMAGENET_DDP_ROOT"] = str(workflow.current_basedir)


envvars:
    "PATH",
    "IMAGENET_DDP_ROOT",


configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


# This Snakemake's heartbeat, for its train jobs to see whether it still runs when they finish:
# one that finishes after it died delivers nothing, and the next invocation's rerun of it writes
# the outputs from its final checkpoint, not trained again (jobs.holders; docs/reliability.md).
onstart:
    watch_invocation(CHECKPOINT_DIR)


onsuccess:
    stop_watching()


onerror:
    stop_watching()


rule all:
    """Every run trained, evaluated, tabulated and plotted."""
    input:
        REPORT_TARGETS,
        VERIFY_REPORT,  # what trains waits for it (data_content); a rerun of it alone, no more
        # every run's rerun keys: a changed setting or data content is a missing key, which
        # Snakemake plans under every trigger set (common.smk key_files)
        key_files,
        # every pruned sweep's rung decisions: made again when a rung's figures change
        PRUNE_DECISIONS,
