"""Process-group setup shared by training and evaluation.

Ranks come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) or, when launched by
``srun``, from SLURM's per-task variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID). The
launcher sets MASTER_ADDR/MASTER_PORT; see :mod:`imagenet_ddp.launch`.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    requested: str, local_rank: int, gpus_per_node: int | None = None
) -> torch.device:
    """``auto`` picks this rank's GPU when CUDA is available, else the CPU.

    A job that asked SLURM for GPUs (``gpus_per_node > 0``) never falls back to the CPU: on a
    node where CUDA is unusable (driver, ``CUDA_VISIBLE_DEVICES``, a CPU build of torch) that
    would burn the GPU allocation at CPU speed and report CPU figures as the run's.
    With ``--gres-flags=allow-task-sharing`` off, SLURM shows each task only its own GPU, so the
    visible device count can be 1 while local_rank is larger: index modulo the visible count.
    """
    wants_gpu = requested == "cuda" or (requested == "auto" and (gpus_per_node or 0) > 0)
    if requested == "cpu" or (not wants_gpu and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = f"gpus_per_node is {gpus_per_node}" if gpus_per_node else "device is 'cuda'"
        raise RuntimeError(
            f"host {socket.gethostname()}: {why} but CUDA is unusable here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "check the node's driver and the job's GPU request, or set gpus_per_node: 0"
        )
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


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
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    dist.init_process_group(
        backend=backend,
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
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
