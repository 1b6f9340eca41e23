"""Device discipline on CPU: a job built for a device keeps all its state there.

The job is built for the ``meta`` device (shapes only, no data): a tensor that ignores the
target device (an EMA counter created on the CPU, a constant made with ``torch.tensor``)
stays on the CPU and is found here, as it would be on a GPU. Device selection for every site
binding (all GPUs, one per task, a per-socket subset, MIG), with a faked CUDA device count and a
real torch store.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.settings.geometry import Geometry
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
    train_step(job, [(images, targets)], epoch=1)  # after warm-up: the EMA is updated
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
        RuntimeError,
        match=r"local ranks 0, 1, 2 see the same 2 GPU\(s\).*local rank 2 has no GPU of its "
        r"own; set tasks_per_node to gpus_per_node",
    ):
        D.select_device("auto", 2, gpus_per_node=2, local_world_size=3)


# Each site binding as the 8 ranks of one node see it: per local rank, the GPUs it sees
# (physical names; CUDA numbers them from 0 in each task), and the index each must pick.
BINDINGS = {
    "all GPUs per task (--gres=gpu:8)": ([["g0-7"]] * 8, list(range(8))),
    "one GPU per task (--gpus-per-task=1)": ([[f"g{i}"] for i in range(8)], [0] * 8),
    "per-socket subset, block (--gpu-bind=closest: 0-3 and 4-7)": (
        [["g0-3"]] * 4 + [["g4-7"]] * 4,
        [0, 1, 2, 3, 0, 1, 2, 3],
    ),
    "per-socket subset, cyclic distribution (even and odd ranks)": (
        [["g0-3"], ["g4-7"]] * 4,
        [0, 0, 1, 1, 2, 2, 3, 3],
    ),
    "one MIG instance per task": ([[f"MIG-{i}"] for i in range(8)], [0] * 8),
}


def _node(sets: list[list[str]], counts: list[int], host: str = "n1") -> list[tuple]:
    """(host, local rank, key, visible count) per rank of a node."""
    return [(host, r, ",".join(k), c) for r, (k, c) in enumerate(zip(sets, counts, strict=True))]


@pytest.mark.parametrize("binding", sorted(BINDINGS))
def test_each_rank_picks_its_own_gpu_whatever_the_binding(binding):
    """Every rank publishes the GPUs it sees in the rendezvous store (a real torch store,
    in this process), then takes its position among the ranks of its node that see the same:
    two nodes of 8 ranks, every rank of both."""
    sets, expected = BINDINGS[binding]
    counts = [4 if "subset" in binding else (8 if "all" in binding else 1)] * 8
    ranks = _node(sets, counts, "n1") + _node(sets, counts, "n2")
    store = torch.distributed.HashStore()
    for rank, (host, local, key, _) in enumerate(ranks):  # the others' entries, as published
        store.set(f"imagenet_ddp/visible/{rank}", json.dumps([host, local, key]))
    chosen = []
    for rank, (host, local, key, visible) in enumerate(ranks):
        info = D.DistInfo(rank, 16, local, 8, host)
        chosen.append(D.gpu_index(local, visible, D.ranks_sharing_my_gpus(store, info, key)))
    assert chosen == expected + expected, binding


def test_ranks_that_must_share_a_gpu_or_mig_instance_are_refused_naming_what_to_set():
    store = torch.distributed.HashStore()
    ranks = [("n1", 0, "MIG-a"), ("n1", 1, "MIG-a")]  # both tasks given the same instance
    for rank, entry in enumerate(ranks):
        store.set(f"imagenet_ddp/visible/{rank}", json.dumps(entry))
    sharing = D.ranks_sharing_my_gpus(store, D.DistInfo(1, 2, 1, 2, "n1"), "MIG-a")
    assert D.gpu_index(0, 1, sharing) == 0
    with pytest.raises(RuntimeError, match=r"local ranks 0, 1 see the same 1 GPU.*--gpu-bind"):
        D.gpu_index(1, 1, sharing)


def test_select_device_asks_the_store_before_it_sets_the_device(monkeypatch):
    """With several ranks, select_device learns the sharing ranks from the rendezvous store
    (here a fake one holding a per-socket binding) and sets the device it picks."""
    chosen = _fake_cuda(monkeypatch, 4)
    monkeypatch.setattr(D, "visible_gpus_key", lambda count: "g4-7")
    store = torch.distributed.HashStore()
    for local in range(8):
        key = "g0-3" if local < 4 else "g4-7"
        store.set(f"imagenet_ddp/visible/{local}", json.dumps(["n1", local, key]))
    monkeypatch.setattr(D, "rendezvous_store", lambda info, minutes: store)
    monkeypatch.setattr(D.socket, "gethostname", lambda: "n1")
    for name, value in {"RANK": 6, "WORLD_SIZE": 8, "LOCAL_RANK": 6}.items():
        monkeypatch.setenv(name, str(value))
    assert D.select_device("auto", 6, gpus_per_node=8, local_world_size=8).index == 2
    assert chosen == [2]


@pytest.mark.parametrize(
    ("counts", "node", "expected"),
    [("8(x2)", 1, 8), ("2,1", 1, 1), ("3(x2),1", 2, 1), ("3(x2),1", 1, 3), ("", 0, 1)],
)
def test_tasks_on_this_node_reads_slurms_compressed_counts(counts, node, expected):
    assert D.tasks_on_this_node(counts, node) == expected


def test_two_ranks_on_one_gpu_are_named_in_one_line():
    placements = [
        {"rank": 0, "host": "n1", "gpu": "GPU-a"},
        {"rank": 1, "host": "n1", "gpu": "GPU-a"},
        {"rank": 2, "host": "n2", "gpu": "GPU-a"},  # another node's GPU with the same name
        {"rank": 3, "host": "n2", "gpu": None},  # CPU ranks share nothing
        {"rank": 4, "host": "n2", "gpu": None},
    ]
    assert D.shared_gpus(placements) == ["host n1: ranks 0, 1 share GPU GPU-a"]


RANK_SCRIPT = """
from imagenet_ddp.jobs import distributed as D
info = D.dist_info_from_env()
device = D.select_device("auto", info.local_rank, 4, info.local_world_size)
D.init_process_group(info, device, "auto", 1)
D.barrier()
print(D.WOULD_SELECT[0])
D.destroy_process_group()
"""


def test_four_processes_on_a_per_socket_binding_each_take_their_own_gpu():
    """Real processes, a real TCP rendezvous store and gloo: ranks 0-1 see GPUs 0,1 and ranks
    2-3 see 2,3, each numbered from 0 (the test cluster's fake GPUs: the choice is recorded,
    compute stays on the CPU). Each picks its own; the process group then starts."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(4):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            D.FAKE_GPUS: "1", "CUDA_VISIBLE_DEVICES": "0,1" if rank < 2 else "2,3",
        }  # fmt: skip
        command = [sys.executable, "-c", RANK_SCRIPT]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        procs.append(subprocess.Popen(command, env=env, text=True, **pipes))
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert [out.strip() for out, _ in outputs] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
