"""Evaluation counts every sample exactly once, whatever the number of ranks."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from imagenet_ddp.evaluate import evaluate_dataset


class Lookup(torch.nn.Module):
    """Returns the logits stored for each sample id (the 'image' is the sample id)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, ids):
        return self.logits[ids[:, 0].long()]


def make(n=23, classes=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, classes, generator=g)
    targets = torch.randint(0, classes, (n,), generator=g)
    ids = torch.arange(n, dtype=torch.float32)[:, None]
    return Lookup(logits), TensorDataset(ids, targets), logits, targets


def test_top1_top5_and_per_class_match_a_direct_computation():
    model, ds, logits, targets = make()
    result = evaluate_dataset(model, ds, num_classes=7, device=torch.device("cpu"), batch_size=4)
    assert result["samples"] == 23
    top1 = (logits.argmax(1) == targets).sum().item() / 23
    top5 = (logits.topk(5, 1).indices == targets[:, None]).any(1).sum().item() / 23
    assert abs(result["top1"] - top1) < 1e-12
    assert abs(result["top5"] - top5) < 1e-12
    assert sum(result["per_class_total"]) == 23
    assert result["per_class_total"] == torch.bincount(targets, minlength=7).tolist()


def test_two_rank_shards_cover_every_sample_once():
    model, ds, _, _ = make(n=23)
    whole = evaluate_dataset(model, ds, num_classes=7, device=torch.device("cpu"), batch_size=5)
    # Without a process group the reduction is local, so sum the two shards by hand.
    shards = [
        evaluate_dataset(
            model, ds, num_classes=7, device=torch.device("cpu"), batch_size=5, rank=r, world_size=2
        )
        for r in (0, 1)
    ]
    assert shards[0]["samples"] + shards[1]["samples"] == 23  # 12 + 11: no padding
    correct = [
        a + b
        for a, b in zip(shards[0]["per_class_correct"], shards[1]["per_class_correct"], strict=True)
    ]
    assert correct == whole["per_class_correct"]
