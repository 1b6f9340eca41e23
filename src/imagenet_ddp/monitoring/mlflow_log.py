"""MLflow tracking (``mlflow_uri``), rank 0 only: TensorBoard's scalars and steps, into an MLflow
file store (a directory: no server, no network on compute nodes; MLflow 3 needs
``MLFLOW_ALLOW_FILE_STORE=true`` for one, set here). The run id is kept beside the checkpoints
(``mlflow_run_id``): a resumed job continues the run, a fresh start makes a new one. Needs
``imagenet-ddp[mlflow]``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

EXPERIMENT = "imagenet-ddp"
RUN_ID_FILE = "mlflow_run_id"


def tracking_uri(setting: str) -> str:
    """A URI as given (``file:///...``), or a directory path as an absolute file URI."""
    return setting if ":" in setting.split("/", 1)[0] else Path(setting).resolve().as_uri()


class MlflowLog:
    """Fixed tags, absent values skipped; the same interface as ``TensorBoardLog``."""

    def __init__(
        self, uri: str, *, run_name: str, state_dir: Path, params: dict[str, Any], fresh: bool
    ):
        uri = tracking_uri(uri)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient  # imports mlflow (~2 s): rank 0 only

        self.client = MlflowClient(tracking_uri=uri)
        id_file = state_dir / RUN_ID_FILE
        if not fresh and id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(EXPERIMENT)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in params.items()])
        state_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run_id + "\n")

    def scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(f"{prefix}/{name}", float(value), now, step)
            for name, value in values.items()
            if value is not None
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, *, finished: bool = False) -> None:
        """FINISHED after the last epoch; KILLED when the job stops early (it resumes later)."""
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


def _param(key: str, value: Any):
    from mlflow.entities import Param

    return Param(key, str(value)[:6000])  # MLflow's limit on a parameter's value
