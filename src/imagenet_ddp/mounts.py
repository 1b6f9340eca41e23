"""Which filesystem holds a path: its mount point and type, read from ``/proc/self/mountinfo``.

Staging uses it to refuse a scratch root that is not node-local (:mod:`imagenet_ddp.data.stage`);
a lock on Lustre mounted ``localflock`` is taken as a directory (:mod:`imagenet_ddp.io`).
The mount is the one whose mount point is the longest prefix of the path's real path; of
several at one mount point the last listed wins (it is on top), as ``findmnt --target`` does.
Linux only; torch-free.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")

# Filesystems whose files every node of a cluster sees (or that live across the network):
# staging into one is no node-local copy. fuse.* types are named by their daemon.
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs",
    "panfs", "pvfs2", "orangefs", "ocfs2", "gfs2", "afs", "9p", "wekafs", "davfs", "ncpfs",
    "fuse.sshfs", "fuse.s3fs", "fuse.glusterfs", "fuse.ceph-fuse", "fuse.gcsfuse",
    "fuse.juicefs", "fuse.rclone", "fuse.goofys", "fuse.mountpoint-s3", "fuse.blobfuse",
    "fuse.blobfuse2", "fuse.lustre", "fuse.beegfs", "fuse.cvmfs", "fuse.weka",
})  # fmt: skip


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fs_type: str
    source: str
    options: frozenset[str] = frozenset()  # the mount's and the filesystem's own

    @property
    def is_network(self) -> bool:
        return self.fs_type in NETWORK_FS_TYPES


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Each line: ``id parent major:minor root mount_point options [optional...] - type
    source super_options`` (proc(5)); the optional fields end at the lone ``-``."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        options = frozenset(",".join([fields[5], *fields[dash + 3 : dash + 4]]).split(","))
        mounts.append(
            Mount(_unescape(fields[4]), fields[dash + 1], _unescape(fields[dash + 2]), options)
        )
    return mounts


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a scratch root may not exist yet)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_of(path: Path, mountinfo: Path = MOUNTINFO) -> Mount | None:
    """The mount holding ``path`` (or the ancestor that will hold it); None if unreadable."""
    try:
        mounts = parse_mountinfo(mountinfo.read_text())
    except OSError:
        return None
    target = os.path.realpath(path)  # resolves what exists, keeps the rest
    best, best_length = None, -1
    for mount in mounts:
        point = mount.mount_point.rstrip("/")
        holds = point == "" or target == point or target.startswith(point + "/")
        if holds and len(point) >= best_length:  # the deepest; at a tie the later (on top)
            best, best_length = mount, len(point)
    return best


def flock_is_node_local(path: Path, mountinfo: Path = MOUNTINFO) -> bool:
    """Whether flock(2) on ``path`` excludes only processes on this node: Lustre mounted
    ``localflock`` grants flock locks on each client alone (lustre's mount.lustre(8)), so two
    nodes would both hold one."""
    mount = mount_of(path, mountinfo)
    return mount is not None and "localflock" in mount.options
