"""Which filesystem holds a path (psutil's mount table): staging refuses a scratch root that
is not node-local, a lock on Lustre mounted ``localflock`` is a directory (imagenet_ddp.io).
Linux only; torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

# Filesystems whose files every node of a cluster sees (or that live across the network):
# staging into one is no node-local copy. fuse.* types are named by their daemon.
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs",
    "panfs", "pvfs2", "orangefs", "ocfs2", "gfs2", "afs", "9p", "wekafs", "davfs", "ncpfs",
    "fuse.sshfs", "fuse.s3fs", "fuse.glusterfs", "fuse.ceph-fuse", "fuse.gcsfuse",
    "fuse.juicefs", "fuse.rclone", "fuse.goofys", "fuse.mountpoint-s3", "fuse.blobfuse",
    "fuse.blobfuse2", "fuse.lustre", "fuse.beegfs", "fuse.cvmfs", "fuse.weka",
})  # fmt: skip


def is_network(mount) -> bool:
    return mount.fstype in NETWORK_FS_TYPES


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a scratch root may not exist yet)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_of(path: Path):
    """The mount holding ``path`` (or the ancestor that will hold it), as psutil lists it
    (``device``, ``mountpoint``, ``fstype``, ``opts``); None if the table is unreadable."""
    try:
        mounts = psutil.disk_partitions(all=True)  # network ones too; in mount order
    except OSError:
        return None
    target = os.path.realpath(path)  # resolves what exists, keeps the rest
    best, best_length = None, -1
    for mount in mounts:
        point = mount.mountpoint.rstrip("/")
        holds = point == "" or target == point or target.startswith(point + "/")
        if holds and len(point) >= best_length:  # the deepest; at a tie the later (on top)
            best, best_length = mount, len(point)
    return best


def flock_is_node_local(path: Path) -> bool:
    """Whether flock(2) on ``path`` excludes only processes on this node: Lustre mounted
    ``localflock`` grants flock locks on each client alone (mount.lustre(8)), so two nodes
    would both hold one."""
    mount = mount_of(path)
    return mount is not None and "localflock" in mount.opts.split(",")
