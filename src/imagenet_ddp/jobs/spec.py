"""One typed spec describes a training, preflight or evaluation job; every process reads it.

Built at the workflow's parse (:func:`job_spec`) as compact JSON (the run's settings at their
default left out; the job's package version must be the workflow's), loaded by the CLI
(:func:`load`), written into the job's folder (:func:`write_spec`) and read back by the
per-node steps and every rank (:func:`read_spec`). A missing or unknown key is refused in one
line naming the file and the key. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from imagenet_ddp import __version__
from imagenet_ddp.data.prepared_layout import resolve_prepared
from imagenet_ddp.errors import InputError, version_problem
from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.jobs.launchers import launcher_problem
from imagenet_ddp.settings.geometry import GEOMETRY_KEYS, LAUNCH_KEYS, Geometry
from imagenet_ddp.settings.kinds import declarations

TRAIN_SPEC = "job_spec.json"  # in the run folder
EVAL_SPEC = "eval_spec.json"  # beside eval.json
PREFLIGHT_SPEC = "preflight_spec.json"  # beside preflight.json
STAGING_DIR = "staging"  # <run folder>/staging/<host>.json: one report per node
PROGRESS = "progress.json"  # in the run folder: rank 0's last epoch (monitoring.monitor)
PREPARED = "results/prepared/{}.json"  # the prepare rule's manifest of train or val


class SpecError(InputError):
    """A job spec that cannot be read: the message names the file (or value) and the key."""


@dataclass(frozen=True)
class Stage:
    """How each node stages the prepared train set (config.yaml ``stage``)."""

    scratch_dir: str  # "": $SLURM_TMPDIR, else $TMPDIR, else /tmp (stage.scratch_root)
    verify: str  # size | sha256
    cleanup: bool


@dataclass(frozen=True)
class Execution:
    """Where and how the job runs: the site's settings (a resource: no rerun when they change)."""

    launcher: str  # auto or a launcher's name (jobs.launchers); auto is resolved in the job
    launch_prefix: str  # the rule's mpi resource: the command starting the ranks' step
    srun_extra: str  # extra srun flags, space separated
    attempt: int = 1  # Snakemake's attempt: a resubmission if > 1
    stage: Stage | None = None  # train and preflight: how the prepared copy is staged

    def __post_init__(self) -> None:
        problem = launcher_problem(self.launcher)
        if problem:
            raise SpecError(problem)


@dataclass(frozen=True)
class TrainPaths:
    prepared_train: Path
    split_dir: Path
    run_dir: Path
    checkpoint_root: Path


@dataclass(frozen=True)
class PreflightPaths:
    prepared_train: Path
    split_dir: Path
    out: Path  # preflight.json
    checkpoint_root: Path  # where train writes its checkpoints: the write rate is measured there

    @property
    def run_dir(self) -> Path:
        """The preflight's folder: its staging reports and spec."""
        return self.out.parent


@dataclass(frozen=True)
class EvalPaths:
    model: Path
    prepared_train: Path
    prepared_val: Path
    split_dir: Path
    classes: Path
    out: Path  # eval.json
    per_class: Path


@dataclass(frozen=True)
class EvalSettings:
    batch_size: int
    workers: int | str  # a number, or auto: cpus_per_task - 1
    device: str = "auto"  # auto | cpu | cuda


@dataclass(frozen=True)
class TrainJob:
    """One training job of a run."""

    kind: ClassVar[str] = "train"
    run: dict[str, Any]  # every run setting, geometry included (TrainConfig.from_dict)
    paths: TrainPaths
    execution: Execution
    # A rung of a pruned sweep (settings.halving): the run's schedule, stopped after this many
    # epochs with the outputs of that epoch (its holdout evaluated); None: to the end.
    # Keyword-only: a subclass's own fields keep their positions.
    stop_epoch: int | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.execution.stage is None:
            raise SpecError("missing key execution.stage: a training job stages its data")

    @property
    def geometry(self) -> Geometry:
        """The job's geometry, from its run (the launcher needs it; a rank reads its own)."""
        missing = [key for key in LAUNCH_KEYS if key not in self.run]
        if missing:
            raise SpecError(
                f"run {self.run.get('run')!r}: the run settings lack {', '.join(missing)}; give "
                "the job's geometry in the run settings (the workflow's rule always does)"
            )
        return Geometry.of(self.run)

    @property
    def name(self) -> str:
        return str(self.run.get("run"))


@dataclass(frozen=True)
class PreflightJob(TrainJob):
    """The preflight of a run: its training job's run, staging and geometry."""

    kind: ClassVar[str] = "preflight"
    paths: PreflightPaths
    # The train rule's time limit per allocation (None: none); the projection counts the
    # allocations of that length the run needs.
    train_runtime_minutes: float | None = None


@dataclass(frozen=True)
class EvalJob:
    """One evaluation job of a run's model."""

    kind: ClassVar[str] = "evaluate"
    geometry: Geometry
    settings: EvalSettings
    paths: EvalPaths
    execution: Execution


KINDS: dict[str, type] = {cls.kind: cls for cls in (TrainJob, PreflightJob, EvalJob)}
Job = TrainJob | EvalJob  # PreflightJob is a TrainJob


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds (``Stage | None``: Stage), else None."""
    for option in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(option):
            return option
    return None


def _build(cls: type, data: Any, where: str) -> Any:
    """``cls`` from the JSON object ``data``; ``where``: its key path, for the error."""
    if not isinstance(data, dict):
        raise SpecError(f"{where.rstrip('.') or 'the spec'} must be a JSON object")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SpecError(f"unknown key {where}{unknown[0]} (known: {', '.join(fields)})")
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and name not in data:
            raise SpecError(f"missing key {where}{name}")
    values = {}
    for name, value in data.items():
        nested = _dataclass_in(hints[name])
        if nested is not None and value is not None:
            value = _build(nested, value, f"{where}{name}.")
        elif Path in (typing.get_args(hints[name]) or (hints[name],)) and value is not None:
            value = Path(value)
        values[name] = value
    return cls(**values)


def from_dict(data: Any, kinds: str | tuple[str, ...] | None = None) -> Job:
    """The job ``data`` (a parsed spec) describes, of one of ``kinds`` (any kind: None)."""
    if not isinstance(data, dict):
        raise SpecError("a job spec must be a JSON object")
    data = dict(data)
    kind = data.pop("kind", None)
    allowed = (kinds,) if isinstance(kinds, str) else kinds or tuple(KINDS)
    if kind not in allowed:
        raise SpecError(f"key kind is {kind!r}; expected {' or '.join(map(repr, allowed))}")
    return _build(KINDS[kind], data, "")


def to_dict(job: Job) -> dict[str, Any]:
    """The spec as JSON values (paths as strings), ``kind`` first."""

    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return {"kind": job.kind, **plain(dataclasses.asdict(job))}


def parse(text: str, kinds: str | tuple[str, ...] | None = None, source: str = "") -> Job:
    """The job of a spec's JSON ``text``; ``source`` (a file) names it in the error."""
    where = source or "--job"
    try:
        return from_dict(_from_compact(json.loads(text)), kinds)
    except json.JSONDecodeError as error:
        raise SpecError(f"{where}: not JSON ({error})") from None
    except (SpecError, TypeError) as error:
        raise SpecError(f"{where}: {error}") from None


def load(value: str, kinds: str | tuple[str, ...] | None = None) -> Job:
    """``--job``'s value (a spec's JSON text, or a spec file's path), each prepared manifest
    replaced by the copy it names, once, by the job's first process."""
    job = parse(value, kinds) if value.lstrip().startswith("{") else read_spec(value, kinds)
    names = [n for n in ("prepared_train", "prepared_val") if hasattr(job.paths, n)]
    resolved = {n: resolve_prepared(getattr(job.paths, n)) for n in names}
    return dataclasses.replace(job, paths=dataclasses.replace(job.paths, **resolved))


def read_spec(path: str | os.PathLike[str], kinds: str | tuple[str, ...] | None = None) -> Job:
    """The job of the spec file at ``path``, of one of ``kinds``."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise SpecError(f"{path}: cannot read the job spec ({error.strerror})") from None
    return parse(text, kinds, source=str(path))


def write_spec(path: str | os.PathLike[str], job: Job) -> Path:
    write_json_atomic(path, to_dict(job))
    return Path(path)


def job_spec(
    kind: str,
    name: str,
    settings: Mapping[str, Any],
    config: Mapping,
    *,
    attempt: int,
    launch_prefix: str,
    train_runtime: float | None = None,
    stop_epoch: int | None = None,
    run_dir: str | None = None,
) -> str:
    """The compact JSON spec of run ``name``'s ``kind`` job (train, preflight, evaluate):
    ``settings`` as the rank gets them, its paths, and where and how it runs (``execution``:
    a resource, which reruns nothing)."""
    paths: dict[str, Any] = {
        "prepared_train": PREPARED.format("train"),
        "split_dir": "results/split",
    }
    parts: dict[str, Any]
    if kind == "evaluate":
        paths.update(
            model=f"results/runs/{name}/model.pt",
            prepared_val=PREPARED.format("val"),
            classes="results/index/classes.csv",
            out=f"results/runs/{name}/eval.json",
            per_class=f"results/runs/{name}/per_class.csv",
        )
        parts = {
            "geometry": {key: settings[key] for key in GEOMETRY_KEYS},
            "settings": {k: settings[k] for k in ("batch_size", "workers")},
        }
    else:
        paths["checkpoint_root"] = f"{config['execution']['checkpoint_dir']}/{name}"
        parts = {"run": dict(settings)}
        if kind == "preflight":
            paths["out"] = f"results/preflight/{name}/preflight.json"
            parts["train_runtime_minutes"] = train_runtime  # what train's allocations last
        else:  # a rung (stop_epoch) delivers into its own folder
            paths["run_dir"] = run_dir or f"results/runs/{name}"
            if stop_epoch is not None:
                parts["stop_epoch"] = stop_epoch
    execution = config["execution"]
    block = {"launcher": execution["launcher"], "launch_prefix": launch_prefix,
             "srun_extra": execution["srun_extra"], "attempt": attempt}  # fmt: skip
    if kind != "evaluate":  # train and its preflight copy the prepared train set to every node
        block["stage"] = {k: config["stage"][k] for k in ("scratch_dir", "verify", "cleanup")}
    return compact_spec({"kind": kind, **parts, "paths": paths, "execution": block})


def compact_spec(data: dict[str, Any]) -> str:
    """``data`` (a spec's JSON values) checked, as compact JSON: the run's settings at their
    declared default left out but its name and geometry, and this package's version."""
    spec = to_dict(from_dict(data))
    if "run" in spec:
        defaults, keep = declarations().rank_defaults(), {"run", *LAUNCH_KEYS}

        def same(a: Any, b: Any) -> bool:  # as JSON: 0 and 0.0 differ in a checkpoint key
            return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)

        spec["run"] = {k: v for k, v in spec["run"].items()
                       if k in keep or k not in defaults or not same(v, defaults[k])}  # fmt: skip
    return json.dumps({"version": __version__, **spec}, separators=(",", ":"))


def _from_compact(data: Any) -> Any:
    """A compact spec with its run's defaults filled in, its version checked; other JSON as is."""
    if not isinstance(data, dict) or "version" not in data:
        return data
    data = dict(data)
    version = data.pop("version")
    problem = version_problem(version)
    if problem:
        raise SpecError(problem)
    if isinstance(data.get("run"), dict):
        data["run"] = {**declarations().rank_defaults(), **data["run"]}
    return data


def with_init_weights(job: Job, sha256: str) -> Job:
    """``job`` with its run's ``init_weights_sha256`` (train's param, which the rank verifies)."""
    if not sha256:
        return job
    return dataclasses.replace(job, run={**job.run, "init_weights_sha256": sha256})


def with_launcher(job: Job, launcher: str) -> Job:
    """``job`` with its execution's launcher replaced (auto resolved where it runs)."""
    return dataclasses.replace(job, execution=dataclasses.replace(job.execution, launcher=launcher))


def staging_report_path(run_dir: str | os.PathLike[str], host: str) -> Path:
    return Path(run_dir) / STAGING_DIR / f"{host}.json"


def staging_reports(run_dir: Path) -> list[dict]:
    """Every node's staging report of the run, by host name."""
    return [json.loads(p.read_text()) for p in sorted((run_dir / STAGING_DIR).glob("*.json"))]


def staged_copy(run_dir: str | os.PathLike[str], host: str) -> Path:
    """The node-local copy of the prepared train set that ``host`` staged for this run."""
    return Path(json.loads(staging_report_path(run_dir, host).read_text())["dest"])
