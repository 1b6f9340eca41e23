"""The ILSVRC2012 archives' file names and the index format version
(:mod:`imagenet_ddp.data.archives`)
in a module without numpy or pandas: the workflow imports it while Snakemake parses the rules,
which a login node's bare Snakemake environment must be able to do."""

TRAIN_ARCHIVE = "ILSVRC2012_img_train.tar"
VAL_ARCHIVE = "ILSVRC2012_img_val.tar"
DEVKIT_ARCHIVE = "ILSVRC2012_devkit_t12.tar.gz"
MD5SUMS = "md5sums"
ARCHIVES = (TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE)

# Bumped when archives.SAMPLE_COLUMNS change; the index rule passes it as a param, so Snakemake
# rebuilds an index written by an older version instead of handing it to prepare.
INDEX_FORMAT_VERSION = 2
