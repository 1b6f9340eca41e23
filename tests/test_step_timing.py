"""The step-time breakdown (training.step_timing) and the profiler window's setting, on CPU.

The CUDA-event path and MFU need a GPU (docs/proven.md); the profiler window's trace and its
bitwise-equal weights are proven by a real 2-rank run in tests/test_resume.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from imagenet_ddp.training.step_timing import (
    BREAKDOWN_COLUMNS,
    StepTimer,
    count_flops,
    flops_per_image,
    mfu_percent,
    peak_flops,
    timed_steps,
)
from tests.workflow_helpers import train_config


class SlowDataset(Dataset):
    """8 tiny samples, each ``delay`` seconds to load (a slow filesystem or decoder)."""

    def __init__(self, delay: float):
        self.delay = delay

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index):
        time.sleep(self.delay)
        return torch.full((4,), float(index)), index % 2


class SlowModel(torch.nn.Module):
    """A linear layer whose forward takes ``delay`` seconds (a large model)."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay, self.linear = delay, torch.nn.Linear(4, 2)

    def forward(self, x):
        time.sleep(self.delay)
        return self.linear(x)


def step(model, optimizer, x, y) -> None:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def train_epoch(load_delay: float, compute_delay: float) -> tuple[dict, float, int]:
    """One epoch of 4 steps (batch 2) through the loop's marks; (figures, wall s, steps)."""
    torch.manual_seed(0)
    model, timer = SlowModel(compute_delay), StepTimer(torch.device("cpu"), drain_every=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # the first steps start autograd and the optimizer (up to ~1 s when
        step(model, optimizer, torch.zeros(2, 4), torch.tensor([0, 1]))  # busy): not measured
    loader = DataLoader(SlowDataset(load_delay), batch_size=2, num_workers=0)
    began = time.perf_counter()
    for x, y in timed_steps(loader, timer):
        step(model, optimizer, x, y)
        timer.done()
    wall = time.perf_counter() - began
    return timer.reduce(), wall, timer.steps


@pytest.fixture
def one_thread():
    """One intra-op thread, as a rank with cpus_per_task 1 has: on a busy machine, waking the
    pool's idle threads after each sleep would add tens of ms to every step's compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "load_delay, compute_delay, input_bound",
    [(0.02, 0.0, True), (0.0, 0.04, False)],
    ids=["slow-loader", "slow-model"],
)
def test_breakdown_adds_up_and_names_the_slow_side(
    one_thread, load_delay, compute_delay, input_bound
):
    figures, wall, steps = train_epoch(load_delay, compute_delay)
    assert steps == 4
    parts = figures["data_wait_ms"] + figures["compute_ms"]
    measured = 1e3 * wall / steps  # the step time, timed around the loop by the test
    assert abs(parts - measured) <= 0.1 * measured, (figures, measured)
    assert abs(figures["step_ms"] - measured) <= 0.1 * measured, (figures, measured)
    if input_bound:  # 2 samples x 20 ms of loading per step, next to ~nothing to compute
        assert figures["input_bound_pct"] > 80 and figures["data_wait_ms"] >= 40
    else:
        assert figures["input_bound_pct"] < 20 and figures["compute_ms"] >= 40


def test_interval_figures_restart_after_each_read():
    timer = StepTimer(torch.device("cpu"), drain_every=1)
    for _ in timed_steps(range(3), timer):
        timer.done()
    assert set(timer.read_interval()) == set(BREAKDOWN_COLUMNS)
    assert all(v is None for v in timer.read_interval().values())  # nothing since the read
    assert timer.steps == 3  # the epoch's totals keep every step


def test_flops_per_image_is_the_hand_count():
    """Linear 8->4, ReLU, Linear 4->2, one image: forward 2*8*4 + 2*4*2 = 80; backward: both
    weight gradients (64 + 16) and the second layer's input gradient (16), not the image's."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert count_flops(model, torch.randn(1, 8)) == 80 + 64 + 16 + 16


def test_resnet18_flops_match_its_published_multiply_adds():
    """torchvision's ResNet-18: 1.81 GFLOPS (multiply-adds) forward at 224 px; training about
    3x the forward's 2 x 1.81 G (no gradient for the image), counted on the meta device."""
    flops = flops_per_image("resnet18", 1000, 224)
    assert 3 * 2 * 1.81e9 * 0.95 < flops < 3 * 2 * 1.82e9


def test_grouped_convolutions_count_their_own_weight_gradient():
    """Depthwise 3x3 conv on 4 channels of 5x5 (padded), one image that needs no gradient:
    forward 2 x 4 x 9 x 25 = 1800, the weight's gradient as many (torch's formula alone
    counts it as a dense conv, 4x as many)."""
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
    assert count_flops(conv, torch.randn(1, 4, 5, 5)) == 1800 + 1800


def test_regnet_flops_match_its_published_multiply_adds():
    """torchvision's RegNetY-400MF (grouped convolutions; its builder computes its widths from
    tensors, so the meta build needs models.on_meta): 0.40 GFLOPS (multiply-adds) forward."""
    flops = flops_per_image("regnet_y_400mf", 1000, 224)
    assert 3 * 2 * 0.39e9 < flops < 3 * 2 * 0.41e9


def test_mfu_only_against_a_known_peak(monkeypatch):
    assert peak_flops(torch.device("cpu"), "bf16") is None
    assert mfu_percent(1e9, 1000.0, 2, None) is None
    names = {"NVIDIA H100 80GB HBM3": 989.4e12, "NVIDIA A100-SXM4-40GB": 312e12,
             "NVIDIA H100 PCIe": 756e12, "NVIDIA A100 80GB PCIe MIG 1g.10gb": None,
             "NVIDIA GeForce RTX 4090": None}  # fmt: skip
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda", 0), "bf16") == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla V100-SXM2-32GB")
    assert peak_flops(torch.device("cuda", 0), "bf16") is None  # V100 has no bf16
    # 10 GFLOP/image at 49,440 img/s over 1 GPU of 989.4 TFLOP/s: 50 %
    assert mfu_percent(10e9, 49_470.0, 1, 989.4e12) == pytest.approx(50.0)


def test_the_profile_setting_keeps_the_checkpoints_and_reruns_nothing():
    from imagenet_ddp.settings.kinds import declarations

    plain = train_config()
    profiled = train_config(profile={"epoch": 1, "steps": 5, "ranks": "per_node"})
    assert profiled.fingerprint() == plain.fingerprint()
    run = {"name": "r", "lr": 0.1, "nodes": 1}
    settings = declarations()
    assert settings.rerun_settings({**run, "profile": {"epoch": 0, "steps": 2}}) == (
        settings.rerun_settings(run)
    )
