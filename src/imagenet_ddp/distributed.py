"""Process-group setup shared by training, evaluation and preflight ranks: rank, GPU, rendezvous.

Ranks come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) or, when launched by
``srun``, from SLURM's per-task variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID). Local
ranks get MASTER_ADDR/MASTER_PORT from the launcher (:mod:`imagenet_ddp.launch`); srun tasks
derive them from the job (:func:`rendezvous_from_slurm_env`) before they join the group.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from imagenet_ddp.hostlist import expand_hostlist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def dist_info_from_env() -> DistInfo:
    return DistInfo(
        rank=_env_int("RANK", "SLURM_PROCID", default=0),
        world_size=_env_int("WORLD_SIZE", "SLURM_NTASKS", default=1),
        local_rank=_env_int("LOCAL_RANK", "SLURM_LOCALID", default=0),
        local_world_size=_env_int(
            "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", default=1
        ),
        host=socket.gethostname(),
    )


def select_device(
    requested: str,
    local_rank: int,
    gpus_per_node: int | None = None,
    local_world_size: int | None = None,
) -> torch.device:
    """``auto`` picks this rank's GPU when the run asked for GPUs (``gpus_per_node > 0``),
    else the CPU, even where CUDA is available (a CPU run on a GPU node stays a CPU run).

    A job that asked SLURM for GPUs never falls back to the CPU: on a node where CUDA is
    unusable (driver, ``CUDA_VISIBLE_DEVICES``, a CPU build of torch) that would burn the GPU
    allocation at CPU speed and report CPU figures as the run's.
    SLURM binds GPUs in one of two ways (docs/slurm-notes.md, checked with fake GPUs): every
    task sees all GPUs of the node (``--gres=gpu:N``: ``cuda:SLURM_LOCALID``) or only its own
    (``--gpus-per-task=1``, or ``--gres-flags`` defaults on newer Slurm: ``cuda:0``). A rank
    whose index is beyond the visible GPUs would share another rank's GPU: refused here.
    ``torch.cuda.set_device`` comes first, before the process group and any CUDA tensor, so
    NCCL and the caching allocator never touch GPU 0 from every rank.
    """
    wants_gpu = requested == "cuda" or (requested == "auto" and (gpus_per_node or 0) > 0)
    if requested == "cpu" or not wants_gpu:
        return torch.device("cpu")
    if os.environ.get(FAKE_GPUS) == "1":  # the test cluster: choose as below, compute on CPU
        visible = len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d])
        WOULD_SELECT[:] = [f"cuda:{gpu_index(local_rank, visible, local_world_size)}"]
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = f"gpus_per_node is {gpus_per_node}" if gpus_per_node else "device is 'cuda'"
        raise RuntimeError(
            f"host {socket.gethostname()}: {why} but CUDA is unusable here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "check the node's driver and the job's GPU request, or set gpus_per_node: 0"
        )
    index = gpu_index(local_rank, torch.cuda.device_count(), local_world_size)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# Tests only: the local SLURM cluster's GPUs are device files (tests/slurm_cluster). With this
# set to 1, a rank that would use a GPU chooses it from CUDA_VISIBLE_DEVICES exactly as on a
# GPU node, records the choice in WOULD_SELECT, and computes on the CPU (gloo).
FAKE_GPUS = "IMAGENET_DDP_FAKE_GPUS"
WOULD_SELECT: list[str] = []


def gpu_index(local_rank: int, visible: int, local_world_size: int | None) -> int:
    """The index, among the ``visible`` GPUs, of this rank's GPU: the one choice that training,
    evaluation and the preflight (what a rank would use) all make."""
    if visible == 1:  # this task's own GPU
        return 0
    if local_rank < visible:
        return local_rank
    raise RuntimeError(
        f"host {socket.gethostname()}: local rank {local_rank} of "
        f"{local_world_size or '?'} ranks has no GPU of its own ({visible} GPUs visible, "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
        "set tasks_per_node to gpus_per_node"
    )


def placement(info: DistInfo, device: torch.device) -> dict[str, object]:
    """Where this rank ran: recorded per rank in train_metrics.json and eval.json."""
    return {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "host": info.host,
        "device": str(device),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        **({"would_select": WOULD_SELECT[0]} if WOULD_SELECT else {}),
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "pid": os.getpid(),
    }


def gpu_identity(device: torch.device) -> str:
    """The physical GPU behind ``device`` (its UUID): the same for two ranks sharing it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def shared_gpus(placements: list[dict]) -> list[str]:
    """One line per GPU that more than one rank uses ({rank, host, gpu} per rank)."""
    users: dict[tuple[str, str], list[int]] = {}
    for p in placements:
        if p.get("gpu"):
            users.setdefault((p["host"], p["gpu"]), []).append(p["rank"])
    return [
        f"host {host}: ranks {', '.join(map(str, ranks))} share GPU {gpu}"
        for (host, gpu), ranks in sorted(users.items())
        if len(ranks) > 1
    ]


def _check_gpus_not_shared(store, info: DistInfo, device: torch.device) -> None:
    """Fail every rank at start, in one line, if another rank uses its GPU (two ranks on one
    GPU: NCCL refuses or hangs, and the run's throughput would be half of what it states).
    Through the rendezvous store, before NCCL exists; CPU ranks publish no GPU."""
    gpu = gpu_identity(device) if device.type == "cuda" else None
    mine = {"rank": info.rank, "host": info.host, "gpu": gpu}
    store.set(f"imagenet_ddp/placement/{info.rank}", json.dumps(mine))
    placements = [
        json.loads(store.get(f"imagenet_ddp/placement/{r}")) for r in range(info.world_size)
    ]
    problems = shared_gpus(placements)
    if problems:
        raise RuntimeError("; ".join(problems) + ": give each rank its own GPU")
    _PLACEMENTS[:] = placements


_PLACEMENTS: list[dict] = []  # every rank's {rank, host, gpu}, from the rendezvous


def node_gpu_uuids(info: DistInfo, device: torch.device) -> list[str]:
    """UUIDs of the GPUs the ranks on this rank's node use, in rank order (what telemetry
    samples: NVML ignores CUDA_VISIBLE_DEVICES, so indices would name other jobs' GPUs)."""
    if device.type != "cuda":
        return []
    if not _PLACEMENTS:  # one process: no rendezvous
        return [gpu_identity(device)]
    return [p["gpu"] for p in _PLACEMENTS if p["host"] == info.host and p["gpu"]]


# Below Linux's default ephemeral range (32768-60999), so it cannot collide with client ports.
MASTER_PORT_BASE, MASTER_PORT_SPAN = 15000, 15000


def master_port(job_id: int) -> int:
    """A port derived from the job id: concurrent jobs sharing a node rarely collide."""
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM hostlist expression -> host names, parsed here: no ``scontrol`` in a rank (a
    container image has no SLURM client)."""
    return expand_hostlist(nodelist)


def rendezvous_from_slurm_env() -> None:
    """Set MASTER_ADDR/MASTER_PORT in an srun task from the variables srun gives every task
    (the first node of the step, a port from the job id), and GLOO_SOCKET_IFNAME on several
    nodes. What a variable set by the user or by torchrun says wins."""
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"]
        os.environ["MASTER_ADDR"] = expand_nodelist(nodelist)[0]
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(master_port(int(os.environ["SLURM_JOB_ID"])))
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        others = [h for h in expand_nodelist(nodelist) if h != socket.gethostname()]
        if others:  # several nodes: the gloo group beside NCCL must not bind loopback
            with contextlib.suppress(OSError):
                os.environ["GLOO_SOCKET_IFNAME"] = interface_towards(others[0])


def interface_towards(host: str) -> str:
    """The network interface this node uses to reach ``host``.

    Gloo (the CPU group that carries the stop-signal agreement beside NCCL) binds the address
    its own hostname resolves to; where that is 127.0.1.1 (Debian's /etc/hosts default) ranks
    on other nodes cannot connect. The kernel's route to another node of the job names the
    right interface; GLOO_SOCKET_IFNAME set by the user wins.
    """
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: nothing is sent
        local = probe.getsockname()[0]
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                request = struct.pack("256s", name[:15].encode())
                address = fcntl.ioctl(s.fileno(), 0x8915, request)[20:24]  # SIOCGIFADDR
            except OSError:  # no IPv4 address on this interface
                continue
        if socket.inet_ntoa(address) == local:
            return name
    raise OSError(f"no interface holds {local}, the address towards {host}")


def init_process_group(
    info: DistInfo, device: torch.device, backend: str, timeout_minutes: float
) -> None:
    """Join the job's process group (a no-op for a single process).

    ``timeout_minutes`` (the run's ``timeout_minutes``, default 10) bounds how long a rank
    waits in one collective for the others: a rank that hangs (stopped, stuck in I/O) ends the
    job after this long. A rank that *dies* (SIGKILL, OOM killer) ends it sooner: the launcher
    stops the others at once (``srun --kill-on-bad-exit=1``; locally
    :func:`imagenet_ddp.launch.spawn_local_ranks`), and gloo's peers see its sockets close.
    The longest legitimate wait is rank 0 writing a checkpoint while the others wait at the
    barrier after it; staging is its own step before the ranks start.
    NCCL (GPU only, not run here): a collective with a dead or hung peer never returns by
    itself; the process group's watchdog thread aborts it after the timeout and, with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (set below unless the site set it), tears the process
    down ("Watchdog caught collective operation timeout" in the log, naming the collective's
    sequence number), so the job ends instead of holding its GPUs.
    """
    if info.world_size == 1:
        return
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:  # an srun task
        rendezvous_from_slurm_env()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # The store env:// makes (MASTER_ADDR/PORT; torchrun's agent store under torchrun), taken
    # here so that the ranks can compare their GPUs before NCCL starts.
    store, _, _ = next(dist.rendezvous("env://", info.rank, info.world_size, timeout=timeout))
    _check_gpus_not_shared(store, info, device)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    # device_id: NCCL's communicator is created now, on this rank's GPU (not lazily on
    # whatever device is current at the first collective), and barrier() knows the device.
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics).

    DDP broadcasts them at the start of each forward pass, so after the last training step each
    rank holds the statistics of its own last batch; rank 0's are the ones saved.
    """
    if is_distributed():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def all_gather_objects(obj: object) -> list[object]:
    if not is_distributed():
        return [obj]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if is_distributed():
        dist.barrier()
