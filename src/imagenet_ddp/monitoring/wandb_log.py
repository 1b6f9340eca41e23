"""Weights & Biases tracking (``wandb_project``), rank 0 only: TensorBoard's scalars and steps.
The x axis is a ``global_step`` metric, not W&B's own step, which refuses a step lower than one
logged (a resumed job logs the steps after its checkpoint again). The run id is kept beside the
checkpoints (``wandb_run_id``): a resumed job continues the run, a fresh start makes a new one.
``wandb_mode: offline`` (the default: compute nodes often have no network) writes
``<run dir>/wandb/offline-run-*`` for ``wandb sync``. Needs ``imagenet-ddp[wandb]``."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

RUN_ID_FILE = "wandb_run_id"
STEP = "global_step"


class WandbLog:
    """Fixed tags, absent values skipped; the same interface as ``TensorBoardLog``."""

    def __init__(
        self, project: str, *, mode: str, run_name: str, run_dir: Path, state_dir: Path,
        params: dict[str, Any], fresh: bool,
    ):  # fmt: skip
        import wandb  # ~1 s, and a wandb-core process: rank 0 only

        id_file = state_dir / RUN_ID_FILE
        resumed = not fresh and id_file.is_file()
        run_id = id_file.read_text().strip() if resumed else secrets.token_hex(4)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            mode=mode,
            id=run_id,
            resume="allow",
            name=run_name,
            dir=str(run_dir),
            config=None if resumed else params,
            # console="off": the job's log stays the workflow's, not a copy in W&B's files.
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        if not resumed:
            state_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")

    def scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
        data = {f"{prefix}/{k}": float(v) for k, v in values.items() if v is not None}
        if data:
            self.run.log({STEP: step, **data})

    def close(self, *, finished: bool = False) -> None:
        """Finished after the last epoch; preempted when the job stops early (it resumes)."""
        import wandb

        if not finished:
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if finished else 1)
        # finish() returns before W&B's service has written the run's file (seen: 7 of ~1,700
        # bytes); teardown waits for it, so a job that ends right after keeps its records.
        wandb.teardown()
