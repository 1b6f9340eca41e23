"""A real multi-node SLURM cluster on one Linux machine, for the tests and CI.

Debian's slurmctld, slurmd, slurmdbd, munged and mariadbd, started by hand (no systemd), as root.
Every "machine" is a set of Linux namespaces held open by a ``sleep`` started with
``unshare --net --uts --mount --propagation private``:

- ``ctl``: slurmctld, slurmdbd and a private mariadbd (so ``sacct`` works);
- ``node1``, ``node2``, ...: one slurmd each (``slurmd -N <name>``).

Each namespace set has its own hostname (UTS), its own address on a private /24 behind a bridge
on this machine (veth pairs; nothing is routed anywhere else) and its own mount table, which
is the host's (same paths, same files: the repo and any test copy under /tmp) except for:

- ``/etc/hosts``: adds the node names, so ``MASTER_ADDR=node1`` resolves inside jobs;
- ``/etc/slurm``: this cluster's config, so ``srun``/``scontrol`` inside jobs find it even
  where SLURM_CONF was removed from the environment (the jobstep plugin strips SLURM_*);
- ``<root>/scratch``: each node's own tmpfs (source ``scratch-<name>``), mounted in its own
  mount namespace only: the same path on every node, different content per node, and an
  empty directory on the host, as node-local disks are on a real cluster (slurm.conf TmpFS).
  As strict as a site that sets nothing: no prolog exports ``SLURM_TMPDIR`` or ``TMPDIR``
  (slurmstepd sets TMPDIR=/tmp, on the host's disk, where the job inherited none), so a job
  stages there only when configured to (``stage.scratch_dir``, :meth:`Cluster.node_scratch_config`).

Every node also declares ``Gres=gpu:<gpus_per_node>`` fake GPUs: character devices
``<root>/dev/fakegpu<i>`` (major 1, minor 3, i.e. what /dev/null is) named in ``gres.conf``,
so ``--gres=gpu:N``/``--gpus-per-task`` are scheduled and ``CUDA_VISIBLE_DEVICES`` is set per
job, step and task exactly as on a GPU cluster; nothing can compute on them. Slurm 22.05 keeps
a node whose GPU GRES has no ``File=`` INVAL, hence device files.

Fresh network namespaces have every port free, so the daemons use their default ports; only
the subnet (``10.213.<k>.0/24``, bridge ``slurmtb<k>``) is chosen per cluster, so several
clusters (parallel test sessions) can run side by side. Clients on the host reach the
controller at ``10.213.<k>.2`` with ``SLURM_CONF`` from :attr:`Cluster.env`.

``python -m tests.slurm_cluster.cluster /tmp/somewhere`` starts one by hand and keeps it up
until Enter is pressed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import stat
import string
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
SUBNET_PREFIX = "10.213"  # this sandbox's private range: 10.213.<k>.0/24 per cluster
BRIDGE_PREFIX = "slurmtb"
# Subnet bookkeeping shared by all sessions on this machine: a lock serialising the choice and,
# per claimed bridge, a file with the owning process id (a dead owner means a stale bridge).
CLAIMS_DIR = Path("/tmp/.slurm-test-clusters")
REQUIRED_COMMANDS = (
    "slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "mariadb-install-db", "mariadb",
    "sbatch", "srun", "sacct", "sacctmgr", "sinfo", "scontrol", "unshare", "nsenter", "ip",
)  # fmt: skip
SLURMCTLD_PORT, SLURMD_PORT, SLURMDBD_PORT, MYSQL_PORT = 6817, 6818, 6819, 3306


class ClusterError(RuntimeError):
    """The cluster could not be started; the message carries the relevant daemon logs."""


def unavailable_reason() -> str | None:
    """Why no cluster can run here (None if it can): not root, no packages, no namespaces."""
    if os.geteuid() != 0:
        return "needs root (network/UTS/mount namespaces, daemons as SlurmUser=root)"
    missing = [c for c in REQUIRED_COMMANDS if not shutil.which(c)]
    if missing:
        return f"missing {', '.join(missing)}: run .ci/install-slurm.sh"
    probe = subprocess.run(
        ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "true"],
        capture_output=True, text=True,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"cannot create namespaces: {probe.stderr.strip()}"
    return None


@dataclass
class Node:
    """One namespace set ("machine"): its name, address and the process holding it open."""

    name: str
    addr: str
    holder: subprocess.Popen
    netns: str = ""  # readlink of /proc/<holder>/ns/net, identifies our processes


@dataclass
class Cluster:
    root: Path  # everything this cluster wrote lives here
    name: str
    subnet: str  # "10.213.<k>"
    bridge: str
    ctl: Node
    nodes: list[Node]
    scratch: Path  # node-local scratch mount point, the same path on every node
    env: dict[str, str]  # os.environ + SLURM_CONF: run clients (sbatch, sacct...) with it
    account: str = "ci"
    service_partition: str = "service"  # its one node: a slurmd in the controller's namespace
    startup_seconds: float = 0.0
    keep_files: bool = False
    # "cgroup" (most sites: slurmstepd SIGKILLs what is left in a step's cgroup once its
    # task exits) where this machine lets us make freezer cgroups, else "linuxproc"
    proctrack: str = "linuxproc"
    _cgroups: list[Path] = field(default_factory=list)  # each node's freezer root (host path)
    _daemons: list[subprocess.Popen] = field(default_factory=list)
    _namespaces: list[Node] = field(default_factory=list)  # every one created, even half set up
    _links: list[str] = field(default_factory=list)  # host ends of the veth pairs
    _stopped: bool = False

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def node_files(self, name: str, under: Path | None = None) -> list[str]:
        """The regular files under ``under`` (default: the scratch mount) as node ``name``
        sees them, sorted: the host cannot see a node's tmpfs."""
        top = str(under or self.scratch)
        out = self.on_node(name, "find", top, "-type", "f", check=False).stdout
        return sorted(out.split())

    def node_scratch_config(self) -> dict:
        """The config a user of this cluster sets, as a site user sets their node-local disk:
        ``stage: {scratch_dir: <the nodes' tmpfs>}``."""
        return {"scratch_dir": str(self.scratch)}

    def run(self, *argv: str, check: bool = True, timeout: float = 60, **kwargs):
        """Run a client command on the host against this cluster."""
        return _run(list(argv), env=self.env, check=check, timeout=timeout, **kwargs)

    def on_node(self, name: str, *argv: str, check: bool = True, timeout: float = 60, **kw):
        """Run a command inside a node's namespaces (its hostname, address and scratch)."""
        node = next(n for n in [self.ctl, *self.nodes] if n.name == name)
        return _run(_nsenter(node, *argv), env=self.env, check=check, timeout=timeout, **kw)

    def sbatch(self, *args: str, cwd: Path | None = None) -> int:
        out = self.run("sbatch", "--parsable", *args, cwd=cwd).stdout
        return int(out.strip().split(";")[0])

    def job_state(self, job_id: int) -> str | None:
        """The allocation's State in the accounting database (None until slurmdbd has it)."""
        out = self.run(
            "sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State", check=False
        ).stdout.split()
        return out[0] if out else None

    def wait_job(self, job_id: int, timeout: float = 120) -> str:
        """Wait until sacct shows the job finished; return its State (e.g. COMPLETED)."""
        final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        state = _wait(lambda: (s := self.job_state(job_id)) and s.split()[0] in final and s,
                      timeout, f"job {job_id} to finish", self)  # fmt: skip
        return state

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon log, for failure messages."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"==> {log.name} <==\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Kill every process in this cluster's namespaces and remove what start created."""
        if self._stopped:
            return
        self._stopped = True
        for node in reversed(self._namespaces):  # the nodes, then the controller
            _kill_namespace(node)
        for proc in self._daemons:  # munged (host) and anything not caught above
            _terminate(proc)
        for link in self._links:  # normally gone with its namespace already
            if _link_exists(link):
                _run(["ip", "link", "del", link], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        for tree in self._cgroups:  # empty now: remove the cgroups slurmstepd left, deepest first
            for folder, _, _ in sorted(os.walk(tree), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
        (CLAIMS_DIR / self.bridge).unlink(missing_ok=True)
        if not self.keep_files:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_cluster(
    workdir: Path,
    nodes: int = 2,
    cpus_per_node: int = 2,
    mem_per_node_mb: int = 4000,
    *,
    gpus_per_node: int = 2,
    name: str = "ci",
    scratch_mb: int = 512,
    keep_files: bool = False,
    timeout: float = 90,
) -> Cluster:
    """Start munged, mariadbd, slurmdbd, slurmctld and ``nodes`` slurmds; wait until idle.

    Files go to ``workdir/slurm`` (removed by :meth:`Cluster.stop` unless ``keep_files``).
    ``scratch_mb``: the size of each node's tmpfs at :attr:`Cluster.scratch` (memory, used only
    as far as it is filled).
    """
    reason = unavailable_reason()
    if reason:
        raise ClusterError(reason)
    t0 = time.monotonic()
    root = Path(workdir).resolve() / "slurm"
    if root.exists():
        shutil.rmtree(root)
    for sub in ("etc", "state", "log", "munge", "scratch", "dev"):
        (root / sub).mkdir(parents=True)
    root.chmod(0o755)

    subnet, bridge = _claim_subnet()
    # From here on, anything that fails must tear down what exists.
    cluster = Cluster(
        root=root, name=name, subnet=subnet, bridge=bridge,
        ctl=None, nodes=[], scratch=root / "scratch",  # type: ignore[arg-type]
        env={**os.environ, "SLURM_CONF": str(root / "etc" / "slurm.conf")},
        keep_files=keep_files,
    )  # fmt: skip
    try:
        _start(cluster, nodes, cpus_per_node, mem_per_node_mb, gpus_per_node,
               scratch_mb, timeout)  # fmt: skip
    except BaseException as exc:
        cluster.keep_files = True  # keep the logs for the error message / post-mortem
        logs = cluster.logs()
        cluster.stop()
        if not keep_files:
            shutil.rmtree(root, ignore_errors=True)
        if not isinstance(exc, Exception):  # KeyboardInterrupt etc.
            raise
        raise ClusterError(
            f"SLURM test cluster failed to start: {exc}\ndaemon logs:\n{logs}"
        ) from exc
    cluster.startup_seconds = time.monotonic() - t0
    return cluster


def _start(cluster: Cluster, n_nodes: int, cpus: int, mem_mb: int, gpus: int, scratch_mb: int,
           timeout):  # fmt: skip
    root, subnet = cluster.root, cluster.subnet
    cluster.proctrack = "cgroup" if _freezer_usable() else "linuxproc"
    for i in range(gpus):  # fake GPUs: any character device will do for slurmd
        os.mknod(root / "dev" / f"fakegpu{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    cluster.ctl = _make_namespace("slurmctl", f"{subnet}.2", cluster)
    for i in range(1, n_nodes + 1):
        cluster.nodes.append(_make_namespace(f"node{i}", f"{subnet}.{10 + i}", cluster))

    # Config files, scripts and the /etc/hosts the namespaces see.
    values = {
        "workdir": str(root),
        "cluster_name": cluster.name,
        "ctl_name": cluster.ctl.name,
        "ctl_addr": cluster.ctl.addr,
        "ctl_port": SLURMCTLD_PORT,
        "slurmd_port": SLURMD_PORT,
        "dbd_port": SLURMDBD_PORT,
        "mysql_port": MYSQL_PORT,
        "munge_socket": str(root / "munge" / "munge.socket"),
        "scratch": str(cluster.scratch),
        "cpus": cpus,
        "scratch_mb": scratch_mb,  # TmpDisk: slurmd measures TmpFS, a node with less is INVAL
        "mem_mb": mem_mb,
        "gres_line": f"Gres=gpu:{gpus}" if gpus else "",
        "gres_conf": f"Name=gpu File={root}/dev/fakegpu[0-{gpus - 1}]" if gpus else "",
        "proctrack": cluster.proctrack,
        "node_lines": "\n".join(f"NodeName={n.name} NodeAddr={n.addr}" for n in cluster.nodes),
        "compute_nodes": ",".join(n.name for n in cluster.nodes),
        "service_node": cluster.ctl.name,
    }
    etc = root / "etc"
    for template in TEMPLATES.iterdir():
        text = string.Template(template.read_text()).substitute(values)
        target = etc / template.name
        target.write_text(text)
        target.chmod(0o755 if template.suffix == ".sh" else 0o644)
    (etc / "slurmdbd.conf").chmod(0o600)  # slurmdbd refuses a readable slurmdbd.conf
    hosts = (
        Path("/etc/hosts").read_text().rstrip("\n")
        + "\n"
        + "".join(f"{n.addr} {n.name}\n" for n in [cluster.ctl, *cluster.nodes])
    )
    (etc / "hosts").write_text(hosts)
    for node in [cluster.ctl, *cluster.nodes]:
        _configure_namespace(cluster, node, scratch_mb)

    # munged on the host; its socket file is visible in every mount namespace.
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    munge = root / "munge"
    cluster._daemons.append(_daemon(
        cluster, "munged",
        ["munged", "-F", "--force", f"--key-file={key}", f"--socket={munge}/munge.socket",
         f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed",
         f"--log-file={root}/log/munged.log"],
    ))  # fmt: skip
    _wait(lambda: (munge / "munge.socket").exists(), 20, "munged's socket", None)

    # MariaDB: private datadir, listening on the controller namespace's loopback only.
    datadir, tmpdir = root / "mysql", root / "mysql-tmp"
    tmpdir.mkdir()  # private: bootstrap servers of parallel clusters collide in /tmp
    _run(["mariadb-install-db", "--no-defaults", f"--datadir={datadir}", "--user=root",
          "--auth-root-authentication-method=normal", "--skip-test-db",
          f"--tmpdir={tmpdir}"], timeout=120)  # fmt: skip
    sock = root / "mysql.sock"
    cluster._daemons.append(_daemon(
        cluster, "mariadbd",
        _nsenter(cluster.ctl, "mariadbd", "--no-defaults", f"--datadir={datadir}",
                 f"--socket={sock}", f"--port={MYSQL_PORT}", "--bind-address=127.0.0.1",
                 "--user=root", f"--pid-file={root}/state/mariadbd.pid",
                 f"--log-error={root}/log/mariadbd.log", "--skip-log-bin", f"--tmpdir={tmpdir}",
                 "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=16M"),
    ))  # fmt: skip
    sql = ["mariadb", "--no-defaults", f"--socket={sock}", "-uroot"]
    _wait(lambda: _run([*sql, "-e", "SELECT 1"], check=False).returncode == 0,
          timeout, "mariadbd", None)  # fmt: skip
    _run([*sql, "-e",
          "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';"
          "CREATE USER 'slurm'@'localhost' IDENTIFIED BY 'slurm';"
          "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
          "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"])  # fmt: skip

    # slurmdbd, then the cluster/account/user records, then slurmctld, then the slurmds.
    cluster._daemons.append(_daemon(cluster, "slurmdbd", _nsenter(cluster.ctl, "slurmdbd", "-D")))
    _wait(lambda: cluster.run("sacctmgr", "-n", "list", "cluster", check=False).returncode == 0,
          timeout, "slurmdbd", None)  # fmt: skip
    for args in (
        ["add", "cluster", cluster.name],
        ["add", "account", cluster.account, f"Cluster={cluster.name}", "Description=tests"],
        ["add", "user", "root", f"Account={cluster.account}", f"Cluster={cluster.name}"],
    ):
        cluster.run("sacctmgr", "-i", *args)
    cluster._daemons.append(
        _daemon(cluster, "slurmctld", _nsenter(cluster.ctl, "slurmctld", "-D", "-i"))
    )
    _wait(lambda: "UP" in cluster.run("scontrol", "ping", check=False).stdout,
          timeout, "slurmctld", None)  # fmt: skip
    for node in [*cluster.nodes, cluster.ctl]:  # the controller's namespace: the service node
        (root / "state" / node.name).mkdir()
        cluster._daemons.append(
            _daemon(
                cluster, f"slurmd-{node.name}", _nsenter(node, "slurmd", "-D", "-N", node.name)
            )  # fmt: skip
        )

    def all_idle() -> bool:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        stuck = [n for n, s in states.items() if s.startswith(("down", "drain"))]
        if stuck:  # a node that registered late may need a nudge (ReturnToService=2 usually)
            cluster.run("scontrol", "update", f"NodeName={','.join(stuck)}", "State=RESUME",
                        check=False)  # fmt: skip
        return len(states) == len(cluster.nodes) + 1 and all(s == "idle" for s in states.values())

    _wait(all_idle, timeout, "all nodes idle in sinfo", None)


def _claim_subnet() -> tuple[str, str]:
    """Pick a free 10.213.<k>.0/24 and create its bridge (holding a lock against races)."""
    CLAIMS_DIR.mkdir(mode=0o700, exist_ok=True)
    with open(CLAIMS_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        links = _run(["ip", "-o", "link", "show"]).stdout
        # A bridge of ours whose owner process is gone is left over from a killed session.
        stale = [
            bridge
            for bridge in re.findall(rf"^\d+: ({BRIDGE_PREFIX}\d+)[:@]", links, re.M)
            if not _owner_alive(CLAIMS_DIR / bridge)
        ]
        for bridge in stale:
            _run(["ip", "link", "del", bridge], check=False)
            (CLAIMS_DIR / bridge).unlink(missing_ok=True)
        # Host ends of veth pairs whose bridge is gone (a killed session's nodes).
        bridges = set(re.findall(rf"^\d+: ({BRIDGE_PREFIX}\d+)[:@]", links, re.M)) - set(stale)
        for link, k in re.findall(r"^\d+: (stb(\d+)v\d+)[:@]", links, re.M):
            if f"{BRIDGE_PREFIX}{k}" not in bridges:
                _run(["ip", "link", "del", link], check=False)
        addrs = _run(["ip", "-o", "-4", "addr", "show"]).stdout
        for k in range(256):
            subnet, bridge = f"{SUBNET_PREFIX}.{k}", f"{BRIDGE_PREFIX}{k}"
            if f" {subnet}." in addrs or _link_exists(bridge):
                continue
            _run(["ip", "link", "add", bridge, "type", "bridge"])
            (CLAIMS_DIR / bridge).write_text(str(os.getpid()))
            _run(["ip", "addr", "add", f"{subnet}.1/24", "dev", bridge])
            _run(["ip", "link", "set", bridge, "up"])
            return subnet, bridge
    raise ClusterError(f"no free {SUBNET_PREFIX}.<k>.0/24 subnet")


def _owner_alive(claim: Path) -> bool:
    try:
        os.kill(int(claim.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def _make_namespace(name: str, addr: str, cluster: Cluster) -> Node:
    holder = subprocess.Popen(
        ["unshare", "--net", "--uts", "--mount", "--propagation", "private",
         "sleep", "infinity"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    node = Node(name=name, addr=addr, holder=holder)
    cluster._namespaces.append(node)  # stop() cleans it up from now on
    mine = os.readlink("/proc/self/ns/net")
    # unshare execs sleep once the namespaces exist; only then may we nsenter into them.
    _wait(lambda: _netns(holder.pid) not in (None, mine), 10, f"namespaces of {name}", None)
    node.netns = _netns(holder.pid) or ""
    # veth pair: one end on the bridge, the other moved into the namespace as eth0.
    k, idx = cluster.subnet.rsplit(".", 1)[1], addr.rsplit(".", 1)[1]
    host_end, peer = f"stb{k}v{idx}", f"stb{k}p{idx}"
    _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", peer])
    cluster._links.append(host_end)
    _run(["ip", "link", "set", host_end, "master", cluster.bridge, "up"])
    _run(["ip", "link", "set", peer, "netns", str(holder.pid)])
    _run(_nsenter(node, "sh", "-ec", f"""
        hostname {name}
        ip link set lo up
        ip link set {peer} name eth0
        ip addr add {addr}/24 dev eth0
        ip link set eth0 up
    """))  # fmt: skip
    return node


def _configure_namespace(cluster: Cluster, node: Node, scratch_mb: int) -> None:
    etc = cluster.root / "etc"
    mounts = f"mount --bind {etc}/hosts /etc/hosts\nmount --bind {etc} /etc/slurm\n"
    if node is not cluster.ctl:  # its own tmpfs, seen only in its mount namespace
        mounts += (f"mount -t tmpfs -o size={scratch_mb}m,mode=1777 scratch-{node.name} "
                   f"{cluster.scratch}\n")  # fmt: skip
    if node is not cluster.ctl and cluster.proctrack == "cgroup":
        # Its own freezer hierarchy: every slurmd names a job's cgroup slurm/uid_0/job_<id>, so
        # on one shared hierarchy the nodes of a 2-node job would share (and kill) one cgroup.
        tree = FREEZER / f"{cluster.bridge}-{node.name}"
        tree.mkdir()
        cluster._cgroups.append(tree)
        mounts += f"mount --bind {tree} {FREEZER}\n"
    _run(_nsenter(node, "sh", "-ec", mounts))


FREEZER = Path("/sys/fs/cgroup/freezer")  # cgroup v1: what proctrack/cgroup uses there


def _freezer_usable() -> bool:
    """Whether this machine has a writable cgroup v1 freezer hierarchy (proctrack/cgroup with
    cgroup/v1). Slurm 22.05's cgroup/v2 needs the unified hierarchy at /sys/fs/cgroup with
    delegated controllers, which a sandbox's hybrid layout does not give."""
    probe = FREEZER / f"probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return (FREEZER / "cgroup.procs").exists()


def _nsenter(node: Node, *argv: str) -> list[str]:
    # Not `ip netns exec`: that remounts /sys and needs named namespaces.
    return ["nsenter", "-t", str(node.holder.pid), "--net", "--uts", "--mount", "--", *argv]


def _daemon(cluster: Cluster, name: str, argv: list[str]) -> subprocess.Popen:
    """Start a foreground daemon; stdout/stderr go to log/<name>.out."""
    out = open(cluster.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (owned by Popen)
    proc = subprocess.Popen(
        argv, env=cluster.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    out.close()
    time.sleep(0.2)
    if proc.poll() is not None:
        raise ClusterError(f"{name} exited at once ({proc.returncode})")
    return proc


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _kill_namespace(node: Node) -> None:
    """SIGTERM, then SIGKILL, every process in the node's network namespace (all ours)."""
    if not node.netns:
        _terminate(node.holder)
        return
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _netns(int(p)) == node.netns]
        pids = [p for p in pids if p != node.holder.pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _netns(p) == node.netns and not _is_zombie(p)]
            time.sleep(0.1)
        if not pids:
            break
    _terminate(node.holder)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _link_exists(name: str) -> bool:
    return _run(["ip", "link", "show", name], check=False).returncode == 0


def _run(argv: list[str], *, check: bool = True, timeout: float = 60, **kwargs):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise ClusterError(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
        )
    return result


def _wait(predicate, timeout: float, what: str, cluster: Cluster | None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = f"\n{cluster.logs()}" if cluster is not None else ""
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}{logs}")
        time.sleep(0.25)


if __name__ == "__main__":
    cluster = start_cluster(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/slurm-cluster"))
    print(f"up in {cluster.startup_seconds:.1f}s; export SLURM_CONF={cluster.conf}")
    print(cluster.run("sinfo").stdout)
    with contextlib.suppress(KeyboardInterrupt, EOFError):
        input("Enter stops the cluster... ")
    cluster.stop()
