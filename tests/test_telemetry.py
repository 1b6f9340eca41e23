"""NVML sampler (driven by a fake NVML module: no GPU here), the cost block, the monitor."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from imagenet_ddp.monitoring.cost import cost_block
from imagenet_ddp.monitoring.monitor import RunMonitor
from imagenet_ddp.monitoring.telemetry import GpuSampler


class FakeNvml:
    """What pynvml offers, for ``gpus`` devices; each read advances the device's counters."""

    class NVMLError_LibraryNotFound(Exception):  # noqa: N801 (pynvml's own naming)
        pass

    def __init__(self, gpus=2, *, energy=True, fail_init=False, watts=(300.0, 200.0)):
        self.count, self.energy, self.fail_init, self.watts = gpus, energy, fail_init, watts
        self.reads = 0
        self.shut = False
        self.energy_mj = [1_000_000] * gpus

    def nvmlInit(self):  # noqa: N802
        if self.fail_init:
            raise self.NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def nvmlShutdown(self):  # noqa: N802
        self.shut = True

    def nvmlDeviceGetCount(self):  # noqa: N802
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return i

    def nvmlDeviceGetUUID(self, h):  # noqa: N802
        return f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        self.reads += 1
        return SimpleNamespace(gpu=90 if h == 0 else 70, memory=50)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return SimpleNamespace(used=(h + 1) * 10**9 + self.reads, total=80 * 10**9)

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        return int(self.watts[h] * 1000)  # mW

    def nvmlDeviceGetTotalEnergyConsumption(self, h):  # noqa: N802
        if not self.energy:
            raise RuntimeError("not supported")
        self.energy_mj[h] += 3_600_000  # 1 Wh per read
        return self.energy_mj[h]


def test_sampler_summarizes_utilization_memory_power_and_energy_counter():
    nvml = FakeNvml(gpus=2)
    sampler = GpuSampler(gpus=8, interval=0.01, nvml=nvml).start()
    time.sleep(0.1)
    latest = sampler.latest()
    summary = sampler.stop()
    assert nvml.shut
    assert summary["available"] and summary["reason"] is None
    assert summary["gpus"] == 2  # NVML lists 2: fewer than gpus_per_node
    assert summary["samples"] >= 3
    assert summary["mean_utilization_percent"] == pytest.approx(80.0)
    assert summary["mean_power_watts"] == pytest.approx(500.0)
    peak = summary["peak_memory_gb_per_gpu"]
    assert 1.0 < peak[0] < 1.01 and 2.0 < peak[1] < 2.01
    # Counter read once at start and once at stop on each of 2 GPUs: 1 Wh each.
    assert summary["energy_kwh"] == pytest.approx(2 * 3.6e6 / 1000 / 3.6e6)
    assert summary["energy_source"] == "nvml_energy_counter"
    assert latest == {
        "utilization_percent": 80.0,
        "memory_used_gb": pytest.approx(3.0, abs=0.01),
        "power_watts": 500.0,
    }
    assert sampler.stop() == summary  # idempotent


def test_the_jobs_gpus_are_found_by_uuid_not_by_index():
    """A node shared with another job: NVML lists 4 GPUs, this job's ranks use the last two
    (CUDA_VISIBLE_DEVICES=2,3, which NVML ignores); torch names them without NVML's prefix."""
    nvml = FakeNvml(gpus=4, watts=(100.0, 200.0, 300.0, 400.0))
    uuids = ["00000003-aaaa-bbbb-cccc-dddddddddddd", "00000002-AAAA-bbbb-cccc-dddddddddddd"]
    summary = GpuSampler(gpus=2, interval=10, nvml=nvml, uuids=uuids).start().stop()
    assert summary["mean_power_watts"] == pytest.approx(700.0)  # GPUs 3 and 2, not 0 and 1
    peak = summary["peak_memory_gb_per_gpu"]
    assert 4.0 < peak[0] < 4.01 and 3.0 < peak[1] < 3.01  # in the ranks' order
    other = GpuSampler(gpus=1, nvml=FakeNvml(gpus=2), uuids=["ffffffff-0"]).start().stop()
    assert other["available"] is False
    assert other["reason"] == (
        "NVML could open none of this node's GPUs: ffffffff-0 (LookupError: not among the GPUs "
        "NVML could open)"
    )


class NVMLError_NoPermission(Exception):  # noqa: N801 (pynvml's naming)
    pass


class NVMLError_NotSupported(Exception):  # noqa: N801
    pass


def test_gpus_nvml_cannot_open_are_named_and_the_others_sampled():
    """Per-task device cgroups: rank 0's NVML lists the node's 4 GPUs but may open only its
    own; the node's ranks use GPUs 0 and 2. GPU 2 refuses: GPU 0 is sampled, GPU 2 named."""
    nvml = FakeNvml(gpus=4, watts=(100.0, 200.0, 300.0, 400.0))
    opened = nvml.nvmlDeviceGetHandleByIndex

    def open_own(i):
        if i != 0:
            raise NVMLError_NoPermission("Insufficient Permissions")
        return opened(i)

    nvml.nvmlDeviceGetHandleByIndex = open_own
    uuids = ["00000000-aaaa-bbbb-cccc-dddddddddddd", "00000002-aaaa-bbbb-cccc-dddddddddddd"]
    summary = GpuSampler(gpus=2, interval=10, nvml=nvml, uuids=uuids).start().stop()
    assert summary["available"] and summary["reason"] is None
    assert summary["gpus"] == 1 and summary["mean_power_watts"] == pytest.approx(100.0)
    assert summary["unsampled"] == [
        {"gpu": uuids[1], "reason": "LookupError: not among the GPUs NVML could open"}
    ]
    # By index (no UUIDs): the handle's own error is kept.
    nvml = FakeNvml(gpus=2)
    nvml.nvmlDeviceGetHandleByIndex = open_own
    summary = GpuSampler(gpus=2, interval=10, nvml=nvml).start().stop()
    assert summary["gpus"] == 1
    assert summary["unsampled"] == [
        {"gpu": "1", "reason": "NVMLError_NoPermission: Insufficient Permissions"}
    ]


def test_a_gpu_nvml_cannot_read_mig_is_left_out_not_all():
    """A MIG instance: NVML opens it but reports no utilization; the other GPU is sampled."""
    nvml = FakeNvml(gpus=2)
    read = nvml.nvmlDeviceGetUtilizationRates

    def utilization(h):
        if h == 1:
            raise NVMLError_NotSupported("Not Supported")
        return read(h)

    nvml.nvmlDeviceGetUtilizationRates = utilization
    sampler = GpuSampler(gpus=2, interval=0.01, nvml=nvml).start()
    time.sleep(0.05)
    summary = sampler.stop()
    assert summary["reason"] is None and summary["samples"] >= 2  # sampling went on
    assert summary["gpus"] == 1 and summary["mean_utilization_percent"] == 90.0
    assert summary["unsampled"] == [{"gpu": "1", "reason": "NVMLError_NotSupported: Not Supported"}]


def test_without_energy_counter_power_is_integrated_over_time():
    sampler = GpuSampler(gpus=1, interval=0.02, nvml=FakeNvml(gpus=1, energy=False)).start()
    time.sleep(0.1)
    summary = sampler.stop()
    assert summary["energy_source"] == "power_samples_integrated"
    # 300 W over the sampled span.
    assert summary["energy_kwh"] == pytest.approx(300 * summary["seconds"] / 3.6e6)


def test_a_gpu_that_stops_answering_ends_sampling_not_training():
    nvml = FakeNvml(gpus=1)
    sampler = GpuSampler(gpus=1, interval=0.01, nvml=nvml).start()

    def lost(*args):
        raise RuntimeError("GPU is lost")

    nvml.nvmlDeviceGetUtilizationRates = lost
    nvml.nvmlShutdown = lost
    time.sleep(0.05)
    summary = sampler.stop()
    assert summary["available"] and summary["samples"] >= 1  # what was read before is kept
    assert summary["reason"] == "NVML read failed: RuntimeError: GPU is lost"


@pytest.mark.parametrize(
    ("gpus", "nvml", "reason"),
    [
        (0, FakeNvml(), "no GPUs in this run (gpus_per_node is 0)"),
        (1, FakeNvml(fail_init=True), "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared"),
        (1, FakeNvml(gpus=0), "NVML lists no GPU on this node"),
    ],
)
def test_no_gpu_gives_a_reason_and_no_figures(gpus, nvml, reason):
    summary = GpuSampler(gpus=gpus, nvml=nvml).start().stop()
    assert summary["available"] is False
    assert summary["reason"].startswith(reason)
    assert set(summary) == {"available", "reason"}  # absent, not zero


def test_real_pynvml_without_a_driver_records_why():
    pytest.importorskip("pynvml")
    summary = GpuSampler(gpus=1).start().stop()
    if summary["available"]:
        pytest.skip("this machine has an NVIDIA driver")
    assert "NVML" in summary["reason"]


GEOMETRY = {"nodes": 2, "tasks_per_node": 4, "cpus_per_task": 8, "gpus_per_node": 4}
EPOCHS = [{"epoch_seconds": 100.0, "images": 10_000}, {"epoch_seconds": 80.0, "images": 10_000}]


def test_cost_block_gpu_and_core_hours_and_energy_per_1k_images():
    telemetry = {"available": True, "energy_kwh": 0.5, "gpus": 4}
    cost = cost_block(GEOMETRY, 3600.0, EPOCHS, telemetry, resumed=False, slurm_job_id="42")
    assert (cost["gpus"], cost["cores"]) == (8, 64)
    assert cost["gpu_hours"] == 8.0 and cost["core_hours"] == 64.0
    assert cost["gpu_hours_per_epoch"] == pytest.approx(8 * 90 / 3600)
    energy = cost["gpu_telemetry"]
    assert energy["energy_kwh_all_nodes"] == 1.0  # rank 0's node x 2 nodes (labelled estimate)
    assert energy["energy_wh_per_1k_images"] == pytest.approx(1000 / 20_000 * 1000)
    assert "estimate" in energy["note"] and cost["slurm_job_id"] == "42"


def test_cost_block_without_gpus_or_after_a_resume_has_no_made_up_figures():
    cpu = {**GEOMETRY, "gpus_per_node": 0}
    cost = cost_block(cpu, 36.0, EPOCHS, {"available": False, "reason": "x"}, resumed=False,
                      slurm_job_id=None)  # fmt: skip
    assert cost["gpu_hours"] == 0 and cost["core_hours"] == pytest.approx(0.64)
    assert cost["gpu_telemetry"] == {"available": False, "reason": "x"}
    resumed = cost_block(GEOMETRY, 1.0, EPOCHS, {"available": True, "energy_kwh": 0.1},
                         resumed=True, slurm_job_id=None)  # fmt: skip
    assert resumed["gpu_telemetry"]["energy_wh_per_1k_images"] is None
    assert "resumed" in resumed["gpu_telemetry"]["energy_per_image_reason"]
    partial = {"available": True, "energy_kwh": 0.1, "unsampled": [{"gpu": "1", "reason": "x"}]}
    part = cost_block(GEOMETRY, 1.0, EPOCHS, partial, resumed=False, slurm_job_id=None)
    assert part["gpu_telemetry"]["energy_kwh_all_nodes"] is None  # not node energy x nodes
    assert part["gpu_telemetry"]["energy_wh_per_1k_images"] is None
    assert (
        "1 GPU(s) of rank 0's node not sampled" in part["gpu_telemetry"]["energy_per_image_reason"]
    )


class FakeMeter:
    """What the monitor reads of training.metrics.EpochMeter (whose interval test_train_units
    proves)."""

    def interval(self):
        return 2.5, 100.0


def test_monitor_logs_every_interval_and_each_epoch_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sampler = GpuSampler(gpus=1, interval=0.01, nvml=FakeNvml(gpus=1))
    monitor = RunMonitor(
        active=True, run_dir=tmp_path, geometry={**GEOMETRY, "nodes": 1}, steps_per_epoch=4,
        log_interval=2, resumed=False, sampler=sampler,
    )  # fmt: skip
    meter = FakeMeter()
    for step in range(1, 5):
        meter.steps = step
        monitor.step(0, step, meter, lr=0.1)
    spike = "loss spiked to 7.4 at epoch 0 (chance 2.3; last epoch 2.4)"  # aggregate.loss_spike
    monitor.epoch(0, {"train_loss": 2.4, "steady_images_per_s": None, "lr_end": 0.05}, spike)
    progress = json.loads((tmp_path / "progress.json").read_text())  # report.progress reads it
    assert progress["loss_spike"] == spike and progress["train_loss"] == 2.4
    cost = monitor.finish(EPOCHS)
    assert cost["gpu_telemetry"]["available"] and cost["wall_seconds"] > 0
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/images_per_s", "train/lr", "epoch/train_loss", "epoch/lr"} <= tags
    assert {"gpu/utilization_percent", "gpu/power_watts", "gpu/memory_used_gb"} <= tags
    assert "epoch/steady_images_per_s" not in tags  # absent, not zero
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert [e.step for e in events.Scalars("epoch/train_loss")] == [4]


def monitored_job(tmp_path, *, resumed: bool, epoch: int, finish: bool, **tracker) -> bool:
    """One training job's monitor on rank 0 (4 steps, one epoch) logging to ``tracker``
    (``mlflow=`` or ``wandb=``); ``finish`` False: it closes as a job stopped by a signal.
    Returns whether W&B logging was active (it is let go at the end)."""
    monitor = RunMonitor(
        active=True, run_dir=tmp_path, geometry={**GEOMETRY, "nodes": 1}, steps_per_epoch=4,
        log_interval=2, resumed=resumed,
        sampler=GpuSampler(gpus=1, interval=0.01, nvml=FakeNvml(gpus=1)), **tracker,
    )  # fmt: skip
    wandb_active = monitor.wandb is not None
    meter = FakeMeter()
    for step in range(1, 5):
        meter.steps = step
        monitor.step(epoch, step, meter, lr=0.1)
    monitor.epoch(epoch, {"train_loss": 2.4, "steady_images_per_s": None, "lr_end": 0.05})
    monitor.finish(EPOCHS) if finish else monitor.close()
    return wandb_active


def test_mlflow_gets_tensorboards_scalars_and_a_resumed_job_continues_its_run(tmp_path):
    """MLflow's own file store (no server); the run id lives beside the checkpoints."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store, checkpoints = tmp_path / "mlruns", tmp_path / "ckpt"
    mlflow = {"uri": str(store), "run_name": "r", "state_dir": checkpoints, "params": {"lr": 0.1}}

    def job(resumed: bool, epoch: int, *, finish: bool):
        monitored_job(tmp_path, resumed=resumed, epoch=epoch, finish=finish, mlflow=mlflow)

    job(resumed=False, epoch=0, finish=False)
    run_id = (checkpoints / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=store.as_uri())
    assert client.get_run(run_id).info.status == "KILLED"
    job(resumed=True, epoch=1, finish=True)
    [experiment] = client.search_experiments(filter_string="name = 'imagenet-ddp'")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1"}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(run.data.metrics) == set(events.Tags()["scalars"])  # the same scalars
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [2, 4, 6, 8]  # both jobs, one x axis
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8]
    job(resumed=False, epoch=0, finish=True)  # a fresh start is a new MLflow run
    assert (checkpoints / "mlflow_run_id").read_text().strip() != run_id
    assert len(client.search_runs([experiment.experiment_id])) == 2


def wandb_records(path):
    """The records of a W&B run file (``run-<id>.wandb``): LevelDB's log format, as W&B's
    datastore writes it (7-byte file header, 32 KiB blocks, 7-byte chunk headers: CRC, length,
    type; FULL=1, FIRST=2, MIDDLE=3, LAST=4), each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, pending = path.read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B"
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_gets_tensorboards_scalars_and_a_resumed_job_continues_its_run(
    tmp_path, monkeypatch
):
    """W&B in offline mode (no network, no account): each job writes its own offline run
    directory under the run dir, both with the run id kept beside the checkpoints."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home" / name))  # not the user's ~/.config
    checkpoints = tmp_path / "ckpt"
    wandb = {"project": "p", "mode": "offline", "run_name": "r", "run_dir": tmp_path,
             "state_dir": checkpoints, "params": {"lr": 0.1}}  # fmt: skip

    def job(resumed: bool, epoch: int, *, finish: bool):
        assert monitored_job(tmp_path, resumed=resumed, epoch=epoch, finish=finish, wandb=wandb)

    job(resumed=False, epoch=0, finish=False)
    job(resumed=True, epoch=1, finish=True)
    run_id = (checkpoints / "wandb_run_id").read_text().strip()
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one per job
    history, configs = {}, []
    for path in files:
        records = {}
        for record in wandb_records(path):
            records.setdefault(record.WhichOneof("record_type"), []).append(record)
        assert {r.run.run_id for r in records["run"]} == {run_id}
        configs += [r.run.config for r in records["run"]] + [
            r.config for r in records.get("config", [])
        ]
        for record in (r.history for r in records["history"]):
            values = {i.key or "/".join(i.nested_key): i.value_json for i in record.item}
            for key in values:
                if not key.startswith("_") and key != "global_step":
                    history.setdefault(key, []).append(int(values["global_step"]))
    assert "lr" in {item.key for config in configs for item in config.update}  # the params
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(history) == set(events.Tags()["scalars"])  # the same scalars
    assert sorted(history["train/loss"]) == [2, 4, 6, 8]  # both jobs, one x axis
    job(resumed=False, epoch=0, finish=True)  # a fresh start is a new W&B run
    assert (checkpoints / "wandb_run_id").read_text().strip() != run_id


def test_monitor_on_other_ranks_does_nothing(tmp_path):
    monitor = RunMonitor(
        active=False, run_dir=tmp_path, geometry=GEOMETRY, steps_per_epoch=4, log_interval=1,
        resumed=False,
    )  # fmt: skip
    monitor.step(0, 1, FakeMeter(), lr=0.1)
    monitor.epoch(0, {})
    monitor.close()
    assert not (tmp_path / "tensorboard").exists()
