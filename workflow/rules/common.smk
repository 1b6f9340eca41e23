import json
import shlex
import sys

from snakemake.utils import validate


validate(config, "../schemas/config.schema.yaml")

# The rules call the package through the interpreter that runs Snakemake, so a job finds the
# same environment locally and inside a SLURM job without relying on PATH.
IMAGENET_DDP = f"{shlex.quote(sys.executable)} -m imagenet_ddp.cli"

RUN_KEYS_NOT_FOR_TRAINING = {"nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node"}


def _runs():
    runs = {}
    for entry in config["runs"]:
        if entry["name"] in runs:
            raise ValueError(
                f"config.yaml: run name {entry['name']!r} appears twice under 'runs'; "
                "give every run a unique name"
            )
        runs[entry["name"]] = {**config["train_defaults"], **entry}
    return runs


RUNS = _runs()


def data_dir():
    """The directory holding the ILSVRC2012 archives (the generated demo set if enabled)."""
    if config.get("demo", {}).get("enabled", False):
        return "resources/demo/ILSVRC2012"
    return config["data"]["dir"]


ARCHIVES = {
    "train": "ILSVRC2012_img_train.tar",
    "val": "ILSVRC2012_img_val.tar",
    "devkit": "ILSVRC2012_devkit_t12.tar.gz",
}


def archive_paths():
    return {key: f"{data_dir()}/{name}" for key, name in ARCHIVES.items()}


def run_settings(wildcards):
    return RUNS[wildcards.run]


def run_training_json(wildcards):
    """The run's training settings (everything but its geometry), as the worker's JSON."""
    settings = {
        k: v for k, v in RUNS[wildcards.run].items() if k not in RUN_KEYS_NOT_FOR_TRAINING
    }
    settings["run"] = settings.pop("name")
    return json.dumps(settings, sort_keys=True)


def run_geometry(key):
    return lambda wildcards: RUNS[wildcards.run][key]


def run_dirs():
    return [f"results/runs/{name}" for name in RUNS]


def _execution_args():
    """Where and how training runs. Not params: moving a run to another scratch dir or
    launcher does not change what it computes, so it must not trigger a retrain."""
    execution = config.get("execution", {})
    stage = config.get("stage", {})
    args = [
        "--launcher", execution.get("launcher", "local"),
        "--scratch-dir", stage.get("scratch_dir", "scratch"),
        "--stage-verify", stage.get("verify", "size"),
        "--cleanup" if stage.get("cleanup", True) else "--no-cleanup",
        "--srun-extra", execution.get("srun_extra", ""),
    ]
    return shlex.join(args)


TRAIN_EXECUTION_ARGS = _execution_args()
CHECKPOINT_DIR = config.get("execution", {}).get("checkpoint_dir", "results/checkpoints")
