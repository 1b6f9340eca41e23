"""Each stage's output version, a param of its rule, raised by hand when a release changes what
the stage writes: exactly that stage reruns, never for a refactoring, a new Python or a
reinstall. A finished training never reruns for code (the runs table flags another package
version). Torch-free; costs at ImageNet scale: docs/configuration.md "Reruns".
"""

from imagenet_ddp.data.archive_names import INDEX_FORMAT_VERSION
from imagenet_ddp.data.prepared_layout import FORMAT_VERSION as PREPARED_FORMAT_VERSION

STAGE_VERSIONS = {
    "verify": 1,
    "index": INDEX_FORMAT_VERSION,
    "split": 1,
    "prepare": PREPARED_FORMAT_VERSION,
    "data_content": 1,
    "check": 1,
    "evaluate": 1,
    "accounting": 1,
    "aggregate": 2,
    "plots": 2,
    "prune": 1,
    "rung_final": 1,
}
