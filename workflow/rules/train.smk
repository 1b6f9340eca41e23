rule train:
    """Train one run with DDP on its nodes x tasks_per_node ranks; resumed after a stop."""
    input:
        # ancient: a rerun of the data stages that makes the same data resubmits no finished
        # training; the split settings rerun it through data_key, the prepared copy's content
        # through its key file (common.smk; docs/configuration.md "Reruns").
        prepared=ancient(prepared_manifest("train")),
        split_train=ancient("results/split/train.csv"),
        split_holdout=ancient("results/split/holdout.csv"),
        data_key=DATA_KEY,
        prepared_key=prepared_key("train"),
        preflight=preflight_input,  # runs with `preflight: true`: a passing preflight first
    output:
        model="results/runs/{run}/model.pt",
        metrics="results/runs/{run}/train_metrics.json",
        history="results/runs/{run}/history.csv",
        job="results/runs/{run}/job.json",
        provenance="results/runs/{run}/model.pt.provenance.json",
    log:
        "logs/train/{run}.log",
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
        # geometry itself is a result (params, rerun_params), these only size the job.
        # A retry that will refuse (max_allocations, or no progress twice in a row) asks for
        # one task without GPUs instead (common.smk train_resource).
        nodes=train_resource("nodes"),
        tasks_per_node=train_resource("tasks_per_node"),
        tasks=train_resource("tasks"),
        cpus_per_task=train_resource("cpus_per_task"),
        gres=train_resource("gres"),
        tasks_per_gpu=0,  # else the plugin adds --ntasks-per-gpu=<all tasks> to GPU jobs
        mpi=train_resource("mpi"),
        snakemake_attempt=lambda wildcards, attempt: attempt,  # 2, 3, ...: a resubmission (shown)
        # The path of the whole job spec (imagenet_ddp.jobs.spec: the run's settings, geometry
        # included, its paths, where and how it runs; common.smk job_spec, a file named by its
        # content's digest), and a compact line of the hyperparameters (shown by
        # `snakemake -n -p`): resources, not params, because a param's every change
        # reruns the finished job (a new GPU allocation that resumes its final checkpoint and
        # changes nothing) and bookkeeping such as log_interval or the launcher changes no
        # result. `imagenet-ddp train` writes the spec once into <run dir>/job_spec.json, the
        # one file every process of the job reads.
        job=job_spec("train", "train"),
        hyperparameters=run_hyperparameters,
    params:
        # What reruns the training: the settings of the run's checkpoint key (kinds weights,
        # numerics, geometry: imagenet_ddp.settings.kinds; docs/configuration.md "Reruns"),
        # one param each, so that a dry-run's reason names the setting that changed.
        **rerun_params(),
    # exec: the launcher replaces the rule's shell, which a stop signal would kill (SLURM
    # signals every process of the step) before the ranks have written their checkpoint.
    # Every job (attempt) writes its own log, logs/train/<run>/job-<SLURM job id>-attempt<n>-
    # <UTC start>.log, which Snakemake does not delete when it starts the next job; {log} links
    # to the newest (imagenet_ddp.jobs.attempt_log). Not beside the checkpoints: a purged
    # scratch would take the logs along. It starts with a header and the run's hyperparameters.
    shell:
        "exec imagenet-ddp train --job {resources.job:q} --attempt-log {log:q}"


# Evaluation runs like training: DDP ranks on the GPUs of `evaluate` geometry (config.yaml
# `evaluate`, per run `runs[].evaluate`; default one node with the run's GPUs per node), each
# sample counted once. Its geometry is a resource, not a param: where the evaluation runs does
# not change the accuracy, so it triggers no rerun; eval.json records the geometry it ran on.
rule evaluate:
    """Evaluate a run's model on the holdout and the val (test) set, DDP ranks."""
    input:
        model="results/runs/{run}/model.pt",
        # The shared prepared copy, read directly: no node-local staging (one sequential pass).
        prepared_train=prepared_manifest("train"),
        prepared_val=prepared_manifest("val"),
        holdout="results/split/holdout.csv",
        classes="results/index/classes.csv",
    output:
        metrics="results/runs/{run}/eval.json",
        per_class="results/runs/{run}/per_class.csv",
    log:
        "logs/evaluate/{run}.log",
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    # Cores this job takes on a local machine (ignored by the SLURM executor's sizing).
    threads: eval_threads
    resources:
        nodes=evaluation_setting("nodes"),
        tasks_per_node=slurm_resource("tasks_per_node", evaluation_settings),
        tasks=slurm_resource("tasks", evaluation_settings),
        cpus_per_task=evaluation_setting("cpus_per_task"),
        gres=slurm_resource("gres", evaluation_settings),
        tasks_per_gpu=0,  # else the plugin adds --ntasks-per-gpu=<all tasks> to GPU jobs
        mpi=slurm_resource("mpi", evaluation_settings),
        # The evaluation's job spec: its geometry, batch size, loader workers, paths and where
        # it runs (common.smk job_spec; a resource: no rerun when it changes, see rule train).
        job=job_spec("evaluate", "evaluate"),
    params:
        # What reruns the evaluation, as before the job spec (the geometry does not).
        batch_size=evaluation_setting("batch_size"),
        split_dir=lambda wildcards, input: os.path.dirname(input.holdout),
        code=CODE["evaluate"],  # its code changed: rerun (common.smk CODE)
    # exec: the launcher replaces the rule's shell (see rule train).
    shell:
        "exec imagenet-ddp evaluate --job {resources.job:q} > {log:q} 2>&1"


# The preflight of a run (imagenet_ddp.preflight.job): its exact geometry and SLURM shape, staging
# as training does, then per rank placement, all-reduce, the training step and the loader, and
# the run's projection; it fails with one line per problem. `snakemake preflight` checks
# every run; `preflight: true` makes the run's `train` wait for a passing one.
rule preflight_run:
    """Check a run's geometry, staging, all-reduce, step and loader; project its cost."""
    input:
        # as train's (see there): its projection is of this data
        prepared=ancient(prepared_manifest("train")),
        split_train=ancient("results/split/train.csv"),
        split_holdout=ancient("results/split/holdout.csv"),
        data_key=DATA_KEY,
        prepared_key=prepared_key("train"),
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
        nodes=run_setting("nodes"),
        tasks_per_node=slurm_resource("tasks_per_node"),
        tasks=slurm_resource("tasks"),
        cpus_per_task=run_setting("cpus_per_task"),
        gres=slurm_resource("gres"),
        tasks_per_gpu=0,
        mpi=slurm_resource("mpi"),
        runtime=30,
        # Its job spec (a resource, as train's, see there): train's run and staging; its ranks
        # start as train's do (the launch prefix of train's `mpi`: --set-resources
        # train:mpi="srun --mpi=pmix"); train's time limit, what the projection counts
        # allocations of; train's checkpoint folder, where it measures the write rate.
        job=job_spec("preflight", "train"),
    params:
        **rerun_params(),
    shell:
        "exec imagenet-ddp preflight --job {resources.job:q} > {log:q} 2>&1"


# `snakemake preflight`: the preflight of every run (a target; nothing trains).
rule preflight:
    """Target: the preflight of every run (nothing trains)."""
    input:
        expand("results/preflight/{run}/preflight.json", run=RUNS),


# Records of an earlier version's finished runs, carried over (common.smk).
migrate_recorded_params(rules.train, rules.preflight_run)
