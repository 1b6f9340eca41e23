"""Every allocation of a run: the attempt record ``<checkpoint_root>/attempts.json``, outside
the rule's outputs so that Snakemake's cleanup keeps it.

Each job (an *attempt*) appends an entry (:func:`begin`) and closes it (:func:`end`). One its
launcher never closed (SIGKILLed with the batch step, a lost node) the next job closes at its
last heartbeat, ``stopped`` where its ranks recorded a stop and wrote its checkpoint.
``outcome``: completed; stopped (exit 75 after a checkpoint); failed; killed (never closed);
refused; diverged (the guard stopped it, exit 0, never retried). :func:`refusal`: a retry after
two attempts in a row without progress, or beyond ``max_allocations``, refuses at once; the
workflow asks first (:func:`refusal_ahead`) and submits it without GPUs. Torch-free.
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

from imagenet_ddp.io import LATE_S, Heartbeat, last_beat, write_json_atomic
from imagenet_ddp.jobs.early_signals import EXIT_REQUEUE  # torch-free, as this module
from imagenet_ddp.provenance import code_version
from imagenet_ddp.settings.geometry import (
    SAMPLE_ORDER,
    Geometry,
    accepted_nodes,
    checkpoint_tag,
    global_batch,
    world_size,
)
from imagenet_ddp.settings.kinds import digest, weight_settings

RECORD = "attempts.json"
_CHECKPOINT = re.compile(r"checkpoint-e(\d+)-s(\d+)\.pt$")
ALIVE_DIR = "alive"  # the jobs' heartbeats (io.Heartbeat), one file per job


def settings_key(run: dict[str, Any]) -> str:
    """The entries of one line of checkpoints, keyed as the checkpoints are (the fingerprint's
    settings and settings.geometry.checkpoint_tag): another node count with the same global
    batch, or other loader settings, continue them."""
    return digest({**weight_settings(run), "tag": checkpoint_tag(run)})


def _earlier_key(run: dict[str, Any]) -> str:
    """:func:`settings_key` as versions before the loader left the key wrote it (the loader
    settings as the run states them now): their entries count for the run still."""
    geometry = {k: run.get(k) for k in ("cpus_per_task", "gpus_per_node", "workers")}
    if run.get("sync_bn"):
        geometry["world"] = world_size(run)
    order = {"global_batch": global_batch(run), "order": SAMPLE_ORDER}
    return digest({**weight_settings(run), "geometry": geometry, **order})


def run_keys(run: dict[str, Any]) -> tuple[str, str]:
    """The keys of the run's entries: :func:`settings_key` (what a new entry gets), and an
    earlier version's."""
    return settings_key(run), _earlier_key(run)


def local_beat_name() -> str:
    """This process's heartbeat name outside SLURM, its host and pid, which
    jobs.holders.beat_owner_ended reads back."""
    return f"local-{socket.gethostname()}-{os.getpid()}"


def beat_path(checkpoint_root) -> Path:
    """This job's heartbeat file: named by its SLURM job id (every srun task sees it alike),
    else the host and launcher's pid."""
    name = os.environ.get("SLURM_JOB_ID") or local_beat_name()
    return Path(checkpoint_root) / ALIVE_DIR / name


def last_sign(checkpoint_root, entry: dict[str, Any]) -> float:
    """When the entry's job last beat (``alive``: an entry of a version before the heartbeat
    file)."""
    beat = entry.get("beat") and last_beat(Path(checkpoint_root) / ALIVE_DIR / entry["beat"])
    return max(beat or 0.0, entry.get("alive") or 0.0, entry["started"])


def has_record(checkpoint_root: str | os.PathLike[str]) -> bool:
    return (Path(checkpoint_root) / RECORD).is_file()


def load(checkpoint_root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(checkpoint_root) / RECORD
    return json.loads(path.read_text())["attempts"] if path.is_file() else []


def _save(checkpoint_root, attempts: list[dict[str, Any]]) -> None:
    write_json_atomic(Path(checkpoint_root) / RECORD, {"attempts": attempts})


def of_run(attempts: list[dict[str, Any]], keys: str | tuple[str, ...]) -> list[dict[str, Any]]:
    """The entries of ``keys`` (one key, or :func:`run_keys`)."""
    keys = (keys,) if isinstance(keys, str) else keys
    return [a for a in attempts if a.get("key") in keys]


def newest_checkpoint(checkpoint_root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest checkpoint under the root (any geometry): epoch, step, path, mtime."""
    paths = Path(checkpoint_root).glob("*/checkpoint-*.pt")
    found = [(int(m[1]), int(m[2]), p) for p in paths if (m := _CHECKPOINT.search(p.name))]
    if not found:
        return None
    epoch, step, path = max(found)
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:  # pruned meanwhile
        return None
    return {"epoch": epoch, "step": step, "path": str(path), "written": mtime}


def final_checkpoint(checkpoint_root, run: dict[str, Any]) -> str | None:
    """The run's final checkpoint where an attempt recorded it and it is still there (its job
    ended before the outputs): the next job needs no staged copy."""
    recorded = load(checkpoint_root)
    for entry in of_run(recorded, run_keys(run)) if recorded else []:
        last = entry.get("last_checkpoint") or {}
        if last.get("epoch", 0) >= run["epochs"] and Path(last["path"]).is_file():
            return last["path"]
    return None


def made_progress(entry: dict[str, Any]) -> bool:
    """Whether the attempt wrote a checkpoint past the point it started from."""
    last, start = entry.get("last_checkpoint"), entry.get("start") or {}
    begun = (start.get("epoch", 0), start.get("step", 0))
    return bool(last) and (last["epoch"], last["step"]) > begun


def _failed_without_progress(entry: dict[str, Any]) -> bool:
    return entry["outcome"] in ("failed", "killed") and not made_progress(entry)


def refusal(mine: list[dict[str, Any]], attempt: int, max_allocations: int) -> str | None:
    """Why this job must not train (None: it may). ``mine``: the run's earlier attempts, the
    newest closed; ``attempt``: Snakemake's in this invocation (1: not a retry)."""
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
    """``mine``, its newest entry closed in place where its launcher never did: killed at its
    last heartbeat, or stopped where its ranks recorded a stop and wrote its checkpoint
    (``proctrack/cgroup`` SIGKILLs the launcher with the batch step). ``ahead``: the
    workflow's reading, while the ranks may still write it: a recorded stop counts."""
    if not mine or mine[-1].get("ended") is not None:
        return mine
    entry = mine[-1]
    entry["outcome"], entry["ended"] = "killed", last_sign(checkpoint_root, entry)
    last = newest_checkpoint(checkpoint_root)
    if last and last["written"] >= entry["started"]:
        entry["last_checkpoint"] = last
    stop = stopped_by_ranks(checkpoint_root, entry, checkpointed=not ahead)
    if stop is not None:
        entry.update(outcome="stopped", stop=stop)
        if entry.get("last_checkpoint"):
            entry["ended"] = max(entry["ended"], entry["last_checkpoint"]["written"])
    return mine


def _mine_ahead(checkpoint_root, run: dict[str, Any]) -> list[dict[str, Any]]:
    return _closed(of_run(load(checkpoint_root), run_keys(run)), checkpoint_root, ahead=True)


def refusal_ahead(checkpoint_root, run: dict[str, Any], attempt: int) -> str | None:
    """What :func:`begin` of this attempt will refuse, read without writing."""
    if attempt == 1:
        return None
    return refusal(_mine_ahead(checkpoint_root, run), attempt, int(run.get("max_allocations", 10)))


def nodes_ahead(checkpoint_root, run: dict[str, Any], attempt: int, since: float) -> int:
    """The node count the workflow asks for ``attempt`` of ``run`` in the invocation that began
    at ``since``: :func:`choose_nodes` over the record."""
    counts = accepted_nodes(run)
    if attempt == 1 or len(counts) == 1:
        return counts[0]
    _settle(checkpoint_root, run)
    return choose_nodes(_mine_ahead(checkpoint_root, run), counts, attempt, since)


def _settle(checkpoint_root, run: dict[str, Any], seconds: float = 30.0) -> None:
    """Wait, at most ``seconds``, while the newest entry is open, beat lately and no rank
    recorded a stop: SLURM says a job ended while its ranks may still agree to stop."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        mine = of_run(load(checkpoint_root), run_keys(run))
        last = mine[-1] if mine else None
        if last is None or last.get("ended") is not None:
            return
        if time.time() - last_sign(checkpoint_root, last) > LATE_S:
            return  # long silent: killed (a node failure), nothing to wait for
        if stopped_by_ranks(checkpoint_root, last, checkpointed=False):
            return
        time.sleep(1.0)


def choose_nodes(
    mine: list[dict[str, Any]], counts: tuple[int, ...], attempt: int, since: float
) -> int:
    """The node count of submission ``attempt`` of the invocation begun at ``since``
    (``counts``: preferred first): after a stopped or completed job the preferred, after one
    that failed, was killed or never started (cancelled while pending) the next smaller."""
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
    refused: str | None = None,
) -> tuple[dict[str, Any], str | None]:
    """Close a killed predecessor, append this attempt; returns (entry, refusal reason).
    ``refused``: a reason found before (another version's job: imagenet_ddp.cli)."""
    attempts, key = load(checkpoint_root), settings_key(run)
    mine = _closed(of_run(attempts, run_keys(run)), checkpoint_root)
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
        # an elastic run's attempts may differ (docs/reliability.md)
        "shape": None if shape is None else shape.shape,
        "accumulation": int(run.get("accumulation") or 1),
        "code": {k: v for k, v in code_version().items() if k.startswith("git_")},
    }
    why = refused or refusal(mine, attempt, int(run.get("max_allocations", 10)))
    if why:
        entry.update(outcome="refused", ended=now, exit_code=1, error=why)
    attempts.append(entry)
    _save(checkpoint_root, attempts)
    return entry, why


def ran_in_this_allocation(checkpoint_root, run: dict[str, Any]) -> dict | None:
    """An ended attempt of the run in this very allocation (job id and restart count): a rule's
    retries reach the jobstep's Snakemake (snakemake-executor-plugin-slurm#284)."""
    own = os.environ.get("SLURM_JOB_ID")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    for entry in of_run(load(checkpoint_root), run_keys(run)) if own else []:
        same = entry.get("slurm_job_id") == own and entry.get("slurm_restart", "0") == restart
        if same and entry.get("ended") is not None:
            return entry
    return None


def end(checkpoint_root, entry: dict[str, Any], exit_code: int) -> None:
    """Close this attempt: its end, exit code, outcome, newest checkpoint and first error."""
    last = newest_checkpoint(checkpoint_root)
    if last and last["written"] < entry["started"]:
        last = None  # written by an earlier attempt
    outcome = {0: "completed", EXIT_REQUEUE: "stopped"}.get(exit_code, "failed")
    stop = stopped_by_ranks(checkpoint_root, entry) if outcome == "stopped" else None
    started = entry["started"]
    error = entry.get("error") or _first_line(checkpoint_root, "rank*.txt", started)
    diverged = _first_line(checkpoint_root, DIVERGED, started) if exit_code == 0 else None
    if diverged:
        outcome, error = "diverged", diverged
    hung = hung_rank(checkpoint_root, started) if outcome == "failed" else None
    if hung:
        print(f"watchdog: {hung}", flush=True)
        error = f"{hung}; {error}" if error else hung
    entry.update(ended=time.time(), exit_code=exit_code, outcome=outcome, last_checkpoint=last,
                 error=error, **({"stop": stop} if stop else {}))  # fmt: skip
    mine = (entry["key"], entry["attempt"])
    attempts = [a | entry if (a["key"], a["attempt"]) == mine else a for a in load(checkpoint_root)]
    _save(checkpoint_root, attempts)


# ------------------------------------------------------------------ errors of the ranks

ERRORS_DIR = "errors"


def _write_line(checkpoint_root, name: str, line: str) -> None:
    folder = Path(checkpoint_root) / ERRORS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f"{time.time()}\n{line}\n")


def _first_line(checkpoint_root, pattern: str, since: float) -> str | None:
    """The earliest line of :func:`_write_line`'s files ``pattern`` written since ``since``."""
    found = []
    for path in (Path(checkpoint_root) / ERRORS_DIR).glob(pattern):
        stamp, _, line = path.read_text().partition("\n")
        if float(stamp) >= since:
            found.append((float(stamp), line.strip()))
    return min(found)[1] if found else None


def _marks(checkpoint_root, folder: str, since: float) -> list[dict[str, Any]]:
    """The ranks' JSON marks in ``folder`` written since ``since``."""
    marks = []
    for path in (Path(checkpoint_root) / folder).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            mark = json.loads(path.read_text())
            if mark["time"] >= since:
                marks.append(mark)
    return marks


def record_error(checkpoint_root, rank: int, host: str, error: BaseException) -> None:
    """A rank's uncaught error, one line, for the attempt record (worker.main calls it)."""
    line = f"rank {rank} on {host}: {type(error).__name__}: {error}".splitlines()[0][:500]
    _write_line(checkpoint_root, f"rank{rank}.txt", line)


# ------------------------------------------------------------------ stops of the ranks

STOPS_DIR = "stops"


def record_stop(
    checkpoint_root, rank: int, host: str, epoch: int, step: int, signum: int = 0
) -> None:
    """A rank stops for requeue at the checkpoint (``epoch``, ``step``) (``signum``: its
    signal, 0 for another rank's); written before that checkpoint, so a rank killed after it
    (KillWait) has said so, whether or not its launcher lives."""
    name = signal.Signals(signum).name if signum else None
    mark = {"rank": rank, "host": host, "epoch": epoch, "step": step, "signal": name}
    with contextlib.suppress(OSError):  # a full disk: the checkpoint fails and says so
        path = Path(checkpoint_root) / STOPS_DIR / f"rank{rank}.json"
        write_json_atomic(path, {**mark, "time": time.time()})


def stopped_by_ranks(
    checkpoint_root, entry: dict[str, Any], checkpointed: bool = True
) -> dict[str, Any] | None:
    """The earliest stop this attempt's ranks recorded (a signalled rank's first), where a
    checkpoint at or past it was written during the attempt (or ``checkpointed=False``)."""
    stops = _marks(checkpoint_root, STOPS_DIR, entry["started"])
    if not stops:
        return None
    stop = min(stops, key=lambda m: (m["signal"] is None, m["time"]))
    if not checkpointed:
        return stop
    last = newest_checkpoint(checkpoint_root)
    if last is None or last["written"] < entry["started"]:
        return None
    return stop if (last["epoch"], last["step"]) >= (stop["epoch"], stop["step"]) else None


DIVERGED = "diverged.txt"  # in ERRORS_DIR: the guard's line (training.guard)


def record_divergence(checkpoint_root, line: str) -> None:
    """Rank 0 of a run the divergence guard stopped: its one line, for the attempt record."""
    _write_line(checkpoint_root, DIVERGED, line)


PROGRESS_DIR = "progress"
# A rank's step written every PROGRESS_SECONDS (RankProgress, a Heartbeat); a rank four writes
# behind the others at the end is named as hung.
PROGRESS_SECONDS = 15.0
HUNG_SECONDS = 4 * PROGRESS_SECONDS


class RankProgress(Heartbeat):
    """Each rank's last step, so a job a hung rank ended names it (:func:`hung_rank`): noted
    without I/O (:meth:`mark`), written by the heartbeat thread when it changed."""

    def __init__(self, checkpoint_root, rank: int, host: str, seconds: float = PROGRESS_SECONDS):
        super().__init__(Path(checkpoint_root) / PROGRESS_DIR / f"rank{rank}.json", seconds)
        self.root, self.rank, self.host = checkpoint_root, rank, host
        self._step = self._written = None
        self.__enter__()  # a daemon thread for the rank's life

    def mark(self, epoch: int, step: int) -> None:
        self._step = (epoch, step)

    def beat(self) -> None:
        if self._step != self._written:
            self._written = (epoch, step) = self._step
            mark = {"rank": self.rank, "host": self.host, "epoch": epoch, "step": step}
            write_json_atomic(self.path, {**mark, "time": time.time()})

    def stopped(self, epoch: int, step: int, signum: int = 0) -> None:
        """This rank stops for requeue at (epoch, step): :func:`record_stop`."""
        record_stop(self.root, self.rank, self.host, epoch, step, signum)


def hung_rank(checkpoint_root, since: float) -> str | None:
    """One line naming the rank whose last step lies HUNG_SECONDS before the others'."""
    marks = _marks(checkpoint_root, PROGRESS_DIR, since)
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
    """One attempt's code as one word (`<commit>[+dirty:<digest>]`); None where unknown."""
    commit = (code or {}).get("git_commit")
    if not commit or commit == "unknown":
        return None
    if code.get("git_dirty"):
        return f"{commit}+dirty:{code.get('git_diff_sha256', 'unknown')}"
    return commit


def code_versions(attempts: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """(the attempts' code labels, each once; whether they differ); unknown ones left out."""
    labels = list(dict.fromkeys(filter(None, (code_label(a.get("code")) for a in attempts))))
    return labels, len(labels) > 1


def cost_over_attempts(checkpoint_root, key: str | tuple[str, ...], now: float) -> dict[str, Any]:
    """Allocations, wall time and GPU-/core-hours over the run's attempts (a running one up to
    ``now``), and those lost after each interrupted one's last checkpoint."""
    mine = [a for a in of_run(load(checkpoint_root), key) if a["outcome"] != "refused"]
    rows = []
    for a in mine:
        ended = a["ended"] if a.get("ended") is not None else now
        wall = max(0.0, ended - a["started"])
        last = a.get("last_checkpoint")
        lost = 0.0  # an interrupted one's work after its newest checkpoint (or all) is redone
        if a["outcome"] in ("stopped", "failed", "killed", "diverged"):
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
