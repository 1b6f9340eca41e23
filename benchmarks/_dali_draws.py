"""The CPU cost of a ``loader: dali`` run's per-sample draws: ``DaliLoader.batch_inputs`` (each
sample's bytes read, its JPEG header, its seeded crop window, flip, policy ops and erasing box),
which DALI's external-source worker processes run while DALI decodes and augments on the GPU.
One process, one thread, per recipe at crop 224 from short side 256, batches of 64, 512
realistic JPEGs (bench_gpu.make_prepared); samples/s per process, the median of 5 passes. Not
counted: the hand-off of the columns into DALI's shared memory.

    .venv/bin/python benchmarks/_dali_draws.py
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RECIPES = ("none", "torchvision-resnet50-v2", "deit-small")


def main() -> int:
    import torch
    from bench_gpu import make_prepared, training_loader

    from imagenet_ddp.data.reader import create_dataset

    torch.set_num_threads(1)
    batch, images = 64, 512
    with tempfile.TemporaryDirectory(prefix="dali-draws-") as tmp:
        base = create_dataset(make_prepared(Path(tmp), images, 256), None, train=True)
        for name in RECIPES:
            # the run's DaliLoader and sampler as the preflight builds them (nothing started)
            loader = training_loader(base, name, 224, batch, 1, "dali")
            keys = list(itertools.islice(loader.sampler, images))
            rates = []
            for _ in range(5):
                started = time.perf_counter()
                for first in range(0, len(keys), batch):
                    loader.batch_inputs(keys[first : first + batch])
                rates.append(len(keys) / (time.perf_counter() - started))
            print(f"{name}: {statistics.median(rates):,.0f} samples/s per process "
                  f"(median of 5 passes; {min(rates):,.0f}-{max(rates):,.0f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
