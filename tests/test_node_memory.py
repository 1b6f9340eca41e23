"""Memory per node, checked at the dry-run against the train job's mem_mb
(imagenet_ddp.settings.node_memory): its arithmetic, and real Snakemake dry-runs in a temporary
copy."""

from __future__ import annotations

import json
import math

import pytest

from imagenet_ddp.data.prepared_layout import MANIFEST_FORMAT
from imagenet_ddp.settings.node_memory import (
    COMPILE_WORKER_MB,
    CUDA_RANK_EXTRA_MB,
    DALI_RANK_MB,
    DALI_WORKER_MB,
    FORKSERVER_MB,
    LOADER_WORKER_MB,
    PREPARED_SAMPLE_BYTES_AT_256,
    RANK_MB,
    DataSizes,
    estimate_mb,
    memory_problem,
    prepared_sample_bytes,
)
from tests.workflow_helpers import copy_workflow, snakemake

# The case: 8 ranks per node, 15 workers each (cpus_per_task 16), batch 256 at 224.
NODE = {
    "tasks_per_node": 8, "gpus_per_node": 8, "cpus_per_task": 16, "workers": "auto",
    "batch_size": 256, "crop_size": 224, "eval_crop_size": 0, "compile": False,
}  # fmt: skip


def test_the_estimate_adds_up_what_each_process_holds():
    batch = 256 * 3 * 224 * 224 / 2**20  # uint8 crops, MiB
    worker = LOADER_WORKER_MB + 4 * batch  # its own memory and 4 batches in flight
    per_rank = RANK_MB + FORKSERVER_MB + 15 * 2 * worker  # training and holdout loaders
    figures = estimate_mb(NODE)
    assert figures["measured"] == pytest.approx(8 * per_rank)
    assert figures["estimated"] == pytest.approx(8 * CUDA_RANK_EXTRA_MB)
    compiled = estimate_mb({**NODE, "compile": True})["estimated"]
    assert compiled == pytest.approx(8 * (CUDA_RANK_EXTRA_MB + 4 * COMPILE_WORKER_MB))
    cpu = estimate_mb({**NODE, "gpus_per_node": 0, "tasks_per_node": 2, "cpus_per_task": 1})
    assert cpu == {"measured": 2 * RANK_MB, "estimated": 0, "workers": 0}  # no forkserver


def test_a_dali_run_is_charged_its_spawned_workers_not_a_forkserver_nor_holdout_workers():
    """loader: dali: DALI's rank, its external source's spawned workers (each importing torch
    itself: ~10x a forked DataLoader worker's own memory), the shared memory of their batches'
    JPEGs, and no holdout workers (its DALI pipeline has none). The issue's node, 8 x 15
    workers: ~73 GB, above the pytorch path's charge for the same run."""
    from imagenet_ddp.settings.node_memory import DataSizes

    dali = {**NODE, "loader": "dali"}
    shared = (15 + 2) * 256 * PREPARED_SAMPLE_BYTES_AT_256 / 2**20
    figures = estimate_mb(dali)
    assert figures["measured"] == pytest.approx(8 * (DALI_RANK_MB + 15 * DALI_WORKER_MB + shared))
    assert figures["estimated"] == pytest.approx(8 * CUDA_RANK_EXTRA_MB)
    assert 72_000 < figures["measured"] < 75_000  # the pytorch path: 57 GB
    assert figures["measured"] > estimate_mb(NODE)["measured"]  # what it used to be charged
    # the dataset's arrays: in the rank (both sets) and each worker (the training set's only)
    data = DataSizes(train_images=1_000_000, holdout_images=50_000)
    arrays = estimate_mb(dali, data)["measured"] - figures["measured"]
    assert arrays == pytest.approx(8 * (16 * 1_000_000 + 50_000) * 40 / 2**20)
    # workers 0 (cpus_per_task 1): the rank's own thread draws, no worker, no shared memory
    alone = estimate_mb({**dali, "cpus_per_task": 1, "gpus_per_node": 0})
    assert alone == {"measured": 8 * DALI_RANK_MB, "estimated": 0, "workers": 0}
    refusal, _ = memory_problem("d", dali, 57_000)  # what fitted a pytorch run's charge
    assert "is below the" in refusal and "15 loader worker(s) each hold" in refusal


def test_a_dali_runs_shared_memory_holds_its_jpegs_at_the_prepared_short_side(tmp_path):
    """DALI's workers hand over a batch's JPEGs: charged at a prepared sample's bytes, by pixels
    at prepare.short_side at the dry-run (jobs.site) until the copy the prepare rule's manifest
    names exists at that short side, then at its own bytes per sample, as the staged copy's on
    the node (data.stage.ram_copy_problem); nothing changes for the pytorch path."""
    from imagenet_ddp.jobs.site import memory_problems
    from imagenet_ddp.settings.run_checks import split_sizes

    dali = {**NODE, "loader": "dali"}

    def measured(sample_bytes, run=dali):
        return estimate_mb(run, DataSizes(sample_bytes=sample_bytes))["measured"]

    assert prepared_sample_bytes(256) == PREPARED_SAMPLE_BYTES_AT_256
    assert prepared_sample_bytes(512) == 4 * PREPARED_SAMPLE_BYTES_AT_256
    more = measured(prepared_sample_bytes(512)) - measured(prepared_sample_bytes(256))
    assert more == pytest.approx(8 * (15 + 2) * 256 * 3 * PREPARED_SAMPLE_BYTES_AT_256 / 2**20)
    assert measured(10**6, NODE) == measured(1, NODE)
    # the dry-run's check: a node that holds the run at short side 256 but not at 512
    # scratch_dir "" (the schema's default, the node's $TMPDIR): no RAM copy at the dry-run,
    # whatever filesystem this machine's temporary directory is on
    config = {"split": {"holdout_fraction": 0.02}, "demo": {"enabled": False},
              "stage": {"scratch_dir": ""},
              "prepare": {"dir": "unused", "short_side": 256}}  # fmt: skip
    train, holdout, _ = split_sizes(config)  # the full train set's
    fits = estimate_mb(dali, DataSizes(train, holdout))["measured"] + 100
    assert memory_problems({"d": dali}, config, fits)[0] == []
    config["prepare"]["short_side"] = 512
    refused = memory_problems({"d": dali}, config, fits)[0]
    assert len(refused) == 1 and "run 'd'" in refused[0], refused
    # the prepared copy at 512, its JPEGs as small as the formula's at 256: it fits again
    copy = tmp_path / "prepared/train-abc"
    copy.mkdir(parents=True)
    info = {"short_side": 512, "num_samples": 1000, "total_bytes": 1000 * 42_700}
    (copy / "prepared.json").write_text(json.dumps(info))
    manifest = tmp_path / "train.json"
    manifest.write_text(json.dumps({"format": MANIFEST_FORMAT, "dir": str(copy)}))
    assert memory_problems({"d": dali}, config, fits, manifest)[0] == []
    config["prepare"]["short_side"] = 448  # another short side: prepare makes a new copy
    assert memory_problems({"d": dali}, config, fits, manifest)[0] != []
    assert memory_problems({"d": dali}, config, fits, tmp_path / "none.json")[0] != []


def test_measured_too_much_is_refused_estimated_too_much_warned():
    figures = estimate_mb(NODE)
    measured, total = figures["measured"], figures["measured"] + figures["estimated"]
    refusal, warning = memory_problem("r", NODE, measured - 1)
    assert warning is None and refusal.startswith(
        f"config.yaml: run 'r': train's mem_mb {measured - 1:.0f} per node is below the "
        f"{measured:.0f} MiB that 8 rank(s) per node with 15 loader worker(s) each hold"
    )
    assert "raise mem_mb to" in refusal and "\n" not in refusal
    refusal, warning = memory_problem("r", NODE, total - 1)
    assert refusal == "" and "is below the estimated need (CUDA estimated)" in warning.kind
    assert warning.detail == f"~{total:.0f} MiB: mem_mb {math.ceil(total / 1000) * 1000}"
    _, warning = memory_problem("r", {**NODE, "compile": True}, total + 1)
    assert "estimated need (CUDA and compile workers estimated)" in warning.kind
    assert memory_problem("r", NODE, total) == ("", None)
    assert memory_problem("r", NODE, None) == ("", None)  # no mem_mb: nothing to check
    assert memory_problem("r", NODE, 128_000) == ("", None)  # the profile's 128 GB fits


# A site's mount table (psutil's, faked): /dev/shm a tmpfs, the workdir on Lustre.
MOUNTS = [
    ("/dev/sda1", "/", "ext4", "rw,relatime"),
    ("tmpfs", "/dev/shm", "tmpfs", "rw,nosuid,nodev"),
    ("10.0.0.1@o2ib:/fs", "/lustre", "lustre", "rw,relatime"),
    ("/dev/sdb1", "/local/scratch", "xfs", "rw,relatime"),
]


def test_a_2x8_v2_preset_run_staging_to_dev_shm_at_128_gb_is_warned_with_its_numbers(
    tmp_path, monkeypatch
):
    """Issue 36: the tmpfs copy (~52 GB at short_side 256) and each loader worker's dataset
    arrays (46 MB at the full train split, 120 workers per node) count against mem_mb."""

    from imagenet_ddp.data.stage import scratch_in_ram
    from imagenet_ddp.settings.node_memory import DATASET_BYTES_PER_SAMPLE, DataSizes
    from imagenet_ddp.settings.presets import preset
    from imagenet_ddp.settings.run_checks import ILSVRC2012_TRAIN_IMAGES
    from tests.test_stage import fake_mounts

    fake_mounts(monkeypatch, [], base=MOUNTS)
    holdout = 128_117
    train = ILSVRC2012_TRAIN_IMAGES - holdout
    assert train * DATASET_BYTES_PER_SAMPLE == pytest.approx(46e6, rel=0.01)  # per worker
    # not prepared yet: estimated from the images
    size, measured, where = scratch_in_ram("/dev/shm", None, train + holdout, 256)
    assert not measured and size == pytest.approx(train_set_mib := 1_281_167 * 42_700 / 2**20)
    assert where.startswith("stage.scratch_dir '/dev/shm' is tmpfs; estimated as 1281167 images")
    assert scratch_in_ram("/local/scratch/me", None, 10, 256) is None  # a disk
    assert scratch_in_ram("", None, 10, 256) is None  # the job's $TMPDIR: unknown
    info = {"total_bytes": 54_700 * 2**20}
    assert scratch_in_ram("/dev/shm/x", info, 10, 256)[:2] == (54_700, True)

    run = {**NODE, "cpus_per_task": 16, **preset("torchvision-resnet50-v2")}
    on_disk = DataSizes(train, holdout)
    in_ram = DataSizes(train, holdout, size, False, where)
    arrays = 8 * 16 * (train + holdout) * DATASET_BYTES_PER_SAMPLE / 2**20  # rank + 15 workers
    assert estimate_mb(run, on_disk)["measured"] == pytest.approx(
        estimate_mb(run)["measured"] + arrays
    )
    assert memory_problem("r", run, 128_000, on_disk) == ("", None)  # fits on a local disk
    refusal, warning = memory_problem("r", run, 128_000, in_ram)
    total = estimate_mb(run, on_disk)["measured"] + 8 * CUDA_RANK_EXTRA_MB + train_set_mib
    assert refusal == "" and str(warning) == (
        f"config.yaml: run 'r' (~{total:.0f} MiB: mem_mb 135000): train's mem_mb 128000 per node "
        "leaves under 15% free beyond the estimate (CUDA and the RAM copy estimated) with the "
        "train copy in RAM (stage.scratch_dir '/dev/shm' is tmpfs; estimated as 1281167 images "
        "x 42.7 kB at prepare.short_side 256): raise it or stage on a node-local disk "
        "(docs/configuration.md, memory per node)"
    ), warning
    # the prepared copy's own size is a measured figure: above mem_mb, refused
    copied = DataSizes(train, holdout, 100_000, True, "its size")
    refusal, _ = memory_problem("r", run, 128_000, copied)
    assert refusal.startswith("config.yaml: run 'r': train's mem_mb 128000 per node is below")
    assert "and the 100000 MiB train copy staged in RAM (its size) hold (measured" in refusal


GPU_RUN = {"name": "gpu", "gpus_per_node": 2, "tasks_per_node": 2, "workers": 2}
CPU_RUN = {"name": "cpu", "tasks_per_node": 2}


def dry_run(workdir, *args):
    result = snakemake(workdir, "-n", *args, check=False)
    return result.returncode, result.stdout + result.stderr


def test_the_dry_run_checks_trains_mem_mb_wherever_it_is_set(tmp_path):
    """Real Snakemake: train's mem_mb from set-resources (a number, `mem`, `N * attempt`) or
    default-resources; the workflow's own profile fits; a local run sets none."""
    from imagenet_ddp.settings.node_memory import DataSizes
    from imagenet_ddp.settings.run_checks import split_sizes
    from tests.workflow_helpers import read_config, with_schema_defaults, write_config

    workdir = copy_workflow(tmp_path / "wf", runs=[GPU_RUN, CPU_RUN])
    sizes = DataSizes(*split_sizes(with_schema_defaults(read_config(workdir)))[:2])
    gpu = estimate_mb({**_resolved(), **GPU_RUN}, sizes)
    code, out = dry_run(workdir)
    assert code == 0 and "mem_mb" not in out  # nothing sets it: not checked
    code, out = dry_run(workdir, "--set-resources", "train:mem_mb=2000")
    lines = [line for line in out.splitlines() if line.startswith("config.yaml: ")]
    assert code != 0 and lines == [
        f"config.yaml: run 'gpu': train's mem_mb 2000 per node is below the "
        f"{gpu['measured']:.0f} MiB that 2 rank(s) per node with 2 loader worker(s) each hold "
        "(measured figures); raise mem_mb to 8000 (set-resources train: mem_mb), or lower "
        "tasks_per_node, workers or batch_size (docs/configuration.md, memory per node)"
    ]
    assert "Traceback" not in out and "Job stats" not in out
    code, out = dry_run(workdir, "--set-resources", "train:mem_mb=5000")
    assert code == 0 and "warning: config.yaml: run 'gpu' (~" in out
    assert "train's mem_mb 5000 per node is below the estimated need" in out
    memory = "\n".join(line for line in out.splitlines() if "mem_mb" in line)
    assert "estimated need (CUDA estimated)" in out and "run 'cpu'" not in memory
    code, out = dry_run(workdir, "--set-resources", "train:mem=8G")
    # the dry-run's other warnings (warm-up, the reference's defaults, few steps) are not memory's
    warnings = [line for line in out.splitlines() if "warning" in line and "mem" in line]
    assert code == 0 and not warnings, warnings
    code, out = dry_run(workdir, "--default-resources", "mem_mb=1000*attempt")
    assert code != 0 and "run 'cpu': train's mem_mb 1000 per node" in out
    code, out = dry_run(workdir, "--profile", "profiles/slurm")  # 128000 per node
    assert code == 0 and "mem_mb 128000 per node" not in out
    # staged to /dev/shm (a tmpfs here, as on the nodes): the copy counts, with headroom
    config = read_config(workdir)
    config["stage"] = {"scratch_dir": "/dev/shm/imagenet-ddp-test"}
    write_config(workdir, config)
    code, out = dry_run(
        workdir, "--set-resources", f"train:mem_mb={gpu['measured'] + gpu['estimated'] + 300:.0f}"
    )
    assert code == 0 and "warning: config.yaml: run 'gpu' (~" in out, out[-2000:]
    assert "train's mem_mb" in out and "leaves under 15% free beyond the estimate" in out
    assert "train copy in RAM (stage.scratch_dir '/dev/shm/imagenet-ddp-test' is tmpfs" in out


def _resolved() -> dict:
    """The tiny test config's train settings as the estimate reads them."""
    from tests.workflow_helpers import TINY_CONFIG_OVERRIDES

    return {
        "cpus_per_task": 1, "eval_crop_size": 0, "compile": False,
        **TINY_CONFIG_OVERRIDES["train_defaults_update"],
    }  # fmt: skip
