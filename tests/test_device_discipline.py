"""Device discipline on CPU: a job built for a device keeps all its state there.

The job is built for the ``meta`` device (shapes only, no data): a tensor that ignores the
target device (an EMA counter created on the CPU, a constant made with ``torch.tensor``)
stays on the CPU and is found here, as it would be on a GPU. Device selection for both SLURM
GPU bindings, with a faked CUDA device count.
"""

from __future__ import annotations

import pytest
import torch

from imagenet_ddp import distributed as D
from imagenet_ddp.geometry import Geometry
from imagenet_ddp.training.discipline import (
    check_device_discipline,
    misplaced_tensors,
    state_tensors,
)
from imagenet_ddp.training.worker import build_job
from tests.workflow_helpers import train_config

META = torch.device("meta")


def _job(**settings):
    cfg = train_config(model="resnet18", batch_size=2, ema_decay=0.99, epochs=2, **settings)
    info = D.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, host="h")
    geometry = Geometry(1, 1, 1, 0, 0)
    return build_job(cfg, info, META, geometry, num_classes=4, steps_per_epoch=3)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_all_state_stays_on_the_device_the_job_was_built_for(optimizer):
    from imagenet_ddp.training.loop import train_step

    job = _job(optimizer=optimizer, channels_last=True)
    check_device_discipline(job, "after setup")
    images = torch.empty(2, 3, 16, 16, device=META)
    targets = torch.zeros(2, dtype=torch.long, device=META)
    train_step(job, images, targets, epoch=1)  # after warm-up: the EMA is updated
    assert job.optimizer.state  # momentum / Adam moments exist now ...
    assert misplaced_tensors(job) == []  # ... and are on the meta device too
    assert "ema.n_averaged" in {
        name for name, _ in state_tensors(job)
    }  # the tensor of defect 1 (issue 18) is checked


def test_a_tensor_left_on_the_cpu_is_named():
    job = _job()
    job.ema.n_averaged = torch.tensor(0)  # what AveragedModel does without device=
    with pytest.raises(RuntimeError, match=r"after setup.*ema\.n_averaged on cpu"):
        check_device_discipline(job, "after setup")


def _fake_cuda(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


@pytest.mark.parametrize(
    ("binding", "visible", "expected"),
    [
        ("each task sees the node's GPUs (--gres=gpu:4)", 4, [0, 1, 2, 3]),
        ("each task sees only its own (--gpus-per-task=1)", 1, [0, 0, 0, 0]),
    ],
)
def test_device_selection_for_both_slurm_bindings(monkeypatch, binding, visible, expected):
    chosen = _fake_cuda(monkeypatch, visible)
    devices = [D.select_device("auto", local, gpus_per_node=4) for local in range(4)]
    assert [d.index for d in devices] == expected, binding
    assert chosen == expected  # set_device before the process group (NCCL's device)


def test_auto_never_picks_cuda_without_gpus_in_the_run(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    assert D.select_device("auto", 0, gpus_per_node=0).type == "cpu"


def test_more_ranks_than_visible_gpus_is_refused_at_start(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    with pytest.raises(
        RuntimeError, match=r"local rank 2 of 3 ranks has no GPU of its own \(2 GPUs visible"
    ):
        D.select_device("auto", 2, gpus_per_node=2, local_world_size=3)


def test_two_ranks_on_one_gpu_are_named_in_one_line():
    placements = [
        {"rank": 0, "host": "n1", "gpu": "GPU-a"},
        {"rank": 1, "host": "n1", "gpu": "GPU-a"},
        {"rank": 2, "host": "n2", "gpu": "GPU-a"},  # another node's GPU with the same name
        {"rank": 3, "host": "n2", "gpu": None},  # CPU ranks share nothing
        {"rank": 4, "host": "n2", "gpu": None},
    ]
    assert D.shared_gpus(placements) == ["host n1: ranks 0, 1 share GPU GPU-a"]
