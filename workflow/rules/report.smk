REPORT_TARGETS = [
    "results/aggregate/runs.csv",
    "results/aggregate/runs.md",
]


rule aggregate:
    input:
        metrics=expand("results/runs/{run}/train_metrics.json", run=RUNS),
        evaluations=expand("results/runs/{run}/eval.json", run=RUNS),
        jobs=expand("results/runs/{run}/job.json", run=RUNS),
    output:
        csv="results/aggregate/runs.csv",
        markdown="results/aggregate/runs.md",
    log:
        "logs/aggregate.log",
    conda:
        "../envs/imagenet-ddp.yaml"
    params:
        run_dirs=run_dirs(),
    shell:
        "imagenet-ddp aggregate --run-dirs {params.run_dirs:q} --csv {output.csv:q}"
        " --markdown {output.markdown:q} > {log:q} 2>&1"
