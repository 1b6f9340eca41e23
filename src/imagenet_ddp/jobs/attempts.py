"""Every allocation of a run: the attempt record kept beside its checkpoints.

A run that outlives its time limit trains in several jobs (Snakemake resubmits a stopped
job: the rule's ``retries``). Each job (an *attempt*; on SLURM one allocation) appends one
entry to ``<checkpoint_root>/attempts.json``, outside the rule's outputs, so Snakemake's
cleanup of a failed attempt keeps it. The launcher writes the entry (:func:`begin`) before
staging and closes it (:func:`end`) when its ranks are gone; its job's heartbeat
(:func:`beat_path`, the entry's ``beat``) says it lives, so an attempt killed with the launcher
(SIGKILL after KillWait, a node failure) is closed by the next one at its last sign of life.

An entry: ``attempt`` (1, 2, ... per line of checkpoints: :func:`settings_key`),
``slurm_job_id``, ``host``, ``started``/``ended`` (Unix seconds), ``beat``, ``exit_code``,
``outcome`` (completed, stopped: exit 75 after a checkpoint, or its ranks recorded a stop and
wrote its checkpoint: :func:`stopped_by_ranks`, failed, killed: no end recorded, refused,
diverged: stopped by the divergence guard, its outputs written and marked, exit 0 so that
nothing retries it: a retry would diverge again), ``start`` (the checkpoint it resumed from:
epoch, step, path, or epoch 0 step 0),
``last_checkpoint`` (the newest it wrote, with its mtime), ``error`` (the first rank's error
line), ``gpus``, ``cores``, ``code`` (the commit the launcher ran, whether the checkout had
uncommitted changes and their digest: :func:`imagenet_ddp.provenance.code_version`), ``stop``
(for a stopped one: the ranks' stop record, the signal a rank got and where it stopped). A run
resubmitted over days runs whatever is checked out at each submission; :func:`code_versions`
says whether its attempts ran different code.

Two rules use it (:func:`refusal`): a Snakemake retry (``attempt`` > 1 in this invocation)
after two attempts in a row that failed without writing a checkpoint refuses at once with the
error (one real retry: a bad node or a transient start-up failure gets a second chance; a crash
that repeats at start uses two jobs), and no invocation runs more than ``max_allocations`` jobs
of a run. The workflow asks the same question before it submits a retry
(:func:`refusal_ahead`) and submits a retry that will refuse as a one-CPU job, so it holds no
GPU and no queue slot of the run's size. The cost block sums all attempts
(:func:`cost_over_attempts`).

Torch-free: the launcher reads and writes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

from imagenet_ddp.io import HEARTBEAT_S, Heartbeat, last_beat, write_json_atomic
from imagenet_ddp.jobs.early_signals import EXIT_REQUEUE  # torch-free, as this module
from imagenet_ddp.provenance import code_version
from imagenet_ddp.settings.geometry import (
    SAMPLE_ORDER,
    Geometry,
    accepted_nodes,
    global_batch,
    world_size,
)
from imagenet_ddp.settings.kinds import digest, weight_settings

RECORD = "attempts.json"
_CHECKPOINT = re.compile(r"checkpoint-e(\d+)-s(\d+)\.pt$")
ALIVE_DIR = "alive"  # the jobs' heartbeats (io.Heartbeat), one file per job


def record_path(checkpoint_root: str | os.PathLike[str]) -> Path:
    return Path(checkpoint_root) / RECORD


def settings_key(run: dict[str, Any]) -> str:
    """Which entries belong together: the attempts that train one line of checkpoints, keyed
    as the checkpoints are (training.checkpoint.checkpoint_tag: the settings that change the
    weights, the global batch, the sample order's version and the geometry but its rank
    count). A changed `max_allocations` or `gpu_type`, or another node count with the same
    global batch (`accumulation`), resumes the checkpoints and continues the count; a changed
    `lr` or global batch starts both afresh."""
    # The tag's fields, as the run states them (workers may say "auto").
    geometry = {k: run.get(k) for k in ("cpus_per_task", "gpus_per_node", "workers")}
    if run.get("sync_bn"):  # its checkpoints key on the rank count too
        geometry["world"] = world_size(run)
    order = {"global_batch": global_batch(run), "order": SAMPLE_ORDER}
    return digest({**weight_settings(run), "geometry": geometry, **order})


def _of_settings(attempts: list[dict[str, Any]], run: dict[str, Any]) -> list[dict[str, Any]]:
    return of_run(attempts, settings_key(run))


def beat_path(checkpoint_root) -> Path:
    """This job's heartbeat file (the same in each of its srun tasks): the SLURM job and its
    restart count, or the host and the launcher's pid."""
    job, restart = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
    name = f"{job}-{restart}" if job else f"local-{socket.gethostname()}-{os.getpid()}"
    return Path(checkpoint_root) / ALIVE_DIR / name


def last_sign(checkpoint_root, entry: dict[str, Any]) -> float:
    """When the entry's job last beat (its start where it never did)."""
    beat = entry.get("beat") and last_beat(Path(checkpoint_root) / ALIVE_DIR / entry["beat"])
    return max(beat or 0.0, entry["started"])


def has_record(checkpoint_root: str | os.PathLike[str]) -> bool:
    return record_path(checkpoint_root).is_file()


def load(checkpoint_root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = record_path(checkpoint_root)
    if not path.is_file():
        return []
    return json.loads(path.read_text())["attempts"]


def _save(checkpoint_root, attempts: list[dict[str, Any]]) -> None:
    path = record_path(checkpoint_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"attempts": attempts})


def of_run(attempts: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [a for a in attempts if a.get("key") == key]


def newest_checkpoint(checkpoint_root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest checkpoint file under the run's checkpoint root (any geometry directory):
    epoch, step, path, mtime. Names sort by (epoch, step) (training.checkpoint)."""
    root = Path(checkpoint_root)
    found = []
    for path in root.glob("*/checkpoint-*.pt") if root.is_dir() else []:
        match = _CHECKPOINT.search(path.name)
        if match:
            found.append((int(match.group(1)), int(match.group(2)), path))
    if not found:
        return None
    epoch, step, path = max(found)
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:  # pruned meanwhile
        return None
    return {"epoch": epoch, "step": step, "path": str(path), "written": mtime}


def final_checkpoint(checkpoint_root, run: dict[str, Any]) -> str | None:
    """The run's checkpoint after its last epoch, where an attempt of these settings recorded
    it and it is still there (its job ended before writing the outputs): the next job has
    nothing to train and needs no staged copy."""
    recorded = load(checkpoint_root)
    for entry in _of_settings(recorded, run) if recorded else []:
        last = entry.get("last_checkpoint") or {}
        if last.get("epoch", 0) >= run["epochs"] and Path(last["path"]).is_file():
            return last["path"]
    return None


def made_progress(entry: dict[str, Any]) -> bool:
    """Whether the attempt wrote a checkpoint past the point it started from."""
    last, start = entry.get("last_checkpoint"), entry.get("start") or {}
    return bool(last) and (last["epoch"], last["step"]) > (
        start.get("epoch", 0),
        start.get("step", 0),
    )


def _close_killed(entry: dict[str, Any], checkpoint_root, ahead: bool = False) -> None:
    """An entry its launcher never closed: it ended at its last heartbeat, killed; or, where
    its ranks recorded a stop and the checkpoint of that stop was written, stopped at that
    checkpoint (under ``proctrack/cgroup`` slurmstepd SIGKILLs the launcher with the batch
    step on scancel, preemption and the time limit while the ranks still checkpoint).
    ``ahead``: read by the workflow as soon as SLURM says the job ended, while the ranks may
    still write that checkpoint (KillWait): a recorded stop is a stop (SLURM's signal, not a
    node failure); the next job's own reading decides for good."""
    entry["outcome"], entry["ended"] = "killed", last_sign(checkpoint_root, entry)
    last = newest_checkpoint(checkpoint_root)
    if last and last["written"] >= entry["started"]:
        entry["last_checkpoint"] = last
    stop = stopped_by_ranks(checkpoint_root, entry, checkpointed=not ahead)
    if stop is not None:
        entry.update(outcome="stopped", stop=stop)
        if entry.get("last_checkpoint"):
            entry["ended"] = max(entry["ended"], entry["last_checkpoint"]["written"])


def _failed_without_progress(entry: dict[str, Any]) -> bool:
    return entry["outcome"] in ("failed", "killed") and not made_progress(entry)


def refusal(mine: list[dict[str, Any]], attempt: int, max_allocations: int) -> str | None:
    """Why this job must not train (None: it may). ``mine``: the run's earlier attempts, oldest
    first, the newest closed; ``attempt``: Snakemake's attempt number in this invocation (1: not
    a retry)."""
    if attempt > max_allocations:
        return (
            f"this is job {attempt} of the run in this invocation, above its max_allocations "
            f"({max_allocations}); raise max_allocations or rerun to continue from the newest "
            "checkpoint"
        )
    if attempt == 1 or not mine:
        return None
    previous = mine[-1]
    if previous["outcome"] == "refused":  # the same reason, not nested
        return previous["error"]
    if previous["outcome"] == "diverged":  # exits 0; a retry would diverge again
        return f"not retrying: {previous.get('error')}"
    # One retry after a failure without progress (a bad node, a transient start-up error);
    # none after the second in a row: the cause is the run's, and a retry cannot help.
    if len(mine) < 2 or not all(_failed_without_progress(a) for a in mine[-2:]):
        return None
    where = previous.get("start") or {}
    return (
        f"not retrying: the previous two attempts made no progress; the last (job "
        f"{previous.get('slurm_job_id') or 'local'}, exit code {previous.get('exit_code')}, "
        f"{previous['outcome']}) from epoch {where.get('epoch', 0)} step {where.get('step', 0)}: "
        f"{previous.get('error') or 'see its log'}; fix the cause and rerun"
    )


def _closed(mine: list[dict[str, Any]], checkpoint_root, ahead=False) -> list[dict[str, Any]]:
    """``mine`` with a newest entry its launcher never closed closed as killed or stopped (in
    place; ``ahead``: :func:`_close_killed`)."""
    if mine and mine[-1].get("ended") is None:
        _close_killed(mine[-1], checkpoint_root, ahead)
    return mine


def refusal_ahead(checkpoint_root, run: dict[str, Any], attempt: int) -> str | None:
    """What :func:`begin` of this attempt will refuse, read without writing: the workflow asks
    before it submits a retry (a refused retry needs no GPU)."""
    if attempt == 1:
        return None
    mine = _closed(_of_settings(load(checkpoint_root), run), checkpoint_root, ahead=True)
    return refusal(mine, attempt, int(run.get("max_allocations", 10)))


def nodes_ahead(checkpoint_root, run: dict[str, Any], attempt: int, since: float) -> int:
    """The node count the workflow asks for Snakemake's ``attempt`` of ``run`` in the
    invocation that began at ``since`` (Unix seconds): :func:`choose_nodes` over the record."""
    counts = accepted_nodes(run)
    if attempt == 1 or len(counts) == 1:
        return counts[0]
    _settle(checkpoint_root, run)
    mine = _closed(_of_settings(load(checkpoint_root), run), checkpoint_root, ahead=True)
    return choose_nodes(mine, counts, attempt, since)


SETTLE_SECONDS = 30.0


def _settle(checkpoint_root, run: dict[str, Any], seconds: float = SETTLE_SECONDS) -> None:
    """Wait, at most ``seconds``, while the newest entry is open, was alive a heartbeat ago
    and no rank recorded a stop: SLURM reports a job ended (scancel, preemption, the time
    limit) while its ranks are still agreeing to stop and its launcher still closing the
    entry; read then, a stop would count as a node failure."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        mine = _of_settings(load(checkpoint_root), run)
        last = mine[-1] if mine else None
        if last is None or last.get("ended") is not None:
            return
        if time.time() - last_sign(checkpoint_root, last) > HEARTBEAT_S + 5:
            return  # long silent: killed (a node failure), nothing to wait for
        if stopped_by_ranks(checkpoint_root, last, checkpointed=False):
            return
        time.sleep(1.0)


def choose_nodes(
    mine: list[dict[str, Any]], counts: tuple[int, ...], attempt: int, since: float
) -> int:
    """The node count of submission ``attempt`` of this invocation (``counts``: preferred
    first, then smaller). The first asks for the preferred count; after a job that was
    stopped (time limit, scancel, preemption: it checkpointed and exits 75) the next asks for
    it again; after one that failed or was killed (a node failure, a rank's error) or that
    left no entry because it never started (cancelled while pending: a long queue wait), the
    next asks for the next smaller count, the smallest staying the smallest. Entries that
    began before ``since`` belong to earlier invocations."""
    ours = {a.get("snakemake_attempt"): a for a in mine if a["started"] >= since}
    nodes = counts[0]
    for submission in range(1, attempt):
        entry = ours.get(submission)
        if entry is not None and entry["outcome"] in ("stopped", "completed"):
            nodes = counts[0]
        else:
            nodes = next((n for n in counts if n < nodes), nodes)
    return nodes


def begin(
    checkpoint_root,
    run: dict[str, Any],
    *,
    attempt: int,
    gpus: int,
    cores: int,
    shape: Geometry | None = None,
) -> tuple[dict[str, Any], str | None]:
    """Close a killed predecessor, append this attempt; returns (entry, refusal reason)."""
    attempts, key = load(checkpoint_root), settings_key(run)
    mine = _closed(_of_settings(attempts, run), checkpoint_root)
    now = time.time()
    entry = {
        "attempt": len(mine) + 1,
        "key": key,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),  # a requeued job's run
        "snakemake_attempt": attempt,
        "host": socket.gethostname(),
        "started": now,
        "beat": beat_path(checkpoint_root).name,
        "ended": None,
        "exit_code": None,
        "outcome": "running",
        "start": newest_checkpoint(checkpoint_root) or {"epoch": 0, "step": 0, "path": None},
        "last_checkpoint": None,
        "error": None,
        "gpus": gpus,
        "cores": cores,
        # nodes x ranks per node this attempt ran on, and its micro-batches per rank and step:
        # an elastic run's attempts may differ (docs/reliability.md)
        "shape": None if shape is None else shape.shape,
        "accumulation": int(run.get("accumulation") or 1),
        "code": {k: v for k, v in code_version().items() if k.startswith("git_")},
    }
    why = refusal(mine, attempt, int(run.get("max_allocations", 10)))
    if why:
        entry.update(outcome="refused", ended=now, exit_code=1, error=why)
    attempts.append(entry)
    _save(checkpoint_root, attempts)
    return entry, why


def ran_in_this_allocation(checkpoint_root, run: dict[str, Any]) -> dict | None:
    """An ended attempt of the run in this very SLURM allocation (the same job id and restart
    count), None if none: a rule's retries reach the jobstep's own Snakemake, which would run
    the job again inside the allocation it ended in (snakemake-executor-plugin-slurm#284)."""
    own = os.environ.get("SLURM_JOB_ID")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    for entry in of_run(load(checkpoint_root), settings_key(run)) if own else []:
        same = entry.get("slurm_job_id") == own and entry.get("slurm_restart", "0") == restart
        if same and entry.get("ended") is not None:
            return entry
    return None


def _update(checkpoint_root, entry: dict[str, Any], **changes) -> None:
    attempts = load(checkpoint_root)
    for i, other in enumerate(attempts):
        if other["key"] == entry["key"] and other["attempt"] == entry["attempt"]:
            attempts[i] = {**other, **changes}
    entry.update(changes)
    _save(checkpoint_root, attempts)


def end(checkpoint_root, entry: dict[str, Any], exit_code: int) -> None:
    """Close this attempt: its end, exit code, outcome, newest checkpoint and first error."""
    last = newest_checkpoint(checkpoint_root)
    if last and last["written"] < entry["started"]:
        last = None  # written by an earlier attempt
    outcome = {0: "completed", EXIT_REQUEUE: "stopped"}.get(exit_code, "failed")
    stop = stopped_by_ranks(checkpoint_root, entry) if outcome == "stopped" else None
    error = entry.get("error") or first_error(checkpoint_root, entry)
    diverged = divergence(checkpoint_root, entry["started"]) if exit_code == 0 else None
    if diverged:
        outcome, error = "diverged", diverged
    hung = hung_rank(checkpoint_root, entry["started"]) if outcome == "failed" else None
    if hung:
        print(f"watchdog: {hung}", flush=True)
        error = f"{hung}; {error}" if error else hung
    _update(
        checkpoint_root, entry, ended=time.time(), exit_code=exit_code, outcome=outcome,
        last_checkpoint=last, error=error, **({"stop": stop} if stop else {}),
    )  # fmt: skip


# ------------------------------------------------------------------ errors of the ranks

ERRORS_DIR = "errors"


def record_error(checkpoint_root, rank: int, host: str, error: BaseException) -> None:
    """A rank's uncaught error, one line, for the attempt record (worker.main calls it)."""
    folder = Path(checkpoint_root) / ERRORS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    line = f"rank {rank} on {host}: {type(error).__name__}: {error}".splitlines()[0][:500]
    (folder / f"rank{rank}.txt").write_text(f"{time.time()}\n{line}\n")


def first_error(checkpoint_root, entry: dict[str, Any]) -> str | None:
    """The earliest error a rank recorded during this attempt."""
    found = []
    for path in sorted((Path(checkpoint_root) / ERRORS_DIR).glob("rank*.txt")):
        stamp, _, line = path.read_text().partition("\n")
        if float(stamp) >= entry["started"]:
            found.append((float(stamp), line.strip()))
    return min(found)[1] if found else None


# ------------------------------------------------------------------ stops of the ranks

STOPS_DIR = "stops"


def record_stop(
    checkpoint_root, rank: int, host: str, epoch: int, step: int, signum: int = 0
) -> None:
    """A rank stops for requeue at (``epoch``, ``step``), the position of the checkpoint it
    stops at (``signum``: the signal this rank got, 0 for another rank's). Written before that
    checkpoint is complete, so a rank killed afterwards (KillWait) has recorded it, and the
    attempt is ``stopped`` once that checkpoint is on disk whoever got the signal and whether
    or not the launcher lived to close the entry (:func:`stopped_by_ranks`)."""
    name = signal.Signals(signum).name if signum else None
    mark = {"rank": rank, "host": host, "epoch": epoch, "step": step, "signal": name}
    with contextlib.suppress(OSError):  # a full disk: the checkpoint fails and says so
        folder = Path(checkpoint_root) / STOPS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / f"rank{rank}.json", {**mark, "time": time.time()})


def stopped_by_ranks(
    checkpoint_root, entry: dict[str, Any], checkpointed: bool = True
) -> dict[str, Any] | None:
    """The stop this attempt's ranks recorded (:func:`record_stop`; the earliest, a signalled
    rank's first), where a checkpoint at or past its position was written during the attempt
    (``checkpointed=False``: written or not); None otherwise (no stop, or the checkpoint never
    completed: work was lost)."""
    stops = []
    for path in (Path(checkpoint_root) / STOPS_DIR).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            mark = json.loads(path.read_text())
            if mark["time"] >= entry["started"]:
                stops.append(mark)
    if not stops:
        return None
    stop = min(stops, key=lambda m: (m["signal"] is None, m["time"]))
    if not checkpointed:
        return stop
    last = newest_checkpoint(checkpoint_root)
    if last is None or last["written"] < entry["started"]:
        return None
    if (last["epoch"], last["step"]) < (stop["epoch"], stop["step"]):
        return None
    return stop


DIVERGED = "diverged.txt"  # in ERRORS_DIR: the guard's line (training.guard)


def record_divergence(checkpoint_root, line: str) -> None:
    """Rank 0 of a run the divergence guard stopped: its one line, for the attempt record."""
    folder = Path(checkpoint_root) / ERRORS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / DIVERGED).write_text(f"{time.time()}\n{line}\n")


def divergence(checkpoint_root, since: float) -> str | None:
    """The guard's line if it stopped the run at or after ``since`` (this attempt)."""
    path = Path(checkpoint_root) / ERRORS_DIR / DIVERGED
    if not path.is_file():
        return None
    stamp, _, line = path.read_text().partition("\n")
    return line.strip() if float(stamp) >= since else None


PROGRESS_DIR = "progress"
PROGRESS_SECONDS = 15.0
HUNG_SECONDS = 60.0  # a rank this far behind the others at the end is named as hung


class RankProgress(Heartbeat):
    """Each rank's last step, so the end of a job that a hung rank ended through the
    process-group timeout names that rank and its host (:func:`hung_rank`). The training loop
    notes it (:meth:`mark`: no I/O, a slow metadata server never stalls a step); the heartbeat
    writes it every ``seconds`` when it changed, so a rank stuck in its main thread goes
    silent."""

    def __init__(self, checkpoint_root, rank: int, host: str, seconds: float = PROGRESS_SECONDS):
        path = Path(checkpoint_root) / PROGRESS_DIR / f"rank{rank}.json"
        super().__init__(path, seconds, news=self._news)
        self.root, self.rank, self.host = checkpoint_root, rank, host
        self._step = self._written = None
        self.__enter__()  # a daemon thread for the rank's life

    def mark(self, epoch: int, step: int) -> None:
        self._step = (epoch, step)

    def _news(self) -> str | None:
        if self._step == self._written:
            return None
        self._written = (epoch, step) = self._step
        mark = {"rank": self.rank, "host": self.host, "epoch": epoch, "step": step}
        return json.dumps({**mark, "time": time.time()})

    def stopped(self, epoch: int, step: int, signum: int = 0) -> None:
        """This rank stops for requeue at (epoch, step): :func:`record_stop`."""
        record_stop(self.root, self.rank, self.host, epoch, step, signum)


def hung_rank(checkpoint_root, since: float) -> str | None:
    """The rank whose last step lies more than HUNG_SECONDS before the others' (this attempt's
    marks only), as one line; None when no rank fell behind."""
    marks = []
    for path in (Path(checkpoint_root) / PROGRESS_DIR).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            mark = json.loads(path.read_text())
            if mark["time"] >= since:
                marks.append(mark)
    if len(marks) < 2:
        return None
    marks.sort(key=lambda m: m["time"])
    behind = marks[-1]["time"] - marks[0]["time"]
    if behind < HUNG_SECONDS:
        return None
    m = marks[0]
    return (
        f"rank {m['rank']} on {m['host']} made no step for {behind:.0f} s while the others "
        f"trained (hung or stopped; last at epoch {m['epoch']} step {m['step']})"
    )


# ------------------------------------------------------------------------ the cost sum


def code_label(code: dict[str, Any] | None) -> str | None:
    """One attempt's code as one word: the commit, `+dirty:<digest>` for uncommitted changes;
    None where not known (an entry from before it was recorded, no git, no commit)."""
    commit = (code or {}).get("git_commit")
    if not commit or commit == "unknown":
        return None
    if code.get("git_dirty"):
        return f"{commit}+dirty:{code.get('git_diff_sha256', 'unknown')}"
    return commit


def code_versions(attempts: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """(the code labels of the attempts, each once, in order; whether they ran different code).
    Attempts of unknown code are left out: they neither flag a run nor clear it."""
    labels = list(dict.fromkeys(filter(None, (code_label(a.get("code")) for a in attempts))))
    return labels, len(labels) > 1


def cost_over_attempts(checkpoint_root, key: str, now: float) -> dict[str, Any]:
    """Allocations, wall time and GPU-/core-hours summed over the run's attempts (this one,
    still running, up to ``now``), and the GPU-hours lost after the last checkpoint of each
    interrupted attempt. ``key``: :func:`settings_key` of the run."""
    mine = [a for a in of_run(load(checkpoint_root), key) if a["outcome"] != "refused"]
    rows = []
    for a in mine:
        ended = a["ended"] if a.get("ended") is not None else now
        wall = max(0.0, ended - a["started"])
        interrupted = a["outcome"] in ("stopped", "failed", "killed", "diverged")
        last = a.get("last_checkpoint")
        lost = 0.0
        if interrupted:  # work after its newest checkpoint (all of it without one) is redone
            lost = max(0.0, ended - (last["written"] if last else a["started"]))
        rows.append(
            {
                "attempt": a["attempt"],
                "slurm_job_id": a.get("slurm_job_id"),
                "outcome": a["outcome"] if a.get("ended") is not None else "running",
                "wall_seconds": wall,
                "gpu_hours": a["gpus"] * wall / 3600,
                "core_hours": a["cores"] * wall / 3600,
                "lost_seconds": lost,
                "gpu_hours_lost": a["gpus"] * lost / 3600,
                "core_hours_lost": a["cores"] * lost / 3600,
                "code": code_label(a.get("code")),
                "shape": a.get("shape"),  # None: recorded before shapes were
                "start": {k: (a.get("start") or {}).get(k) for k in ("epoch", "step")},
                "last_checkpoint": None if not last else {k: last[k] for k in ("epoch", "step")},
            }
        )
    summed = ("wall_seconds", "gpu_hours", "core_hours", "gpu_hours_lost", "core_hours_lost")
    total = {k: sum(r[k] for r in rows) for k in summed}
    versions, changed = code_versions(mine)
    return {
        "allocations": len(rows),
        "code_versions": versions,
        "code_changed": changed,
        "slurm_job_ids": [r["slurm_job_id"] for r in rows if r["slurm_job_id"]],
        **total,
        "attempts": rows,
    }
