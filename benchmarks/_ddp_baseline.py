"""The common-recipe DDP training loop (baseline of bench_train_step.py); run under torchrun.

Same data (PreparedImageDataset + dataset.train_transform), model, optimizer and per-rank
batch as ``imagenet_ddp.training.worker``, but: ``DistributedSampler`` + plain loop, no
per-sample RNG seeding, no per-step stop-flag all-reduce, no scheduler/scaler/progress. Optional
flags add one of our extras back, to attribute a gap (``--fork-rng``, ``--agreed``).

Prints one JSON line from rank 0: per-epoch global images/s (slowest rank's epoch time).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main() -> int:
    parser = C.baseline_parser(workers=0)
    parser.add_argument("--fork-rng", action="store_true", help="add train.py's per-sample RNG")
    parser.add_argument("--agreed", action="store_true", help="add train.py's per-step all_reduce")
    args = parser.parse_args()

    import pandas as pd
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    from imagenet_ddp.data.dataset import PreparedImageDataset, train_transform

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    ids = pd.read_csv(args.split_dir / "train.csv", usecols=["sample_id"])["sample_id"].tolist()
    transform = train_transform(args.crop_size)
    base = PreparedImageDataset(args.train_data, sample_ids=ids)

    class Augmented(Dataset):
        def __len__(self):
            return len(base)

        def __getitem__(self, i):
            image, label = base[i]
            if args.fork_rng:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(i)
                    return transform(image), label
            return transform(image), label

    dataset = Augmented()
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        drop_last=True,
    )
    num_classes = int(json.loads((args.train_data / "prepared.json").read_text())["num_classes"])
    model = torchvision.models.get_model(args.model, weights=None, num_classes=num_classes)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5, nesterov=True
    )
    criterion = torch.nn.CrossEntropyLoss()
    rates = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        samples = 0
        started = time.perf_counter()
        for images, targets in loader:
            loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss.item()
            samples += targets.shape[0]
            if args.agreed:
                flag = torch.zeros(1)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                bool(flag.item())
        seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        rates.append(samples * world / float(seconds))
    if rank == 0:
        print(json.dumps({"images_per_s": rates, "pid": os.getpid()}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
