"""Host memory of a training rank's processes: the figures the dry-run's memory check uses
(imagenet_ddp.settings.node_memory).

    .venv/bin/python benchmarks/bench_memory.py [--batch 256 --crop 224 --workers 2] [--compile]
    .venv/bin/python benchmarks/bench_memory.py --loader dali [--recipe deit-small]

Memory, not time: one measurement, no repeats, no ratio (not in run_all.py or the smoke test).

What a node's memory cgroup is charged is each page once: what a process holds of its own
(USS: ``Private_Clean + Private_Dirty`` of /proc/<pid>/smaps_rollup) plus what it shares,
charged once. So this reports, after a few batches:

* **rank**: a CPU process with torch and torchvision imported and the run's DataLoader
  started (RSS and USS). On a GPU the CUDA context and libraries add to it: not measured here.
* **loader worker**: USS of one DataLoader worker of the run's loader (forkserver with torch
  preloaded, :func:`imagenet_ddp.training.data.train_loader`) producing uint8 crops, and the
  shared memory its in-flight batches hold (prefetch_factor x batch bytes; arithmetic).
* **DALI** (``--loader dali``): the same for a ``loader: dali`` run (training.dali_loader),
  whose loader is DALI's pipeline in the rank and its external source's spawned worker processes
  (no forkserver: each imports what it needs itself), on 512 realistic JPEGs at short side 256
  (bench_gpu.make_prepared) with the run's recipe (``--recipe``): the rank (RSS, USS; with its
  training loader, then with the holdout's persistent DALI loader too, 2 batches read), each
  DALI worker (USS), and the shared memory the workers hand their batches through (the
  ``memfd``/``/dev/shm`` mappings of the rank, RSS: charged once). DALI's CPU backend: on a GPU
  node the decoded batches are on the device, so the rank's figure is an upper bound there.
* **compile worker**: RSS and USS of one inductor compile worker (``torch.compile`` of a small
  model on the CPU with ``TORCHINDUCTOR_COMPILE_THREADS=2``), its pool still alive.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402, F401  (sys.path: the package from this checkout)


def memory_mb(pid: int) -> dict[str, float]:
    """RSS and USS of ``pid`` in MB, from /proc/<pid>/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    uss = fields["Private_Clean"] + fields["Private_Dirty"]
    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    return {"rss_mb": round(fields["Rss"], 1), "uss_mb": round(uss, 1), "command": command}


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


class Crops:
    """uint8 crops as the training transform outputs them (normalized later, on the device)."""

    def __init__(self, length: int, crop: int):
        self.length, self.crop = length, crop

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key):
        import torch

        return torch.randint(0, 255, (3, self.crop, self.crop), dtype=torch.uint8), 0


def loader_figures(batch: int, crop: int, workers: int) -> dict:
    import torch

    from imagenet_ddp.training.data import EpochSampler, shutdown_loader_workers, train_loader

    sampler = EpochSampler(batch * workers * 8, 1, 0, 0, batch_size=batch)
    loader = train_loader(Crops(len(sampler), crop), sampler, batch, workers, pin=False)
    batches = iter(loader)
    for _ in range(workers * 2):
        next(batches)
    rank = memory_mb(os.getpid())
    server = children(os.getpid())
    workers_mem = [memory_mb(w) for s in server for w in children(s)]
    figures = {
        "rank": rank,
        "forkservers": [memory_mb(s) for s in server],
        "loader_workers": workers_mem,
        "batch_mb": batch * 3 * crop * crop / 2**20,
        "torch": torch.__version__,
    }
    del batches
    shutdown_loader_workers(loader)
    return figures


def _shared_mb(pid: int) -> float:
    """RSS of ``pid``'s shared-memory mappings (memfd and /dev/shm): the pages DALI's workers
    hand batches through, charged to the node once."""
    total, counting = 0.0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            counting = "memfd:" in line or "/dev/shm/" in line
        elif counting and head[:1] == ["Rss:"]:
            total += int(head[1]) / 1024
    return round(total, 1)


def dali_figures(batch: int, crop: int, workers: int, recipe_name: str) -> dict:
    """A ``loader: dali`` run's loader (the preflight's: preflight.rank.preflight_loader) after
    ``workers`` x 2 batches: the rank, its DALI workers and their shared memory."""
    import tempfile

    import torch
    from bench_gpu import make_prepared, training_loader

    from imagenet_ddp.data.reader import create_dataset
    from imagenet_ddp.training.accuracy import shard_loader

    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        base = create_dataset(make_prepared(Path(tmp), 512, 256), None, train=True)
        loader = training_loader(base, recipe_name, crop, batch, workers, "dali")
        batches = iter(loader)
        for _ in range(max(1, workers) * 2):
            next(batches)
        training_only = memory_mb(os.getpid())
        # the holdout's loader beside it, as training holds it (persistent, the same threads)
        holdout = shard_loader(base, device=torch.device("cpu"), batch_size=batch,
                               workers=workers, persistent=True, cfg=loader.cfg)  # fmt: skip
        for _ in zip(range(2), holdout, strict=False):
            pass
        figures = {
            "recipe": recipe_name,
            "rank_training_loader_only": training_only,
            "rank": memory_mb(os.getpid()),
            "dali_workers": [memory_mb(w) for w in children(os.getpid())],
            "shared_mb": _shared_mb(os.getpid()),
            "torch": torch.__version__,
        }
        del batches, loader, holdout
    return figures


def _tree(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        out += [child, *_tree(child)]
    return out


def compile_figures() -> dict:
    """The compile workers' memory, sampled every 0.2 s while ResNet-18 compiles (the pool is
    gone when compile returns); the largest total of USS seen, and that sample's processes."""
    import threading
    import time

    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "2"
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # a cached graph compiles nothing
    import torch
    import torchvision

    samples, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError, ValueError):
                samples.append([memory_mb(p) for p in _tree(os.getpid())])
            time.sleep(0.2)

    thread = threading.Thread(target=sample)
    thread.start()
    model = torch.compile(torchvision.models.resnet18(num_classes=10))
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    done.set()
    thread.join()
    peak = max(samples, key=lambda s: sum(p["uss_mb"] for p in s), default=[])
    largest = {}  # per command: the sample with the largest USS
    for process in (p for s in samples for p in s):
        key = process["command"].split(" ")[0] + " " + process["command"][-40:]
        if process["uss_mb"] > largest.get(key, {"uss_mb": -1})["uss_mb"]:
            largest[key] = process
    return {
        "processes_at_peak": peak,
        "largest": list(largest.values()),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="the compile workers instead")
    parser.add_argument("--loader", choices=("pytorch", "dali"), default="pytorch")
    parser.add_argument("--recipe", default="none", help="with --loader dali: a preset, or none")
    parser.add_argument("--quick", action="store_true", help="batch 16, crop 64")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.crop = 16, 64
    if args.compile:
        figures = compile_figures()
    elif args.loader == "dali":
        figures = dali_figures(args.batch, args.crop, args.workers, args.recipe)
    else:
        figures = loader_figures(args.batch, args.crop, args.workers)
    print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
