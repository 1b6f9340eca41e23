"""torchvision's reference training loop (baseline of bench_train_step.py); run under torchrun.

The shape of ``references/classification/train.py`` (``train_one_epoch``, its ``utils``'s
``MetricLogger.log_every`` / ``SmoothedValue`` / ``accuracy``) and its DataLoader: a
``DistributedSampler``, ``num_workers=--workers`` in the default (fork) context, default
prefetch, ``pin_memory=True`` (a no-op without CUDA), workers started again each epoch (no
``persistent_workers``), and per step ``loss.item()``, top-1/top-5 ``.item()``s, a lr read and
an img/s meter; rank 0 prints every ``--print-freq`` steps. Its data path is ours, so that the
loop and the loader settings are what differs: the product's prepared reader with the crop-first
decode (``create_dataset(train=True)``), ``train_transform(normalize=False)`` and
``normalize_batch`` in the rank.

Prints one JSON line from rank 0: per-epoch global images/s (slowest rank's epoch time) and
steady images/s (after ``--warmup-steps``, as ``steady_images_per_s`` of train_metrics.json).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


class SmoothedValue:
    """The reference's: a window deque plus a running total and count."""

    def __init__(self, window_size: int = 20):
        self.deque, self.total, self.count = deque(maxlen=window_size), 0.0, 0

    def update(self, value: float, n: int = 1) -> None:
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def __str__(self) -> str:
        values = list(self.deque)
        return f"{sorted(values)[len(values) // 2]:.4f} ({self.total / max(self.count, 1):.4f})"


def accuracy(output, target, topk=(1,)):
    """The reference's ``utils.accuracy``."""
    import torch

    with torch.inference_mode():
        maxk, batch_size = max(topk), target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target[None])
        return [correct[:k].flatten().sum(dtype=torch.float32) * (100.0 / batch_size) for k in topk]


def log_every(iterable, meters: dict, print_freq: int, header: str, main: bool):
    """The reference's ``MetricLogger.log_every``: iteration and data time per step, a line on
    rank 0 every ``print_freq`` steps."""
    iter_time, data_time = SmoothedValue(), SmoothedValue()
    end = time.time()
    for i, obj in enumerate(iterable):
        data_time.update(time.time() - end)
        yield obj
        iter_time.update(time.time() - end)
        if main and i % print_freq == 0:
            fields = "  ".join(f"{k}: {v}" for k, v in meters.items())
            print(f"{header} [{i}]  {fields}  time: {iter_time}  data: {data_time}", flush=True)
        end = time.time()


def main() -> int:
    parser = C.baseline_parser(workers=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--print-freq", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=5)
    args = parser.parse_args()

    import pandas as pd
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    from imagenet_ddp.data.dataset import normalize_batch, train_transform
    from imagenet_ddp.data.reader import create_dataset

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    ids = pd.read_csv(args.split_dir / "train.csv", usecols=["sample_id"])["sample_id"].tolist()
    transform = train_transform(args.crop_size, normalize=False)
    base = create_dataset(args.train_data, ids, train=True)

    class Augmented(Dataset):  # the reference's ImageFolder(transform=...)
        def __len__(self):
            return len(base)

        def __getitem__(self, i):
            image, label = base[i]
            return transform(image), label

    dataset = Augmented()
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),  # the reference's True; CPU-only: off, as torch does
        drop_last=True,  # as ours (EpochSampler): whole batches only
    )
    num_classes = int(json.loads((args.train_data / "prepared.json").read_text())["num_classes"])
    model = torchvision.models.get_model(args.model, weights=None, num_classes=num_classes)
    model = DistributedDataParallel(model)
    # --opt sgd_nesterov --wd 5e-5: ours's recipe defaults (config.schema.yaml)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5, nesterov=True
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    criterion = torch.nn.CrossEntropyLoss()
    rates, steady_rates = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        meters = {k: SmoothedValue() for k in ("loss", "lr", "acc1", "acc5", "img/s")}
        samples, steady_from, started = 0, None, time.perf_counter()
        batches = log_every(loader, meters, args.print_freq, f"Epoch: [{epoch}]", rank == 0)
        for step, (image, target) in enumerate(batches):
            start_time = time.time()
            image = normalize_batch(image)  # ours: uint8 crops, normalized in the rank
            output = model(image)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            batch_size = image.shape[0]
            meters["loss"].update(loss.item())
            meters["lr"].update(optimizer.param_groups[0]["lr"])
            meters["acc1"].update(acc1.item(), n=batch_size)
            meters["acc5"].update(acc5.item(), n=batch_size)
            meters["img/s"].update(batch_size / (time.time() - start_time))
            samples += batch_size
            if step + 1 == args.warmup_steps:
                steady_from = (time.perf_counter(), samples)
        scheduler.step()
        end = time.perf_counter()
        steady = (samples - steady_from[1], end - steady_from[0]) if steady_from else (0, 1.0)
        seconds = torch.tensor([end - started, steady[1]], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        rates.append(samples * world / float(seconds[0]))
        steady_rates.append(steady[0] * world / float(seconds[1]))
    if rank == 0:
        out = {"images_per_s": rates, "steady_images_per_s": steady_rates, "pid": os.getpid()}
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
