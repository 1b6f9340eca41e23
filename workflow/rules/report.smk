report: "../report/workflow.rst"


PLOT_FILES = {
    "throughput": "results/plots/throughput.png",
    "efficiency": "results/plots/scaling_efficiency.png",
    "curves": "results/plots/training_curves.png",
    "per_class": "results/plots/per_class_test_top1.png",
    "cost": "results/plots/cost.png",
    "to_target": "results/plots/holdout_vs_gpu_hours.png",
}

REPORT_TARGETS = [
    "results/aggregate/runs.csv",
    "results/aggregate/runs.md",
    *PLOT_FILES.values(),
]


# The report rules run on the machine that runs Snakemake (a cluster's login node), not as
# sbatch jobs: each reads a few small files for seconds, where a job would wait in the queue.
# Each says so itself (`localrule: True`), which a `module`'s prefix keeps, as `localrules:`
# does not (it names rules unprefixed).


# SLURM's accounting of a run's training jobs (sacct, with a timeout:
# imagenet_ddp.report.accounting), one job per run: sacct is asked only about a run whose
# training changed; a run not trained in a SLURM job gets the reason instead.
rule accounting:
    """SLURM's accounting (sacct) of one run's training jobs."""
    input:
        metrics="results/runs/{run}/train_metrics.json",
    output:
        "results/runs/{run}/accounting.json",
    log:
        "logs/accounting/{run}.log",
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        run_dir=lambda wildcards, input: os.path.dirname(input.metrics),
        version=STAGE_VERSIONS["accounting"],
    shell:
        "imagenet-ddp accounting --run-dirs {params.run_dir:q} > {log:q} 2>&1"


rule aggregate:
    """The table of every run: throughput, scaling, accuracy, cost."""
    input:
        metrics=expand("results/runs/{run}/train_metrics.json", run=RUNS),
        evaluations=expand("results/runs/{run}/eval.json", run=RUNS),
        jobs=expand("results/runs/{run}/job.json", run=RUNS),
        accounting=expand("results/runs/{run}/accounting.json", run=RUNS),
        provenances=expand("results/runs/{run}/model.pt.provenance.json", run=RUNS),
        # Runs with `preflight: true`: their projection beside what training measured.
        preflights=preflight_reports(),
    output:
        csv=report(
            "results/aggregate/runs.csv",
            caption="../report/runs_table.rst",
            category="Tables",
            labels={"table": "all runs"},
        ),
        markdown="results/aggregate/runs.md",
    log:
        "logs/aggregate.log",
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        run_dirs=run_dirs(),
        # What it writes: a new version reruns this local rule (a second), and its table flags
        # a run trained by another package version.
        version=STAGE_VERSIONS["aggregate"],
        package=PACKAGE_VERSION,
        report=REPORT_SETTINGS,  # report.target_top1, the sweeps' axes
    shell:
        "imagenet-ddp aggregate --run-dirs {params.run_dirs:q} --csv {output.csv:q}"
        " --markdown {output.markdown:q} --report-settings {params.report:q} > {log:q} 2>&1"


rule plots:
    """The figures: throughput, scaling efficiency, curves, per class, cost."""
    input:
        runs="results/aggregate/runs.csv",
        histories=expand("results/runs/{run}/history.csv", run=RUNS),
        per_class=expand("results/runs/{run}/per_class.csv", run=RUNS),
    output:
        throughput=report(
            PLOT_FILES["throughput"],
            caption="../report/throughput.rst",
            category="Throughput",
            labels={"figure": "throughput vs ranks"},
        ),
        efficiency=report(
            PLOT_FILES["efficiency"],
            caption="../report/scaling_efficiency.rst",
            category="Throughput",
            labels={"figure": "scaling efficiency"},
        ),
        curves=report(
            PLOT_FILES["curves"],
            caption="../report/training_curves.rst",
            category="Training curves",
            labels={"figure": "loss and accuracy per epoch"},
        ),
        per_class=report(
            PLOT_FILES["per_class"],
            caption="../report/per_class.rst",
            category="Accuracy",
            labels={"figure": "per-class test top-1"},
        ),
        cost=report(
            PLOT_FILES["cost"],
            caption="../report/cost.rst",
            category="Cost",
            labels={"figure": "throughput vs cost per epoch and energy"},
        ),
        to_target=report(
            PLOT_FILES["to_target"],
            caption="../report/to_target.rst",
            category="Accuracy",
            labels={"figure": "holdout top-1 vs GPU-hours"},
        ),
    log:
        "logs/plots.log",
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        run_dirs=run_dirs(),
        version=STAGE_VERSIONS["plots"],
    shell:
        "imagenet-ddp plots --runs-csv {input.runs:q} --run-dirs {params.run_dirs:q}"
        " --throughput {output.throughput:q} --efficiency {output.efficiency:q}"
        " --curves {output.curves:q} --per-class {output.per_class:q}"
        " --cost {output.cost:q} --to-target {output.to_target:q} > {log:q} 2>&1"


# `snakemake progress` (add --nolock while the workflow runs in this directory): the runs
# finished so far and the state of the others (imagenet_ddp.report.progress). No input, so it
# waits for no run; no output, so it runs each time it is asked.
rule progress:
    """The runs so far: finished runs' table; the others' epoch, throughput, ETA or failure."""
    log:
        "logs/progress.log",
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        runs=list(RUNS),
        run_dirs=run_dirs(),
        checkpoint_roots=[f"{CHECKPOINT_DIR}/{name}" for name in RUNS],
        csv="results/progress/runs.csv",
        markdown="results/progress/runs.md",
    shell:
        "imagenet-ddp progress --runs {params.runs:q} --run-dirs {params.run_dirs:q}"
        " --checkpoint-roots {params.checkpoint_roots:q} --csv {params.csv:q}"
        " --markdown {params.markdown:q} > {log:q} 2>&1; cat {params.markdown:q}"
