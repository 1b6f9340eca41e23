# ImageNet (ILSVRC2012) classifiers trained with multi-node PyTorch DDP, measured and reported.
#   snakemake --profile profiles/local      # one machine
#   snakemake --profile profiles/slurm      # a SLURM cluster
# Review first: add -n (dry-run) to see every job and its resources.

from snakemake.utils import min_version

# pyproject.toml's range (snakemake>=9.0,<10); CI verifies the pinned 9.27.1.
min_version("9.0")


configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        REPORT_TARGETS,
