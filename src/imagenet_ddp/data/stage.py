"""Copy a prepared directory to node-local scratch once per node, and remove it afterwards.

Into ``<scratch_root>/imagenet_ddp-<uid>/<fingerprint of prepared.json>/<src.name>`` (one
private part per user: a node's /tmp is every user's), under a lock held for the whole copy,
complete once its marker (written last, after verification) exists; a complete copy is reused.
A scratch root every node shares is refused (:func:`scratch_problem`). Each job sharing a copy
holds a lease naming its io.Heartbeat file; the last to leave removes the copy. The next stager
of any run reclaims what a killed job left (:func:`reclaim_stale_leases`): a lease whose
heartbeat is gone or stale, and a partial copy whose lock no stager holds (the kernel releases
a SIGKILLed stager's flock)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from imagenet_ddp.data.prepared_layout import (
    PREPARED_JSON,
    SHARD_DIR,
    content_digest,
    resolve_prepared,
)
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import (
    STALE_S,
    atomic_path,
    exclusive_lock,
    file_digest,
    last_beat,
    lock_path_for,
    remove_path,
    temporaries,
    write_json_atomic,
)
from imagenet_ddp.mounts import existing_ancestor, is_network, mount_of
from imagenet_ddp.settings.node_memory import (
    PREPARED_SAMPLE_BYTES_AT_256,
    DataSizes,
    estimate_mb,
    prepared_sample_bytes,
)

STAGE_DIR = "imagenet_ddp"  # <scratch>/imagenet_ddp-<uid>: this user's part (user_stage_dir)
MARKER = ".staged.json"


SCRATCH_KEY = "stage.scratch_dir"
# Where to point it. /dev/shm is RAM: the copy counts against the job's mem_mb (the dry-run
# adds it, imagenet_ddp.settings.node_memory), tens of GB at full ImageNet.
NODE_LOCAL_EXAMPLE = (
    "e.g. /local/scratch; /dev/shm only with mem_mb raised by the train set's size, "
    "which the dry-run adds"
)
# Where a node stages when stage.scratch_dir is unset. SLURM sets neither to anything
# node-local itself: slurmstepd keeps the TMPDIR the job inherited, else /tmp.
SCRATCH_VARIABLES = ("SLURM_TMPDIR", "TMPDIR")


def scratch_root(configured: str | None, environ=None) -> tuple[Path, str]:
    """Where this node stages, and what chose it."""
    environ = os.environ if environ is None else environ
    if configured:
        return Path(configured), SCRATCH_KEY
    for variable in SCRATCH_VARIABLES:
        if environ.get(variable):
            return Path(environ[variable]), f"${variable}"
    return Path("/tmp"), "the default /tmp"


def scratch_problem(root: Path, shared: dict[str, Path]) -> tuple[str, str] | None:
    """Why ``root`` cannot hold a node-local copy, as (kind, text), or None. Kind ``network``:
    on a network filesystem; ``shared``: on the filesystem (st_dev) of one of ``shared``
    ({what: path}, which every node sees). A root not there yet is judged by its ancestor."""
    mount = mount_of(root)
    if mount is not None and is_network(mount):
        return "network", f"on {mount.fstype} ({mount.device} at {mount.mountpoint})"
    device = existing_ancestor(root).stat().st_dev
    for what, path in shared.items():
        if Path(path).exists() and Path(path).stat().st_dev == device:
            return "shared", f"on the same filesystem as {what} ({path})"
    return None


def scratch_info(root: Path, origin: str) -> dict:
    """The scratch root, what chose it and the filesystem holding it (for the report)."""
    mount = mount_of(root)
    return {
        "root": str(root),
        "from": origin,
        "fs_type": mount.fstype if mount else None,
        "source": mount.device if mount else None,
    }


def configured_scratch_problem(scratch_dir: str) -> str | None:
    """What the dry-run can tell about ``stage.scratch_dir`` (the node checks again): relative
    (in the workdir every node shares), or on a network filesystem here."""
    if not scratch_dir:
        return None
    if not os.path.isabs(scratch_dir):
        return (
            f"{SCRATCH_KEY} {scratch_dir!r} is relative, i.e. in the workdir that every node "
            "shares: set an absolute node-local path, or leave it empty ($SLURM_TMPDIR, "
            "$TMPDIR, /tmp)"
        )
    problem = scratch_problem(Path(scratch_dir), {}) if Path(scratch_dir).exists() else None
    if problem:  # no shared paths given: a network filesystem
        return (f"{SCRATCH_KEY} {scratch_dir!r} is {problem[1]}, which every node shares: set "
                f"a node-local path ({NODE_LOCAL_EXAMPLE})")  # fmt: skip
    return None


# Filesystems in RAM: a copy staged there is charged to the job's memory cgroup (--mem).
RAM_FS_TYPES = frozenset({"tmpfs", "ramfs"})


def _ram_fs(path: Path) -> str | None:
    """The filesystem type of ``path`` where it lives in RAM (charged to the job's memory)."""
    mount = mount_of(existing_ancestor(path))
    return mount.fstype if mount is not None and mount.fstype in RAM_FS_TYPES else None


def prepared_info(manifest, short_side: int) -> dict | None:
    """The prepared.json of the copy that the prepare rule's ``manifest`` names, where it is
    there and made at ``short_side`` (at another, prepare makes a new one); None otherwise."""
    try:
        info = json.loads((resolve_prepared(manifest) / PREPARED_JSON).read_text())
    except (InputError, OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("short_side") == short_side else None


def scratch_in_ram(
    scratch_dir: str, info: dict | None, images: int, short_side: int
) -> tuple[float, bool, str] | None:
    """(MiB, measured, what) of the train copy each node stages where ``stage.scratch_dir`` is
    a tmpfs here (/dev/shm): the prepared copy's size (``info``: :func:`prepared_info`), else
    ``images`` at ``short_side``; None where not in RAM or unknown at the dry-run (empty: seen
    only on the node)."""
    fs_type = os.path.isabs(scratch_dir or "") and _ram_fs(Path(scratch_dir))
    if not fs_type:
        return None
    where = f"{SCRATCH_KEY} {scratch_dir!r} is {fs_type}"
    if info and isinstance(info.get("total_bytes"), int):
        return info["total_bytes"] / 2**20, True, f"{where}; the prepared copy's size"
    per_image = prepared_sample_bytes(short_side)
    estimate = f"estimated as {images} images x {per_image / 1000:.1f} kB at prepare.short_side"
    return images * per_image / 2**20, False, f"{where}; {estimate} {short_side}"


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver found
UNLIMITED = 2**60  # cgroup v1 writes "no limit" as 9223372036854771712


def memory_limit(
    environ=None, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
) -> tuple[int, str] | None:
    """(bytes, what says so) this job may hold on this node: the lowest of its memory cgroups'
    limits (v2 ``memory.max``, v1 ``memory.limit_in_bytes``: SLURM's ``--mem``) and
    ``$SLURM_MEM_PER_NODE``; None where none is set (psutil reads no cgroup)."""
    environ = os.environ if environ is None else environ
    found = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = base / path.strip("/")
        for level in [folder, *folder.parents[: len(folder.parents) - len(base.parents)]]:
            try:
                text = (level / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < UNLIMITED:
                found.append((int(text), str(level / name)))
    if environ.get("SLURM_MEM_PER_NODE", "").isdigit():
        found.append((int(environ["SLURM_MEM_PER_NODE"]) * 2**20, "$SLURM_MEM_PER_NODE"))
    return min(found) if found else None


def ram_copy_problem(
    src: Path, scratch: Path, origin: str, run: dict, limit: tuple[int, str] | None,
    nvidia: Path | None = None,
) -> str | None:  # fmt: skip
    """Why this node must not copy ``src`` into ``scratch`` in RAM (a diskless node's /tmp):
    the copy and the ranks (settings.node_memory's estimate) above ``limit`` would be
    OOM-killed in the first epoch. None where it fits, no limit is known, or it is staged."""
    fs_type = _ram_fs(scratch)
    if limit is None or fs_type is None or (staged_path(src, scratch) / MARKER).is_file():
        return None
    copy = sum(size for _, size in _files(src))
    samples = json.loads((Path(src) / PREPARED_JSON).read_text()).get("num_samples", 0)
    # DALI's workers hand over JPEGs: this copy's own bytes per sample
    per_sample = copy / samples if samples else PREPARED_SAMPLE_BYTES_AT_256
    data = DataSizes(train_images=samples, sample_bytes=per_sample)
    figures = estimate_mb(run, data)
    nvidia = NVIDIA_GPUS if nvidia is None else nvidia
    cuda = nvidia.is_dir() and any(nvidia.iterdir())  # not a fake GPU: CUDA's host memory
    ranks = (figures["measured"] + cuda * figures["estimated"]) * 2**20
    if copy + ranks <= limit[0]:
        return None
    return (
        f"scratch {scratch} (from {origin}) is {fs_type}, in RAM: the train copy "
        f"({_human(copy)}) and the ranks ({_human(ranks)}, settings.node_memory's estimate) need "
        f"{_human(copy + ranks)}, above this job's memory limit of {_human(limit[0])} "
        f"({limit[1]}); set {SCRATCH_KEY} to a node-local disk, or raise train's mem_mb to "
        f"{math.ceil((copy + ranks) / 2**20 / 1000) * 1000}"
    )


def refuse_shared_scratch(root: Path, origin: str, problem: str) -> InputError:
    return InputError(
        f"scratch {root} (from {origin}) is {problem}: every node would stage into one shared "
        f"place; set {SCRATCH_KEY} to a node-local disk ({NODE_LOCAL_EXAMPLE})"
    )


def _report(src: Path, dest: Path, files: list, verify: str | None, **more) -> dict:
    return {"host": socket.gethostname(), "src": str(src), "dest": str(dest),
            "bytes": sum(size for _, size in files), "files": len(files), "verify": verify,
            "fingerprint": fingerprint(src), "seconds": 0.0, "bytes_per_s": 0.0,
            "reused": False, **more}  # fmt: skip


def in_place_report(src: Path, why: str) -> dict:
    """The report of a prepared copy read where it is (``in_place``: why; nothing copied)."""
    return _report(Path(src), Path(src), _files(Path(src)), None, in_place=why)


def fingerprint(src: Path) -> str:
    try:
        return content_digest(src)[:16]
    except FileNotFoundError:
        raise InputError(
            f"{Path(src) / PREPARED_JSON} not found: {src} is not a prepared "
            "directory; run `imagenet-ddp prepare`"
        ) from None


def user_stage_dir(scratch_root: Path) -> Path:
    """This user's part of a scratch root, private (0700 when made here): the same root on
    the same node serves every user's jobs, and one user's directory refuses another's."""
    return Path(scratch_root) / f"{STAGE_DIR}-{os.getuid()}"


def staged_path(src: Path, scratch_root: Path) -> Path:
    return user_stage_dir(scratch_root) / fingerprint(src) / Path(src).name


def _own_stage_dir(scratch_root: Path) -> Path:
    """:func:`user_stage_dir`, made if needed; refused where another user owns it."""
    base = user_stage_dir(scratch_root)
    with scratch_access(scratch_root):
        Path(scratch_root).mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            base.mkdir(mode=0o700)
        owner = base.lstat().st_uid
    if owner != os.getuid() or base.is_symlink():
        raise InputError(
            f"scratch {base} belongs to uid {owner}, not to this job's uid {os.getuid()}: "
            f"have it removed, or set {SCRATCH_KEY} to a node-local directory of your own"
        )
    return base


@contextlib.contextmanager
def scratch_access(scratch_root: Path):
    """A PermissionError under ``scratch_root`` as one InputError line naming the path."""
    try:
        yield
    except PermissionError as error:
        where = Path(error.filename or scratch_root)
        if not where.is_relative_to(scratch_root):
            raise  # not the scratch's (the prepared copy's own): as it is
        raise InputError(
            f"scratch {error.filename or scratch_root}: permission denied to uid {os.getuid()} "
            f"({error.strerror}); set {SCRATCH_KEY} to a node-local directory this user may "
            "write, or have the node's admin free it"
        ) from None


def _files(src: Path) -> list[tuple[str, int]]:
    """(relative path, size) of every regular file under src, sorted."""
    files = (p for p in Path(src).rglob("*") if p.is_file())
    return sorted((p.relative_to(src).as_posix(), p.stat().st_size) for p in files)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _verify(src: Path, dest: Path, files: list[tuple[str, int]], verify: str) -> None:
    for rel, size in files:
        actual = (dest / rel).stat().st_size if (dest / rel).is_file() else None
        if actual != size:
            raise InputError(
                f"staged copy {dest / rel} has {actual} bytes, {src / rel} has {size}; the "
                "scratch disk may be full or failing: free it or set stage.scratch_dir"
            )
    if verify == "sha256":
        info = json.loads((dest / PREPARED_JSON).read_text())
        for shard in info["shards"]:
            path = dest / SHARD_DIR / shard["name"]
            if file_digest(path, "sha256") != shard["sha256"]:
                raise InputError(
                    f"staged copy {path} does not match the sha256 in {src / PREPARED_JSON}; "
                    "the source or the scratch disk is damaged: rerun prepare or change "
                    "stage.scratch_dir"
                )


def _is_complete(dest: Path, fp: str, files: list[tuple[str, int]]) -> bool:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if marker.get("fingerprint") != fp or marker.get("files") != [list(f) for f in files]:
        return False
    return all(
        (dest / rel).is_file() and (dest / rel).stat().st_size == size for rel, size in files
    )


def _leases(dest: Path) -> Path:
    return dest.parent / f"{dest.name}.leases"


def _lease_file(dest: Path, lease: str) -> Path:
    return _leases(dest) / hashlib.sha256(lease.encode()).hexdigest()[:16]


def stage_dataset(src: Path, scratch_root: Path, *, verify: str, lease: str | None = None) -> dict:
    """Copy ``src`` (a prepared dir) under ``scratch_root`` unless a verified copy is there,
    checked by ``verify`` (stage.verify); ``lease``: the job's io.Heartbeat file."""
    src, fp, dest = Path(src), fingerprint(src), staged_path(src, scratch_root)
    files = _files(src)
    total = sum(size for _, size in files)
    started = time.perf_counter()
    _own_stage_dir(scratch_root)
    with scratch_access(scratch_root), exclusive_lock(lock_path_for(dest)):
        if lease is not None:  # taken before the copy: a concurrent cleanup must keep it
            _leases(dest).mkdir(parents=True, exist_ok=True)
            _lease_file(dest, lease).write_text(lease)
        if _is_complete(dest, fp, files):
            seconds = time.perf_counter() - started
            return _report(src, dest, files, verify, seconds=seconds, reused=True)
        # Under the lock no other stager writes: a temporary here is a killed stager's.
        free = shutil.disk_usage(dest.parent).free + _remove_partials(dest)
        if dest.exists():  # an incomplete copy: its space is about to be freed
            free += sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
        if free < total:
            raise InputError(
                f"scratch {dest.parent} has {_human(free)} free, needs {_human(total)}; free "
                "it, or set stage.scratch_dir to a larger node-local disk"
            )
        with atomic_path(dest, is_dir=True) as tmp:
            for rel, _ in files:
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, target)  # copy_file_range/sendfile fast path
            _verify(src, tmp, files, verify)
            write_json_atomic(
                tmp / MARKER,
                {"fingerprint": fp, "src": str(src), "files": [list(f) for f in files]},
            )
    seconds = time.perf_counter() - started
    rate = total / seconds if seconds > 0 else 0.0
    return _report(src, dest, files, verify, seconds=seconds, bytes_per_s=rate)


def _remove_partials(dest: Path) -> int:
    """Remove the partial copies into ``dest`` (atomic_path's temporaries); the caller holds
    its lock, so no stager writes them. The bytes freed."""
    freed = sum(remove_path(tmp) for tmp in temporaries(dest))
    if freed:
        print(f"removed {_human(freed)} of partial copies into {dest} that a killed stager "
              "left", flush=True)  # fmt: skip
    return freed


def _is_stage_part(path: Path) -> bool:
    """Whether ``path`` names a user's part of a scratch root (or an earlier version's)."""
    return path.name == STAGE_DIR or path.name.startswith(f"{STAGE_DIR}-")


def cleanup_staged(dest: Path, lease: str | None = None) -> bool:
    """Give up ``lease`` on a staged copy; remove it, its partial copies (and empty parents)
    if no lease remains. Returns whether nothing of it is left."""
    dest = Path(dest)
    if not _is_stage_part(dest.parent.parent):
        raise ValueError(f"{dest} is not a staged copy (<scratch>/{STAGE_DIR}-<uid>/<fp>/<name>)")
    lock = lock_path_for(dest)
    if not (dest.exists() or lock.exists() or temporaries(dest)):
        return True
    with exclusive_lock(lock):
        leases = _leases(dest)
        if lease is not None:
            _lease_file(dest, lease).unlink(missing_ok=True)
        if leases.is_dir() and any(leases.iterdir()):
            return False  # another job still reads it; the last one removes it
        shutil.rmtree(leases, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        _remove_partials(dest)
        gone = not (dest.exists() or temporaries(dest))
        if gone:  # removed while held: a waiter finds it unlinked (io.exclusive_lock)
            lock.unlink(missing_ok=True)
    for parent in (dest.parent, dest.parent.parent):
        try:
            parent.rmdir()
        except OSError:  # not empty (another copy or a stager still there) or already gone
            break
    return gone


def _owner_gone(lease: Path, ended: Callable[[str], bool]) -> bool:
    """Whether the job that took ``lease`` has ended: its heartbeat is gone or long silent, or
    ``ended`` (given the heartbeat's path) says so."""
    with contextlib.suppress(OSError):
        beat_file = lease.read_text()
        beat = last_beat(beat_file)
        return beat is None or time.time() - beat > STALE_S or ended(beat_file)
    return False


def _destination_of(temporary: Path) -> Path:
    """The copy an atomic_path temporary (``.<name>.tmp-XXXX``) was to become."""
    return temporary.with_name(temporary.name[1 : temporary.name.rindex(".tmp-")])


def reclaim_stale_leases(
    scratch_root: Path, ended: Callable[[str], bool] = lambda beat: False
) -> list[Path]:
    """In this user's part of ``scratch_root`` (and an earlier version's ``imagenet_ddp``
    there, where this user made it): remove the partial copies no stager writes
    (their lock is free: a stager holds it for its whole copy, and the kernel releases a
    SIGKILLed one's), ended jobs' leases (``ended``: whether a heartbeat's job has ended,
    where SLURM says so before its file goes silent), and the copies no lease holds now.
    Returns the copies removed."""
    removed = []
    # an earlier version's shared <root>/imagenet_ddp too, where this user made it
    legacy, parts = Path(scratch_root) / STAGE_DIR, [user_stage_dir(scratch_root)]
    with contextlib.suppress(OSError):
        if legacy.lstat().st_uid == os.getuid() and not legacy.is_symlink():
            parts.append(legacy)
    with scratch_access(scratch_root):
        partials = (tmp for base in parts for tmp in base.glob("*/.*.tmp-*"))
        for dest in sorted({_destination_of(tmp) for tmp in partials}):
            with exclusive_lock(lock_path_for(dest), wait=False) as held:
                if held:  # else a live stager copies it now
                    _remove_partials(dest)
            if held and cleanup_staged(dest):  # its lease too, unless a live job holds one
                removed.append(dest)
        for leases in sorted(leases for base in parts for leases in base.glob("*/*.leases")):
            stale = [p for p in leases.iterdir() if _owner_gone(p, ended)]
            if not stale:
                continue
            dest = leases.with_name(leases.name[: -len(".leases")])
            with exclusive_lock(lock_path_for(dest)):
                for lease in stale:
                    lease.unlink(missing_ok=True)
            print(f"reclaimed {len(stale)} stale staging lease(s) on {dest}", flush=True)
            if cleanup_staged(dest):  # removed only if no live lease remains
                removed.append(dest)
    return removed
