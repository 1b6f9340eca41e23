"""The names and format version of a prepared directory (:mod:`imagenet_ddp.prepared`), in a
module without torch: the rules (a format change reruns ``prepare``) and the staging steps
import it."""

FORMAT = "imagenet_ddp.prepared"
# 2: shards are tar files with WebDataset member names (1: bare concatenated JPEGs, .bin)
FORMAT_VERSION = 2
SHARD_DIR = "shards"
SAMPLES_CSV = "samples.csv"
PREPARED_JSON = "prepared.json"
