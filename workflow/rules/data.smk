rule demo_data:
    """A small synthetic ILSVRC2012 (the three archives and md5sums) when demo.enabled."""
    output:
        train="resources/demo/ILSVRC2012/ILSVRC2012_img_train.tar",
        val="resources/demo/ILSVRC2012/ILSVRC2012_img_val.tar",
        devkit="resources/demo/ILSVRC2012/ILSVRC2012_devkit_t12.tar.gz",
        md5sums="resources/demo/ILSVRC2012/md5sums",
    log:
        "logs/demo_data.log",
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        out=lambda wildcards, output: os.path.dirname(output.train),
        num_classes=config["demo"]["num_classes"],
        train_per_class=config["demo"]["train_per_class"],
        val_per_class=config["demo"]["val_per_class"],
        image_size=config["demo"]["image_size"],
        seed=config["demo"]["seed"],
    shell:
        "imagenet-ddp demo-data --out {params.out:q} --num-classes {params.num_classes}"
        " --train-per-class {params.train_per_class} --val-per-class {params.val_per_class}"
        " --image-size {params.image_size} --seed {params.seed} > {log:q} 2>&1"


rule verify:
    """Check the archives are present and complete (and their md5 with data.check_md5)."""
    input:
        **archive_paths(),
        md5sums=md5sums_input,
    output:
        report="results/verify/report.json",
    log:
        "logs/verify.log",
    benchmark:
        "results/benchmarks/verify.tsv"
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        data_dir=lambda wildcards: data_dir(),
        check_md5="--check-md5" if config["data"]["check_md5"] else "--no-check-md5",
        version=STAGE_VERSIONS["verify"],  # what it writes changed: rerun (stage_versions)
    shell:
        "imagenet-ddp verify --data-dir {params.data_dir:q} --report {output.report:q}"
        " {params.check_md5} > {log:q} 2>&1"


rule index:
    """List every train and val image with its class from the archives and devkit."""
    input:
        # Not verify's report: index reads the tars' headers beside verify's md5 pass, and a
        # verify rerun (data.check_md5 flipped) reruns nothing after it. What trains waits
        # for the report (data_content).
        **archive_paths(),
    output:
        classes="results/index/classes.csv",
        train="results/index/train.csv",
        val="results/index/val.csv",
    log:
        "logs/index.log",
    benchmark:
        "results/benchmarks/index.tsv"
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        data_dir=lambda wildcards: data_dir(),
        out_dir=lambda wildcards, output: os.path.dirname(output.train),
        # A new index format reruns this rule: prepare never reads an index of an older one.
        version=STAGE_VERSIONS["index"],
    shell:
        "imagenet-ddp index --data-dir {params.data_dir:q} --out-dir {params.out_dir:q}"
        " > {log:q} 2>&1"


rule split:
    """Hold out a stratified, seeded share of the train set for validation."""
    input:
        train="results/index/train.csv",
    output:
        train="results/split/train.csv",
        holdout="results/split/holdout.csv",
        class_counts="results/split/class_counts.csv",
    log:
        "logs/split.log",
    benchmark:
        "results/benchmarks/split.tsv"
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        holdout_fraction=config["split"]["holdout_fraction"],
        seed=config["split"]["seed"],
        index_dir=lambda wildcards, input: os.path.dirname(input.train),
        out_dir=lambda wildcards, output: os.path.dirname(output.train),
        version=STAGE_VERSIONS["split"],
    shell:
        "imagenet-ddp split --index-dir {params.index_dir:q}"
        " --holdout-fraction {params.holdout_fraction} --seed {params.seed}"
        " --out-dir {params.out_dir:q} > {log:q} 2>&1"


if PREPARE_JOBS == 1:

    rule prepare:
        """Write the training-ready copy (resized JPEG tar shards) of train or val."""
        input:
            **archive_paths(),
            index="results/index/{which}.csv",
            classes="results/index/classes.csv",
        output:
            # A manifest naming the content-addressed copy in prepare.dir (common.smk
            # prepared_manifest): what Snakemake deletes before the job, never a copy.
            manifest=prepared_manifest("{which}"),
        log:
            "logs/prepare_{which}.log",
        benchmark:
            "results/benchmarks/prepare_{which}.tsv"
        wildcard_constraints:
            which="train|val",
        conda:
            "../envs/imagenet-ddp.yaml"
        container:
            CONTAINER
        threads: PREPARE["workers"]
        params:
            data_dir=lambda wildcards: data_dir(),
            index_dir=lambda wildcards, input: os.path.dirname(input.index),
            flags=prepare_flags,
            # A new prepared format reruns this rule: no job reads a copy of an older one.
            version=STAGE_VERSIONS["prepare"],
            # Where the copies live (a function: --lint takes a plain prefix of the output
            # for a path to derive from it; the copies are not this job's outputs).
            prepared_dir=lambda wildcards: PREPARED_DIR,
        shell:
            "imagenet-ddp prepare --data-dir {params.data_dir:q} --index-dir {params.index_dir:q}"
            " --manifest {output.manifest:q} --prepared-dir {params.prepared_dir:q}"
            " {params.flags} --workers {threads} > {log:q} 2>&1"

else:

    rule prepare_chunk:
        """Convert one of prepare.jobs ranges of shards of the prepared copy."""
        input:
            **archive_paths(),
            index="results/index/{which}.csv",
            classes="results/index/classes.csv",
        output:
            temp(
                directory(
                    f"results/prepare_chunks/{{which}}/{{chunk}}-of-{PREPARE_JOBS}"
                )
            ),
        log:
            "logs/prepare_{which}_{chunk}.log",
        benchmark:
            "results/benchmarks/prepare_{which}_{chunk}.tsv"
        wildcard_constraints:
            which="train|val",
            chunk=r"\d+",
        conda:
            "../envs/imagenet-ddp.yaml"
        container:
            CONTAINER
        threads: PREPARE["workers"]
        params:
            data_dir=lambda wildcards: data_dir(),
            index_dir=lambda wildcards, input: os.path.dirname(input.index),
            flags=prepare_flags,
            # A new prepared format reruns this rule: no job reads a copy of an older one.
            version=STAGE_VERSIONS["prepare"],
            # a copy of the same index and settings there already: convert nothing
            prepared_dir=lambda wildcards: PREPARED_DIR,
        shell:
            "imagenet-ddp prepare-chunk --data-dir {params.data_dir:q}"
            " --index-dir {params.index_dir:q} --chunk {wildcards.chunk}"
            f" --chunks {PREPARE_JOBS}"
            " --chunk-dir {output:q} --prepared-dir {params.prepared_dir:q}"
            " {params.flags} --workers {threads} > {log:q} 2>&1"

    rule prepare:
        """Write the training-ready copy (resized JPEG tar shards) of train or val."""
        input:
            chunks=expand(
                "results/prepare_chunks/{{which}}/{chunk}-of-{jobs}",
                chunk=range(PREPARE_JOBS),
                jobs=PREPARE_JOBS,
            ),
        output:
            # A manifest naming the content-addressed copy in prepare.dir (common.smk
            # prepared_manifest): what Snakemake deletes before the job, never a copy.
            manifest=prepared_manifest("{which}"),
        log:
            "logs/prepare_{which}.log",
        benchmark:
            "results/benchmarks/prepare_{which}.tsv"
        wildcard_constraints:
            which="train|val",
        conda:
            "../envs/imagenet-ddp.yaml"
        container:
            CONTAINER
        params:
            version=STAGE_VERSIONS["prepare"],
            # Where the copies live (a function: --lint takes a plain prefix of the output
            # for a path to derive from it; the copies are not this job's outputs).
            prepared_dir=lambda wildcards: PREPARED_DIR,
        shell:
            "imagenet-ddp prepare-join --chunk-dirs {input.chunks:q}"
            " --manifest {output.manifest:q} --prepared-dir {params.prepared_dir:q}"
            " > {log:q} 2>&1"


# What the trainings and evaluations read, by content: the sha256 of the prepared copies'
# content (their prepared.json, which holds every shard's sha256) and of the split's files. A
# checkpoint: Snakemake judges train and evaluate again once it has run, by their params (these
# digests), not by its time, so a data stage that reruns and makes the same data (a new stage
# version, another layout or data.dir with the same images) retrains nothing, and other images
# retrain every run. A dry-run shows them waiting for it ("decided after data_content").
checkpoint data_content:
    """Record the content digest of the data each training and evaluation reads."""
    input:
        prepared_train=prepared_manifest("train"),
        prepared_val=prepared_manifest("val"),
        split_train="results/split/train.csv",
        split_holdout="results/split/holdout.csv",
        classes="results/index/classes.csv",
        # What trains waits for verified archives; a verify rerun (check_md5) alone reruns
        # nothing here (ancient: its report's time is no reason).
        verified=ancient(VERIFY_REPORT),
    output:
        DATA_CONTENT,
    log:
        "logs/data_content.log",
    localrule: True
    conda:
        "../envs/imagenet-ddp.yaml"
    container:
        CONTAINER
    params:
        version=STAGE_VERSIONS["data_content"],
    shell:
        "imagenet-ddp data-content --prepared-train {input.prepared_train:q}"
        " --prepared-val {input.prepared_val:q} --split-train {input.split_train:q}"
        " --split-holdout {input.split_holdout:q} --classes {input.classes:q}"
        " --out {output:q} > {log:q} 2>&1"
