"""The ILSVRC2012 archives' file names, the image file suffixes and the index format version, in
a module without numpy or pandas: Snakemake's parse on a bare login node imports it."""

TRAIN_ARCHIVE = "ILSVRC2012_img_train.tar"
VAL_ARCHIVE = "ILSVRC2012_img_val.tar"
DEVKIT_ARCHIVE = "ILSVRC2012_devkit_t12.tar.gz"
MD5SUMS = "md5sums"
ARCHIVES = (TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE)
# What torchvision's ImageFolder accepts (torchvision.datasets.folder.IMG_EXTENSIONS).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# Bumped when archives.SAMPLE_COLUMNS change; the index rule passes it as a param, so Snakemake
# rebuilds an index written by an older version instead of handing it to prepare.
INDEX_FORMAT_VERSION = 2
