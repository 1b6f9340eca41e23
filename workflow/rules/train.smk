rule train:
    input:
        prepared="results/prepared/train",
        split_train="results/split/train.csv",
        split_holdout="results/split/holdout.csv",
    output:
        model="results/runs/{run}/model.pt",
        metrics="results/runs/{run}/train_metrics.json",
        history="results/runs/{run}/history.csv",
        job="results/runs/{run}/job.json",
    params:
        run_config=run_training_json,
        nodes=run_geometry("nodes"),
        tasks_per_node=run_geometry("tasks_per_node"),
        cpus_per_task=run_geometry("cpus_per_task"),
        run_dir="results/runs/{run}",
        checkpoint_root=f"{CHECKPOINT_DIR}/{{run}}",
    # Cores this job takes on a local machine (ignored by the SLURM executor's sizing).
    threads: lambda wildcards: RUNS[wildcards.run]["tasks_per_node"]
        * RUNS[wildcards.run]["cpus_per_task"]
    resources:
        # One SLURM task per GPU (rank) on every node; the rule launches them itself with srun,
        # which the SLURM executor requires to be declared with the `mpi` resource.
        nodes=run_geometry("nodes"),
        tasks=lambda wildcards: RUNS[wildcards.run]["nodes"]
        * RUNS[wildcards.run]["tasks_per_node"],
        tasks_per_node=run_geometry("tasks_per_node"),
        cpus_per_task=run_geometry("cpus_per_task"),
        gpus_per_node=run_geometry("gpus_per_node"),
        mpi="srun",
    log:
        "logs/train/{run}.log",
    shell:
        "{IMAGENET_DDP} train {TRAIN_EXECUTION_ARGS} --run-config-json {params.run_config:q}"
        " --prepared-train {input.prepared:q} --split-dir results/split"
        " --run-dir {params.run_dir:q} --checkpoint-root {params.checkpoint_root:q}"
        " --nodes {params.nodes} --tasks-per-node {params.tasks_per_node}"
        " --cpus-per-task {params.cpus_per_task} > {log:q} 2>&1"


rule evaluate:
    input:
        model="results/runs/{run}/model.pt",
        prepared_train="results/prepared/train",
        prepared_val="results/prepared/val",
        holdout="results/split/holdout.csv",
        classes="results/index/classes.csv",
    output:
        metrics="results/runs/{run}/eval.json",
        per_class="results/runs/{run}/per_class.csv",
    params:
        batch_size=config.get("evaluate", {}).get("batch_size", 128),
    threads: 1
    log:
        "logs/evaluate/{run}.log",
    shell:
        "{IMAGENET_DDP} evaluate --model {input.model:q}"
        " --prepared-train {input.prepared_train:q} --prepared-val {input.prepared_val:q}"
        " --split-dir results/split --classes {input.classes:q} --out {output.metrics:q}"
        " --per-class {output.per_class:q} --batch-size {params.batch_size}"
        " --workers {resources.eval_workers} > {log:q} 2>&1"
