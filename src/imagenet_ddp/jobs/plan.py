"""What the workflow's parse reads of Snakemake's own objects, through their public attributes,
passed in by workflow/rules/common.smk: the rerun keys' input functions (jobs.rerun_keys: what a
key is), the pruned sweeps' (settings.halving), the resources set-resources gives a rule under a
`module`'s prefix, the rerun triggers that cannot be served. Torch-free: it runs while
Snakemake parses the rules.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from snakemake.exceptions import IncompleteCheckpointException, WorkflowError
from snakemake.io import ancient
from snakemake.settings.types import RerunTrigger

from imagenet_ddp.jobs.rerun_keys import changes, key_path, key_text
from imagenet_ddp.jobs.stage_versions import STAGE_VERSIONS
from imagenet_ddp.settings.evaluation import eval_settings
from imagenet_ddp.settings.halving import (
    RUNG_OUTPUTS,
    Halving,
    by_run,
    previous_stage,
    survivors,
)
from imagenet_ddp.settings.run_checks import CHECKED_SETTINGS

DATA_CONTENT = "results/data/content.json"  # the data_content checkpoint's record


def refuse(lines) -> None:
    """Stop the parse: one line per refusal, no traceback (a WorkflowError adds its own)."""
    for line in lines:
        print(line, file=sys.stderr)
    sys.exit(1)


class RuleResources:
    """What set-resources gives this workflow's rules, by their names under a `module`'s prefix
    (`use rule * from imagenet as imagenet_*`: imagenet_train), named while the rules parse."""

    def __init__(self, workflow, rules=("train", "evaluate")):
        self.names = {name: workflow.modifier.modify_rulename(name) for name in rules}
        self._workflow = workflow

    def value(self, rule: str, key: str, defaults: bool = True) -> Any:
        """A resource that set-resources gives `rule`, else default-resources (where
        `defaults`); a number, a string, or None (unset, or an expression such as
        `60 * attempt`, not evaluated here). Read through Snakemake's public ResourceSettings."""
        settings = self._workflow.resource_settings
        for resources in (
            settings.overwrite_resources.get(self.names[rule]),
            settings.default_resources if defaults else None,
        ):
            given = None if resources is None or key not in resources else resources[key]
            if given is not None:
                try:  # a number or string; an expression (`60 * attempt`): its text
                    value = getattr(given, "value", given)
                except ValueError:
                    value = getattr(given, "raw", None)
                if isinstance(value, str) and key == "mem_mb":
                    match = re.fullmatch(
                        r"\s*['\"]?(\d+(?:\.\d+)?)\s*(\*\s*attempt)?['\"]?\s*", value
                    )
                    value = float(match.group(1)) if match else None
                return value if isinstance(value, (int, float, str)) else None
        return None

    def number(self, rule: str, key: str) -> float | None:
        """get's value where it is a number (train's runtime, mem_mb); else None."""
        value = self.value(rule, key)
        return value if isinstance(value, (int, float)) else None


def refuse_unserved_triggers(workflow) -> None:
    """A rerun trigger set without mtime cannot be served: new images under data.dir's file
    names are seen by the data stages' times only. Snakemake's DAG settings (its public
    workflow.dag_settings) exist once the DAG is built, so the key's input functions ask."""
    if RerunTrigger.MTIME not in workflow.dag_settings.rerun_triggers:
        refuse(["--rerun-triggers without mtime: new images under the same file names in"
                " data.dir would never retrain a run (the data stages see them by their"
                " time); add mtime"])  # fmt: skip


class RerunKeys:
    """The rerun keys' input functions and param (jobs.rerun_keys: a key's path is its digest;
    the local `key` rule writes it when missing, `all` asks for it). A key holds the run's
    rerun settings (one a newer version adds at its x-earlier value stays off them:
    settings.kinds), the content digest of the data the job reads (the data_content
    checkpoint) and, for train, its weights file's sha256 as its check read it."""

    def __init__(self, workflow, checkpoints, config: Mapping, runs: Mapping, settings):
        self._workflow, self._checkpoints = workflow, checkpoints
        self._config, self._runs, self._settings = config, runs, settings

    def key(self, kind: str, name: str, content: str, check: str | None = None) -> dict:
        """The key of the run's `kind` job from the data_content and check records' paths."""
        with open(content) as f:
            data = json.load(f)["evaluate" if kind == "evaluate" else "train"]
        if kind == "evaluate":
            batch = eval_settings(self._config.get("evaluate"), self._runs[name])["batch_size"]
            return {"batch_size": batch, "data": data, "version": STAGE_VERSIONS["evaluate"]}
        with open(check) as f:
            init_weights = json.load(f)["init_weights_sha256"]
        settings = self._settings.rerun_settings(self._runs[name])
        return {"settings": settings, "data": data, "init_weights_sha256": init_weights}

    def _records(self, kind: str, name: str) -> list[Callable[[], str]]:
        """The checkpoint records a key is made of (each job is judged again once they exist)."""
        records = [lambda: self._checkpoints.data_content.get().output[0]]
        if kind != "evaluate":
            records.append(lambda: self._checkpoints.check.get(run=name).output[0])
        return records

    def key_file(self, kind: str):
        """An input function: the run's key file. While a record it is made of is yet to be
        (re)made, that record, ancient: Snakemake judges the job again once it exists, and
        until then neither the job nor what reads its outputs is planned for the record's new
        time (a data rerun that makes the same bytes reruns nothing downstream)."""

        def value(wildcards):
            refuse_unserved_triggers(self._workflow)
            records, pending = [], []
            for record in self._records(kind, wildcards.run):
                try:
                    path = record()
                except IncompleteCheckpointException as incomplete:
                    pending.append(ancient(incomplete.targetfile))
                    continue
                # a checkpoint done but its record missing (--touch skips a missing output):
                # as pending, until a run writes it
                if os.path.exists(path):
                    records.append(path)
                else:
                    pending.append(ancient(path))
            if pending:
                return pending
            return key_path(kind, wildcards.run, self.key(kind, wildcards.run, *records))

        return value

    def key_files(self, wildcards=None) -> list:
        """`all`'s: every run's keys. A missing key is a missing input of the target, which
        Snakemake plans under every rerun trigger set (a missing input of a finished job it
        would not: mtime alone)."""
        files = []
        for name in self._runs:
            for kind in ("train", "evaluate"):
                found = self.key_file(kind)(SimpleNamespace(run=name))
                files += found if isinstance(found, list) else [found]
        return files

    def key_records(self, wildcards) -> list:
        """The `key` rule's inputs: the records its key is made of, ancient (their times are no
        reason: the key's path is)."""
        return [ancient(record()) for record in self._records(wildcards.kind, wildcards.run)]

    def key_content(self, wildcards) -> str:
        """The `key` rule's param: the key's text, of the path asked for (a stale path of a key
        that is no longer the run's is refused). Read from the records themselves: while one
        is yet to be (re)made (a dry-run, a --touch), a placeholder, which no job runs with."""
        try:
            paths = [record() for record in self._records(wildcards.kind, wildcards.run)]
        except IncompleteCheckpointException:
            paths = []
        if not paths or not all(os.path.exists(path) for path in paths):
            return "decided once its records exist"
        key = self.key(wildcards.kind, wildcards.run, *paths)
        path = key_path(wildcards.kind, wildcards.run, key)
        if os.path.basename(path) != f"{wildcards.digest}.json":
            raise WorkflowError(
                f"{path}: the run's {wildcards.kind} key now; not {wildcards.digest}"
            )
        return key_text(key)

    def changed(self) -> list[str]:
        """One line per run whose train key differs from what its last delivered training
        recorded (job.json's key; before the keys, its train_metrics.json's settings): what
        changed, bookkeeping and unchanged keys left out. Read from our own records only, once
        their checkpoint records exist."""
        lines = []
        for name in self._runs:
            paths = [DATA_CONTENT, f"results/checks/{name}.json", f"results/runs/{name}/job.json"]
            if not all(os.path.isfile(p) for p in paths):
                continue
            try:
                with open(paths[2]) as f:
                    recorded = json.load(f).get("key")
                now = self.key("train", name, *paths[:2])
                if recorded is None:  # trained by a version before the keys: its settings only
                    with open(f"results/runs/{name}/train_metrics.json") as f:
                        trained = json.load(f)["config"]
                    now = {"settings": now["settings"]}
                    recorded = {
                        "settings": {k: trained[k] for k in now["settings"] if k in trained}
                    }
            except (OSError, ValueError, KeyError):
                continue
            line = changes(name, recorded, now, self._settings.earlier_values())
            if line and _judged_by_check(recorded, now):  # the dry-run plans only its check
                line += f" ({CHECK_FIRST})"
            lines += [line] if line else []
        return lines


CHECK_FIRST = "its check runs first: train is planned after it"


def _judged_by_check(recorded: Mapping, now: Mapping) -> bool:
    """Whether a setting the run's check judges differs between two train keys: the check (a
    checkpoint) reruns, and its train is planned only once it has."""
    before, after = recorded.get("settings", {}), now.get("settings", {})
    return any(before.get(k) != after.get(k) for k in CHECKED_SETTINGS)


class SweepStages:
    """The pruned sweeps' input functions and params (settings.halving): a run trains in stages
    (train_rung, results/runs/<run>/rungs/<epoch>/), each rung's `prune` checkpoint keeps the
    best, and rung_final copies a run's last stage into its run folder. A decision is read
    through Snakemake's ``checkpoints.prune.get()``, and every job whose inputs it chose also
    lists it (ancient: its time is no reason): Snakemake re-evaluates a finished checkpoint's
    dependents, so a decision made again in this invocation (a run's setting changed) chooses
    their inputs anew, where one read when the DAG was built would stand otherwise (the keys'
    own checkpoints make it a second-order one, snakemake/snakemake#3862)."""

    def __init__(self, checkpoints, found: Mapping[int, Halving]):
        self._checkpoints, self.halvings = checkpoints, found
        self.of_run = by_run(found)
        # every rung's decision, asked for by `all`: only a target's input is decided again
        # when the rung's figures are newer (an input function's get() alone reads the file)
        self.decisions = [f"results/sweeps/{h.index}/rung-{epoch}.json"
                          for h in found.values() for epoch in h.rungs]  # fmt: skip

    def _decision(self, halving: Halving, epoch: int) -> str:
        return self._checkpoints.prune.get(sweep=halving.index, epoch=epoch).output[0]

    def previous(self, wildcards):
        """train_rung's: the run's stage before this one, ancient (it orders the stages on one
        checkpoint; a rerun of it with the same settings makes the same bytes, no reason)."""
        halving, epoch = self.of_run[wildcards.run], int(wildcards.epoch)
        if epoch not in halving.stages:
            raise WorkflowError(
                f"run {wildcards.run!r}: {epoch} is none of its rungs {halving.stages}"
            )
        before = previous_stage(halving, epoch)
        if before is None:
            return []
        return ancient(f"results/runs/{wildcards.run}/rungs/{before}/train_metrics.json")

    def _reached(self, wildcards) -> tuple[list[str], list[str]]:
        """(the runs that reached rung `epoch` of sweep `sweep`: all at the first, else the
        survivors of the rung before; the decision that chose them)."""
        halving, epoch = self.halvings[int(wildcards.sweep)], int(wildcards.epoch)
        before = previous_stage(halving, epoch)
        if before is None:
            return list(halving.runs), []
        decision = self._decision(halving, before)
        return survivors(decision), [ancient(decision)]

    def runs(self, wildcards) -> list[str]:
        """prune's param: the runs it ranks."""
        return self._reached(wildcards)[0]

    def metrics(self, wildcards) -> list[str]:
        """prune's input: the figures of the runs that reached the rung."""
        return [f"results/runs/{n}/rungs/{wildcards.epoch}/train_metrics.json"
                for n in self._reached(wildcards)[0]]  # fmt: skip

    def decided(self, wildcards) -> list[str]:
        """prune's input: the decision that chose its runs."""
        return self._reached(wildcards)[1]

    def _last_stage(self, name: str) -> tuple[int, list[str]]:
        """(the epoch the run's training ends at: the rung where it was pruned, else the end;
        the decisions read to know it)."""
        halving, read = self.of_run[name], []
        for epoch in halving.rungs:
            decision = self._decision(halving, epoch)
            read.append(ancient(decision))
            if name not in survivors(decision):
                return epoch, read
        return halving.epochs, read

    def final_input(self, wildcards) -> dict[str, list[str]]:
        """rung_final's inputs: the outputs of the run's last stage, the decisions read."""
        stage, read = self._last_stage(wildcards.run)
        outputs = [f"results/runs/{wildcards.run}/rungs/{stage}/{o}" for o in RUNG_OUTPUTS]
        return {"stage": outputs, "decided": read}

    @staticmethod
    def final_dir(wildcards, input) -> str:
        """rung_final's param: its stage's folder (while a decision is yet to be made, the
        folder of the checkpoint's target, which Snakemake makes its input meanwhile)."""
        return os.path.dirname(getattr(input, "stage", input)[0])
