"""Each train job's own log, ``<log dir>/<run>/job-<SLURM job id>-attempt<n>-<UTC start>.log``,
with the rule's ``log:`` a link to the newest: Snakemake deletes a rule's ``log:`` before it
runs the job again, so each allocation keeps a file of its own. Torch-free.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from imagenet_ddp.jobs.spec import TrainJob
from imagenet_ddp.settings.kinds import declarations, hyperparameter_line


def open_attempt_log(link: str | os.PathLike[str], job: TrainJob) -> Path:
    """Create this job's log, point ``link`` at it, write its header, and send this process's
    stdout and stderr (and so its children's) there; its path."""
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    job_id = os.environ.get("SLURM_JOB_ID") or "local"
    attempt = job.execution.attempt
    log_dir = Path(os.path.realpath(Path(link).parent / job.name))
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"job-{job_id}-attempt{attempt}-{started}.log"
    header = (
        f"== job {job_id}, Snakemake attempt {attempt}, started {started} ==\n"
        f"hyperparameters: {hyperparameter_line(job.run, declarations())}\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, header.encode())
    tmp = Path(link).with_name(f".{Path(link).name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(path, tmp)
    os.replace(tmp, link)  # the newest attempt's, atomically
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path
