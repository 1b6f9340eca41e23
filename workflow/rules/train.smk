# The checks a run needs torch for, once per change of its settings or weights file and before
# any of its GPU jobs: its model built on the meta device at its crops (constructor options,
# training-mode outputs, CUDA determinism, residual zero-init), its optimizer, its init_weights
# file's keys and shapes against the data's class count, that file's sha256 (train's param), and
# its training transform at every extreme draw and evaluation transform on synthetic images
# (with loader: dali, through its DALI pipeline on DALI's CPU backend too).
# Local: a few seconds on the machine that runs Snakemake. A checkpoint, so a check that reruns
# (a setting changed) leaves train to its own params, which say whether it retrains.
checkpoint check:
    """Check a run's model, optimizer and weights file where torch is (before its GPU jobs)."""
    output:
        "results/checks/{run}.json",
    log:
        "logs/check/{run}.log",
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    # The run's settings, bookkeeping included: a resource, so that only what the check judges
    # (its params) reruns it.
    resources:
        run=lambda wildcards: json.dumps(
            SETTINGS.changed_from_default(training_settings(wildcards.run))
        ),
    params:
        run=check_params,
        version=STAGE_VERSIONS["check"],
        num_classes=class_count,
        run_dir=lambda wildcards: f"results/runs/{wildcards.run}",
    shell:
        "imagenet-ddp check --run {resources.run:q} --num-classes {params.num_classes}"
        " --run-dir {params.run_dir:q} --out {output:q} > {log:q} 2>&1"
        # a refusal's lines (else the log's last) to the terminal, above Snakemake's own block
        " || {{ s=$?; grep -A99 '^imagenet-ddp check: error: ' {log:q} >&2"
        " || tail -n 1 {log:q} >&2; exit $s; }}"


# A run's rerun key (common.smk key_file, imagenet_ddp.jobs.rerun_keys), written when missing:
# its path is its content's digest, so it never reruns for a time or a trigger; the job that
# reads it removes the run's other keys of its kind once it has delivered. Its shell and its
# param's format are its code and params: a change to either rewrites every key, and with it
# reruns every finished train and evaluate under the default triggers: keep both as they are.
rule key:
    """Write a run's train or evaluate rerun key (what retrains or re-evaluates it)."""
    input:
        key_records,
    output:
        "results/keys/{kind}/{run}/{digest}.json",
    log:
        "logs/keys/{kind}/{run}/{digest}.log",
    wildcard_constraints:
        kind="train|evaluate",
        digest="[0-9a-f]{16}",
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        key=key_content,
    shell:
        "imagenet-ddp key --text {params.key:q} --out {output:q} > {log:q} 2>&1"


rule train:
    """Train one run with DDP on its nodes x tasks_per_node ranks; resumed after a stop."""
    input:
        # What retrains the run, by path (common.smk key_file): its settings, data content
        # and weights file.
        key=key_file("train"),
        preflight=preflight_input,  # runs with `preflight: true`: a passing preflight first
    output:
        model="results/runs/{run}/model.pt",
        metrics="results/runs/{run}/train_metrics.json",
        history="results/runs/{run}/history.csv",
        job="results/runs/{run}/job.json",
        provenance="results/runs/{run}/model.pt.provenance.json",
    log:
        "logs/train/{run}.log",
    # A pruned sweep's runs train by stages instead (train_rung, rung_final).
    wildcard_constraints:
        run=UNPRUNED_RUNS,
    # Resubmitted while it makes progress, up to the run's max_allocations (common.smk).
    retries: TRAIN_RETRIES
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    # Cores this job takes on a local machine (ignored by the SLURM executor's sizing).
    threads:
        lambda wildcards: RUNS[wildcards.run]["tasks_per_node"]
        * RUNS[wildcards.run]["cpus_per_task"]
    resources:
        # One SLURM task per GPU (rank) on every node; the rule launches them itself with srun,
        # which the SLURM executor requires to be declared with the `mpi` resource. The
        # geometry itself is a result (params), these only size the job. A retry that will
        # refuse (max_allocations, or no progress twice in a row) asks for one task without
        # GPUs instead (common.smk train_resource).
        nodes=train_resource("nodes"),
        tasks_per_node=train_resource("tasks_per_node"),
        tasks=train_resource("tasks"),
        cpus_per_task=train_resource("cpus_per_task"),
        gres=train_resource("gres"),
        tasks_per_gpu=0,  # else the plugin adds --ntasks-per-gpu=<all tasks> to GPU jobs
        mpi=train_resource("mpi"),
        # The stop warning the ranks checkpoint on, then the site's flags (common.smk).
        slurm_extra=train_slurm_extra,
        # Shown for review: where each node stages the copy, the image the ranks enter.
        staging=STAGING,
        image=lambda wildcards: CONTAINER if _APPTAINER else None,
        snakemake_attempt=lambda wildcards, attempt: attempt,  # 2, 3, ...: a resubmission
        # The whole job spec (imagenet_ddp.jobs.spec, compact JSON) and the hyperparameters on
        # one line: resources, not params, because a param's every change reruns the
        # finished job, and bookkeeping such as log_interval or the launcher changes no result.
        # `imagenet-ddp train` writes the spec into <run dir>/job_spec.json, the one file every
        # process of the job reads.
        job=job_spec("train", "train"),
        hyperparameters=run_hyperparameters,
    # exec: the launcher replaces the rule's shell, which a stop signal would kill (SLURM
    # signals every process of the step) before the ranks have written their checkpoint.
    # Every job (attempt) writes its own log, logs/train/<run>/job-<SLURM job id>-attempt<n>-
    # <UTC start>.log, which Snakemake does not delete when it starts the next job; {log} links
    # to the newest (imagenet_ddp.jobs.attempt_log).
    shell:
        "exec imagenet-ddp train --job {resources.job:q} --key {input.key:q}"
        " --attempt-log {log:q}"


# A stage of a pruned sweep's run (settings.halving): train's job with a stop_epoch, into the
# stage's folder, resumed from the stage before on the run's one checkpoint root. Its key is
# train's: a changed setting retrains this run's stages alone.
use rule train as train_rung with:
    input:
        key=key_file("train"),
        preflight=preflight_input,
        previous=STAGES.previous,
    output:
        model="results/runs/{run}/rungs/{epoch}/model.pt",
        metrics="results/runs/{run}/rungs/{epoch}/train_metrics.json",
        history="results/runs/{run}/rungs/{epoch}/history.csv",
        job="results/runs/{run}/rungs/{epoch}/job.json",
        provenance="results/runs/{run}/rungs/{epoch}/model.pt.provenance.json",
    log:
        "logs/train/{run}/rung-{epoch}.log",
    wildcard_constraints:
        run=PRUNED_RUNS,
        epoch="[0-9]+",


# A pruned sweep's decision at one rung: the ranking of the runs that reached it, the survivors
# (ties by name; the same whatever order they finished in). A checkpoint: which runs train on
# is known once it is made.
checkpoint prune:
    """Rank a pruned sweep's runs at one rung; keep the best 1/eta."""
    input:
        metrics=STAGES.metrics,
        decided=STAGES.decided,
    output:
        "results/sweeps/{sweep}/rung-{epoch}.json",
    log:
        "logs/prune/{sweep}/rung-{epoch}.log",
    wildcard_constraints:
        sweep="[0-9]+",
        epoch="[0-9]+",
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        runs=STAGES.runs,
        eta=lambda wildcards: HALVINGS[int(wildcards.sweep)].eta,
        metric=lambda wildcards: HALVINGS[int(wildcards.sweep)].metric,
        version=STAGE_VERSIONS["prune"],
    shell:
        "imagenet-ddp prune --sweep {wildcards.sweep} --epoch {wildcards.epoch}"
        " --eta {params.eta} --metric {params.metric} --runs {params.runs:q}"
        " --metrics {input.metrics:q} --out {output:q} > {log:q} 2>&1"


# A pruned sweep's run: its last stage's outputs (the rung it was pruned at, else the end)
# copied into its run folder, train_metrics.json marked (halving); no GPU job.
rule rung_final:
    """A pruned sweep's run: its last stage's outputs in its run folder."""
    input:
        unpack(STAGES.final_input),
    output:
        model="results/runs/{run}/model.pt",
        metrics="results/runs/{run}/train_metrics.json",
        history="results/runs/{run}/history.csv",
        job="results/runs/{run}/job.json",
        provenance="results/runs/{run}/model.pt.provenance.json",
    log:
        "logs/rung_final/{run}.log",
    wildcard_constraints:
        run=PRUNED_RUNS,
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        rung_dir=STAGES.final_dir,
        epoch=lambda wildcards, input: os.path.basename(
            STAGES.final_dir(wildcards, input)
        ),
        epochs=lambda wildcards: HALVING_OF[wildcards.run].epochs,
        version=STAGE_VERSIONS["rung_final"],
    shell:
        "imagenet-ddp rung-final --rung-dir {params.rung_dir:q} --run-dir"
        " results/runs/{wildcards.run} --epoch {params.epoch} --epochs {params.epochs}"
        " > {log:q} 2>&1"


# Evaluation runs like training: DDP ranks on the GPUs of `evaluate` geometry (config.yaml
# `evaluate`, per run `runs[].evaluate`; default one node with the run's GPUs per node), each
# sample counted once. Its geometry is a resource, not a param: where the evaluation runs does
# not change the accuracy, so it triggers no rerun; eval.json records the geometry it ran on.
rule evaluate:
    """Evaluate a run's model on the holdout and the val (test) set, DDP ranks."""
    input:
        model="results/runs/{run}/model.pt",
        # What re-evaluates it besides a new model, by path (common.smk key_file): the
        # content of the prepared copies, holdout list and classes it reads, its batch size and
        # what the stage writes.
        key=key_file("evaluate"),
    output:
        metrics="results/runs/{run}/eval.json",
        per_class="results/runs/{run}/per_class.csv",
        spec="results/runs/{run}/eval_spec.json",
    log:
        "logs/evaluate/{run}.log",
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    # Cores this job takes on a local machine (ignored by the SLURM executor's sizing).
    threads: eval_threads
    resources:
        nodes=job_resource("nodes", evaluation_settings),
        tasks_per_node=job_resource("tasks_per_node", evaluation_settings),
        tasks=job_resource("tasks", evaluation_settings),
        cpus_per_task=job_resource("cpus_per_task", evaluation_settings),
        gres=job_resource("gres", evaluation_settings),
        tasks_per_gpu=0,  # else the plugin adds --ntasks-per-gpu=<all tasks> to GPU jobs
        mpi=job_resource("mpi", evaluation_settings),
        # The evaluation's job spec: its geometry, batch size, loader workers, paths and where
        # it runs (common.smk job_spec; a resource: no rerun when it changes, see rule train).
        job=job_spec("evaluate", "evaluate"),
    # exec: the launcher replaces the rule's shell (see rule train).
    shell:
        "exec imagenet-ddp evaluate --job {resources.job:q} --key {input.key:q} > {log:q} 2>&1"


# The preflight of a run (imagenet_ddp.preflight.job): its exact geometry and SLURM shape, staging
# as training does, then per rank placement, all-reduce, the training step and the loader, and
# the run's projection; it fails with one line per problem. `snakemake preflight` checks
# every run; `preflight: true` makes the run's `train` wait for a passing one.
rule preflight_run:
    """Check a run's geometry, staging, all-reduce, step and loader; project its cost."""
    input:
        # train's key (see there): its projection is of these settings and this data
        key=key_file("train"),
    output:
        report="results/preflight/{run}/preflight.json",
    log:
        "logs/preflight/{run}.log",
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    threads:
        lambda wildcards: RUNS[wildcards.run]["tasks_per_node"]
        * RUNS[wildcards.run]["cpus_per_task"]
    resources:
        # The train rule's shape (see there); a short time limit of its own (a profile's
        # set-resources may change it).
        nodes=job_resource("nodes"),
        tasks_per_node=job_resource("tasks_per_node"),
        tasks=job_resource("tasks"),
        cpus_per_task=job_resource("cpus_per_task"),
        gres=job_resource("gres"),
        tasks_per_gpu=0,
        mpi=job_resource("mpi"),
        runtime=30,
        # Its job spec (a resource, as train's, see there): train's run and staging; its ranks
        # start as train's do (the launch prefix of train's `mpi`: --set-resources
        # train:mpi="srun --mpi=pmix"); train's time limit, what the projection counts
        # allocations of; train's checkpoint folder, where it measures the write rate.
        job=job_spec("preflight", "train"),
    shell:
        "exec imagenet-ddp preflight --job {resources.job:q} > {log:q} 2>&1"


# `snakemake preflight`: the preflight of every run (a target; nothing trains).
rule preflight:
    """Target: the preflight of every run (nothing trains)."""
    input:
        expand("results/preflight/{run}/preflight.json", run=RUNS),


# `snakemake keys`: every run's rerun keys written, nothing trained (an upgrade writes them once
# and then --touch records the finished jobs: docs/configuration.md "Code changes").
rule keys:
    """Target: every run's train and evaluate rerun keys (nothing trains)."""
    input:
        key_files,
