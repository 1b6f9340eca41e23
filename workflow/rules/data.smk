import os


def md5sums_input(wildcards):
    """md5sums is optional for real data; the demo set always writes one."""
    path = f"{data_dir()}/md5sums"
    if config.get("demo", {}).get("enabled", False) or os.path.exists(path):
        return [path]
    return []


rule demo_data:
    output:
        train="resources/demo/ILSVRC2012/ILSVRC2012_img_train.tar",
        val="resources/demo/ILSVRC2012/ILSVRC2012_img_val.tar",
        devkit="resources/demo/ILSVRC2012/ILSVRC2012_devkit_t12.tar.gz",
        md5sums="resources/demo/ILSVRC2012/md5sums",
    params:
        out="resources/demo/ILSVRC2012",
        num_classes=config.get("demo", {}).get("num_classes", 10),
        train_per_class=config.get("demo", {}).get("train_per_class", 100),
        val_per_class=config.get("demo", {}).get("val_per_class", 10),
        image_size=config.get("demo", {}).get("image_size", 64),
        seed=config.get("demo", {}).get("seed", 0),
    log:
        "logs/demo_data.log",
    shell:
        "{IMAGENET_DDP} demo-data --out {params.out:q} --num-classes {params.num_classes}"
        " --train-per-class {params.train_per_class} --val-per-class {params.val_per_class}"
        " --image-size {params.image_size} --seed {params.seed} > {log:q} 2>&1"


rule verify:
    input:
        **archive_paths(),
        md5sums=md5sums_input,
    output:
        report="results/verify/report.json",
    params:
        data_dir=data_dir(),
        check_md5="--check-md5" if config["data"].get("check_md5", True) else "--no-check-md5",
    log:
        "logs/verify.log",
    benchmark:
        "results/benchmarks/verify.tsv"
    shell:
        "{IMAGENET_DDP} verify --data-dir {params.data_dir:q} --report {output.report:q}"
        " {params.check_md5} > {log:q} 2>&1"


rule index:
    input:
        **archive_paths(),
        verified="results/verify/report.json",
    output:
        classes="results/index/classes.csv",
        train="results/index/train.csv",
        val="results/index/val.csv",
    params:
        data_dir=data_dir(),
        out_dir="results/index",
    log:
        "logs/index.log",
    benchmark:
        "results/benchmarks/index.tsv"
    shell:
        "{IMAGENET_DDP} index --data-dir {params.data_dir:q} --out-dir {params.out_dir:q}"
        " > {log:q} 2>&1"


rule split:
    input:
        train="results/index/train.csv",
    output:
        train="results/split/train.csv",
        holdout="results/split/holdout.csv",
        class_counts="results/split/class_counts.csv",
    params:
        holdout_fraction=config["split"]["holdout_fraction"],
        seed=config["split"]["seed"],
        out_dir="results/split",
    log:
        "logs/split.log",
    benchmark:
        "results/benchmarks/split.tsv"
    shell:
        "{IMAGENET_DDP} split --index-dir results/index"
        " --holdout-fraction {params.holdout_fraction} --seed {params.seed}"
        " --out-dir {params.out_dir:q} > {log:q} 2>&1"


rule prepare:
    input:
        **archive_paths(),
        index="results/index/{which}.csv",
    output:
        directory("results/prepared/{which}"),
    wildcard_constraints:
        which="train|val",
    params:
        data_dir=data_dir(),
        short_side=config.get("prepare", {}).get("short_side", 160),
        quality=config.get("prepare", {}).get("jpeg_quality", 90),
        on_corrupt=config.get("prepare", {}).get("on_corrupt", "fail"),
    threads: config.get("prepare", {}).get("workers", 1)
    log:
        "logs/prepare_{which}.log",
    benchmark:
        "results/benchmarks/prepare_{which}.tsv"
    shell:
        "{IMAGENET_DDP} prepare --data-dir {params.data_dir:q} --index-dir results/index"
        " --which {wildcards.which} --out {output:q} --short-side {params.short_side}"
        " --quality {params.quality} --workers {threads} --on-corrupt {params.on_corrupt}"
        " > {log:q} 2>&1"
