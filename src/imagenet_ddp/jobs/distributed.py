"""Process-group setup shared by training, evaluation and preflight ranks: rank, GPU, rendezvous.

Ranks come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) or SLURM's per-task ones
(SLURM_PROCID, ...); srun tasks derive MASTER_ADDR/PORT from the job
(:func:`rendezvous_from_slurm_env`), local ranks get them from the launcher.
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

from imagenet_ddp.settings.geometry import Geometry, loader_workers, trains_on_gpus


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
        local_world_size=_env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=0)
        or tasks_on_this_node(
            os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""), _env_int("SLURM_NODEID", default=0)
        ),
        host=socket.gethostname(),
    )


def resolve_geometry(cfg, info: DistInfo, device: torch.device) -> Geometry:
    """The geometry that ``cfg`` (a TrainConfig) states, checked against the ranks that
    actually started; None in ``cfg`` means "as they started" (a rank started by hand)."""
    tasks = cfg.tasks_per_node or info.local_world_size
    nodes = cfg.nodes or max(1, info.world_size // tasks)
    if nodes * tasks != info.world_size:
        raise RuntimeError(
            f"run {cfg.run!r}: configured {nodes} node(s) x {tasks} task(s) per node, but "
            f"{info.world_size} ranks started; check the launcher's geometry"
        )
    cpus = cfg.cpus_per_task or int(
        os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("OMP_NUM_THREADS") or 1
    )
    gpus = cfg.gpus_per_node
    if gpus is None:
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return Geometry(nodes, tasks, cpus, gpus, loader_workers(cfg.workers, cpus))


def tasks_on_this_node(counts: str, node_id: int) -> int:
    """This node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (``8(x2)``, ``3(x2),1``); 1 unset."""
    import hostlist

    expanded = hostlist.parse_slurm_tasks_per_node(counts) if counts else [1]
    return expanded[min(node_id, len(expanded) - 1)]


def select_device(
    requested: str,
    local_rank: int,
    gpus_per_node: int | None = None,
    local_world_size: int | None = None,
    timeout_minutes: float = 10.0,
) -> torch.device:
    """``auto``: this rank's GPU where the run asked for GPUs (never the CPU then), else the
    CPU. Whether each task sees all the node's GPUs, its own or a shared subset
    (``--gpu-bind=closest``), a rank takes the one at its position among its node's ranks that
    see the same (:func:`gpu_index`), and sets it first: no rank touches GPU 0 by default."""
    if not trains_on_gpus({"device": requested, "gpus_per_node": gpus_per_node}):
        return torch.device("cpu")
    if os.environ.get(FAKE_GPUS) == "1":  # the test cluster: choose as below, compute on CPU
        ids = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        key = lambda: ",".join(ids)  # noqa: E731 - the physical indices stand for UUIDs here
        index = _choose_gpu(local_rank, len(ids), local_world_size, key, timeout_minutes)
        WOULD_SELECT[:] = [f"cuda:{index}"]
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = f"gpus_per_node is {gpus_per_node}" if gpus_per_node else "device is 'cuda'"
        raise RuntimeError(
            f"host {socket.gethostname()}: {why} but CUDA is unusable here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "check the node's driver and the job's GPU request, or set gpus_per_node: 0"
        )
    count = torch.cuda.device_count()
    key = lambda: visible_gpus_key(count)  # noqa: E731
    index = _choose_gpu(local_rank, count, local_world_size, key, timeout_minutes)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def visible_gpus_key(count: int) -> str:
    """The UUIDs of the GPUs this process sees, however it numbers them; reads properties
    only, creating no CUDA context (only a real GPU shows it; docs/proven.md)."""
    return ",".join(gpu_identity(i) for i in range(count))


def _choose_gpu(
    local_rank: int, visible: int, local_world_size: int | None, key, minutes: float
) -> int:
    """:func:`gpu_index` among the ranks sharing this rank's GPUs (from the store)."""
    info = dist_info_from_env()
    if info.world_size > 1 and visible > 0:
        sharing = ranks_sharing_my_gpus(rendezvous_store(info, minutes), info, key())
    elif visible == 1:
        sharing = [local_rank]
    else:
        sharing = list(range(max(local_world_size or 1, local_rank + 1)))
    return gpu_index(local_rank, visible, sharing)


# The local SLURM cluster's fake GPUs (tests/slurm_cluster): =1, a rank chooses its GPU from
# CUDA_VISIBLE_DEVICES as on a GPU node, records it in WOULD_SELECT and computes on the CPU.
FAKE_GPUS = "IMAGENET_DDP_FAKE_GPUS"
WOULD_SELECT: list[str] = []


def gpu_index(local_rank: int, visible: int, sharing: list[int]) -> int:
    """This rank's GPU among the ``visible``: its position among ``sharing``, its node's local
    ranks that see the same GPUs (all: the local rank; one each: 0; a socket's: its place)."""
    position = sorted(sharing).index(local_rank)
    if position < visible:
        return position
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    raise RuntimeError(
        f"host {socket.gethostname()}: local ranks {', '.join(map(str, sorted(sharing)))} "
        f"see the same {visible} GPU(s) (CUDA_VISIBLE_DEVICES={devices}), so local rank "
        f"{local_rank} has no GPU of its own; set tasks_per_node to gpus_per_node, and where "
        "the site binds GPUs per task (--gpu-bind, --gpus-per-task, MIG) give each task its "
        "own GPU or at least as many as the tasks that share them"
    )


def _from_every_rank(store, info: DistInfo, name: str, mine) -> list:
    """Every rank's ``mine``, in rank order, through the rendezvous ``store``."""
    store.set(f"imagenet_ddp/{name}/{info.rank}", json.dumps(mine))
    return [json.loads(store.get(f"imagenet_ddp/{name}/{r}")) for r in range(info.world_size)]


def ranks_sharing_my_gpus(store, info: DistInfo, key: str) -> list[int]:
    """This node's local ranks that see the GPUs this one does (``key``)."""
    entries = _from_every_rank(store, info, "visible", [info.host, info.local_rank, key])
    return sorted(local for host, local, k in entries if host == info.host and k == key)


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
        "intra_op_threads": torch.get_num_threads(),  # training.worker.rank_threads
        "pid": os.getpid(),
    }


def gpu_identity(device) -> str:
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
    """Fail every rank at start, in one line, if two ranks use one GPU (NCCL refuses or hangs,
    throughput would be half of what it states); before NCCL exists."""
    gpu = gpu_identity(device) if device.type == "cuda" else None
    placements = _from_every_rank(
        store, info, "placement", {"rank": info.rank, "host": info.host, "gpu": gpu}
    )
    problems = shared_gpus(placements)
    if problems:
        raise RuntimeError(
            "; ".join(problems) + ": give each rank its own GPU (tasks_per_node equal to "
            "gpus_per_node; where the site binds GPUs per task, --gpu-bind or --gpus-per-task "
            "that leave no two tasks one GPU or MIG instance)"
        )
    _PLACEMENTS[:] = placements


_PLACEMENTS: list[dict] = []  # every rank's {rank, host, gpu}, from the rendezvous


def node_gpu_uuids(info: DistInfo, device: torch.device) -> list[str]:
    """UUIDs of the GPUs this node's ranks use, in rank order (telemetry: NVML ignores
    CUDA_VISIBLE_DEVICES, so indices would name other jobs' GPUs)."""
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
    """SLURM hostlist expression -> host names (python-hostlist: no ``scontrol`` in a rank's
    container image); ValueError naming the expression where it is not one."""
    import hostlist

    try:
        return hostlist.expand_hostlist(nodelist, allow_duplicates=True)
    except hostlist.BadHostlist as error:
        raise ValueError(f"invalid SLURM hostlist {nodelist!r}: {error}") from None


def rendezvous_from_slurm_env() -> None:
    """MASTER_ADDR/PORT of an srun task (the step's first node, a port from the job id) and,
    on several nodes, GLOO_SOCKET_IFNAME, unless already set."""
    hosts = expand_nodelist(
        os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"]
    )
    os.environ.setdefault("MASTER_ADDR", hosts[0])
    os.environ.setdefault("MASTER_PORT", str(master_port(int(os.environ["SLURM_JOB_ID"]))))
    others = [h for h in hosts if h != socket.gethostname()]
    if others and "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo beside NCCL: not loopback
        with contextlib.suppress(OSError):
            os.environ["GLOO_SOCKET_IFNAME"] = interface_towards(others[0])


def interface_towards(host: str) -> str:
    """The network interface this node uses to reach ``host`` (the kernel's route): gloo would
    bind the address its hostname resolves to, which may be 127.0.1.1 (Debian's /etc/hosts)."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: nothing is sent
        local = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            return name
    raise OSError(f"no interface holds {local}, the address towards {host}")


def init_process_group(
    info: DistInfo, device: torch.device, backend: str, timeout_minutes: float
) -> None:
    """Join the job's process group (a no-op for one process). ``timeout_minutes`` bounds a
    wait in one collective; NCCL's watchdog (GPU only, not run here) then tears the process
    down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) instead of holding GPUs."""
    if info.world_size == 1:
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = rendezvous_store(info)
    store.set_timeout(timeout)
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


def rendezvous_store(info: DistInfo, minutes: float = 10.0):
    """The job's rendezvous store (env://), made once per process: :func:`select_device`
    compares the ranks' GPUs through it, :func:`init_process_group` builds the group on it."""
    if not _STORE:
        if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:  # an srun task
            rendezvous_from_slurm_env()
        timeout = datetime.timedelta(minutes=minutes)
        _STORE.append(
            next(dist.rendezvous("env://", info.rank, info.world_size, timeout=timeout))[0]
        )
    return _STORE[0]


_STORE: list = []  # this process's rendezvous store, once made


def destroy_process_group() -> None:
    _STORE.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics: after the last step each rank
    holds its own last batch's; rank 0's are saved)."""
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
